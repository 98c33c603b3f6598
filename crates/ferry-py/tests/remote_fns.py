"""Functions and classes the tests run on other workers. They travel by
reference, so every worker imports this module (the tests' directory is
on each worker's path)."""

import threading

import torch

import ferry.rpc as rpc


class CustomError(Exception):
    """An exception type of the tests' own, re-raised by type on the caller."""


def add(a, b):
    return a + b


def add_kw(a, *, b=0, c=0):
    return a + b + c


def identity(x):
    return x


def raise_value_error(text):
    raise ValueError(f"bad value: {text}")


def raise_custom(text):
    raise CustomError(text)


def make_tensors(seed):
    """Tensors made on the callee, of several dtypes and layouts."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(4, 6, generator=g)
    return {
        "f32": base,
        "t": base.t(),
        "i64": torch.arange(10),
        "empty": torch.empty(0, 3),
        "b": base > 0.5,
    }


def sum_of(t):
    return t.sum()


def describe(t):
    """What a tensor looked like on arrival: its dtype, shape, strides, and
    its values as a list (to compare on the caller)."""
    return (str(t.dtype), tuple(t.shape), t.stride(), t.tolist())


def sum_on(to, t):
    """Calls back: `to` sums `t`, and this worker returns what it got."""
    return rpc.rpc_sync(to, torch.sum, args=(t,))


def call_back(to, fn, args):
    """Calls `fn(*args)` on `to` from here (a nested call)."""
    return rpc.rpc_sync(to, fn, args=args)


def fetch(rref):
    """`to_here()` of an RRef passed in by a caller."""
    return rref.to_here()


def owner_value(rref):
    """The value of an RRef passed back to its owner."""
    return rref.local_value()


def is_owner(rref):
    return rref.is_owner()


def fill_(t, value):
    """Fills the tensor that arrived, returning it."""
    t.fill_(value)
    return t


class Counter:
    """State that lives on its owner and changes there."""

    def __init__(self, start=0):
        self.value = start

    def add(self, k):
        self.value += k
        return self.value

    def get(self):
        return self.value

    def fail(self):
        raise KeyError("no such key")


# A gate that a call can wait at until another call opens it: lets a test
# hold a callee busy without sleeping.
_gate = threading.Event()


def wait_at_gate(limit):
    """Waits until the gate opens (at most `limit` seconds); True if it did."""
    return _gate.wait(limit)


def open_gate():
    _gate.set()


def close_gate():
    _gate.clear()


def worker_name():
    return rpc.get_worker_info().name
