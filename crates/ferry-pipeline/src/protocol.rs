//! The remote functions between the driver and the stage workers, and
//! between stage workers, with their messages.

use ferry_rpc::{Function, Schema};
use ferry_tch::Tensor;
use serde::{Deserialize, Serialize};

/// A flattened value on the wire: its tensors travel over Ferry's channels
/// (the tensor table), the rest as bytes.
#[derive(Debug, Serialize, Deserialize, Schema)]
pub(crate) struct Packet {
    /// `ferry_tch::tree::flatten`'s bytes.
    pub bytes: Vec<u8>,
    /// Its tensors.
    pub tensors: Vec<Tensor>,
}

impl Packet {
    /// Packs a flattened value, its tensors detached from their graphs.
    pub(crate) fn detached(flat: ferry_tch::tree::Flat) -> Packet {
        Packet {
            bytes: flat.bytes,
            tensors: flat
                .tensors
                .iter()
                .map(|t| Tensor::from(t.detach()))
                .collect(),
        }
    }

    /// The tensors as libtorch tensors.
    pub(crate) fn into_parts(self) -> (Vec<u8>, Vec<tch::Tensor>) {
        (
            self.bytes,
            self.tensors.into_iter().map(Tensor::into_inner).collect(),
        )
    }
}

/// One stage to build on a rank.
#[derive(Debug, Serialize, Deserialize, Schema)]
pub(crate) struct StageInit {
    /// Its index in the pipeline.
    pub stage: u32,
    /// The registered constructor.
    pub constructor: String,
    /// Its flattened arguments.
    pub args: Packet,
}

/// Builds one rank of a pipeline on its worker.
#[derive(Debug, Serialize, Deserialize, Schema)]
pub(crate) struct CreateRank {
    pub pipeline: u64,
    pub rank: u32,
    /// The worker of every stage.
    pub stage_workers: Vec<String>,
    /// This rank's stages.
    pub stages: Vec<StageInit>,
    /// This rank's lowered actions, in PyTorch's text form.
    pub program: Vec<String>,
    pub microbatches: u32,
    /// The loss, when this rank holds the last stage.
    pub loss: Option<String>,
    pub scale_grads: bool,
    /// The optimizer (postcard of `OptimizerKind`), one per stage.
    pub optimizer: Option<Vec<u8>>,
    /// How long a wait for an input polls before it sleeps, µs.
    pub wait_spin_us: u64,
    /// Whether the rank's host has cores to spare
    /// ([`PipelineBuilder::host_cores`](crate::PipelineBuilder::host_cores));
    /// `None`: the rank finds out.
    pub spare_cores: Option<bool>,
}

/// Runs one step on a rank.
#[derive(Debug, Serialize, Deserialize, Schema)]
pub(crate) struct RunStep {
    pub pipeline: u64,
    pub step: u64,
    /// Forward and backward (`true`), or forward only without gradients.
    pub train: bool,
    /// The microbatches' inputs (flattened), when this rank holds stage 0.
    pub inputs: Vec<Packet>,
    /// The targets' microbatches, when this rank holds the last stage.
    pub targets: Vec<Tensor>,
    /// Whether to return the timeline of the rank's actions.
    pub trace: bool,
    /// Whether the last stage returns its outputs.
    pub outputs: bool,
    /// How long a wait for a value from another stage may last, ms.
    pub wait_limit_ms: u64,
}

/// The start and end of one action, in nanoseconds since the Unix epoch.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, Schema)]
pub(crate) struct ActionSpan {
    /// The action's position in the rank's program.
    pub index: u32,
    pub start_ns: u64,
    pub end_ns: u64,
}

/// A rank's result of a step.
#[derive(Debug, Default, Serialize, Deserialize, Schema)]
pub(crate) struct StepReply {
    /// (microbatch, loss), when the rank holds the last stage and has
    /// targets.
    pub losses: Vec<(u32, f64)>,
    /// (microbatch, output), when the rank holds the last stage and the
    /// outputs were asked for.
    pub outputs: Vec<(u32, Packet)>,
    /// The action timeline, when asked for.
    pub spans: Vec<ActionSpan>,
    /// The values this rank received from other workers, when the timeline
    /// was asked for.
    pub handoffs: Vec<HandOffStamps>,
}

