//! The model, the synthetic task, and the same training in one process.
//!
//! The model is `stages` stages of `layers` × (Linear(width, width) +
//! ReLU), the very last layer mapping to `OUTPUTS` without a ReLU. The task
//! is a regression: inputs live on a low-dimensional subspace (`LATENT`
//! directions embedded in `width` dimensions) and the targets are a fixed
//! smooth function of the latent point, so the loss falls quickly.

use ferry_autograd::optim::LocalOptimizer;
use ferry_autograd::OptimizerKind;
use ferry_pipeline::{LossFn, Stage, StageFn, Stages};
use ferry_rpc::BoxError;
use ferry_tch::Tensor;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Reduction};

const F32: (Kind, Device) = (Kind::Float, Device::Cpu);
/// The model's output width.
pub(crate) const OUTPUTS: i64 = 16;
/// The dimension of the subspace the inputs lie on.
const LATENT: i64 = 8;

/// What one stage is built from (it travels to the stage's worker).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(crate) struct BlockArgs {
    /// The stage's index (seeds its parameters).
    pub(crate) stage: usize,
    /// Whether this is the model's last stage.
    pub(crate) last: bool,
    /// Hidden width.
    pub(crate) width: i64,
    /// Linear layers in the stage.
    pub(crate) layers: usize,
}

/// One stage: `layers` linear layers with ReLU between them.
pub(crate) struct Block {
    layers: Vec<(tch::Tensor, tch::Tensor, bool)>,
}

impl Block {
    /// Builds the stage's parameters, seeded by its index: Kaiming-normal
    /// weights (for ReLU), zero biases.
    pub(crate) fn new(args: BlockArgs) -> Block {
        let layers = (0..args.layers)
            .map(|layer| {
                tch::manual_seed(100 * args.stage as i64 + layer as i64);
                let final_layer = args.last && layer + 1 == args.layers;
                let outputs = if final_layer { OUTPUTS } else { args.width };
                let gain = if final_layer { 1.0 } else { 2.0 };
                let std = (gain / args.width as f64).sqrt();
                let weight =
                    (tch::Tensor::randn([outputs, args.width], F32) * std).set_requires_grad(true);
                let bias = tch::Tensor::zeros([outputs], F32).set_requires_grad(true);
                (weight, bias, !final_layer)
            })
            .collect();
        Block { layers }
    }

    /// The stage's computation.
    pub(crate) fn apply(&self, x: &tch::Tensor) -> tch::Tensor {
        self.layers
            .iter()
            .fold(x.shallow_clone(), |h, (weight, bias, relu)| {
                let y = h.linear(weight, Some(bias));
                if *relu {
                    y.relu()
                } else {
                    y
                }
            })
    }

    fn params(&self) -> Vec<tch::Tensor> {
        self.layers
            .iter()
            .flat_map(|(w, b, _)| [w.shallow_clone(), b.shallow_clone()])
            .collect()
    }
}

impl Stage for Block {
    type Input = Tensor;
    type Output = Tensor;
    fn forward(&mut self, x: Tensor) -> Result<Tensor, BoxError> {
        Ok(Tensor::from(self.apply(&x)))
    }
    fn parameters(&self) -> Vec<tch::Tensor> {
        self.params()
    }
}

/// The stage constructor every worker registers.
pub(crate) const BLOCK: StageFn<BlockArgs, Block> = StageFn::new("train_pipeline.block");
/// The loss, on the last stage's worker: mean squared error.
pub(crate) const MSE: LossFn<Tensor> = LossFn::new("train_pipeline.mse");

/// What every worker can build.
pub(crate) fn stages() -> Stages {
    let mut stages = Stages::new();
    stages.add(BLOCK, |args: BlockArgs| Ok::<_, BoxError>(Block::new(args)));
    stages.add_loss(MSE, |out: Tensor, target: Tensor| {
        Ok::<_, BoxError>(out.mse_loss(&target, Reduction::Mean))
    });
    stages
}

/// The arguments of every stage.
pub(crate) fn block_args(stages: usize, width: i64, layers: usize) -> Vec<BlockArgs> {
    (0..stages)
        .map(|stage| BlockArgs {
            stage,
            last: stage + 1 == stages,
            width,
            layers,
        })
        .collect()
}

/// The optimizer of every stage (and of the one-process run).
pub(crate) fn optimizer() -> OptimizerKind {
    OptimizerKind::sgd(0.02).momentum(0.9)
}

/// The synthetic task: a fixed embedding of the latent space and a fixed
/// map from it to the targets.
pub(crate) struct Task {
    embed: tch::Tensor,
    mix: tch::Tensor,
    width: i64,
    batch: i64,
}

impl Task {
    /// The task for inputs of `width` and batches of `batch` rows.
    pub(crate) fn new(width: i64, batch: i64) -> Task {
        tch::manual_seed(7);
        let embed = tch::Tensor::randn([LATENT, width], F32) / (LATENT as f64).sqrt();
        let mix = tch::Tensor::randn([LATENT, OUTPUTS], F32) / (LATENT as f64).sqrt();
        Task {
            embed,
            mix,
            width,
            batch,
        }
    }

    /// The batch of step `step`: the same on every run.
    pub(crate) fn batch(&self, step: usize) -> (tch::Tensor, tch::Tensor) {
        tch::manual_seed(1000 + step as i64);
        let z = tch::Tensor::randn([self.batch, LATENT], F32);
        let x = z.matmul(&self.embed);
        debug_assert_eq!(x.size()[1], self.width);
        (x, z.matmul(&self.mix).sin())
    }
}

/// The same model trained in one process, without pipelining: same
/// initial parameters, same batches, same optimizer, the whole batch at
/// once. Calls `each(step, loss, seconds)` after every step.
pub(crate) fn train_in_one_process(
    args: &[BlockArgs],
    task: &Task,
    steps: usize,
    mut each: impl FnMut(usize, f64, f64),
) -> Result<(), BoxError> {
    let blocks: Vec<Block> = args.iter().map(|a| Block::new(*a)).collect();
    let params: Vec<tch::Tensor> = blocks.iter().flat_map(Block::params).collect();
    let mut optimizer = LocalOptimizer::new(
        optimizer(),
        params.iter().map(tch::Tensor::shallow_clone).collect(),
    )?;
    for step in 0..steps {
        let (x, y) = task.batch(step);
        let started = std::time::Instant::now();
        let out = blocks.iter().fold(x, |h, b| b.apply(&h));
        let loss = out.mse_loss(&y, Reduction::Mean);
        let grads = tch::Tensor::run_backward(&[&loss], &params, false, false);
        optimizer.step(&grads.into_iter().map(Some).collect::<Vec<_>>())?;
        let seconds = started.elapsed().as_secs_f64();
        each(step, loss.double_value(&[]), seconds);
    }
    Ok(())
}
