"""Calls between Python and Rust workers in one group.

A function named by a ``str`` in ``rpc_sync``, ``rpc_async`` or
``remote`` is a function a worker registered by name: a Rust function
(``Function<A, R>`` registered with ``Functions::add``) or a Python one
registered with ``register``. Its worker describes its argument and
result types (their shapes in serde's data model); the arguments are
converted to the argument type by that shape and the result back from
the result type (``ferry._ferry.interop``'s docs give the mapping:
``int`` for integers, ``dict`` for structs, ``torch.Tensor`` for tensors,
out of band). Positional arguments fill a tuple argument's items or a
struct argument's fields in order; keywords name a struct argument's
fields (an ``Option`` field left out is ``None``). Arguments that do not
fit raise ``TypeError`` naming the function, its signature and the value
or keyword.
"""

import torch

from ferry import _ferry
from ferry.rpc import _internal
from ferry.rpc.rref import RRef

_interop = _ferry.interop


def _args(args):
    return tuple(args) if args is not None else ()


def rpc_sync(to, name, args, kwargs, timeout, method=False):
    """``rpc_sync`` of the function registered as ``name`` on ``to``.
    ``method``: an RRef proxy's call, the RRef the first argument (the
    function must take an RRef first, else ``TypeError``)."""
    return _interop.rpc_sync(to, name, _args(args), kwargs, float(timeout), method)


def rpc_async(to, name, args, kwargs, timeout, method=False):
    """``rpc_async`` of the function registered as ``name`` on ``to``: a
    ``torch.futures.Future`` of its result. ``method`` as for
    ``rpc_sync``."""
    fut = torch.futures.Future()

    def on_done(value, error):
        if error is not None:
            _internal.set_future_error(fut, error)
        else:
            fut.set_result(value)

    _interop.rpc_async(to, name, _args(args), kwargs, float(timeout), on_done, method)
    return fut


def remote(to, name, args, kwargs, timeout, method=False):
    """``remote`` of the function registered as ``name`` on ``to``: an
    ``RRef`` to its result, which stays there. ``method`` as for
    ``rpc_sync``."""
    return RRef._from_handle(
        _interop.remote(to, name, _args(args), kwargs, float(timeout), method)
    )


def _rref_debug_info():
    """Counts of this worker's RRef tables, a ``dict``: ``num_owner_rrefs``,
    ``num_confirmed_users``, ``num_pending_users``, ``num_pending_children``,
    ``num_pending_control``, ``num_pending_remotes``."""
    return _interop.rref_debug_info()


def _rref_wait_until_empty(timeout):
    """Waits until this worker's RRef tables are empty (no value owned, no
    user, nothing pending), at most ``timeout`` seconds: ``None``, or what
    was left as text."""
    return _interop.rref_wait_until_empty(float(timeout))
