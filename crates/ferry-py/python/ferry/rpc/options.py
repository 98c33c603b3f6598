"""``WorkerInfo``, the backend options and the constants of ``ferry.rpc``,
as ``torch.distributed.rpc`` names them."""

import re

from ferry.rpc.constants import (
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
    UNSET_RPC_TIMEOUT,  # noqa: F401  (re-exported)
)


#: What a worker's name may hold (PyTorch's rule, and Ferry's).
NAME_PATTERN = "^[A-Za-z0-9-_:]*$"
#: A worker's name is shorter than this.
MAX_NAME_LEN = 128


def _valid_name(name):
    return 0 < len(name) < MAX_NAME_LEN and re.fullmatch(r"[A-Za-z0-9\-_:]*", name) is not None


class WorkerInfo:
    """A worker of the group: its unique ``name`` and its rank, ``id``."""

    __slots__ = ("name", "id")

    def __init__(self, name, id):
        if not isinstance(name, str) or not _valid_name(name):
            raise RuntimeError(
                f"Worker name must match {NAME_PATTERN}, and must be non-empty and "
                f"shorter than {MAX_NAME_LEN} chars (got {name!r})"
            )
        self.name = name
        self.id = id

    def __eq__(self, other):
        return (
            isinstance(other, WorkerInfo)
            and self.name == other.name
            and self.id == other.id
        )

    def __hash__(self):
        return hash((self.name, self.id))

    def __repr__(self):
        return f"WorkerInfo(id={self.id}, name={self.name})"

    def __reduce__(self):
        return (WorkerInfo, (self.name, self.id))


class RpcBackendOptions:
    """The options every backend takes (PyTorch's base class of backend
    options): ``rpc_timeout``, the default timeout of calls in seconds (0:
    none), and ``init_method``, where the group meets (``"env://"`` or
    ``"tcp://host:port"``)."""

    def __init__(self, rpc_timeout=DEFAULT_RPC_TIMEOUT_SEC, init_method=DEFAULT_INIT_METHOD):
        self.rpc_timeout = rpc_timeout
        self.init_method = init_method


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """The options ``init_rpc`` takes, with PyTorch's names.

    ``rpc_timeout`` (seconds, 0 for none) is the default timeout of calls;
    ``init_method`` is ``"env://"`` (``MASTER_ADDR``/``MASTER_PORT``) or
    ``"tcp://host:port"``, where rank 0 hosts the rendezvous. Ferry picks
    its transports and tensor channels itself (``FERRY_CHANNELS``,
    ``FERRY_TRANSPORTS``), so ``num_worker_threads``, ``_transports`` and
    ``_channels`` are accepted and kept but change nothing; CPU tensors
    only for now, so device maps must be empty.
    """

    def __init__(
        self,
        *,
        num_worker_threads=DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout=DEFAULT_RPC_TIMEOUT_SEC,
        init_method=DEFAULT_INIT_METHOD,
        device_maps=None,
        devices=None,
        _transports=None,
        _channels=None,
    ):
        # PyTorch's options are a pybind class: a timeout that is not a
        # number of seconds (a timedelta) does not match its constructor.
        if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, (int, float)):
            raise TypeError(
                "TensorPipeRpcBackendOptions(): incompatible constructor arguments: "
                f"rpc_timeout is a number of seconds, not {type(rpc_timeout).__name__}"
            )
        super().__init__(rpc_timeout=rpc_timeout, init_method=init_method)
        self.num_worker_threads = num_worker_threads
        self.device_maps = dict(device_maps or {})
        self.devices = list(devices or [])
        self._transports = _transports
        self._channels = _channels

    def set_device_map(self, to, device_map):
        """Records a device map for calls to ``to`` (PyTorch's); Ferry's
        Python workers carry CPU tensors only for now."""
        self.device_maps.setdefault(to, {}).update(device_map)

    def set_devices(self, devices):
        """Records the devices this worker uses (PyTorch's)."""
        self.devices = list(devices)
