//! The benchmark's model, data and one-process baseline, built exactly as
//! `pt_pipeline.py` builds them, so both sides train the same numbers.
//!
//! - Model: `layers` blocks of `nn.Linear(width, width)` + ReLU. Under
//!   `torch.manual_seed(0)`, each block is made as PyTorch makes it: the
//!   constructor's `kaiming_uniform_(a=√5)` weight (bound 1/√width) and
//!   uniform bias draw from the generator, then `kaiming_normal_` (ReLU
//!   gain: std √(2/width)) overwrites the weight and the bias is zeroed.
//!   Every stage rebuilds the whole model from the seed on its own worker
//!   and keeps its blocks, as the peer's stages slice `build_model`.
//! - Data: step `k` uses `x ~ N(0, 1)` `[batch, width]` from seed `1000 + k`
//!   and the target `relu(x @ W_t / √width)`, with the teacher `W_t ~ N(0, 1)`
//!   `[width, width]` from seed 7.
//! - Loss: `MSELoss` (mean) per microbatch; SGD without momentum.

use ferry_autograd::optim::LocalOptimizer;
use ferry_autograd::OptimizerKind;
use ferry_pipeline::{LossFn, Stage, StageFn, Stages};
use ferry_rpc::BoxError;
use ferry_tch::Tensor;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Reduction};

const F32: (Kind, Device) = (Kind::Float, Device::Cpu);

/// The model's shape.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(crate) struct Shape {
    /// Blocks in the whole model.
    pub(crate) layers: usize,
    /// Width of every linear layer.
    pub(crate) width: i64,
}

/// One block's parameters: `Linear(width, width)`'s weight and bias.
pub(crate) struct Block {
    pub(crate) weight: tch::Tensor,
    pub(crate) bias: tch::Tensor,
}

/// The whole model's blocks, with PyTorch's initialisation under seed 0.
pub(crate) fn build_model(shape: Shape) -> Vec<Block> {
    let width = shape.width;
    let bound = 1.0 / (width as f64).sqrt();
    let std = (2.0 / width as f64).sqrt();
    tch::manual_seed(0);
    tch::no_grad(|| {
        (0..shape.layers)
            .map(|_| {
                // nn.Linear's own reset_parameters (draws from the generator).
                let mut weight = tch::Tensor::empty([width, width], F32);
                let _ = weight.uniform_(-bound, bound);
                let mut bias = tch::Tensor::empty([width], F32);
                let _ = bias.uniform_(-bound, bound);
                // Then the recipe: kaiming_normal_(relu) and a zero bias.
                let _ = weight.normal_(0.0, std);
                let _ = bias.zero_();
                Block {
                    weight: weight.set_requires_grad(true),
                    bias: bias.set_requires_grad(true),
                }
            })
            .collect()
    })
}

impl Block {
    fn forward(&self, x: &tch::Tensor) -> tch::Tensor {
        x.linear(&self.weight, Some(&self.bias)).relu()
    }

    fn parameters(&self) -> [tch::Tensor; 2] {
        [self.weight.shallow_clone(), self.bias.shallow_clone()]
    }
}

/// Which blocks a stage holds: `count` blocks from `first`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(crate) struct StageArgs {
    pub(crate) shape: Shape,
    pub(crate) first: usize,
    pub(crate) count: usize,
}

/// A stage: consecutive blocks of the model.
pub(crate) struct Blocks {
    blocks: Vec<Block>,
}

impl Blocks {
    fn new(args: StageArgs) -> Result<Blocks, BoxError> {
        if args.count == 0 || args.first + args.count > args.shape.layers {
            return Err(format!(
                "blocks {}..{} do not fit a model of {} blocks",
                args.first,
                args.first + args.count,
                args.shape.layers
            )
            .into());
        }
        let blocks = build_model(args.shape)
            .into_iter()
            .skip(args.first)
            .take(args.count)
            .collect();
        Ok(Blocks { blocks })
    }
}

