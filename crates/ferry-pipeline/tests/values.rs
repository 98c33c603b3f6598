//! Beyond PyTorch: any serde value holding tensors travels between stages
//! (here a struct with two float tensors, an integer tensor and plain
//! fields), its shapes may change from microbatch to microbatch, and
//! gradients flow back through every float tensor of it. Also: `eval`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use ferry_pipeline::{LossFn, Pipeline, Stage, StageFn, Stages};
use ferry_rpc::{BoxError, RpcOptions};
use ferry_schedule::ScheduleKind;
use ferry_tch::Tensor;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Reduction};

const F32: (Kind, Device) = (Kind::Float, Device::Cpu);
const WIDTH: i64 = 6;

/// What the first stage hands the second.
#[derive(Serialize, Deserialize)]
struct Hidden {
    /// Only the first `kept` columns, a number that changes per microbatch.
    h: Tensor,
    /// A second float tensor that needs its own gradient.
    gate: Tensor,
    /// Integer data: travels, gets no gradient.
    positions: Tensor,
    kept: i64,
    label: String,
}

struct Encoder {
    w: tch::Tensor,
    g: tch::Tensor,
}

fn params(seed: i64) -> (tch::Tensor, tch::Tensor) {
    tch::manual_seed(seed);
    (
        (tch::Tensor::randn([WIDTH, WIDTH], F32) * 0.5).set_requires_grad(true),
        (tch::Tensor::randn([WIDTH, WIDTH], F32) * 0.5).set_requires_grad(true),
    )
}

/// Columns kept for a microbatch: its first row's first value decides, so
/// the driver and the reference agree without sharing a counter.
fn kept(x: &tch::Tensor) -> i64 {
    2 + (x.double_value(&[0, 0]).abs() * 10.0) as i64 % (WIDTH - 1)
}

fn encode(w: &tch::Tensor, g: &tch::Tensor, x: &tch::Tensor) -> (tch::Tensor, tch::Tensor, i64) {
    let k = kept(x);
    (x.matmul(w).tanh().narrow(1, 0, k), x.matmul(g).sigmoid(), k)
}

fn decode(
    w: &tch::Tensor,
    h: &tch::Tensor,
    gate: &tch::Tensor,
    positions: &tch::Tensor,
) -> tch::Tensor {
    let k = h.size()[1];
    let padded = h.constant_pad_nd([0, WIDTH - k]);
    (padded * gate).matmul(w) + positions.to_kind(Kind::Float) * 0.01
}

impl Stage for Encoder {
    type Input = Tensor;
    type Output = Hidden;
    fn forward(&mut self, x: Tensor) -> Result<Hidden, BoxError> {
        let (h, gate, k) = encode(&self.w, &self.g, &x);
        let positions = tch::Tensor::arange(x.size()[0], (Kind::Int64, Device::Cpu)).unsqueeze(1);
        Ok(Hidden {
            h: h.into(),
            gate: gate.into(),
            positions: positions.into(),
            kept: k,
            label: format!("kept {k}"),
        })
    }
    fn parameters(&self) -> Vec<tch::Tensor> {
        vec![self.w.shallow_clone(), self.g.shallow_clone()]
    }
}

struct Decoder {
    w: tch::Tensor,
}

impl Stage for Decoder {
    type Input = Hidden;
    type Output = Tensor;
    fn forward(&mut self, hidden: Hidden) -> Result<Tensor, BoxError> {
        if hidden.h.size()[1] != hidden.kept || hidden.label != format!("kept {}", hidden.kept) {
            return Err("the value arrived changed".into());
        }
        if hidden.positions.kind() != Kind::Int64 || hidden.positions.requires_grad() {
            return Err("integer tensors travel as data".into());
        }
        Ok(decode(&self.w, &hidden.h, &hidden.gate, &hidden.positions).into())
    }
    fn parameters(&self) -> Vec<tch::Tensor> {
        vec![self.w.shallow_clone()]
    }
}

const ENCODER: StageFn<i64, Encoder> = StageFn::new("encoder");
const DECODER: StageFn<i64, Decoder> = StageFn::new("decoder");
const MSE: LossFn<Tensor> = LossFn::new("mse");

