"""The forms a call is pickled in (``ferry.rpc._internal``), without
workers: the reference forms for functions and classes found by module and
qualified name (arguments pickled, or the arguments being the message's
tensors), the general form for everything else, and what each side does
when a name is rebound or a message is forged."""

import functools
import io
import pickle
import sys
import types

import pytest
import torch

from ferry.rpc import _internal


def plain(x=0, *, y=0):
    return x + y


class Plain:
    def method(self):
        return 1


_REF = pickle.dumps(plain, protocol=5)


@pytest.fixture
def module():
    """A module of its own in ``sys.modules``, its ``f`` rebindable."""
    m = types.ModuleType("ferry_pickle_test_module")

    def f():
        return "first"

    f.__module__ = m.__name__
    f.__qualname__ = "f"
    m.f = f
    sys.modules[m.__name__] = m
    yield m
    del sys.modules[m.__name__]


def test_an_empty_call_is_its_function_reference_alone():
    data, tensors, rrefs = _internal.dumps_call(plain, None, None)
    assert data[0] == 1
    assert data[3:] == pickle.dumps(plain, protocol=5)
    assert (tensors, rrefs) == ([], [])
    assert _internal.loads_call(data, tensors, rrefs) == (plain, (), {})


def test_arguments_follow_the_reference_and_keep_their_tensors():
    t = torch.arange(6.0).reshape(2, 3)
    data, tensors, rrefs = _internal.dumps_call(plain, [t, 2], {"y": t})
    assert data[0] == 1
    assert len(tensors) == 2 and all(x is t for x in tensors)
    func, args, kwargs = _internal.loads_call(data, tensors, rrefs)
    assert func is plain
    assert args[0] is t and args[1] == 2 and kwargs["y"] is t


def test_distinct_tensor_arguments_are_the_message_tensors():
    a, b = torch.ones(2), torch.zeros(3, 2).t()
    data, tensors, rrefs = _internal.dumps_call(plain, (a, b), None)
    assert data[0] == 2 and data[3:] == pickle.dumps(plain, protocol=5)
    assert tensors == [a, b] and rrefs == []
    func, args, kwargs = _internal.loads_call(data, tensors, rrefs)
    assert func is plain and args[0] is a and args[1] is b and kwargs == {}


@pytest.mark.parametrize(
    "args",
    [
        pytest.param("repeated", id="one tensor twice"),
        pytest.param("parameter", id="a Parameter (a subclass)"),
        pytest.param("mixed", id="a tensor and an int"),
    ],
)
def test_other_arguments_are_pickled_and_keep_their_identity(args):
    t = torch.ones(2)
    args = {
        "repeated": (t, t),
        "parameter": (torch.nn.Parameter(torch.ones(2)),),
        "mixed": (t, 3),
    }[args]
    data, tensors, rrefs = _internal.dumps_call(plain, args, None)
    assert data[0] == 1
    _, got, _ = _internal.loads_call(data, tensors, rrefs)
    assert len(got) == len(args)
    if len(args) > 1 and args[0] is args[1]:
        assert got[0] is got[1]
    if isinstance(args[0], torch.nn.Parameter):
        assert isinstance(got[0], torch.nn.Parameter)


def test_a_lone_tensor_result_is_its_persistent_id():
    t = torch.arange(4)
    data, tensors, rrefs = _internal.dumps(t)
    assert tensors == [t] and rrefs == []
    class Ids(pickle.Unpickler):
        def persistent_load(self, pid):
            return ("pid", pid)

    assert Ids(io.BytesIO(data)).load() == ("pid", 0)
    assert _internal.load_reply(False, data, tensors, rrefs) is t


def test_classes_travel_by_reference():
    data, _, _ = _internal.dumps_call(Plain, (), {})
    assert data[0] == 1
    assert _internal.loads_call(data, [], []) == (Plain, (), {})


@pytest.mark.parametrize(
    "func",
    [
        lambda: 1,
        Plain().method,
        functools.partial(plain, 1),
        torch.add,
        len,
    ],
    ids=["lambda", "bound method", "partial", "torch builtin", "builtin"],
)
def test_everything_else_travels_in_the_general_form(func):
    try:
        data, tensors, rrefs = _internal.dumps_call(func, (1,), None)
    except (pickle.PicklingError, AttributeError, TypeError):
        # A lambda does not pickle at all, as with torch.distributed.rpc.
        assert func.__name__ == "<lambda>"
        return
    assert data[:2] == b"\x80\x05"
    got, args, kwargs = _internal.loads_call(data, tensors, rrefs)
    assert args == (1,) and kwargs == {}
    assert got == func or type(got) is type(func)


def test_a_rebound_name_is_found_again_on_both_sides(module):
    first = module.f
    data, _, _ = _internal.dumps_call(first, (), {})
    assert _internal.loads_call(data, [], [])[0] is first

    def second():
        return "second"

    second.__module__ = module.__name__
    second.__qualname__ = "f"
    module.f = second
    # The callee finds the new function under the same reference.
    assert _internal.loads_call(data, [], [])[0] is second
    # The caller no longer names the old one by reference (pickle itself
    # would refuse it: not the same object as the module's `f`).
    with pytest.raises(pickle.PicklingError):
        _internal.dumps_call(first, (), {})
    data2, _, _ = _internal.dumps_call(second, (), {})
    assert data2 == data


@pytest.mark.parametrize(
    "data",
    [
        b"\x01",
        b"\x01\xff\xff" + b"x" * 10,
        b"\x01\x03\x00abc",
        b"\x02" + (len(_REF)).to_bytes(2, "little") + _REF + b"extra",
    ],
    ids=["no length", "length past the end", "not a pickle", "tensor form with bytes after"],
)
def test_a_forged_reference_is_an_unpickling_error(data):
    with pytest.raises(pickle.UnpicklingError):
        _internal.loads_call(data, [], [])


def test_atoms_pickle_alone_and_replies_load_without_tables():
    for value in [None, True, 3, 2.5, 1j, "text", b"bytes"]:
        data, tensors, rrefs = _internal.dumps(value)
        assert (tensors, rrefs) == ([], [])
        assert _internal.load_reply(False, data, tensors, rrefs) == value


def test_a_persistent_id_without_its_table_is_refused():
    data, tensors, rrefs = _internal.dumps([torch.ones(2)])
    assert len(tensors) == 1
    with pytest.raises(pickle.UnpicklingError):
        _internal.loads(data, [], [])
