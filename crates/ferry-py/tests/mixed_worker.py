"""The Python worker of a mixed-group test: ``python mixed_worker.py
<scenario>`` joins a group of two, this worker ``py`` (rank 0) and the
Rust worker ``rust`` (``crates/ferry/examples/mixed_worker.rs``, rank 1),
runs the scenario's checks and leaves with the group; it exits with 0
when every check passed.

The Python functions the Rust worker calls are registered here, before
``init_rpc``, with the shapes of the Rust types its declarations use.
"""

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


def register():
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
    def raises(exc, fragments, *call):
        try:
            rpc.rpc_sync(*call)
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
    try:
        rpc.rpc_sync(RUST, "add", args=(1,), kwargs={"b": 2})
        raise AssertionError("keywords accepted")
    except TypeError as e:
        assert "positional arguments only" in str(e)
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
    try:
        rpc.rpc_sync("py", len, args=([rref],))
        raise AssertionError("an RRef to a Rust value pickled")
    except TypeError as e:
        assert "travels only in calls of functions named by a str" in str(e), str(e)
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
        rpc.register("late", py_scale, args="(Tensor, f32)", returns="Tensor")
        raise AssertionError("registered after init_rpc")
    except RuntimeError as e:
        assert "before init_rpc" in str(e)


SCENARIOS = {
    "calls": calls,
    "tensors": tensors_to_rust_and_back,
    "type_errors": type_errors,
    "rust_errors": rust_errors,
    "rrefs": rrefs,
    "rust_calls_python": rust_calls_python,
    "registration": registration,
}


def main():
    scenarios = sys.argv[1:] or list(SCENARIOS)
    register()
    for text, reason in [("(Tensor", "ends too early"), ("Foo<", "ends too early")]:
        try:
            rpc.register("bad", py_scale, args=text, returns="()")
            raise AssertionError(f"{text!r} accepted")
        except ValueError as e:
            assert reason in str(e), str(e)
    rpc.init_rpc("py", rank=0, world_size=2)
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
