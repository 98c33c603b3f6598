"""The Python worker of a mixed-group test: ``python mixed_worker.py
<scenario>`` joins a group (``WORLD_SIZE``) of this worker ``py`` (rank 0),
the Rust worker ``rust`` (``crates/ferry/examples/mixed_worker.rs``, rank
1) and, in a group of three, a second Python worker ``py2`` (rank 2,
``python mixed_worker.py --serve``, which serves the functions here until
the group shuts down); it runs the scenario's checks and leaves with the
group, exiting with 0 when every check passed.

The Python functions the Rust worker calls are registered here, before
``init_rpc`` (and one after), with the shapes of the Rust types its
declarations use.
"""

import os
import sys
import traceback

import torch

import ferry.rpc as rpc

RUST = "rust"
POINT = "Point { x: i64, y: Option<f32>, tags: [String] }"


def py_scale(t, k):
    return t * k


def py_echo(tensors):
    assert isinstance(tensors, list) and all(isinstance(t, torch.Tensor) for t in tensors)
    return tensors


def py_point(p):
    return {"x": p["x"] + 1, "y": 0.5, "tags": p["tags"] + ["python"]}


def py_fail(text):
    raise ValueError(f"no good: {text}")


def py_raw_echo(tensors):
    assert isinstance(tensors, list) and all(isinstance(t, torch.Tensor) for t in tensors)
    return tensors


def register():
    rpc.register("py_raw_echo", py_raw_echo, args="[RawTensor]", returns="[RawTensor]")
    rpc.register("py_scale", py_scale, args="(Tensor, f32)", returns="Tensor")
    rpc.register("py_echo", py_echo, args="[Tensor]", returns="[Tensor]")
    rpc.register("py_point", py_point, args=POINT, returns=POINT)
    rpc.register("py_fail", py_fail, args="String", returns="String")