fn start(rank: u32) {
    let mut stages = Stages::new();
    stages.add(ENCODER, |seed| {
        let (w, g) = params(seed);
        Ok::<_, BoxError>(Encoder { w, g })
    });
    stages.add(DECODER, |seed| {
        Ok::<_, BoxError>(Decoder { w: params(seed).0 })
    });
    stages.add_loss(MSE, |out: Tensor, target: Tensor| {
        Ok::<_, BoxError>(out.mse_loss(&target, Reduction::Mean))
    });
    let mut options = RpcOptions::from_env(format!("worker{rank}")).unwrap();
    ferry_pipeline::install(&mut options, stages);
    ferry::init_rpc(options).unwrap();
}

fn close(a: &tch::Tensor, b: &tch::Tensor) -> bool {
    a.allclose(b, 1e-5, 4e-5, false)
}

#[test]
fn structs_with_several_tensors_and_changing_shapes_train_like_one_process() {
    let test = "structs_with_several_tensors_and_changing_shapes_train_like_one_process";
    let Some(outputs) = ferry_testkit::world_ok(test, 2, |rank| {
        start(rank);
        if rank == 0 {
            let m = 4;
            tch::manual_seed(5);
            let x = tch::Tensor::randn([8, WIDTH], F32);
            let y = tch::Tensor::randn([8, WIDTH], F32);
            let mut pipeline = Pipeline::builder()
                .stage(0, ENCODER, 1)
                .stage(1, DECODER, 2)
                .schedule(ScheduleKind::OneFOneB)
                .microbatches(m)
                .loss(MSE)
                .build()
                .unwrap();
            let out = pipeline.step(&x, &y).unwrap();
            // The microbatches keep different numbers of columns.
            let kepts: std::collections::BTreeSet<i64> =
                x.chunk(m as i64, 0).iter().map(kept).collect();
            assert!(kepts.len() > 1, "{kepts:?}");

            // One process: the same computation per microbatch, gradients
            // summed and scaled by 1/m.
            let (ew, eg) = params(1);
            let (dw, _) = params(2);
            let mut losses = Vec::new();
            let mut total: Option<tch::Tensor> = None;
            for (xm, ym) in x.chunk(m as i64, 0).iter().zip(y.chunk(m as i64, 0)) {
                let (h, gate, _) = encode(&ew, &eg, xm);
                let positions =
                    tch::Tensor::arange(xm.size()[0], (Kind::Int64, Device::Cpu)).unsqueeze(1);
                let loss = decode(&dw, &h, &gate, &positions).mse_loss(&ym, Reduction::Mean);
                losses.push(loss.double_value(&[]));
                total = Some(match total {
                    None => loss,
                    Some(t) => t + loss,
                });
            }
            (total.unwrap() / m as f64).backward();
            for (got, want) in out.losses.iter().zip(&losses) {
                assert!((got - want).abs() < 1e-5, "loss {got} against {want}");
            }
            let grads = pipeline.gradients().unwrap();
            let want = [vec![ew.grad(), eg.grad()], vec![dw.grad()]];
            for (stage, (got, want)) in grads.iter().zip(&want).enumerate() {
                for (i, (g, w)) in got.iter().zip(want).enumerate() {
                    let g = g.as_ref().expect("a gradient");
                    assert!(close(g, w), "stage {stage} gradient {i}");
                }
            }

            // eval: forward only, the outputs in microbatch order.
            let outputs = pipeline.eval(&x, None).unwrap().outputs;
            assert_eq!(outputs.len(), m);
            for (mb, (out, xm)) in outputs.iter().zip(x.chunk(m as i64, 0)).enumerate() {
                let (h, gate, _) = encode(&ew, &eg, &xm);
                let positions =
                    tch::Tensor::arange(xm.size()[0], (Kind::Int64, Device::Cpu)).unsqueeze(1);
                let want = decode(&dw, &h, &gate, &positions);
                assert!(close(out, &want.detach()), "eval output of microbatch {mb}");
                assert!(!out.requires_grad());
            }
            println!("VALUES=ok");
        }
        ferry_rpc::shutdown().unwrap();
    }) else {
        return;
    };
    assert_eq!(outputs[0].values("VALUES"), ["ok"]);
}
