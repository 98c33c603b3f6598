//! A Rust worker of a mixed group (Python and Rust workers together): the
//! functions ferry-py's tests (`crates/ferry-py/tests/test_mixed.py`) call
//! from Python by name, and the calls it makes of the functions a Python
//! worker registered (`ferry.rpc.register`).
//!
//! ```sh
//! RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
//!     cargo run -p ferry --features torch --example mixed_worker -- rust
//! ```
//!
//! It serves until the group shuts down (graceful shutdown: every worker
//! calls it).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use ferry::rpc::describe::DESCRIBE;
use ferry::tensor::tch::{self, Kind};
use ferry::tensor::Tensor;
use ferry::{Function, Functions, RRef, RawTensor, RpcError, RpcOptions, Schema};
use serde::{Deserialize, Serialize};

/// A struct crossing as a Python `dict`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Schema)]
struct Point {
    x: i64,
    y: Option<f32>,
    tags: Vec<String>,
}

/// An enum crossing as a name or a one-entry `dict`.
#[derive(Debug, Serialize, Deserialize, Schema)]
enum Op {
    Add(i64),
    Scale { by: i64 },
    Pair(i64, i64),
    Neg,
}

/// A value an RRef from Python refers to.
#[derive(Debug, Serialize, Deserialize, Schema)]
struct Params {
    name: String,
    weights: Tensor,
    step: u64,
}

/// A struct argument: its fields are the function's arguments, which
/// Python passes by position or by keyword (`alpha` may be left out).
#[derive(Debug, Serialize, Deserialize, Schema)]
struct Axpy {
    x: Tensor,
    y: Tensor,
    alpha: Option<f64>,
}

/// What a tensor arrived as: dtype, sizes, strides, and its values as
/// `f64`s (a zero-size tensor has none).
type Meta = (String, Vec<i64>, Vec<i64>, Vec<f64>);

const ADD: Function<(i64, i64), i64> = Function::new("add");
const GREET: Function<String, String> = Function::new("greet");
const NOTHING: Function<(), u8> = Function::new("nothing");
const MOVE_POINT: Function<(Point, i64), Point> = Function::new("move_point");
const APPLY: Function<(Op, i64), i64> = Function::new("apply");
const COUNT: Function<BTreeMap<String, Vec<u32>>, BTreeMap<String, u64>> = Function::new("count");
/// Small scalars and a byte sequence, one way.
type Smalls = (i8, u16, char, bool, Vec<u8>);
const SMALL: Function<Smalls, (i8, u16, char, bool)> = Function::new("small");
const ECHO_TENSORS: Function<Vec<Tensor>, Vec<Tensor>> = Function::new("echo_tensors");
const META: Function<Vec<Tensor>, Vec<Meta>> = Function::new("meta");
const MAKE_TENSORS: Function<(), Vec<Tensor>> = Function::new("make_tensors");
const SCALE: Function<(Tensor, f64), Tensor> = Function::new("scale");
const FAIL: Function<String, String> = Function::new("fail");
const MAKE: Function<(String, Vec<f32>), Params> = Function::new("make");
const READ: Function<RRef<Params>, (String, u64)> = Function::new("read");
const SCALED_WEIGHTS: Function<(RRef<Params>, f32), Tensor> = Function::new("scaled_weights");
const RREFS_EMPTY: Function<u64, String> = Function::new("rrefs_empty");
const AXPY: Function<Axpy, Tensor> = Function::new("axpy");
const RAW_ECHO: Function<Vec<RawTensor>, Vec<RawTensor>> = Function::new("raw_echo");
/// dtype, sizes and strides of a tensor, as a `RawTensor` holds them.
type RawMeta = (String, Vec<i64>, Vec<i64>);
const RAW_META: Function<Vec<RawTensor>, Vec<RawMeta>> = Function::new("raw_meta");
const RAW_MAKE: Function<(), Vec<RawTensor>> = Function::new("raw_make");
/// What `call_late` found: `py_late`'s signature as described (none if
/// it is not registered), its result's values (none if the call failed)
/// and the call's error.
type Late = (Option<String>, Option<Vec<f64>>, String);
/// Describes and calls `py_late` on the worker named.
const CALL_LATE: Function<String, Late> = Function::new("call_late");
const CALL_PYTHON: Function<String, Vec<String>> = Function::new("call_python");

// The functions the Python worker registers, as Rust declares them.
const PY_SCALE: Function<(Tensor, f32), Tensor> = Function::new("py_scale");
const PY_ECHO: Function<Vec<Tensor>, Vec<Tensor>> = Function::new("py_echo");
const PY_POINT: Function<Point, Point> = Function::new("py_point");
const PY_FAIL: Function<String, String> = Function::new("py_fail");
const PY_RAW_ECHO: Function<Vec<RawTensor>, Vec<RawTensor>> = Function::new("py_raw_echo");
/// Registered by the Python worker after `init_rpc`.
const PY_LATE: Function<(Tensor, i64), Tensor> = Function::new("py_late");
/// `py_scale` declared with other types: refused as a wrong type.
const PY_SCALE_WRONG: Function<(i64, i64), i64> = Function::new("py_scale");

