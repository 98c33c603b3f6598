"""``ferry.rpc.backend_registry``: ``BackendType`` and the options of a
backend, as ``torch.distributed.rpc.backend_registry`` names them.

Ferry's agent is the one backend; its member keeps PyTorch's name,
``TENSORPIPE``, so that code passing ``backend=BackendType.TENSORPIPE``
runs unchanged. Registering other backends is not offered.
"""

import enum

from ferry.rpc import constants


class BackendType(enum.Enum):
    """The RPC backends: Ferry's agent, under PyTorch's default name."""

    TENSORPIPE = "TENSORPIPE"

    def __repr__(self):
        return f"BackendType.{self.name}"


def backend_registered(backend_name):
    """Whether ``backend_name`` names a member of :class:`BackendType`."""
    return backend_name in BackendType.__members__


def construct_rpc_backend_options(
    backend,
    rpc_timeout=constants.DEFAULT_RPC_TIMEOUT_SEC,
    init_method=constants.DEFAULT_INIT_METHOD,
    **kwargs,
):
    """The options of ``backend`` (a ``TensorPipeRpcBackendOptions``), with
    ``kwargs`` passed on to it."""
    from ferry.rpc.options import TensorPipeRpcBackendOptions

    if not is_backend(backend):
        raise TypeError("Argument backend must be a member of BackendType")
    return TensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)


def is_backend(backend):
    """Whether ``backend`` is a member of Ferry's :class:`BackendType`, or
    PyTorch's ``TENSORPIPE`` (code moving from ``torch.distributed.rpc``
    may still pass that one)."""
    if isinstance(backend, BackendType):
        return True
    return type(backend).__name__ == "BackendType" and getattr(backend, "name", None) == "TENSORPIPE"
