"""Pickling for ``ferry.rpc``, and running calls on the callee.

Arguments and results are pickled with protocol 5; functions and classes
travel by reference (module and qualified name), as pickle does. Every
``torch.Tensor`` and every ``RRef`` inside becomes a persistent id, an
index into a list of its own, so that the Rust side sends tensors out of
band through Ferry's tensor channels (received into a fresh tensor's
storage, never pickled) and RRefs as forks by Ferry's RRef protocol.
"""

import collections
import io
import pickle
import sys
import threading
import traceback
import types

import torch

from ferry import _ferry
from ferry.rpc.functions import is_async_execution
from ferry.rpc.rref import RRef as _RRef

_rpc = _ferry.rpc

#: What a function that raised on its callee sends back: the message (the
#: callee, the exception's ``repr`` and its traceback) and the exception's
#: type, as PyTorch's ``torch.distributed.rpc.internal.RemoteException``.
RemoteException = collections.namedtuple("RemoteException", ["msg", "exception_type"])

#: The tensor layouts that travel out of band as themselves.
_OUT_OF_BAND_LAYOUTS = (torch.strided, torch.sparse_coo)

# Persistent ids are ints: 2*i for tensor i, 2*i+1 for RRef i.


class _Pickler(pickle.Pickler):
    """A protocol-5 pickler that pulls tensors and RRefs out."""

    def __init__(self, file):
        super().__init__(file, protocol=5)
        self.tensors = []
        self.rrefs = []

    def persistent_id(self, obj):
        # Exactly torch.Tensor: subclasses (nn.Parameter) reduce through
        # their own __reduce_ex__ to plain tensors, which then land here.
        # Strided and sparse COO (which travels as its indices and values,
        # with its autograd identity, as PyTorch's RPC sends it); other
        # layouts (CSR, ...) reduce to their dense parts, which land here.
        if type(obj) is torch.Tensor and obj.layout in _OUT_OF_BAND_LAYOUTS:
            self.tensors.append(obj)
            return 2 * (len(self.tensors) - 1)
        if type(obj) is _RRef:
            self.rrefs.append(obj._handle)
            return 2 * (len(self.rrefs) - 1) + 1
        return None


class _Unpickler(pickle.Unpickler):
    """Unpickles what ``_Pickler`` wrote, given its tensors and RRefs (set
    as ``_tensors`` and ``_rrefs`` before ``load``: no ``__init__`` of its
    own, one Python call less per message)."""

    _tensors = ()
    _rrefs = ()

    def persistent_load(self, pid):
        if type(pid) is not int or pid < 0:
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        index, is_rref = divmod(pid, 2)
        table = self._rrefs if is_rref else self._tensors
        if index >= len(table):
            kind = "RRef" if is_rref else "tensor"
            raise pickle.UnpicklingError(
                f"{kind} {index} of a message that carries {len(table)}"
            )
        if is_rref:
            return _RRef._from_handle(table[index])
        return table[index]


#: Per thread: a pickler and its buffer, reused from one message to the
#: next (making them costs about as much as pickling a small call).
_local = threading.local()

#: A buffer that grew past this is not kept for the next message.
_KEPT_BUFFER_BYTES = 1 << 20


#: The types whose values pickle alone: no tensor or RRef can be inside.
_ATOMS = frozenset((type(None), bool, int, float, complex, str, bytes))


def _pickled_by_itself(obj):
    """``obj`` pickled by a ``_Pickler`` of its own: the bytes."""
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return buf.getvalue()


#: What ``_Pickler`` writes for a lone tensor: its persistent id, 0.
_ONE_TENSOR = _pickled_by_itself(torch.empty(0))


def _out_of_band(obj):
    """Whether ``obj`` is a tensor that travels out of band as itself (what
    ``_Pickler.persistent_id`` pulls out)."""
    return type(obj) is torch.Tensor and obj.layout in _OUT_OF_BAND_LAYOUTS


