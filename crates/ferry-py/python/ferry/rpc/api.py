"""The calls of ``ferry.rpc``, with ``torch.distributed.rpc``'s signatures
and semantics."""

import contextlib
import threading
import urllib.parse

import torch

from ferry import _ferry
from ferry.rpc import _interop, _internal, backend_registry
from ferry.rpc.options import (
    UNSET_RPC_TIMEOUT,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    WorkerInfo,
)
from ferry.rpc.rref import RRef

_rpc = _ferry.rpc


def _master_of(init_method):
    """``(addr, port)`` of a ``tcp://host:port`` init method; ``(None,
    None)`` for ``env://`` (``MASTER_ADDR`` and ``MASTER_PORT``)."""
    if init_method is None or init_method == "env://":
        return None, None
    url = urllib.parse.urlparse(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(
            f"init_method {init_method!r}: ferry.rpc takes 'env://' or 'tcp://host:port'"
        )
    return url.hostname, url.port


def _is_backend_options(options):
    """Whether ``options`` are backend options: Ferry's, or PyTorch's
    (``torch.distributed.rpc.RpcBackendOptions``, whose ``rpc_timeout`` and
    ``init_method`` Ferry reads)."""
    if isinstance(options, RpcBackendOptions):
        return True
    return any(
        c.__name__ == "RpcBackendOptions" and c.__module__.startswith("torch")
        for c in type(options).__mro__
    )


def _is_tensorpipe_options(options):
    """Whether ``options`` are TensorPipe's options, Ferry's or PyTorch's."""
    if isinstance(options, TensorPipeRpcBackendOptions):
        return True
    return any(
        c.__name__ == "TensorPipeRpcBackendOptions" and c.__module__.startswith("torch")
        for c in type(options).__mro__
    )


def init_rpc(name, backend=None, rank=-1, world_size=None, rpc_backend_options=None):
    """Starts this process's worker ``name`` and waits until the whole
    group has met.

    ``rank`` and ``world_size`` default to ``RANK`` and ``WORLD_SIZE``;
    rank 0 hosts the rendezvous at ``MASTER_ADDR:MASTER_PORT`` (or the
    options' ``init_method``, ``tcp://host:port``). Under torchrun its
    variables are read as the Rust ``ferry::init_rpc`` reads them.
    ``rpc_backend_options`` is a ``TensorPipeRpcBackendOptions`` (ferry's
    or PyTorch's): its ``rpc_timeout`` is the default timeout of calls.
    ``backend`` is accepted for compatibility; Ferry is the backend.
    """
    if backend is not None and not backend_registry.is_backend(backend):
        raise TypeError("Argument backend must be a member of BackendType")
    if rpc_backend_options is not None:
        if not _is_backend_options(rpc_backend_options):
            raise TypeError(
                "Argument rpc_backend_options must be an instance of RpcBackendOptions"
            )
        # Ferry's agent takes TensorPipe's options (its only backend's).
        if not _is_tensorpipe_options(rpc_backend_options):
            if backend is None:
                raise TypeError(f"Could not infer backend for options {rpc_backend_options}")
            raise TypeError(
                "`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`. "
                f"Got {type(rpc_backend_options)}."
            )
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    rpc_timeout = None
    addr, port = None, None
    if rpc_backend_options is not None:
        rpc_timeout = float(getattr(rpc_backend_options, "rpc_timeout"))
        addr, port = _master_of(getattr(rpc_backend_options, "init_method", None))
        maps = getattr(rpc_backend_options, "device_maps", None) or {}
        if any(maps.values()):
            raise ValueError("ferry.rpc carries CPU tensors only for now: no device maps")
    if rank is not None and rank < 0:
        rank = None
    _rpc.init(name, rank, world_size, addr, port, rpc_timeout)


def shutdown(graceful=True, timeout=0):
    """Stops this worker. Graceful (the default): every worker must call
    it; each waits until no worker of the group has calls outstanding,
    serving meanwhile, then all stop together. Otherwise at once:
    outstanding calls fail. ``timeout`` is accepted for compatibility
    (Ferry bounds graceful shutdown by its own ``shutdown_timeout``)."""
    _rpc.shutdown(graceful)


def get_worker_info(worker_name=None):
    """The ``WorkerInfo`` of worker ``worker_name`` (a name or a rank), or
    of this worker."""
    name, rank = _rpc.get_worker_info(worker_name)
    return WorkerInfo(name, rank)


def _all_worker_infos():
    """Every worker of the group, by rank."""
    return [WorkerInfo(n, r) for n, r in _rpc.workers()]


def get_rpc_timeout():
    """The default timeout of calls, in seconds (0: none)."""
    return _rpc.get_rpc_timeout()


#: ``get_rpc_timeout`` under the name ``ferry.rpc`` first offered.
_get_rpc_timeout = get_rpc_timeout


def _set_rpc_timeout(rpc_timeout):
    """Sets the default timeout of calls from now on, in seconds (0: none)."""
    _rpc.set_rpc_timeout(float(rpc_timeout))


def _to(to):
    """The worker ``to`` names, as the compiled side takes it."""
    if type(to) is str:
        return to
    if isinstance(to, WorkerInfo):
        return to.name
    if isinstance(to, (str, int)):
        return to
    name = getattr(to, "name", None)  # torch's own WorkerInfo
    if isinstance(name, str):
        return name
    # PyTorch's `_to_worker_info` raises ValueError here too.
    raise ValueError(
        f"Cannot get WorkerInfo from name {to!r}: a worker is named by a str, "
        f"an int rank or a WorkerInfo, not {type(to).__name__}"
    )


def rpc_sync(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """Runs ``func(*args, **kwargs)`` on worker ``to`` and returns its
    result; raises what it raised there (same type, the callee's message
    and traceback), or ``RuntimeError`` after ``timeout`` seconds (unset:
    the default timeout; 0: none). Tensors in the arguments and result
    travel out of band. A ``str`` names a function registered by name
    (a Rust function's, or one registered with ``register``), its
    arguments and result converted by its declared types."""
    if isinstance(func, str):
        return _interop.rpc_sync(_to(to), func, args, kwargs, timeout)
    data, tensors, rrefs = _internal.dumps_call(func, args, kwargs)
    reply = _rpc.rpc_sync(_to(to), data, tensors, rrefs, float(timeout))
    return _internal.load_reply(*reply)


#: Per thread: the futures of ``rpc_async`` calls made inside ``_wait_all``.
_thread_local_var = threading.local()


@contextlib.contextmanager
def _wait_all():
    """Collects the futures of the ``rpc_async`` calls this thread makes in
    the block and waits for all of them when it exits
    (``torch.futures.wait_all``: the first error raised), as PyTorch's
    ``rpc.api._wait_all`` does."""
    _thread_local_var.future_list = []
    try:
        yield
    finally:
        try:
            torch.futures.wait_all(_thread_local_var.future_list)
        finally:
            del _thread_local_var.future_list


def rpc_async(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """Starts ``func(*args, **kwargs)`` on worker ``to``; returns a
    ``torch.futures.Future`` of its result (``wait()``, ``then()``,
    ``done()``, ``value()``; ``torch.futures.wait_all`` takes it). A
    ``str`` names a function registered by name, as for ``rpc_sync``."""
    if isinstance(func, str):
        fut = _interop.rpc_async(_to(to), func, args, kwargs, timeout)
    else:
        data, tensors, rrefs = _internal.dumps_call(func, args, kwargs)
        fut = torch.futures.Future()

        def on_done(reply, error):
            if error is not None:
                _internal.set_future_error(fut, error)
                return
            try:
                value = _internal.load_reply(*reply)
            except BaseException as e:
                _internal.set_future_error(fut, e)
            else:
                fut.set_result(value)

        _rpc.rpc_async(_to(to), data, tensors, rrefs, float(timeout), on_done)
    pending = getattr(_thread_local_var, "future_list", None)
    if pending is not None:
        pending.append(fut)
    return fut


def remote(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """Runs ``func(*args, **kwargs)`` on worker ``to`` and returns at once
    an ``RRef`` to its result, which stays there. If the creation does not
    finish within ``timeout`` seconds, using the RRef raises. A ``str``
    names a function registered by name, as for ``rpc_sync``."""
    if isinstance(func, str):
        return _interop.remote(_to(to), func, args, kwargs, timeout)
    data, tensors, rrefs = _internal.dumps_call(func, args, kwargs)
    return RRef._from_handle(_rpc.remote(_to(to), data, tensors, rrefs, float(timeout)))


def register(name, func, *, args, returns):
    """Registers the Python function ``func`` under ``name`` for callers
    that name it (a Rust worker's ``Function<A, R>`` of that name, or
    ``rpc_sync(to, name, ...)``), with its argument and result types
    declared as the shapes of Rust types, in the text Ferry writes them:
    ``args="(Tensor, f32)"``, ``returns="Tensor"``; structs as
    ``"Point { x: i64, y: i64 }"``, enums as ``"enum Op { Add(i64), Stop }"``.
    A tuple shape's items are ``func``'s positional arguments, ``"()"`` none,
    any other shape its one argument. Call it at any time, before
    ``init_rpc`` or after: a call or description that arrives once it
    returns finds the function (one before: no such function). Registering
    a name again replaces its function. ``ValueError`` for a shape that
    does not parse, or a name starting with ``"ferry."`` (Ferry's own)."""
    _ferry.interop.register(name, func, args, returns)


def describe(to, name, timeout=UNSET_RPC_TIMEOUT):
    """The signature of the function registered as ``name`` on worker
    ``to``, as text: ``"fn((i64, i64)) -> i64"``."""
    return _ferry.interop.describe(_to(to), name, float(timeout))
