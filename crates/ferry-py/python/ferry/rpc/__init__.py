"""``ferry.rpc``: ``torch.distributed.rpc``'s API over Ferry.

``import ferry.rpc as rpc`` in place of ``import torch.distributed.rpc as
rpc``: ``init_rpc``, ``shutdown``, ``rpc_sync``, ``rpc_async`` (a
``torch.futures.Future``), ``remote`` and ``RRef``, ``get_worker_info``
and ``WorkerInfo``, with PyTorch's timeouts and errors. Python functions
travel by reference and their arguments and results pickled (protocol
5), every tensor out of band through Ferry's tensor channels. A function
named by a ``str`` is one a worker registered by name (a Rust worker's,
or one registered in Python with ``register``), called with its
arguments converted by its declared types: Python and Rust workers share
one group.
"""

from ferry.rpc import backend_registry, constants, functions
from ferry.rpc.api import (
    _all_worker_infos,
    _get_rpc_timeout,
    _set_rpc_timeout,
    describe,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    register,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from ferry.rpc.backend_registry import BackendType
from ferry.rpc.options import (
    DEFAULT_INIT_METHOD,
    DEFAULT_RPC_TIMEOUT_SEC,
    UNSET_RPC_TIMEOUT,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    WorkerInfo,
)
from ferry.rpc._interop import _rref_debug_info, _rref_wait_until_empty
from ferry.rpc.rref import RRef


def retain_freed_memory():
    """Keeps freed large blocks (up to 1 GiB) in this process for the next
    received tensor, by raising glibc's mmap and trim thresholds: a 40 MB
    tensor then lands in memory already mapped instead of fresh pages (a
    page fault per 4 KiB). It changes the allocator of the whole process
    and keeps freed memory in it, so it is opt-in; call it before
    ``init_rpc``. Returns whether it was applied (not off glibc)."""
    from ferry import _ferry

    return _ferry.rpc.retain_freed_memory()


def link_info(to):
    """The link to worker ``to`` (a name, rank or ``WorkerInfo``) once it
    is up, or None: ``{"transport": ..., "outgoing": [...], "incoming":
    [...]}``, the transport carrying the frames (``"shm"``, ``"tcp"``,
    ``"ucx"``) and the channels of the tensors this worker sends to and
    receives from it (``"cma"``, ``"shm"``, ``"mpt"``, ``"inline"``, ...).
    Ferry picks them itself (``FERRY_TRANSPORTS`` and ``FERRY_CHANNELS``
    narrow the choice); a Ferry extension, not in torch.distributed.rpc."""
    from ferry import _ferry
    from ferry.rpc.api import _to

    link = _ferry.rpc.link_info(_to(to))
    if link is None:
        return None
    transport, outgoing, incoming = link
    return {"transport": transport, "outgoing": outgoing, "incoming": incoming}


def is_available():
    """Whether RPC is available (``torch.distributed.rpc.is_available``):
    always, where ``ferry.rpc`` imports."""
    return True


__all__ = [
    "retain_freed_memory",
    "link_info",
    "BackendType",
    "RpcBackendOptions",
    "backend_registry",
    "constants",
    "functions",
    "get_rpc_timeout",
    "DEFAULT_INIT_METHOD",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "UNSET_RPC_TIMEOUT",
    "RRef",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "describe",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "register",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "_all_worker_infos",
    "_get_rpc_timeout",
    "_set_rpc_timeout",
    "_rref_debug_info",
    "_rref_wait_until_empty",
]
