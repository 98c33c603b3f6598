//! What the multi-process pipeline tests share: the stages every worker
//! can build, worker start-up, and the same model trained in one process.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use ferry_autograd::OptimizerKind;
use ferry_pipeline::{LossFn, Pipeline, PipelineBuilder, Stage, StageFn, Stages};
use ferry_rpc::{BoxError, RpcOptions};
use ferry_tch::Tensor;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Reduction};

pub(crate) const F32: (Kind, Device) = (Kind::Float, Device::Cpu);
pub(crate) const WIDTH: i64 = 8;
pub(crate) const LR: f64 = 0.1;

/// Rows of the batches the numerics tests train on.
pub(crate) const ROWS: i64 = 8;

/// The learning rate of a run on batches of `rows` rows: with a summed loss
/// the gradients are `rows × WIDTH` times the mean loss's, so the step is
/// divided by as much.
/// Taking the mean loss's step instead drives the parameters past 1000 in
/// three steps, where float32 rounding that differs between a microbatched
/// and a whole-batch backward (and between CPUs' GEMM kernels) alone
/// exceeds PyTorch's tolerance.
pub(crate) fn lr(sum: bool, rows: i64) -> f64 {
    if sum {
        LR / (rows * WIDTH) as f64
    } else {
        LR
    }
}

/// How a block is made: its seed (deterministic parameters), whether a ReLU
/// follows the linear layer, and an optional failure to inject.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(crate) struct BlockArgs {
    pub(crate) seed: i64,
    pub(crate) relu: bool,
    /// Fail the forward of this microbatch (counted across steps).
    pub(crate) fail_at_forward: Option<usize>,
    /// Exit the process at this forward.
    pub(crate) exit_at_forward: Option<usize>,
}

impl BlockArgs {
    pub(crate) fn new(seed: i64, relu: bool) -> Self {
        Self {
            seed,
            relu,
            fail_at_forward: None,
            exit_at_forward: None,
        }
    }
}

/// Linear(WIDTH, WIDTH), then tanh-free ReLU where asked.
pub(crate) struct Block {
    pub(crate) weight: tch::Tensor,
    pub(crate) bias: tch::Tensor,
    pub(crate) args: BlockArgs,
    forwards: usize,
}

impl Block {
    pub(crate) fn new(args: BlockArgs) -> Block {
        tch::manual_seed(args.seed);
        let weight = (tch::Tensor::randn([WIDTH, WIDTH], F32) * 0.4).set_requires_grad(true);
        let bias = (tch::Tensor::randn([WIDTH], F32) * 0.1).set_requires_grad(true);
        Block {
            weight,
            bias,
            args,
            forwards: 0,
        }
    }

    pub(crate) fn apply(&self, x: &tch::Tensor) -> tch::Tensor {
        let y = x.linear(&self.weight, Some(&self.bias));
        if self.args.relu {
            y.relu()
        } else {
            y
        }
    }
}

impl Stage for Block {
    type Input = Tensor;
    type Output = Tensor;
    fn forward(&mut self, x: Tensor) -> Result<Tensor, BoxError> {
        let n = self.forwards;
        self.forwards += 1;
        if self.args.exit_at_forward == Some(n) {
            use std::io::Write;
            let _ = std::io::stdout().flush();
            std::process::exit(0);
        }
        if self.args.fail_at_forward == Some(n) {
            return Err(format!("injected failure at forward {n}").into());
        }
        Ok(Tensor::from(self.apply(&x)))
    }
    fn parameters(&self) -> Vec<tch::Tensor> {
        vec![self.weight.shallow_clone(), self.bias.shallow_clone()]
    }
}

pub(crate) const BLOCK: StageFn<BlockArgs, Block> = StageFn::new("block");
/// A constructor that always fails, naming the seed it refused.
pub(crate) const REFUSING: StageFn<BlockArgs, Block> = StageFn::new("refusing_block");
pub(crate) const MSE_MEAN: LossFn<Tensor> = LossFn::new("mse_mean");
pub(crate) const MSE_SUM: LossFn<Tensor> = LossFn::new("mse_sum");

/// The stages and losses every test worker registers.
pub(crate) fn stages() -> Stages {
    let mut stages = Stages::new();
    stages.add(BLOCK, |args: BlockArgs| Ok::<_, BoxError>(Block::new(args)));
    stages.add(REFUSING, |args: BlockArgs| -> Result<Block, BoxError> {
        Err(format!("refused seed {}", args.seed).into())
    });
    stages.add_loss(MSE_MEAN, |out: Tensor, target: Tensor| {
        Ok::<_, BoxError>(out.mse_loss(&target, Reduction::Mean))
    });
    stages.add_loss(MSE_SUM, |out: Tensor, target: Tensor| {
        Ok::<_, BoxError>(out.mse_loss(&target, Reduction::Sum))
    });
    stages
}

