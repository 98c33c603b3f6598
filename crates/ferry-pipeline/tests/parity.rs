//! What a torch.distributed.pipelining user does every day, against one
//! process at PyTorch's tolerance (rtol 1e-5, atol 4e-5): the step's
//! outputs, uneven microbatches with mean and sum losses, `eval` with
//! targets, several inputs split along their own dimensions with one
//! replicated, and a stage-to-rank map that is neither a loop nor a V.
//! Two workers on 127.0.0.1; worker 0 drives.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::*;
use ferry_autograd::OptimizerKind;
use ferry_pipeline::{
    Pipeline, Replicate, ScheduleSpec, Split, SplitAlong, Stage, StageFn, Stages,
};
use ferry_rpc::{BoxError, RpcOptions};
use ferry_schedule::{Schedule, ScheduleKind};
use ferry_tch::Tensor;
use tch::Reduction;

const STEPS: usize = 3;

/// Rows of the uneven batches: 10 into 4 microbatches is 3, 3, 2, 2.
const UNEVEN_ROWS: i64 = 10;
const UNEVEN_MICROBATCHES: usize = 4;

/// The input of the mixing stage: rows split along dimension 0, a per-row
/// scale split along dimension 1, a table every microbatch uses whole, and
/// a plain factor passed through.
#[derive(serde::Serialize, serde::Deserialize, Split)]
struct MixIn {
    x: Tensor,
    scale: SplitAlong<1>,
    table: Replicate<Tensor>,
    k: f64,
}

/// `(x * scale^T) W^T + factor * table`, with a learnable `W`.
struct Mixer {
    weight: tch::Tensor,
}

impl Mixer {
    fn new(seed: i64) -> Mixer {
        tch::manual_seed(seed);
        Mixer {
            weight: (tch::Tensor::randn([WIDTH, WIDTH], F32) * 0.4).set_requires_grad(true),
        }
    }

    fn apply(
        &self,
        x: &tch::Tensor,
        scale: &tch::Tensor,
        table: &tch::Tensor,
        k: f64,
    ) -> tch::Tensor {
        (x * scale.tr()).linear::<&tch::Tensor>(&self.weight, None) + table * k
    }
}

impl Stage for Mixer {
    type Input = MixIn;
    type Output = Tensor;
    fn forward(&mut self, input: MixIn) -> Result<Tensor, BoxError> {
        let MixIn { x, scale, table, k } = input;
        Ok(Tensor::from(self.apply(&x, &scale, &table, k)))
    }
    fn parameters(&self) -> Vec<tch::Tensor> {
        vec![self.weight.shallow_clone()]
    }
}

const MIXER: StageFn<i64, Mixer> = StageFn::new("mixer");

/// Starts this process's worker with the common stages and the mixer.
fn start_parity(rank: u32) {
    let mut stages: Stages = stages();
    stages.add(MIXER, |seed: i64| Ok::<_, BoxError>(Mixer::new(seed)));
    let mut options = RpcOptions::from_env(format!("worker{rank}")).unwrap();
    ferry_pipeline::install(&mut options, stages);
    ferry::init_rpc(options).unwrap();
}

/// One step's losses and outputs, per microbatch.
type StepWant = (Vec<f64>, Vec<tch::Tensor>);

/// One process: per step the loss and output of every microbatch (split
/// as `tensor_split` does) at the parameters before the step, then the
/// parameters after the last step; SGD on the whole batch's mean (or sum)
/// loss.
fn reference_uneven(
    args: &[BlockArgs],
    microbatches: usize,
    sum: bool,
    rows: i64,
) -> (Vec<StepWant>, Vec<Vec<tch::Tensor>>) {
    let blocks: Vec<Block> = args.iter().map(|a| Block::new(*a)).collect();
    let reduction = if sum { Reduction::Sum } else { Reduction::Mean };
    let run = |x: &tch::Tensor| blocks.iter().fold(x.shallow_clone(), |h, b| b.apply(&h));
    let mut per_step = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch(step as i64, rows);
        let m = microbatches as i64;
        let (losses, outputs) = tch::no_grad(|| {
            x.tensor_split(m, 0)
                .iter()
                .zip(y.tensor_split(m, 0))
                .map(|(xm, ym)| {
                    let out = run(xm);
                    (out.mse_loss(&ym, reduction).double_value(&[]), out)
                })
                .unzip()
        });
        per_step.push((losses, outputs));
        let loss = run(&x).mse_loss(&y, reduction);
        loss.backward();
        tch::no_grad(|| {
            for b in &blocks {
                for mut p in b.parameters() {
                    let mut g = p.grad();
                    let _ = p.f_sub_(&(&g * lr(sum, rows))).unwrap();
                    let _ = g.zero_();
                }
            }
        });
    }
    let params = blocks
        .iter()
        .map(|b| b.parameters().iter().map(|p| p.detach().copy()).collect())
        .collect();
    (per_step, params)
}