fn meta(t: &tch::Tensor) -> Meta {
    let values = t
        .to_kind(Kind::Double)
        .flatten(0, -1)
        .iter::<f64>()
        .map(|it| it.collect())
        .unwrap_or_default();
    (format!("{:?}", t.kind()), t.size(), t.stride(), values)
}

/// Tensors of several dtypes, one of them a transposed view and one of
/// no elements, as Rust makes them.
fn rust_tensors() -> Vec<Tensor> {
    let base = tch::Tensor::arange(6, (Kind::Float, tch::Device::Cpu)).reshape([2, 3]);
    vec![
        Tensor::from(base.tr()),
        Tensor::from(tch::Tensor::arange(4, (Kind::Int64, tch::Device::Cpu)) - 2),
        Tensor::from(tch::Tensor::zeros([0, 3], (Kind::Double, tch::Device::Cpu))),
        Tensor::from(tch::Tensor::from_slice(&[true, false, true])),
        Tensor::from(tch::Tensor::arange(5, (Kind::Int8, tch::Device::Cpu)).slice(0, 0, 5, 2)),
        Tensor::from(tch::Tensor::ones([2, 2], (Kind::Half, tch::Device::Cpu))),
    ]
}

/// `RawTensor`s of several dtypes, one of no elements and one of no
/// dimensions.
fn raw_tensors() -> Vec<RawTensor> {
    let made = [
        RawTensor::from_slice(&[1.5f32, -2.0, 3.25, 4.0, 5.0, 6.0], &[2, 3]),
        RawTensor::from_slice(&[-2i64, -1, 0, 1], &[4]),
        RawTensor::from_slice(&[0.5f64; 0], &[0, 3]),
        RawTensor::from_slice(&[7u8, 8, 9], &[3]),
        RawTensor::from_slice(&[-3i16, 3], &[2, 1]),
        RawTensor::from_slice(&[2.5f64], &[]),
    ];
    made.into_iter()
        .map(|t| t.expect("a RawTensor of a slice and its shape"))
        .collect()
}

/// Calls `py_late`, described first, on worker `py`.
fn call_late(py: String) -> Late {
    let described = match DESCRIBE.rpc_sync(py.as_str(), "py_late".to_string()) {
        Ok(d) => d.map(|d| d.signature_text()),
        Err(e) => Some(format!("describe failed: {e}")),
    };
    let x = tch::Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
    match PY_LATE.rpc_sync(py.as_str(), (Tensor::from(x), 10)) {
        Ok(y) => {
            let values =
                y.0.to_kind(Kind::Double)
                    .iter::<f64>()
                    .map(|it| it.collect())
                    .unwrap_or_default();
            (described, Some(values), String::new())
        }
        Err(RpcError::UnknownFunction { function, .. }) => {
            (described, None, format!("unknown function {function}"))
        }
        Err(e) => (described, None, e.to_string()),
    }
}

fn same(a: &tch::Tensor, b: &tch::Tensor) -> bool {
    a.kind() == b.kind() && a.size() == b.size() && a.stride() == b.stride() && a.equal(b)
}

/// Calls the Python worker `py`'s registered functions; a line per check
/// that failed (none: all passed).
fn call_python(py: String) -> Vec<String> {
    let mut failed = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            failed.push(what);
        }
    };
    // Tensors both ways: a transposed view travels as a view.
    let x = tch::Tensor::arange(6, (Kind::Float, tch::Device::Cpu))
        .reshape([2, 3])
        .tr();
    match PY_SCALE.rpc_sync(py.as_str(), (Tensor::from(x.shallow_clone()), 3.0)) {
        Ok(y) => check(
            y.0.equal(&(&x * 3.0)) && y.0.kind() == Kind::Float,
            format!("py_scale gave {:?}", meta(&y.0)),
        ),
        Err(e) => check(false, format!("py_scale failed: {e}")),
    }
    let sent = rust_tensors();
    let originals: Vec<tch::Tensor> = sent.iter().map(|t| t.0.shallow_clone()).collect();
    match PY_ECHO.rpc_sync(py.as_str(), sent) {
        Ok(back) => {
            check(
                back.len() == originals.len(),
                format!("py_echo gave {} tensors", back.len()),
            );
            for (a, b) in originals.iter().zip(&back) {
                check(
                    same(a, &b.0),
                    format!("py_echo: sent {:?}, got {:?}", meta(a), meta(&b.0)),
                );
            }
        }
        Err(e) => check(false, format!("py_echo failed: {e}")),
    }
    let p = Point {
        x: 4,
        y: None,
        tags: vec!["a".into()],
    };
    match PY_POINT.rpc_sync(py.as_str(), p) {
        Ok(q) => check(
            q == Point {
                x: 5,
                y: Some(0.5),
                tags: vec!["a".into(), "python".into()],
            },
            format!("py_point gave {q:?}"),
        ),
        Err(e) => check(false, format!("py_point failed: {e}")),
    }
    match PY_FAIL.rpc_sync(py.as_str(), "bad input".to_string()) {
        Err(RpcError::Remote { message, .. }) => check(
            message.starts_with("ValueError: no good: bad input") && message.contains("Traceback"),
            format!("py_fail's error text: {message:?}"),
        ),
        other => check(false, format!("py_fail gave {other:?}")),
    }
    let raw = raw_tensors();
    match PY_RAW_ECHO.rpc_sync(py.as_str(), raw.clone()) {
        Ok(back) => check(
            back == raw,
            format!("py_raw_echo: sent {raw:?}, got {back:?}"),
        ),
        Err(e) => check(false, format!("py_raw_echo failed: {e}")),
    }
    match PY_SCALE_WRONG.rpc_sync(py.as_str(), (1, 2)) {
        Err(RpcError::WrongType { expected, .. }) => check(
            expected == "fn((Tensor, f32)) -> Tensor",
            format!("py_scale's wrong-type error expected {expected:?}"),
        ),
        other => check(false, format!("py_scale with wrong types gave {other:?}")),
    }
    failed
}

fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(ADD, |(a, b)| a + b)
        .add(GREET, |name: String| format!("hello, {name}"))
        .add(NOTHING, |()| 7u8)
        .add(MOVE_POINT, |(mut p, dx): (Point, i64)| {
            p.x += dx;
            p.y = p.y.map(|y| y * 2.0);
            p.tags.push("moved".into());
            p
        })
        .add(APPLY, |(op, v): (Op, i64)| match op {
            Op::Add(n) => v + n,
            Op::Scale { by } => v * by,
            Op::Pair(a, b) => v + a * b,
            Op::Neg => -v,
        })
        .add(COUNT, |m: BTreeMap<String, Vec<u32>>| {
            m.into_iter()
                .map(|(k, v)| (k, v.iter().map(|x| u64::from(*x)).sum()))
                .collect::<BTreeMap<String, u64>>()
        })
        .add(
            SMALL,
            |(a, b, c, d, bytes): (i8, u16, char, bool, Vec<u8>)| {
                (a.wrapping_neg(), b + bytes.len() as u16, c, !d)
            },
        )
        .add(ECHO_TENSORS, |ts: Vec<Tensor>| ts)
        .add(META, |ts: Vec<Tensor>| {
            ts.iter().map(|t| meta(&t.0)).collect::<Vec<_>>()
        })
        .add(MAKE_TENSORS, |()| rust_tensors())
        .add(SCALE, |(t, k): (Tensor, f64)| Tensor::from(&t.0 * k))
        .add(FAIL, |why: String| -> Result<String, String> {
            Err(format!("refused: {why}\nsecond line"))
        })
        .add(
            MAKE,
            |(name, w): (String, Vec<f32>)| -> Result<Params, String> {
                if name.is_empty() {
                    return Err("a name is needed".into());
                }
                Ok(Params {
                    name,
                    weights: Tensor::from(tch::Tensor::from_slice(&w)),
                    step: w.len() as u64,
                })
            },
        )
        .add(READ, |r: RRef<Params>| -> Result<(String, u64), String> {
            r.with_local_value(|p| (p.name.clone(), p.step))
                .map_err(|e| e.to_string())
        })
        .add(
            SCALED_WEIGHTS,
            |(r, k): (RRef<Params>, f32)| -> Result<Tensor, String> {
                r.with_local_value(|p| Tensor::from(&p.weights.0 * f64::from(k)))
                    .map_err(|e| e.to_string())
            },
        )
        .add(AXPY, |a: Axpy| {
            Tensor::from(&a.x.0 * a.alpha.unwrap_or(1.0) + &a.y.0)
        })
        .add(RAW_ECHO, |ts: Vec<RawTensor>| ts)
        .add(RAW_META, |ts: Vec<RawTensor>| {
            ts.iter()
                .map(|t| {
                    (
                        t.dtype().to_string(),
                        t.shape().to_vec(),
                        t.strides().to_vec(),
                    )
                })
                .collect::<Vec<_>>()
        })
        .add(RAW_MAKE, |()| raw_tensors())
        .add(CALL_LATE, call_late)
        .add(RREFS_EMPTY, |ms: u64| -> Result<String, String> {
            let ctx = ferry::rref::RRefContext::current().map_err(|e| e.to_string())?;
            match ctx.wait_until_empty(Duration::from_millis(ms)) {
                Ok(()) => Ok("empty".into()),
                Err(left) => Ok(format!("{left:?}")),
            }
        })
        .add(CALL_PYTHON, call_python);
    f
}

fn main() -> anyhow::Result<()> {
    let name = std::env::args().nth(1).unwrap_or_else(|| "rust".into());
    let options = RpcOptions::from_env(name)
        .context("RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are needed")?
        .functions(functions());
    ferry::init_rpc(options)?;
    // Serves until every worker has called shutdown.
    ferry::shutdown()?;
    Ok(())
}