/// Starts this process's worker with the test stages.
pub(crate) fn start(rank: u32) {
    let mut options = RpcOptions::from_env(format!("worker{rank}")).unwrap();
    ferry_pipeline::install(&mut options, stages());
    ferry::init_rpc(options).unwrap();
}

/// The batch of step `step`.
pub(crate) fn batch(step: i64, rows: i64) -> (tch::Tensor, tch::Tensor) {
    tch::manual_seed(1000 + step);
    (
        tch::Tensor::randn([rows, WIDTH], F32),
        tch::Tensor::randn([rows, WIDTH], F32),
    )
}

/// Block arguments of a pipeline of `stages` stages (ReLU on all but the last).
pub(crate) fn block_args(stages: usize) -> Vec<BlockArgs> {
    (0..stages)
        .map(|s| BlockArgs::new(7 + s as i64, s + 1 < stages))
        .collect()
}

/// The same model trained in one process, without pipelining: per step the
/// loss of every microbatch (at the parameters before the step), then the
/// parameters after every step.
pub(crate) fn reference(
    args: &[BlockArgs],
    microbatches: usize,
    sum: bool,
    steps: usize,
    rows: i64,
) -> (Vec<Vec<f64>>, Vec<Vec<tch::Tensor>>) {
    let blocks: Vec<Block> = args.iter().map(|a| Block::new(*a)).collect();
    let reduction = if sum { Reduction::Sum } else { Reduction::Mean };
    let mut losses = Vec::new();
    for step in 0..steps {
        let (x, y) = batch(step as i64, rows);
        let run = |x: &tch::Tensor| blocks.iter().fold(x.shallow_clone(), |h, b| b.apply(&h));
        let per_mb: Vec<f64> = tch::no_grad(|| {
            x.chunk(microbatches as i64, 0)
                .iter()
                .zip(y.chunk(microbatches as i64, 0))
                .map(|(xm, ym)| run(xm).mse_loss(&ym, reduction).double_value(&[]))
                .collect()
        });
        losses.push(per_mb);
        // The whole batch's loss: the mean over equal microbatches of their
        // mean losses is the batch mean; sums add up.
        let loss = run(&x).mse_loss(&y, reduction);
        for b in &blocks {
            for p in b.parameters() {
                let mut g = p.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
        }
        loss.backward();
        tch::no_grad(|| {
            for b in &blocks {
                for mut p in b.parameters() {
                    let g = p.grad();
                    let _ = p.f_sub_(&(g * lr(sum, rows))).unwrap();
                }
            }
        });
    }
    let params = blocks
        .iter()
        .map(|b| b.parameters().iter().map(|p| p.detach().copy()).collect())
        .collect();
    (losses, params)
}

/// Builds a pipeline of `workers` (one per stage) with test blocks.
pub(crate) fn pipeline(
    workers: &[u32],
    args: &[BlockArgs],
    schedule: impl Into<ferry_pipeline::ScheduleSpec>,
    microbatches: usize,
    sum: bool,
) -> Result<Pipeline<Tensor>, ferry_pipeline::PipelineError> {
    builder(workers, args, schedule, microbatches, sum).build()
}

/// [`pipeline`]'s builder, for a test to set more before it builds.
pub(crate) fn builder(
    workers: &[u32],
    args: &[BlockArgs],
    schedule: impl Into<ferry_pipeline::ScheduleSpec>,
    microbatches: usize,
    sum: bool,
) -> PipelineBuilder<Tensor, Tensor> {
    let mut builder = Pipeline::builder();
    for (w, a) in workers.iter().zip(args) {
        builder = builder.stage(*w, BLOCK, *a);
    }
    builder
        .schedule(schedule)
        .microbatches(microbatches)
        .loss(if sum { MSE_SUM } else { MSE_MEAN })
        .scale_grads(!sum)
        .optimizer(OptimizerKind::sgd(lr(sum, ROWS)))
}

/// Asserts `a` and `b` agree at PyTorch's pipelining tolerance.
pub(crate) fn assert_close(a: &tch::Tensor, b: &tch::Tensor, what: &str) {
    assert!(
        a.allclose(b, 1e-5, 4e-5, false),
        "{what}: max difference {}",
        (a - b).abs().max().double_value(&[])
    );
}

pub(crate) fn assert_close_f64(a: f64, b: f64, what: &str) {
    assert!(
        (a - b).abs() <= 4e-5 + 1e-5 * b.abs(),
        "{what}: {a} against {b}"
    );
}
