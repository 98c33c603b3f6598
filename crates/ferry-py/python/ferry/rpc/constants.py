"""``ferry.rpc.constants``: the defaults ``torch.distributed.rpc.constants``
names, with PyTorch's values."""

from datetime import timedelta

#: PyTorch's default timeout of calls, in seconds.
DEFAULT_RPC_TIMEOUT_SEC = 60.0
#: A call's ``timeout`` left unset: the agent's default applies.
UNSET_RPC_TIMEOUT = -1.0
#: PyTorch's default ``init_method``: ``MASTER_ADDR`` and ``MASTER_PORT``.
DEFAULT_INIT_METHOD = "env://"
#: PyTorch's default bound on a graceful shutdown, in seconds.
DEFAULT_SHUTDOWN_TIMEOUT = 100.0
#: PyTorch's default size of the agent's thread pool (an option Ferry keeps
#: but does not need: its agent sizes its own pools).
DEFAULT_NUM_WORKER_THREADS = 16
#: The default timeout of the rendezvous, as PyTorch's ``rendezvous`` has it.
DEFAULT_PROCESS_GROUP_TIMEOUT = timedelta(milliseconds=60000)
