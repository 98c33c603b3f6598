"""``ferry.rpc.functions``: ``async_execution``, as
``torch.distributed.rpc.functions`` has it."""

import functools

#: The attribute ``async_execution`` sets on its wrapper (PyTorch's name,
#: so that code that tests for it, as PyTorch's RRef proxies do, works
#: with either).
ASYNC_ATTR = "_wrapped_async_rpc_function"


def async_execution(fn):
    """Marks ``fn`` as returning a ``torch.futures.Future``: when a worker
    runs it for ``rpc_sync``, ``rpc_async`` or ``remote`` (directly, or as a
    method through an RRef's proxies), the caller gets the future's value
    once it completes, not the future. ``fn`` can so hand its work on
    (``rpc_async(...).then(...)``) without holding the result back.

    As in PyTorch, it must be the innermost decorator under
    ``@staticmethod`` or ``@classmethod``, and ``fn`` must return a
    ``Future``: anything else fails the call with ``RuntimeError``.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    setattr(wrapper, ASYNC_ATTR, fn)
    return wrapper


def is_async_execution(fn):
    """Whether ``fn`` was decorated with :func:`async_execution`."""
    return hasattr(fn, ASYNC_ATTR)