impl Stage for Blocks {
    type Input = Tensor;
    type Output = Tensor;
    fn forward(&mut self, x: Tensor) -> Result<Tensor, BoxError> {
        let first = self
            .blocks
            .first()
            .ok_or("a stage without blocks")?
            .forward(&x);
        Ok(Tensor::from(
            self.blocks[1..].iter().fold(first, |h, b| b.forward(&h)),
        ))
    }
    fn parameters(&self) -> Vec<tch::Tensor> {
        self.blocks.iter().flat_map(Block::parameters).collect()
    }
}

/// The stage constructor every worker registers.
pub(crate) const BLOCKS: StageFn<StageArgs, Blocks> = StageFn::new("pipeline_bench.blocks");
/// `nn.MSELoss()` (mean) on a microbatch.
pub(crate) const MSE: LossFn<Tensor> = LossFn::new("pipeline_bench.mse");

/// What every worker of the benchmark can build.
pub(crate) fn stages() -> Stages {
    let mut stages = Stages::new();
    stages.add(BLOCKS, Blocks::new);
    stages.add_loss(MSE, |out: Tensor, target: Tensor| {
        Ok::<_, BoxError>(out.mse_loss(&target, Reduction::Mean))
    });
    stages
}

/// The teacher `W_t`.
pub(crate) fn teacher(width: i64) -> tch::Tensor {
    tch::manual_seed(7);
    tch::Tensor::randn([width, width], F32)
}

/// The batch of step `k`: inputs and targets.
pub(crate) fn batch(
    k: i64,
    rows: i64,
    width: i64,
    teacher: &tch::Tensor,
) -> (tch::Tensor, tch::Tensor) {
    tch::manual_seed(1000 + k);
    let x = tch::Tensor::randn([rows, width], F32);
    let y = tch::no_grad(|| (x.matmul(teacher) / (width as f64).sqrt()).relu());
    (x, y)
}

/// The same model trained in one process without pipelining: full-batch
/// forward, `MSELoss`, backward, SGD (the optimizer the pipeline's stages
/// use), timed per step like the peer's baseline: the gradients dropped
/// first, as `zero_grad(set_to_none=True)`.
pub(crate) struct Baseline {
    blocks: Vec<Block>,
    optimizer: LocalOptimizer,
}

impl Baseline {
    pub(crate) fn new(shape: Shape, lr: f64) -> Result<Baseline, BoxError> {
        let blocks = build_model(shape);
        let params = blocks.iter().flat_map(Block::parameters).collect();
        let optimizer = LocalOptimizer::new(OptimizerKind::sgd(lr), params)?;
        Ok(Baseline { blocks, optimizer })
    }

    /// One step on `(x, y)`: returns the loss (at the parameters before it).
    pub(crate) fn step(&mut self, x: &tch::Tensor, y: &tch::Tensor) -> Result<f64, BoxError> {
        // set_to_none: fresh leaves over the same storage as the
        // optimizer's parameters, without a gradient, so that backward
        // allocates new gradients.
        for b in &mut self.blocks {
            b.weight = b.weight.detach().set_requires_grad(true);
            b.bias = b.bias.detach().set_requires_grad(true);
        }
        let out = self
            .blocks
            .iter()
            .fold(x.shallow_clone(), |h, b| b.forward(&h));
        let loss = out.f_mse_loss(y, Reduction::Mean)?;
        loss.f_backward()?;
        let grads: Vec<Option<tch::Tensor>> = self
            .blocks
            .iter()
            .flat_map(Block::parameters)
            .map(|p| Some(p.grad()))
            .collect();
        self.optimizer.step(&grads)?;
        Ok(loss.f_double_value(&[])?)
    }

    /// The parameters, block by block (weight, bias).
    pub(crate) fn parameters(&self) -> Vec<tch::Tensor> {
        self.blocks.iter().flat_map(Block::parameters).collect()
    }
}