def tensors_of_several_kinds():
    """Tensors of several dtypes, with views and tensors of no elements."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return [
        base,
        base.t(),  # a transposed view
        base[:, 1::2],  # a strided view
        torch.arange(5, dtype=torch.int64) - 2,
        torch.tensor([True, False, True]),
        torch.arange(6, dtype=torch.int8).reshape(2, 3),
        torch.arange(4, dtype=torch.uint8),
        torch.arange(4, dtype=torch.int16),
        torch.arange(4, dtype=torch.int32),
        torch.linspace(0, 1, 5, dtype=torch.float64),
        torch.ones(3, dtype=torch.float16),
        torch.ones(3, dtype=torch.bfloat16),
        torch.zeros(0, dtype=torch.float32),
        torch.zeros(2, 0, 3, dtype=torch.int64),
        torch.tensor(3.5),  # no dimensions
    ]


def same(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and torch.equal(a, b)
    )


def calls():
    assert rpc.rpc_sync(RUST, "add", args=(2, 3)) == 5
    assert rpc.rpc_sync(1, "add", args=(-4, 1)) == -3  # by rank
    assert rpc.rpc_sync(rpc.get_worker_info(RUST), "greet", args=("ferry",)) == "hello, ferry"
    assert rpc.rpc_sync(RUST, "nothing") == 7
    assert rpc.describe(RUST, "add") == "fn((i64, i64)) -> i64"
    assert rpc.describe(RUST, "move_point") == f"fn(({POINT}, i64)) -> {POINT}"
    moved = rpc.rpc_sync(RUST, "move_point", args=({"x": 1, "y": 1.5, "tags": ["a"]}, 2))
    assert moved == {"x": 3, "y": 3.0, "tags": ["a", "moved"]}, moved
    # A dataclass-like object with the fields as attributes is a struct too.
    class P:
        x, y, tags = 1, None, ()
    assert rpc.rpc_sync(RUST, "move_point", args=(P(), 0)) == {"x": 1, "y": None, "tags": ["moved"]}
    for op, expected in [
        ({"Add": 5}, 15),
        ({"Scale": {"by": 3}}, 30),
        ({"Pair": (2, 4)}, 18),
        ("Neg", -10),
    ]:
        assert rpc.rpc_sync(RUST, "apply", args=(op, 10)) == expected, op
    assert rpc.rpc_sync(RUST, "count", args=({"a": [1, 2], "b": []},)) == {"a": 3, "b": 0}
    assert rpc.rpc_sync(RUST, "small", args=(-128 + 1, 65000, "é", True, b"xyz")) == (
        127,
        65003,
        "é",
        False,
    )
    fut = rpc.rpc_async(RUST, "add", args=(20, 22))
    futs = [rpc.rpc_async(RUST, "add", args=(i, i)) for i in range(10)]
    assert fut.wait() == 42
    assert torch.futures.wait_all(futs) == [2 * i for i in range(10)]
    assert fut.then(lambda f: f.value() + 1).wait() == 43


def tensors_to_rust_and_back():
    sent = tensors_of_several_kinds()
    back = rpc.rpc_sync(RUST, "echo_tensors", args=(sent,))
    assert len(back) == len(sent)
    for a, b in zip(sent, back):
        assert same(a, b), (a, b)
        assert b.data_ptr() != a.data_ptr() or a.numel() == 0  # a copy that arrived
    # What the Rust side saw: dtype, sizes, strides, values.
    meta = rpc.rpc_sync(RUST, "meta", args=(sent,))
    for t, (kind, size, stride, values) in zip(sent, meta):
        assert size == list(t.shape) and stride == list(t.stride()), (t, size, stride)
        assert values == t.to(torch.float64).flatten().tolist(), (t, values)
    assert [m[0] for m in meta[:4]] == ["Float", "Float", "Float", "Int64"]
    # Tensors Rust made: a transposed view, zero-size and several dtypes.
    made = rpc.rpc_sync(RUST, "make_tensors")
    expected = [
        torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),
        torch.arange(4) - 2,
        torch.zeros(0, 3, dtype=torch.float64),
        torch.tensor([True, False, True]),
        torch.arange(5, dtype=torch.int8)[0:5:2],
        torch.ones(2, 2, dtype=torch.float16),
    ]
    for a, b in zip(expected, made):
        assert same(a, b), (a, b)
    assert made[0].stride() == (1, 3)  # a view arrives as a view
    x = torch.randn(4, 5)[:, 1:4]
    torch.testing.assert_close(rpc.rpc_sync(RUST, "scale", args=(x, 2.5)), x * 2.5)


def type_errors():
    def raises(exc, fragments, to, name, args, kwargs=None):
        call = (to, name, args, kwargs)
        try:
            rpc.rpc_sync(to, name, args=args, kwargs=kwargs)
        except exc as e:
            text = str(e)
            for f in fragments:
                assert f in text, (f, text)
            return
        raise AssertionError(f"{call} did not raise {exc.__name__}")

    sig = 'add on worker "rust" (fn((i64, i64)) -> i64)'
    raises(TypeError, [sig + " got a wrong argument: at [1]: expected i64, got str 'x'"],
           RUST, "add", (1, "x"))
    raises(TypeError, [sig, "takes 2 arguments, 1 given"], RUST, "add", (1,))
    raises(TypeError, ["expected i64", "out of range"], RUST, "add", (1, 2**70))
    raises(TypeError, ["expected i64", "got bool"], RUST, "add", (1, True))
    raises(TypeError, ["at [0]: expected Point", "without the field \"tags\""],
           RUST, "move_point", ({"x": 1, "y": None}, 1))
    raises(TypeError, ["a dict with the key 'z'"],
           RUST, "move_point", ({"x": 1, "y": None, "tags": [], "z": 0}, 1))
    raises(TypeError, ["at [0].tags[1]: expected String, got int 5"],
           RUST, "move_point", ({"x": 1, "y": None, "tags": ["a", 5]}, 1))
    raises(TypeError, ['no variant "Mul"'], RUST, "apply", ({"Mul": 2}, 1))
    raises(TypeError, ["expected u16", "out of range"], RUST, "small", (1, -1, "a", True, b""))
    raises(TypeError, ["expected char"], RUST, "small", (1, 1, "ab", True, b""))
    raises(TypeError, ["expected Tensor, got list"], RUST, "scale", ([1.0], 2.0))
    raises(TypeError, [sig + " takes no keyword arguments (got 'b')", "tuple"],
           RUST, "add", (1,), {"b": 2})
    try:
        rpc.rpc_sync(RUST, "no_such_function", args=(1,))
        raise AssertionError("an unknown function was called")
    except RuntimeError as e:
        assert "no_such_function" in str(e), e
    # Refused before anything was sent: the worker goes on serving.
    assert rpc.rpc_sync(RUST, "add", args=(1, 1)) == 2


def rust_errors():
    try:
        rpc.rpc_sync(RUST, "fail", args=("because",))
        raise AssertionError("fail did not fail")
    except RuntimeError as e:
        assert "refused: because\nsecond line" in str(e), str(e)
        assert 'On worker "rust", fail failed' in str(e), str(e)
    fut = rpc.rpc_async(RUST, "fail", args=("later",))
    try:
        fut.wait()
        raise AssertionError("fail did not fail")
    except RuntimeError as e:
        assert "refused: later" in str(e), str(e)


def rrefs():
    info = rpc._rref_debug_info
    rref = rpc.remote(RUST, "make", args=("model", [1.0, 2.0, 3.0]))
    assert rref.owner_name() == RUST and rref.owner() == rpc.get_worker_info(RUST)
    assert not rref.is_owner()
    value = rref.to_here()
    assert value["name"] == "model" and value["step"] == 3, value
    torch.testing.assert_close(value["weights"], torch.tensor([1.0, 2.0, 3.0]))
    assert rref.confirmed_by_owner()
    assert "UserRRef" in repr(rref)
    # Back to a Rust function that takes an RRef<Params>: it reads the
    # value where it lives.
    assert rpc.rpc_sync(RUST, "read", args=(rref,)) == ("model", 3)
    assert rpc.rpc_async(RUST, "read", args=(rref,)).wait() == ("model", 3)
    assert info()["num_confirmed_users"] >= 1
    # A failing creation raises at to_here, with the Rust error's text.
    failed = rpc.remote(RUST, "make", args=("", []))
    try:
        failed.to_here()
        raise AssertionError("a failed creation gave a value")
    except RuntimeError as e:
        assert "a name is needed" in str(e), str(e)
    try:
        rref.local_value()
        raise AssertionError("local_value of a Rust value")
    except RuntimeError as e:
        assert "to_here" in str(e)
    # An RRef to a Rust value is refused in a Python call's arguments.
    try:
        rpc.rpc_sync(RUST, "add", args=(rref, 1))
        raise AssertionError("an RRef taken as an i64")
    except TypeError as e:
        assert "expected i64" in str(e)
    # In a pickled Python call (here, to this worker itself) it travels
    # as an RRef too.
    assert rpc.rpc_sync("py", len, args=([rref, rref],)) == 2
    del rref, value, failed
    # Accounting: every table empties on both sides once the RRefs are gone.
    assert rpc._rref_wait_until_empty(30.0) is None, info()
    assert rpc.rpc_sync(RUST, "rrefs_empty", args=(30000,)) == "empty"


def rust_calls_python():
    failed = rpc.rpc_sync(RUST, "call_python", args=("py",))
    assert failed == [], "\n".join(failed)
    # The same registered functions are callable by name from Python too.
    t = torch.arange(3.0)
    torch.testing.assert_close(rpc.rpc_sync("py", "py_scale", args=(t, 2.0)), t * 2)


def registration():
    try:
        rpc.register("ferry.mine", py_scale, args="(Tensor, f32)", returns="Tensor")
        raise AssertionError("a name of Ferry's own registered")
    except ValueError as e:
        assert "Ferry's own" in str(e), str(e)


def late_registration():
    # Before it is registered: no such function, for Rust callers (typed
    # UnknownFunction, describe gives none) and Python ones alike.
    described, values, error = rpc.rpc_sync(RUST, "call_late", args=("py",))
    assert described is None and values is None, (described, values)
    assert error == "unknown function py_late", error
    try:
        rpc.describe("py", "py_late")
        raise AssertionError("described before it was registered")
    except RuntimeError as e:
        assert "py_late" in str(e), str(e)
    # Registered after init_rpc: found from then on.
    rpc.register("py_late", lambda t, k: t + k, args="(Tensor, i64)", returns="Tensor")
    described, values, error = rpc.rpc_sync(RUST, "call_late", args=("py",))
    assert described == "fn((Tensor, i64)) -> Tensor", described
    assert values == [11.0, 12.0, 13.0] and error == "", (values, error)
    assert rpc.describe("py", "py_late") == "fn((Tensor, i64)) -> Tensor"
    # Registered again: replaced.
    rpc.register("py_late", lambda t, k: t * k, args="(Tensor, i64)", returns="Tensor")
    _, values, error = rpc.rpc_sync(RUST, "call_late", args=("py",))
    assert values == [10.0, 20.0, 30.0] and error == "", (values, error)
    # A Python caller's description (cached) is forgotten once the callee
    # refuses a call by it: registered again with other types, the first
    # call is refused as of a wrong type, the next one asks again.
    t = torch.arange(3.0)
    torch.testing.assert_close(rpc.rpc_sync("py", "py_late", args=(t, 2)), t * 2)
    rpc.register("py_late", lambda t, k: t + k, args="(Tensor, f64)", returns="Tensor")
    try:
        rpc.rpc_sync("py", "py_late", args=(t, 2))
        raise AssertionError("a call by a stale description accepted")
    except RuntimeError as e:
        assert "py_late" in str(e), str(e)
    torch.testing.assert_close(rpc.rpc_sync("py", "py_late", args=(t, 0.5)), t + 0.5)
    assert rpc.describe("py", "py_late") == "fn((Tensor, f64)) -> Tensor"


AXPY = "Axpy { x: Tensor, y: Tensor, alpha: Option<f64> }"


def keywords():
    close = torch.testing.assert_close
    assert rpc.describe(RUST, "axpy") == f"fn({AXPY}) -> Tensor"
    x, y = torch.arange(3.0), torch.ones(3)
    # The struct's fields are the arguments: by position, by keyword, both;
    # the Option field left out is None.
    close(rpc.rpc_sync(RUST, "axpy", args=(x, y)), x + y)
    close(rpc.rpc_sync(RUST, "axpy", args=(x, y, 2.0)), 2 * x + y)
    close(rpc.rpc_sync(RUST, "axpy", args=(x,), kwargs={"y": y, "alpha": 3.0}), 3 * x + y)
    close(rpc.rpc_sync(RUST, "axpy", kwargs={"alpha": -1.0, "y": y, "x": x}), y - x)
    close(rpc.rpc_sync(RUST, "axpy", args=(x, y), kwargs={"alpha": None}), x + y)
    # The whole struct as one value, as before.
    close(rpc.rpc_sync(RUST, "axpy", args=({"x": x, "y": y, "alpha": 0.5},)), 0.5 * x + y)
    # rpc_async and remote bind them alike.
    close(rpc.rpc_async(RUST, "axpy", args=(x,), kwargs={"y": y}).wait(), x + y)
    rref = rpc.remote(RUST, "axpy", args=(y,), kwargs={"y": x, "alpha": 4.0})
    close(rref.to_here(), 4 * y + x)


def keyword_errors():
    def raises(fragments, args=None, kwargs=None, name="axpy"):
        try:
            rpc.rpc_sync(RUST, name, args=args, kwargs=kwargs)
        except TypeError as e:
            text = str(e)
            for f in fragments:
                assert f in text, (f, text)
            return
        raise AssertionError(f"{name}({args}, {kwargs}) did not raise TypeError")

    x, y = torch.arange(3.0), torch.ones(3)
    title = f'axpy on worker "rust" (fn({AXPY}) -> Tensor)'
    raises([title + ' got an unexpected keyword argument "beta"', "(its arguments: x, y, alpha)"],
           (x, y), {"beta": 1.0})
    raises([title + ' got multiple values for argument "x"'], (x,), {"x": x, "y": y})
    raises([title + ' missing 1 required argument: "y"'], (x,))
    raises([title + ' missing 2 required arguments: "x", "y"'], (), {"alpha": 1.0})
    raises([title + " takes 3 arguments (x, y, alpha), 4 given"], (x, y, 1.0, 2))
    raises([title + " got a wrong argument: at .y: expected Tensor, got str 'no'"],
           (x,), {"y": "no"})
    raises([title + " got a wrong argument: at .alpha: expected f64"], (x, y), {"alpha": "a"})
    raises([title + " got a keyword that is not a str: 1"], (x, y), {1: 2})
    # Functions whose argument has no names take no keywords.
    raises(['greet on worker "rust" (fn(String) -> String) takes no keyword arguments '
            "(got 'name')"], (), {"name": "x"}, name="greet")
    raises(['nothing on worker "rust" (fn(()) -> u8) takes no keyword arguments'],
           (), {"a": 1}, name="nothing")
    raises(["add", "takes no keyword arguments (got 'a', 'b')", "struct argument type"],
           (), {"a": 1, "b": 2}, name="add")
    # rpc_async and remote refuse them at once, before anything is sent.
    for api in (rpc.rpc_async, rpc.remote):
        try:
            api(RUST, "axpy", args=(x,), kwargs={"z": 1})
            raise AssertionError(f"{api.__name__} took an unexpected keyword")
        except TypeError as e:
            assert 'unexpected keyword argument "z"' in str(e), str(e)
    assert rpc.rpc_sync(RUST, "add", args=(1, 1)) == 2


def raw_tensors():
    assert rpc.describe(RUST, "raw_echo") == "fn([RawTensor]) -> [RawTensor]"
    sent = tensors_of_several_kinds()
    back = rpc.rpc_sync(RUST, "raw_echo", args=(sent,))
    assert len(back) == len(sent)
    for a, b in zip(sent, back):
        assert same(a, b), (a, b)
    # What the Rust side's RawTensors hold: the views as sent.
    meta = rpc.rpc_sync(RUST, "raw_meta", args=(sent,))
    for t, (dtype, size, stride) in zip(sent, meta):
        assert size == list(t.shape) and stride == list(t.stride()), (t, dtype, size, stride)
    made = rpc.rpc_sync(RUST, "raw_make")
    expected = [
        torch.tensor([[1.5, -2.0, 3.25], [4.0, 5.0, 6.0]]),
        torch.tensor([-2, -1, 0, 1]),
        torch.zeros(0, 3, dtype=torch.float64),
        torch.tensor([7, 8, 9], dtype=torch.uint8),
        torch.tensor([[-3], [3]], dtype=torch.int16),
        torch.tensor(2.5, dtype=torch.float64),
    ]
    assert len(made) == len(expected)
    for a, b in zip(expected, made):
        assert same(a, b), (a, b)
    # rpc_async too, and a RawTensor result of a remote.
    back = rpc.rpc_async(RUST, "raw_echo", args=([sent[1]],)).wait()
    assert same(back[0], sent[1])
    try:
        rpc.rpc_sync(RUST, "raw_echo", args=([1.0],))
        raise AssertionError("a float taken as a RawTensor")
    except TypeError as e:
        assert "at [0]: expected RawTensor, got float" in str(e), str(e)


def rref_name_there(rref):
    """On ``py2``: what an RRef to a Rust value that arrived in a pickled
    call is there."""
    value = rref.to_here()
    return value["name"], rref.owner_name(), rref.is_owner(), type(rref._handle).__name__


def rref_read_there(rref):
    """On ``py2``: passes the RRef it received on to the Rust owner."""
    return rpc.rpc_sync(RUST, "read", args=(rref,))


def rref_back(rrefs):
    return rrefs


def rref_hold(rref):
    """On ``py2``, by ``remote``: a Python value holding the RRef."""
    return {"held": rref}


def rrefs_empty(timeout):
    """This worker's RRef tables, once empty (``None``) or after ``timeout``
    seconds (what is left)."""
    return rpc._rref_wait_until_empty(timeout)


def rrefs_pickled():
    rref = rpc.remote(RUST, "make", args=("m", [1.0, 2.0]))
    # An argument of a Python function on another Python worker: it
    # arrives as an RRef to the Rust value, a user of the Rust owner.
    assert rpc.rpc_sync("py2", rref_name_there, args=(rref,)) == (
        "m", RUST, False, "RustRRefHandle")
    assert rpc.rpc_async("py2", rref_name_there, args=(rref,)).wait()[0] == "m"
    # Passed on from there to a Rust function.
    assert rpc.rpc_sync("py2", rref_read_there, args=(rref,)) == ("m", 2)
    # Returned: forked back, twice in one result.
    back = rpc.rpc_sync("py2", rref_back, args=([rref, rref],))
    assert len(back) == 2 and all(isinstance(r, rpc.RRef) for r in back)
    assert back[0].to_here()["step"] == 2
    assert rpc.rpc_sync(RUST, "read", args=(back[1],)) == ("m", 2)
    # Inside the value of an RRef to a Python value: fetched with it.
    held = rpc.remote("py2", rref_hold, args=(rref,))
    inner = held.to_here()["held"]
    assert inner.owner_name() == RUST and inner.to_here()["name"] == "m"
    # A Rust creation that failed travels too, and raises where it is used.
    failed = rpc.remote(RUST, "make", args=("", []))
    try:
        rpc.rpc_sync("py2", rref_name_there, args=(failed,))
        raise AssertionError("a failed creation gave a value")
    except RuntimeError as e:
        assert "a name is needed" in str(e), str(e)
    del rref, back, held, inner, failed
    # Accounting: every table empties on all three workers.
    assert rpc._rref_wait_until_empty(30.0) is None, rpc._rref_debug_info()
    assert rpc.rpc_sync("py2", rrefs_empty, args=(30.0,)) is None
    assert rpc.rpc_sync(RUST, "rrefs_empty", args=(30000,)) == "empty"


def rref_proxies():
    close = torch.testing.assert_close
    rref = rpc.remote(RUST, "make", args=("p", [1.0, 2.0]))
    # A Rust value has no methods: a proxy calls the owner's function of
    # that name with the RRef first.
    assert rref.rpc_sync().read() == ("p", 2)
    assert rref.rpc_async().read().wait() == ("p", 2)
    assert rref.remote().read().to_here() == ("p", 2)
    close(rref.rpc_sync().scaled_weights(2.0), torch.tensor([2.0, 4.0]))
    close(rref.rpc_async(timeout=30).scaled_weights(-1.0).wait(), torch.tensor([-1.0, -2.0]))
    # A function that takes no RRef first is no method of it.
    try:
        rref.rpc_sync().add(1)
        raise AssertionError("add called as a method")
    except TypeError as e:
        assert 'add on worker "rust" (fn((i64, i64)) -> i64) is not a method of an RRef' in str(
            e), str(e)
    try:
        rref.rpc_sync().no_such_function()
        raise AssertionError("an unknown function called as a method")
    except RuntimeError as e:
        assert "no_such_function" in str(e), str(e)
    try:
        rref._get_type()
        raise AssertionError("a Python type for a Rust value")
    except RuntimeError as e:
        assert "no Python type" in str(e), str(e)
    del rref
    assert rpc._rref_wait_until_empty(30.0) is None, rpc._rref_debug_info()
    assert rpc.rpc_sync(RUST, "rrefs_empty", args=(30000,)) == "empty"


SCENARIOS = {
    "calls": calls,
    "tensors": tensors_to_rust_and_back,
    "type_errors": type_errors,
    "rust_errors": rust_errors,
    "rrefs": rrefs,
    "rust_calls_python": rust_calls_python,
    "registration": registration,
    "late_registration": late_registration,
    "keywords": keywords,
    "keyword_errors": keyword_errors,
    "raw_tensors": raw_tensors,
    "rrefs_pickled": rrefs_pickled,
    "rref_proxies": rref_proxies,
}


def main():
    world_size = int(os.environ.get("WORLD_SIZE", "2"))
    if sys.argv[1:] == ["--serve"]:
        # The second Python worker: serves until the group shuts down.
        register()
        rpc.init_rpc("py2", rank=2, world_size=world_size)
        rpc.shutdown()
        return
    scenarios = sys.argv[1:] or list(SCENARIOS)
    register()
    for text, reason in [("(Tensor", "ends too early"), ("Foo<", "ends too early")]:
        try:
            rpc.register("bad", py_scale, args=text, returns="()")
            raise AssertionError(f"{text!r} accepted")
        except ValueError as e:
            assert reason in str(e), str(e)
    rpc.init_rpc("py", rank=0, world_size=world_size)
    ok = True
    for name in scenarios:
        try:
            SCENARIOS[name]()
            print(f"PASSED: {name}", flush=True)
        except Exception:
            ok = False
            print(f"FAILED: {name}", flush=True)
            traceback.print_exc()
    rpc.shutdown()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