def dumps(obj):
    """``obj`` pickled: ``(bytes, tensors, rref handles)``."""
    if type(obj) in _ATOMS:
        return pickle.dumps(obj, protocol=5), [], []
    if _out_of_band(obj):
        # What the pickler writes for a lone tensor, without running it.
        return _ONE_TENSOR, [obj], []
    p = getattr(_local, "pickler", None)
    if p is None or p.busy:
        # First use on this thread, or pickling inside a pickling (an
        # object's reduction that makes a call): a pickler of its own.
        buf = io.BytesIO()
        p = _Pickler(buf)
        p.buf = buf
        if getattr(_local, "pickler", None) is None:
            _local.pickler = p
    buf = p.buf
    p.busy = True
    try:
        p.dump(obj)
        return buf.getvalue(), p.tensors, p.rrefs
    finally:
        # Ready for the next message, holding nothing of this one.
        p.busy = False
        p.tensors = []
        p.rrefs = []
        p.clear_memo()
        if buf.tell() > _KEPT_BUFFER_BYTES:
            if _local.pickler is p:
                _local.pickler = None
        else:
            buf.seek(0)
            buf.truncate()


def loads(data, tensors, rrefs):
    """The object ``dumps`` gave ``(data, tensors, rrefs)`` for."""
    if not tensors and not rrefs:
        # No persistent id inside (each one is an entry of a table):
        # the C unpickler alone, which refuses one if a peer forged it.
        return pickle.loads(data)
    if data == _ONE_TENSOR and len(tensors) == 1 and not rrefs:
        return tensors[0]
    u = _Unpickler(io.BytesIO(data))
    u._tensors = tensors
    u._rrefs = rrefs
    return u.load()


# A call travels in one of three forms. The general one is the pickle of
# ``(function, args, kwargs)``; it starts with pickle's PROTO opcode
# (0x80). A function or class that pickles by reference alone (a plain
# Python function or a class, found by module and qualified name) travels
# as a *reference*: a form byte, the length of the function's own pickle
# (2 bytes, little-endian) and that pickle, then
# - form 0x01: the pickle of ``(args, kwargs)``, or nothing when both
#   are empty;
# - form 0x02: nothing: the arguments are the message's tensors, in order
#   (a call whose arguments are all distinct tensors and no keywords).
# Both sides keep the references they met: the caller does not pickle the
# function again, the callee does not look it up again.

_PICKLED_ARGS = 1
_TENSOR_ARGS = 2
_PICKLED_ARGS_BYTE = bytes((_PICKLED_ARGS,))
_TENSOR_ARGS_BYTE = bytes((_TENSOR_ARGS,))
_REFERENCE_HEAD = 3
_REFERENCE_TYPES = (types.FunctionType, type)

#: Each side keeps at most this many references (then starts over).
_KEPT_REFERENCES = 4096

#: Caller: function -> its reference (the length and the pickle).
_references = {}

#: Callee: a reference (the length and the pickle) -> its function.
_referenced = {}


def _named(func):
    """Whether ``func`` is what its module and qualified name find now
    (as pickle checks when it pickles it by reference)."""
    found = sys.modules.get(func.__module__)
    for part in func.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is func


def _reference(func):
    """The reference of ``func`` (the length and its pickle), or None
    where it does not pickle by reference alone (a lambda, a bound method,
    a partial, a callable object, a function its name no longer finds:
    those travel in the general form)."""
    if type(func) not in _REFERENCE_TYPES or not _named(func):
        return None
    ref = _references.get(func)
    if ref is not None:
        return ref
    try:
        own = pickle.dumps(func, protocol=5)
    except Exception:
        return None
    if len(own) > 0xFFFF:
        return None
    if len(_references) >= _KEPT_REFERENCES:
        _references.clear()
    ref = len(own).to_bytes(2, "little") + own
    _references[func] = ref
    return ref


def _distinct_tensors(args):
    """Whether ``args`` are all tensors that travel as themselves, no two
    the same object (the pickle would send a repeated one once)."""
    for a in args:
        if not _out_of_band(a):
            return False
    return len(args) == 1 or len(set(map(id, args))) == len(args)


def dumps_call(func, args, kwargs):
    """The call ``func(*args, **kwargs)`` pickled, in a reference form
    where ``func`` allows: ``(bytes, tensors, rref handles)``."""
    args = tuple(args) if args is not None else ()
    kwargs = dict(kwargs) if kwargs else {}
    ref = _reference(func)
    if ref is None:
        return dumps((func, args, kwargs))
    if not kwargs:
        if not args:
            return _PICKLED_ARGS_BYTE + ref, [], []
        if _distinct_tensors(args):
            return _TENSOR_ARGS_BYTE + ref, list(args), []
    data, tensors, rrefs = dumps((args, kwargs))
    return _PICKLED_ARGS_BYTE + ref + data, tensors, rrefs


