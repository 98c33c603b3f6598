//! # ferry-pipeline
//!
//! Pipeline-parallel training over Ferry's RPC and libtorch, in the
//! single-driver, RPC-based shape PyTorch's pipeline-parallelism RFC
//! sketches (<https://github.com/pytorch/pytorch/issues/44827>): a training
//! loop on one driver; stage actors on the workers, each running its rank's lowered
//! action list from [`ferry_schedule`] (any schedule PyTorch ships, or one
//! written by hand or loaded from PyTorch's CSV); a manual backward per
//! stage (no distributed autograd), with I and W split for the zero-bubble
//! schedules; the loss as a callback on the last stage; and an optimizer
//! per stage, stepped after the last backward.
//!
//! Activations go from stage to stage directly between the stage workers
//! over Ferry's channels (never through the driver); two adjacent stages on
//! the same worker hand over in memory. Between stages any serde value that
//! holds tensors can travel, and shapes may change from microbatch to
//! microbatch.
//!
//! Stages are built on their owning worker by a constructor registered
//! there ([`Stages`]), so no code travels; the driver names it through a
//! typed [`StageFn`] handle, and a stage whose input is not the previous
//! stage's output does not compile.
//!
//! ```no_run
//! use ferry_pipeline::{LossFn, Pipeline, Stage, StageFn, Stages};
//! use ferry_schedule::ScheduleKind;
//! use ferry_tch::Tensor;
//!
//! struct Block {
//!     linear: tch::nn::Linear,
//!     _vars: tch::nn::VarStore,
//! }
//!
//! impl Stage for Block {
//!     type Input = Tensor;
//!     type Output = Tensor;
//!     fn forward(&mut self, x: Tensor) -> Result<Tensor, ferry_rpc::BoxError> {
//!         use tch::nn::Module;
//!         Ok(Tensor::from(self.linear.forward(&x).relu()))
//!     }
//!     fn parameters(&self) -> Vec<tch::Tensor> {
//!         self._vars.trainable_variables()
//!     }
//! }
//!
//! pub const BLOCK: StageFn<i64, Block> = StageFn::new("block");
//! pub const MSE: LossFn<Tensor> = LossFn::new("mse");
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // On every worker:
//! let mut stages = Stages::new();
//! stages.add(BLOCK, |width: i64| {
//!     let vars = tch::nn::VarStore::new(tch::Device::Cpu);
//!     let linear = tch::nn::linear(vars.root(), width, width, Default::default());
//!     Ok::<_, ferry_rpc::BoxError>(Block { linear, _vars: vars })
//! });
//! stages.add_loss(MSE, |out: Tensor, target: Tensor| {
//!     Ok::<_, ferry_rpc::BoxError>(out.mse_loss(&target, tch::Reduction::Mean))
//! });
//! let rank: u32 = std::env::var("RANK")?.parse()?;
//! let mut options = ferry_rpc::RpcOptions::from_env(format!("worker{rank}"))?;
//! ferry_pipeline::install(&mut options, stages);
//! ferry::init_rpc(options)?; // installs the other layers too
//!
//! // On the driver:
//! if rank == 0 {
//!     let mut pipeline = Pipeline::builder()
//!         .stage(0, BLOCK, 64)
//!         .stage(1, BLOCK, 64)
//!         .stage(0, BLOCK, 64)
//!         .stage(1, BLOCK, 64)
//!         .schedule(ScheduleKind::Interleaved1F1B)
//!         .microbatches(4)
//!         .loss(MSE)
//!         .optimizer(ferry_autograd::OptimizerKind::sgd(0.05))
//!         .build()?;
//!     let x = tch::Tensor::randn([32, 64], (tch::Kind::Float, tch::Device::Cpu));
//!     let y = tch::Tensor::randn([32, 64], (tch::Kind::Float, tch::Device::Cpu));
//!     for _ in 0..10 {
//!         let step = pipeline.step(&x, &y)?;
//!         pipeline.optimizer_step()?;
//!         pipeline.zero_grad()?;
//!         println!("losses {:?}", step.losses);
//!     }
//! }
//! ferry::shutdown()?;
//! # Ok(()) }
//! ```

mod actor;
mod driver;
mod erased;
mod error;
mod fault;
mod host;
mod mailbox;
mod memory;
mod microbatch;
mod plan;
mod protocol;
mod slot;
mod stage;
mod timeline;

pub use driver::{Pipeline, PipelineBuilder, StepOutput, DEFAULT_WAIT_SPIN, DROP_TIMEOUT};
pub use error::{Awaited, PipelineError};
pub use ferry_pipeline_macros::Split;
pub use ferry_transport::spin::HostCores;
pub use host::{install, PipelineHost};
pub use memory::{
    retain_freed_memory, RetainMemoryError, ARENA_MAX, MMAP_THRESHOLD, TRIM_THRESHOLD,
};
pub use microbatch::{split_tensor, Replicate, Split, SplitAlong, SplitError};
pub use plan::ScheduleSpec;
pub use stage::{LossFn, Stage, StageFn, Stages};
pub use timeline::{HandOff, HandOffSummary, Timeline};