/// Trains `schedule` on uneven microbatches and checks losses, outputs
/// (per microbatch and merged), `eval` with targets and the parameters
/// against one process.
fn check_uneven(schedule: ScheduleSpec, workers: &[u32], sum: bool) {
    let label = format!("{schedule:?} sum={sum}");
    let args = block_args(workers.len());
    let (want, want_params) = reference_uneven(&args, UNEVEN_MICROBATCHES, sum, UNEVEN_ROWS);
    let mut builder = Pipeline::builder();
    for (w, a) in workers.iter().zip(&args) {
        builder = builder.stage(*w, BLOCK, *a);
    }
    let mut pipeline = builder
        .schedule(schedule)
        .microbatches(UNEVEN_MICROBATCHES)
        .loss(if sum { MSE_SUM } else { MSE_MEAN })
        .scale_grads(!sum)
        .optimizer(OptimizerKind::sgd(lr(sum, UNEVEN_ROWS)))
        .build()
        .unwrap();
    for (step, (losses, outputs)) in want.iter().enumerate() {
        let (x, y) = batch(step as i64, UNEVEN_ROWS);
        if step + 1 == STEPS {
            // eval with targets: forward only, the same losses and outputs,
            // nothing accumulated.
            let eval = pipeline.eval(&x, Some(&y)).unwrap();
            for (mb, (got, want)) in eval.losses.iter().zip(losses).enumerate() {
                assert_close_f64(*got, *want, &format!("{label}: eval loss {mb}"));
            }
            assert_close(
                &eval.merged().unwrap(),
                &tch::Tensor::cat(outputs, 0),
                &format!("{label}: eval output"),
            );
            assert!(pipeline
                .gradients()
                .unwrap()
                .iter()
                .flatten()
                .all(Option::is_none));
        }
        let out = pipeline
            .step(&x, &y)
            .unwrap_or_else(|e| panic!("{label}: step {step}: {e}"));
        assert_eq!(out.losses.len(), UNEVEN_MICROBATCHES);
        for (mb, (got, want)) in out.losses.iter().zip(losses).enumerate() {
            assert_close_f64(*got, *want, &format!("{label}: step {step} loss {mb}"));
        }
        let rows: Vec<i64> = out.outputs.iter().map(|o| o.size()[0]).collect();
        assert_eq!(rows, [3, 3, 2, 2], "{label}");
        for (mb, (got, want)) in out.outputs.iter().zip(outputs).enumerate() {
            assert_close(got, want, &format!("{label}: step {step} output {mb}"));
            assert!(!got.requires_grad());
        }
        let merged: Tensor = out.merged().unwrap();
        assert_close(
            &merged,
            &tch::Tensor::cat(outputs, 0),
            &format!("{label}: step {step} merged"),
        );
        pipeline.optimizer_step().unwrap();
        pipeline.zero_grad().unwrap();
    }
    let params = pipeline.parameters().unwrap();
    for (stage, (got, want)) in params.iter().zip(&want_params).enumerate() {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_close(g, w, &format!("{label}: stage {stage} parameter {i}"));
        }
    }
    println!("CHECKED={label}");
}

const LOOP_2: &[u32] = &[0, 1];
const LOOP_4: &[u32] = &[0, 1, 0, 1];
const V_4: &[u32] = &[0, 1, 1, 0];

#[test]
fn uneven_microbatches_outputs_and_eval_losses_match_one_process() {
    let Some(outputs) = ferry_testkit::world_ok(
        "uneven_microbatches_outputs_and_eval_losses_match_one_process",
        2,
        |rank| {
            start_parity(rank);
            if rank == 0 {
                for sum in [false, true] {
                    check_uneven(ScheduleKind::GPipe.into(), LOOP_2, sum);
                    check_uneven(ScheduleKind::OneFOneB.into(), LOOP_2, sum);
                    check_uneven(ScheduleKind::Interleaved1F1B.into(), LOOP_4, sum);
                    check_uneven(ScheduleKind::InterleavedZeroBubble.into(), LOOP_4, sum);
                    check_uneven(ScheduleKind::ZbvZeroBubble.into(), V_4, sum);
                }
            }
            ferry_rpc::shutdown().unwrap();
        },
    ) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED").len(), 10);
}

/// Stages 0 and 1 on worker 0, 2 and 3 on worker 1, as PyTorch's
/// unbalanced test schedules place them: neither a loop nor a V.
const SPLIT_MAP_CSV: &str =
    "0F0,1F0,0F1,1F1,,,1B1,0B1,1B0,0B0\n,,2F0,3F0,2F1,3F1,3B0,2B0,3B1,2B1\n";