/// Why a rank's step failed, as it travels back to the driver.
#[derive(Debug, Clone, Serialize, Deserialize, Schema)]
pub(crate) enum StepFailure {
    /// An action failed.
    Stage {
        stage: u32,
        worker: String,
        action: String,
        microbatch: Option<u32>,
        message: String,
    },
    /// A value did not arrive within the time limit.
    Timeout {
        /// The stage that did not deliver it.
        stage: u32,
        /// Its worker.
        worker: String,
        /// An activation (`true`) or a gradient.
        forward: bool,
        microbatch: u32,
        /// The action that waited for it.
        action: String,
        /// The worker of that action.
        waiting_worker: String,
        limit_ms: u64,
    },
    /// Stopped because of another failure.
    Aborted { worker: String, reason: String },
    /// No such pipeline on the worker.
    UnknownPipeline { worker: String },
}

/// What a rank's worker refused in a create, control or tensors call;
/// the driver turns it into the [`PipelineError`](crate::PipelineError)
/// that names it, with the worker.
#[derive(Debug, Serialize, Deserialize, Schema)]
pub(crate) enum HostFailure {
    /// Nothing registered under `name`: a loss function (`loss`) or a
    /// stage constructor.
    NotRegistered { loss: bool, name: String },
    /// A stage's constructor failed.
    Construct {
        stage: u32,
        constructor: String,
        message: String,
    },
    /// A stage's optimizer could not be built or stepped.
    Optimizer { stage: u32, message: String },
    /// An optimizer step on a pipeline built without an optimizer.
    NoOptimizer,
    /// A stage's accumulated gradients could not be scaled.
    Gradients { stage: u32, message: String },
    /// The request does not decode (an action's text, the optimizer).
    Malformed(String),
    /// No such pipeline on the worker.
    UnknownPipeline,
    /// The worker's agent is gone (it is shutting down).
    NoAgent(String),
}

/// A value for a stage on another worker.
#[derive(Debug, Serialize, Deserialize, Schema)]
pub(crate) struct Deliver {
    pub pipeline: u64,
    pub step: u64,
    /// The stage it is for.
    pub stage: u32,
    /// `true`: an activation (forward); `false`: gradients (backward).
    pub forward: bool,
    pub microbatch: u32,
    /// An activation's flattened value.
    pub activation: Option<Packet>,
    /// Gradients, one per tensor of the activation that went forward
    /// (`None`: that tensor gets no gradient).
    pub grads: Vec<Option<Tensor>>,
    /// When the sender sent it (ns since the Unix epoch), for the
    /// timeline's hand-offs.
    pub sent_ns: u64,
}

/// One value handed from a stage to the next (or back), as the receiving
/// rank saw it: nanoseconds since the Unix epoch, on the sender's and the
/// receiver's clocks (one host: one clock).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, Schema)]
pub(crate) struct HandOffStamps {
    /// The receiving stage.
    pub stage: u32,
    pub microbatch: u32,
    /// An activation (`true`) or a gradient.
    pub forward: bool,
    /// The sender sent it.
    pub sent_ns: u64,
    /// It reached the receiver's mailbox.
    pub received_ns: u64,
    /// The receiving action started waiting for it (or asked for it).
    pub asked_ns: u64,
    /// The receiving action had it and started computing.
    pub started_ns: u64,
}

/// Stops a step on a rank.
#[derive(Debug, Serialize, Deserialize, Schema)]
pub(crate) struct Abort {
    pub pipeline: u64,
    pub step: u64,
    pub reason: String,
}

/// What the driver asks of a rank between steps.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Schema)]
pub(crate) enum Control {
    /// Step every stage's optimizer with its accumulated gradients.
    OptimizerStep,
    /// Drop the accumulated gradients.
    ZeroGrad,
    /// Drop the rank.
    Destroy,
}

/// Tensors per stage: (stage, one per parameter; `None`: no gradient).
pub(crate) type StageTensors = Vec<(u32, Vec<Option<Tensor>>)>;

/// Builds a rank.
pub(crate) const CREATE: Function<CreateRank, Result<(), HostFailure>> =
    Function::new("ferry_pipeline::create");
/// Runs a step on a rank.
pub(crate) const RUN_STEP: Function<RunStep, Result<StepReply, StepFailure>> =
    Function::new("ferry_pipeline::run_step");
/// Delivers a value to a stage.
pub(crate) const DELIVER: Function<Deliver, Result<(), String>> =
    Function::new("ferry_pipeline::deliver");
/// Aborts a step.
pub(crate) const ABORT: Function<Abort, ()> = Function::new("ferry_pipeline::abort");
/// Optimizer step, zero grad, destroy.
pub(crate) const CONTROL: Function<(u64, Control), Result<(), HostFailure>> =
    Function::new("ferry_pipeline::control");
/// The parameters (or, with `true`, the accumulated gradients) of a rank's
/// stages: (stage, tensors), undefined tensors standing for "no gradient".
pub(crate) const TENSORS: Function<(u64, bool), Result<StageTensors, HostFailure>> =
    Function::new("ferry_pipeline::tensors");