def loads_call(data, tensors, rrefs):
    """``(function, args, kwargs)`` of a call ``dumps_call`` pickled."""
    form = data[0] if data else None
    if form != _PICKLED_ARGS and form != _TENSOR_ARGS:
        return loads(data, tensors, rrefs)
    end = _REFERENCE_HEAD + int.from_bytes(data[1:_REFERENCE_HEAD], "little")
    if len(data) < end:
        raise pickle.UnpicklingError(
            f"a call's function reference of {end - _REFERENCE_HEAD} bytes "
            f"in a message of {len(data)}"
        )
    ref = data[1:end]
    func = _referenced.get(ref)
    if func is None or not _named(func):
        func = pickle.loads(ref[_REFERENCE_HEAD - 1 :])
        if len(_referenced) >= _KEPT_REFERENCES:
            _referenced.clear()
        _referenced[ref] = func
    if form == _TENSOR_ARGS:
        if len(data) != end or rrefs:
            raise pickle.UnpicklingError(
                "a call whose arguments are its tensors carries "
                f"{len(data) - end} more bytes and {len(rrefs)} RRefs"
            )
        return func, tuple(tensors), {}
    if len(data) == end:
        return func, (), {}
    args, kwargs = loads(data[end:], tensors, rrefs)
    return func, args, kwargs


def _current_worker():
    name, rank = _rpc.get_worker_info()
    return f"WorkerInfo(id={rank}, name={name})"


def _remote_exception(exc):
    """``exc``, being handled on the callee, as a ``RemoteException``."""
    msg = f"On {_current_worker()}:\n{exc!r}\n{traceback.format_exc()}"
    exc_type = type(exc)
    try:
        # The caller re-raises this type: it travels by reference.
        pickle.dumps(exc_type, protocol=5)
    except Exception:
        exc_type = RuntimeError
    return RemoteException(msg, exc_type)


def exception_from(remote):
    """The exception to raise on the caller for a ``RemoteException``:
    the callee's type with the callee's message, as PyTorch re-raises it."""
    try:
        return remote.exception_type(remote.msg)
    except BaseException as e:
        return RuntimeError(
            f"Failed to create original exception type. Error msg was {e}"
            f" Original exception on remote side was {remote.msg}"
        )


def run(data, tensors, rrefs):
    """Runs a pickled ``(function, args, kwargs)`` on the callee:
    ``(raised, (bytes, tensors, rrefs))`` of its result, or of the
    ``RemoteException`` for what it raised."""
    raised, obj = run_object(data, tensors, rrefs)
    try:
        return raised, dumps(obj)
    except Exception as e:
        return True, dumps(_remote_exception(e))


def call_function(func, args, kwargs):
    """``func(*args, **kwargs)``; for a function marked with
    ``functions.async_execution``, the value of the future it returned,
    once that completes."""
    result = func(*args, **kwargs)
    if is_async_execution(func):
        result = wait_async_result(result)
    return result


def wait_async_result(result):
    """The value of the future an ``async_execution`` function returned,
    waited for (the GIL released meanwhile, as ``Future.wait`` does)."""
    # torch._C.Future: `then()` returns the C++ type, not torch.futures.Future.
    if not isinstance(result, torch._C.Future):
        raise RuntimeError(
            "Functions decorated with @rpc.async_function must return a "
            f"torch.futures.Future object, but got {type(result)}"
        )
    return result.wait()


def run_object(data, tensors, rrefs):
    """Runs a pickled ``(function, args, kwargs)``: ``(raised, object)``,
    the object being the result or the ``RemoteException``."""
    try:
        try:
            func, args, kwargs = loads_call(data, tensors, rrefs)
        except AttributeError as e:
            # A function or class the caller has and this worker lacks.
            raise RuntimeError(
                f"{e}. The RPC pickler does not serialize function code: define the "
                "functions and classes a call names on both the caller and the callee."
            ) from e
        return False, call_function(func, args, kwargs)
    except Exception as e:
        return True, _remote_exception(e)


def set_future_error(fut, exc):
    """Completes the ``torch.futures.Future`` ``fut`` with the exception
    ``exc`` as PyTorch's RPC futures hold an error: the C++ future fails,
    so ``torch.futures.wait_all`` stops at it, and ``wait()`` / ``value()``
    raise ``exc`` itself (its type kept). ``Future.set_exception`` would
    store it as the future's value instead, which ``wait_all`` takes for a
    result."""
    _rpc.set_future_error(fut, exc)


def load_reply(raised, data, tensors, rrefs):
    """The result a reply carries, or raises the callee's exception."""
    obj = loads(data, tensors, rrefs)
    if raised:
        raise exception_from(obj)
    return obj

