//! Both tensor kinds in one worker. Built with the
//! `torch` feature, `ferry::init_rpc` installs the libtorch receive path in
//! every worker; a worker then still serves functions taking `RawTensor`
//! beside functions taking libtorch `Tensor`s, and values holding both,
//! for callers in another process. Results are checked exactly.
//!
//! Needs the `torch` feature (`cargo test -p ferry --features torch --test
//! tensor_kinds`; `cargo xtask test` runs it); without it, it has no tests.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)]

use ferry::tensor::tch::{self, Device, Kind};
use ferry::tensor::Tensor;
use ferry::{DType, Function, Functions, RawTensor, RpcOptions, Schema};
use ferry_testkit::world_ok;
use serde::{Deserialize, Serialize};

/// Each element doubled: `RawTensor` in, `RawTensor` out.
const RAW_DOUBLE: Function<RawTensor, RawTensor> = Function::new("raw_double");
/// The tensor as it arrived: shape, strides and element bytes.
const RAW_ECHO: Function<RawTensor, RawTensor> = Function::new("raw_echo");
/// Each element doubled, by libtorch: `Tensor` in, `Tensor` out.
const TCH_DOUBLE: Function<Tensor, Tensor> = Function::new("tch_double");
/// `raw` doubled and `tensor` plus one, in one value.
const MIXED: Function<Mixed, Mixed> = Function::new("mixed");

/// A value holding both kinds.
#[derive(Debug, Serialize, Deserialize, Schema)]
struct Mixed {
    label: String,
    raw: RawTensor,
    tensor: Tensor,
    more: Vec<RawTensor>,
}

/// The f32 elements of a `RawTensor`'s view, in row-major order.
fn raw_f32(t: &RawTensor) -> Vec<f32> {
    assert_eq!(t.dtype(), DType::F32);
    t.to_contiguous_bytes()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn doubled(t: &RawTensor) -> RawTensor {
    let data: Vec<f32> = raw_f32(t).iter().map(|x| x * 2.0).collect();
    RawTensor::from_slice(&data, t.shape()).unwrap()
}

fn tch_f32(t: &tch::Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.contiguous().flatten(0, -1)).unwrap()
}

fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(RAW_DOUBLE, |t| doubled(&t));
    f.add(RAW_ECHO, |t| t);
    f.add(TCH_DOUBLE, |t| Tensor::from(&*t * 2.0));
    f.add(MIXED, |m: Mixed| Mixed {
        label: format!("{} back", m.label),
        raw: doubled(&m.raw),
        tensor: Tensor::from(&*m.tensor + 1.0),
        more: m.more,
    });
    f
}

/// Worker 1, started with `ferry::init_rpc` and the `torch` feature,
/// serves both kinds side by side; worker 0 (the same) calls it, with
/// calls of both kinds in flight at once, and takes both kinds back.
#[test]
fn one_worker_serves_raw_and_libtorch_tensors_side_by_side() {
    let outputs = world_ok(
        "one_worker_serves_raw_and_libtorch_tensors_side_by_side",
        2,
        |rank| {
            let options = RpcOptions::from_env(format!("worker{rank}"))
                .unwrap()
                .functions(functions());
            ferry::init_rpc(options).unwrap();
            if rank == 0 {
                let to = "worker1";
                // A float32 [2, 2] into a function taking `RawTensor`.
                let raw = RawTensor::from_slice(&[1.0f32, -2.5, 3.0, 0.25], &[2, 2]).unwrap();
                let back = RAW_DOUBLE.rpc_sync(to, raw.clone()).unwrap();
                assert_eq!(back.shape(), [2, 2]);
                assert_eq!(raw_f32(&back), [2.0, -5.0, 6.0, 0.5]);

                let t = tch::Tensor::from_slice(&[1.0f32, -2.5, 3.0, 0.25]).reshape([2, 2]);
                let back = TCH_DOUBLE
                    .rpc_sync(to, Tensor::from(t.shallow_clone()))
                    .unwrap();
                assert_eq!(back.size(), [2, 2]);
                assert_eq!(back.kind(), Kind::Float);
                assert_eq!(tch_f32(&back), [2.0, -5.0, 6.0, 0.5]);

                // Side by side: both kinds in flight at once, interleaved,
                // of sizes that take the inline path and the channel's.
                let calls: Vec<_> = (0..16usize)
                    .map(|i| {
                        let n = if i % 4 == 0 { 1 << 18 } else { i + 1 };
                        let data: Vec<f32> = (0..n).map(|k| (k % 1000) as f32 + i as f32).collect();
                        let want: Vec<f32> = data.iter().map(|x| x * 2.0).collect();
                        let raw = RawTensor::from_slice(&data, &[n as i64]).unwrap();
                        let t = Tensor::from(tch::Tensor::from_slice(&data));
                        (
                            want,
                            RAW_DOUBLE.rpc_async(to, raw),
                            TCH_DOUBLE.rpc_async(to, t),
                        )
                    })
                    .collect();
                for (want, raw, t) in calls {
                    assert_eq!(raw_f32(&raw.wait().unwrap()), want);
                    assert_eq!(tch_f32(&t.wait().unwrap()), want);
                }

                // A transposed RawTensor arrives as the same view.
                let base =
                    RawTensor::from_slice(&(0..12).map(|i| i as f32).collect::<Vec<_>>(), &[3, 4])
                        .unwrap();
                let view = base.t().unwrap();
                let back = RAW_ECHO.rpc_sync(to, view.clone()).unwrap();
                assert_eq!(back.shape(), [4, 3]);
                assert_eq!(back.strides(), [1, 4]);
                assert_eq!(back, view);
                let empty = RawTensor::from_slice::<f32>(&[], &[0, 3]).unwrap();
                assert_eq!(RAW_ECHO.rpc_sync(to, empty.clone()).unwrap(), empty);

                // Both kinds in one value, both ways.
                let mixed = Mixed {
                    label: "mixed".into(),
                    raw: RawTensor::from_slice(&[0.5f32, 1.5, -1.0], &[3]).unwrap(),
                    tensor: Tensor::from(
                        tch::Tensor::arange(6, (Kind::Float, Device::Cpu)).reshape([2, 3]),
                    ),
                    more: vec![
                        RawTensor::from_slice(&[7i64, 8], &[2]).unwrap(),
                        RawTensor::from_slice(&[true, false, true], &[3]).unwrap(),
                    ],
                };
                let back = MIXED.rpc_sync(to, mixed).unwrap();
                assert_eq!(back.label, "mixed back");
                assert_eq!(raw_f32(&back.raw), [1.0, 3.0, -2.0]);
                assert_eq!(back.tensor.size(), [2, 3]);
                assert_eq!(tch_f32(&back.tensor), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
                assert_eq!(back.more[0].as_slice::<i64>().unwrap(), [7, 8]);
                assert_eq!(
                    back.more[1].as_slice::<bool>().unwrap(),
                    [true, false, true]
                );
                println!("CALLS_CHECKED=yes");
            }
            ferry::shutdown().unwrap();
        },
    );
    let Some(outputs) = outputs else {
        return; // a worker: done
    };
    assert_eq!(outputs[0].values("CALLS_CHECKED"), ["yes"]);
}