#[test]
fn a_stage_map_that_is_neither_loop_nor_v_trains_like_one_process() {
    let Some(outputs) = ferry_testkit::world_ok(
        "a_stage_map_that_is_neither_loop_nor_v_trains_like_one_process",
        2,
        |rank| {
            start_parity(rank);
            if rank == 0 {
                let args = block_args(4);
                let (want_losses, want_params) = reference(&args, 2, false, STEPS, ROWS);
                let schedule = ScheduleSpec::Custom(Schedule::from_csv(SPLIT_MAP_CSV).unwrap());
                let mut pipeline = pipeline(&[0, 0, 1, 1], &args, schedule, 2, false).unwrap();
                assert_eq!(pipeline.stage_to_rank(), [0, 0, 1, 1]);
                for (step, want) in want_losses.iter().enumerate() {
                    let (x, y) = batch(step as i64, ROWS);
                    let out = pipeline.step(&x, &y).unwrap();
                    for (mb, (got, want)) in out.losses.iter().zip(want).enumerate() {
                        assert_close_f64(*got, *want, &format!("step {step} loss {mb}"));
                    }
                    pipeline.optimizer_step().unwrap();
                    pipeline.zero_grad().unwrap();
                }
                let params = pipeline.parameters().unwrap();
                for (stage, (got, want)) in params.iter().zip(&want_params).enumerate() {
                    for (i, (g, w)) in got.iter().zip(want).enumerate() {
                        assert_close(g, w, &format!("stage {stage} parameter {i}"));
                    }
                }
                println!("CHECKED=split map");
            }
            ferry_rpc::shutdown().unwrap();
        },
    ) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED"), ["split map"]);
}

#[test]
fn several_inputs_split_along_their_own_dimensions_train_like_one_process() {
    let Some(outputs) = ferry_testkit::world_ok(
        "several_inputs_split_along_their_own_dimensions_train_like_one_process",
        2,
        |rank| {
            start_parity(rank);
            if rank == 0 {
                let block = BlockArgs::new(11, false);
                let mut pipeline = Pipeline::builder_for::<MixIn>()
                    .stage(0, MIXER, 5)
                    .stage(1, BLOCK, block)
                    .schedule(ScheduleKind::OneFOneB)
                    .microbatches(UNEVEN_MICROBATCHES)
                    .loss(MSE_MEAN)
                    .optimizer(OptimizerKind::sgd(LR))
                    .build()
                    .unwrap();
                // One process: the same two stages on the whole batch.
                let mixer = Mixer::new(5);
                let last = Block::new(block);
                for step in 0..STEPS as i64 {
                    let (x, y) = batch(step, UNEVEN_ROWS);
                    tch::manual_seed(500 + step);
                    let scale = tch::Tensor::rand([1, UNEVEN_ROWS], F32) + 0.5;
                    let table = tch::Tensor::randn([WIDTH], F32);
                    let k = 0.25 * (step + 1) as f64;
                    let inputs = MixIn {
                        x: Tensor::from(x.shallow_clone()),
                        scale: SplitAlong(Tensor::from(scale.shallow_clone())),
                        table: Replicate(Tensor::from(table.shallow_clone())),
                        k,
                    };
                    let out = pipeline.step(&inputs, &y).unwrap();
                    let whole = last.apply(&mixer.apply(&x, &scale, &table, k));
                    let merged: Tensor = out.merged().unwrap();
                    assert_close(&merged, &whole.detach(), &format!("step {step} output"));
                    let m = UNEVEN_MICROBATCHES as i64;
                    for (mb, ((got, o), ym)) in out
                        .losses
                        .iter()
                        .zip(whole.tensor_split(m, 0))
                        .zip(y.tensor_split(m, 0))
                        .enumerate()
                    {
                        let want = o.mse_loss(&ym, Reduction::Mean).double_value(&[]);
                        assert_close_f64(*got, want, &format!("step {step} loss {mb}"));
                    }
                    whole.mse_loss(&y, Reduction::Mean).backward();
                    tch::no_grad(|| {
                        for mut p in mixer.parameters().into_iter().chain(last.parameters()) {
                            let mut g = p.grad();
                            let _ = p.f_sub_(&(&g * LR)).unwrap();
                            let _ = g.zero_();
                        }
                    });
                    pipeline.optimizer_step().unwrap();
                    pipeline.zero_grad().unwrap();
                }
                let params = pipeline.parameters().unwrap();
                let want = [mixer.parameters(), last.parameters()];
                for (stage, (got, want)) in params.iter().zip(&want).enumerate() {
                    for (i, (g, w)) in got.iter().zip(want).enumerate() {
                        assert_close(g, w, &format!("stage {stage} parameter {i}"));
                    }
                }
                println!("CHECKED=several inputs");
            }
            ferry_rpc::shutdown().unwrap();
        },
    ) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED"), ["several inputs"]);
}
