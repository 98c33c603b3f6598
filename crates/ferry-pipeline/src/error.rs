//! What can go wrong building or running a pipeline.

use ferry_schedule::{DeadlockError, GenerateError, LowerError, PlacementError, ValidationError};

/// An error of the pipeline runtime. Errors raised while a step runs name
/// the stage, the worker, the action and the microbatch.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The pipeline was declared or used wrongly (no stage, no microbatch,
    /// no loss, an action naming a stage the pipeline lacks, an optimizer
    /// step without an optimizer).
    #[error("invalid pipeline: {0}")]
    Config(String),
    /// The schedule could not be generated for this shape.
    #[error("cannot generate the schedule: {0}")]
    Generate(#[from] GenerateError),
    /// The stages are not where the schedule puts them: a stage declared on
    /// another worker than its rank's, a custom schedule running a stage on
    /// two ranks or on none, two ranks on one worker.
    #[error("cannot place the stages: {0}")]
    Placement(#[from] PlacementError),
    /// The schedule is not valid for this many microbatches.
    #[error("the schedule is not valid: {0}")]
    Invalid(#[from] ValidationError),
    /// Lowering (adding sends and receives) failed for another reason than
    /// a deadlock.
    #[error("cannot lower the schedule: {0}")]
    Lower(#[from] LowerError),
    /// The schedule would deadlock (found while lowering a compute-only
    /// schedule, or in the lowered one); nothing was run.
    #[error("the schedule would deadlock: {0}")]
    Deadlock(#[from] DeadlockError),
    /// A batch that does not split into the microbatches (nothing was
    /// sent).
    #[error("cannot split {what} into the microbatches: {source}")]
    Split {
        /// "the inputs" or "the targets".
        what: &'static str,
        /// What was wrong.
        #[source]
        source: crate::SplitError,
    },
    /// The last stage's outputs could not be merged into one value
    /// ([`StepOutput::merged`](crate::StepOutput::merged)).
    #[error("cannot merge the microbatches' outputs: {0}")]
    Merge(String),
    /// A stage constructor or loss function is not registered on the worker.
    #[error("worker {worker} has no {what} registered as {name:?} (register it with ferry_pipeline::Stages before init_rpc)")]
    NotRegistered {
        /// The worker.
        worker: String,
        /// "stage constructor" or "loss function".
        what: &'static str,
        /// The name asked for.
        name: String,
    },
    /// An action failed on a stage.
    #[error("stage {stage} on worker {worker} failed at action {action}{mb}: {message}", mb = microbatch.map(|m| format!(" (microbatch {m})")).unwrap_or_default())]
    Stage {
        /// The stage.
        stage: usize,
        /// Its worker.
        worker: String,
        /// The action, in PyTorch's text form.
        action: String,
        /// The microbatch, where the action has one.
        microbatch: Option<usize>,
        /// What went wrong.
        message: String,
    },
    /// A stage did not deliver an activation or a gradient within the
    /// pipeline's timeout: names the stage that did not deliver, and the
    /// action that waited for it.
    #[error("stage {stage} on worker {worker} did not deliver the {what} of microbatch {microbatch} within {limit:?}: action {action} on worker {waiting_worker} waited for it")]
    Timeout {
        /// The stage that did not deliver.
        stage: usize,
        /// Its worker.
        worker: String,
        /// What it did not deliver.
        what: Awaited,
        /// The microbatch.
        microbatch: usize,
        /// The action that waited, in PyTorch's text form.
        action: String,
        /// The worker of that action.
        waiting_worker: String,
        /// The time limit ([`PipelineBuilder::timeout`](crate::PipelineBuilder::timeout)).
        limit: std::time::Duration,
    },
    /// The step was stopped because another stage or worker failed.
    #[error("step {step} was aborted on worker {worker}: {reason}")]
    Aborted {
        /// The worker.
        worker: String,
        /// The step number.
        step: u64,
        /// Why.
        reason: String,
    },
    /// A worker of the pipeline could not be reached or did not answer.
    #[error("worker {worker} (ranks' stages {stages:?}) failed: {source}")]
    Worker {
        /// The worker.
        worker: String,
        /// The stages it holds.
        stages: Vec<usize>,
        /// The RPC error.
        #[source]
        source: Box<ferry_rpc::RpcError>,
    },
    /// A worker does not know the pipeline (dropped, or never built there).
    #[error("worker {worker} has no pipeline {pipeline:#x}")]
    UnknownPipeline {
        /// The worker.
        worker: String,
        /// The pipeline id.
        pipeline: u64,
    },
    /// RPC itself failed (no agent, an unknown worker, ...).
    #[error(transparent)]
    Rpc(Box<ferry_rpc::RpcError>),
    /// A value could not be flattened into tensors or rebuilt.
    #[error("{0}")]
    Tree(#[from] ferry_tch::tree::TreeError),
    /// A stage's constructor failed on its worker.
    #[error("stage {stage} ({constructor}) could not be built on worker {worker}: {message}")]
    Construct {
        /// The stage.
        stage: usize,
        /// Its worker.
        worker: String,
        /// The constructor's registered name.
        constructor: String,
        /// The constructor's error, as it was raised.
        message: String,
    },
    /// A stage's optimizer could not be built or stepped.
    #[error("optimizer of stage {stage} on worker {worker}: {message}")]
    Optimizer {
        /// The stage.
        stage: usize,
        /// Its worker.
        worker: String,
        /// The optimizer's error ([`OptimError`](ferry_autograd::optim::OptimError)'s text).
        message: String,
    },
}

impl From<ferry_rpc::RpcError> for PipelineError {
    fn from(e: ferry_rpc::RpcError) -> Self {
        PipelineError::Rpc(Box::new(e))
    }
}

/// What an action waited for from another stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Awaited {
    /// An activation, from the previous stage.
    Activation,
    /// A gradient, from the next stage.
    Gradient,
}

impl std::fmt::Display for Awaited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Awaited::Activation => "activation",
            Awaited::Gradient => "gradient",
        })
    }
}
