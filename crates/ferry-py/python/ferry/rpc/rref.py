"""``RRef``: a reference to a value that lives on one worker, its owner,
after ``torch.distributed.rpc.RRef``, held by Ferry's RRef protocol."""

import functools
import types

from ferry import _ferry
from ferry.rpc.options import UNSET_RPC_TIMEOUT, WorkerInfo

_Handle = _ferry.rpc.RRefHandle
_RustHandle = _ferry.interop.RustRRefHandle


class RRef:
    """A remote reference.

    ``RRef(value)`` makes one owned by this worker; ``ferry.rpc.remote``
    makes one owned by the callee, holding the function's result. An RRef
    travels inside the arguments and results of ``rpc_sync``,
    ``rpc_async`` and ``remote``; the owner keeps the value as long as any
    worker can reach it. So does an RRef to a value of a Rust function
    (``remote`` of a function named by a ``str``), in calls of Python and
    Rust functions alike.
    """

    __slots__ = ("_handle", "_type")

    def __init__(self, value, type_hint=None):
        self._handle = _Handle.local(value)
        self._type = None

    def __class_getitem__(cls, item):
        """``RRef[T]``: an annotation, as PyTorch's ``RRef`` is generic."""
        return types.GenericAlias(cls, item)

    @classmethod
    def _from_handle(cls, handle):
        rref = cls.__new__(cls)
        rref._handle = handle
        rref._type = None
        return rref

    def owner(self):
        """The owner's ``WorkerInfo``."""
        return WorkerInfo(self._handle.owner_name(), self._handle.owner_id())

    def owner_name(self):
        """The owner's name."""
        return self._handle.owner_name()

    def is_owner(self):
        """Whether this worker owns the value."""
        return self._handle.is_owner()

    def confirmed_by_owner(self):
        """Whether the owner knows of this reference (always ``True`` on
        the owner)."""
        return self._handle.confirmed_by_owner()

    def local_value(self):
        """The value itself, on the owner only (waiting until the function
        creating it has run); raises what that function raised."""
        from ferry.rpc import _internal

        if type(self._handle) is _RustHandle:
            raise RuntimeError(
                "local_value() of an RRef to a value of a Rust function: use to_here()"
            )
        raised, value = self._handle.local_value()
        if raised:
            raise _internal.exception_from(value)
        return value

    def to_here(self, timeout=UNSET_RPC_TIMEOUT):
        """A copy of the value, fetched from the owner (the value itself on
        the owner); raises what the function creating it raised, or
        ``RuntimeError`` after ``timeout`` seconds (unset: the default
        timeout; 0: none)."""
        from ferry.rpc import _internal

        if type(self._handle) is _RustHandle:
            # A Rust value: fetched by the RRef protocol and converted by
            # its type's shape, wherever it is.
            return self._handle.to_here(float(timeout))
        if self.is_owner():
            return self.local_value()
        return _internal.load_reply(*self._handle.to_here(float(timeout)))

    def _get_type(self, timeout=UNSET_RPC_TIMEOUT, blocking=True):
        """The type of the value (PyTorch's ``RRef._get_type``): asked of
        the owner once, then remembered. Blocking, the type (raising what
        the function creating the value raised); otherwise a
        ``torch.futures.Future`` of it."""
        import torch

        if type(self._handle) is _RustHandle:
            raise RuntimeError(
                f"an RRef to a value of a Rust function ({self._handle.type_name()}) has "
                "no Python type"
            )
        if self._type is not None:
            if blocking:
                return self._type
            done = torch.futures.Future()
            done.set_result(self._type)
            return done
        if self.is_owner():
            from ferry.rpc import _internal

            fut = torch.futures.Future()
            try:
                fut.set_result(type(self.local_value()))
            except Exception as e:
                _internal.set_future_error(fut, e)
        else:
            from ferry.rpc import api as rpc_api

            fut = rpc_api.rpc_async(self.owner(), _type_on_owner, args=(self,), timeout=timeout)

        def remember(f):
            try:
                self._type = f.value()
            except Exception:
                pass  # not remembered: it reaches whoever waits on `fut`

        fut.add_done_callback(remember)
        return fut.wait() if blocking else fut

    def backward(self, dist_autograd_ctx_id=-1, retain_graph=False):
        """Runs the backward pass from the value (a scalar tensor) on its
        owner, as PyTorch's ``RRef.backward``: with
        ``dist_autograd_ctx_id`` -1 (on the owner only), local autograd
        (gradients in ``.grad``); otherwise distributed autograd in that
        context (``ferry.autograd.backward``). A user RRef asks its owner
        and waits until the pass is done."""
        if self.is_owner():
            _backward_value(self.local_value(), dist_autograd_ctx_id, retain_graph)
            return
        if dist_autograd_ctx_id == -1:
            raise RuntimeError("User RRefs require 'dist_autograd_ctx_id' to be specified")
        from ferry.rpc import api as rpc_api

        rpc_api.rpc_sync(
            self.owner(), _backward_on_owner, args=(self, dist_autograd_ctx_id, retain_graph)
        )

    def rpc_sync(self, timeout=UNSET_RPC_TIMEOUT):
        """A proxy running the value's methods on the owner with
        ``rpc_sync``: ``rref.rpc_sync().method(*args)``. For an RRef to a
        value of a Rust function, which has no methods,
        ``rref.rpc_sync().f(*args)`` calls the owner's function ``f``
        (registered by name) with ``(rref, *args)``: a Rust function taking
        an ``RRef<T>`` first is the value's method."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout=UNSET_RPC_TIMEOUT):
        """A proxy running the value's methods on the owner with
        ``rpc_async``, each call returning a future."""
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout=UNSET_RPC_TIMEOUT):
        """A proxy running the value's methods on the owner with
        ``remote``, each call returning an RRef to the result."""
        return _Proxy(self, "remote", timeout)

    def __repr__(self):
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}({self._handle.rref_id()}, owner={self.owner_name()})"

    def __reduce__(self):
        # PyTorch's message, then where an RRef may travel.
        raise RuntimeError(
            "Can not pickle rref in python pickler, rref can only be pickled when "
            "using RPC (only inside the arguments or results of rpc_sync, rpc_async "
            "or remote)"
        )


def _type_on_owner(rref):
    """The type of the value, on its owner (``RRef._get_type``)."""
    return type(rref.local_value())


def _local_invoke(rref, name, args, kwargs):
    """Runs method ``name`` of the value on its owner (what the proxies
    call there); for a method marked with ``functions.async_execution``,
    the value of the future it returned."""
    from ferry.rpc import _internal

    return _internal.call_function(getattr(rref.local_value(), name), args, kwargs)


def _invoke(rref, api, name, timeout, *args, **kwargs):
    """Runs method ``name`` of the value on its owner with ``api``
    (``rpc_sync``, ``rpc_async`` or ``remote``). As PyTorch's proxies do,
    the value's type is looked up first (asked of the owner once per RRef,
    ``RRef._get_type``), and a method it lacks is an ``AttributeError`` on
    the caller: raised at once for ``rpc_sync`` and ``remote``, the
    future's error for ``rpc_async``.

    A value of a Rust function has no methods: ``name`` is the owner's
    function of that name (registered by name) taking the RRef as its
    first argument, ``args`` and ``kwargs`` the rest; one that takes no
    RRef first is a ``TypeError`` naming it and its signature, one the
    owner lacks a ``RuntimeError`` naming it."""
    from ferry.rpc import _internal
    from ferry.rpc import api as rpc_api

    if type(rref._handle) is _RustHandle:
        # A Rust value has no methods: the owner's function of that name
        # taking the RRef first stands for one.
        from ferry.rpc import _interop

        return getattr(_interop, api)(
            rref.owner_name(), name, (rref, *args), kwargs, timeout, method=True
        )
    call = getattr(rpc_api, api)

    def start(rref_type):
        getattr(rref_type, name)  # AttributeError: no such method
        return call(
            rref.owner(), _local_invoke, args=(rref, name, args, kwargs), timeout=timeout
        )

    if api != "rpc_async":
        return start(rref._get_type(timeout=timeout))

    import torch

    result = torch.futures.Future()

    def complete(fut):
        try:
            result.set_result(fut.value())
        except BaseException as e:
            _internal.set_future_error(result, e)

    def on_type(type_fut):
        try:
            start(type_fut.value()).add_done_callback(complete)
        except BaseException as e:
            _internal.set_future_error(result, e)

    rref._get_type(timeout=timeout, blocking=False).add_done_callback(on_type)
    return result


def _backward_on_owner(rref, context_id, retain_graph):
    """``RRef.backward`` on the owner of ``rref`` (a user RRef's call)."""
    _backward_value(rref.local_value(), context_id, retain_graph)


def _backward_value(value, context_id, retain_graph):
    """The backward pass from ``value`` (an RRef's value, a tensor): local
    autograd for context id -1, else distributed autograd in that context,
    as PyTorch's ``RRef.backward`` runs it on the owner."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise RuntimeError("RRef should contain a tensor for .backward()")
    if context_id == -1:
        torch.autograd.backward(value, retain_graph=retain_graph)
    else:
        from ferry import autograd

        autograd.backward(context_id, [value], retain_graph=retain_graph)


class _Proxy:
    """``rref.rpc_sync()``, ``rref.rpc_async()``, ``rref.remote()``:
    every attribute is a method of the value, run on its owner."""

    __slots__ = ("_rref", "_api", "_timeout")

    def __init__(self, rref, api, timeout):
        self._rref = rref
        self._api = api
        self._timeout = timeout

    def __getattr__(self, name):
        return functools.partial(_invoke, self._rref, self._api, name, self._timeout)
