//! The driver's side: declaring a pipeline, building its stages on their
//! workers, and running training and evaluation steps.

use std::future::Future;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ferry_autograd::optim::OptimizerKind;
use ferry_rpc::{Agent, RpcError, WorkerRef};
use ferry_schedule::Schedule;
use ferry_tch::tree::{self, Flat, TreeError};
use ferry_tch::Tensor;
use ferry_transport::spin::HostCores;
use futures::stream::{FuturesUnordered, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Awaited, PipelineError};
use crate::host::PipelineHost;
use crate::microbatch::{split_tensor, Split};
use crate::plan::{plan, Plan, ScheduleSpec};
use crate::protocol::{
    Abort, Control, CreateRank, HostFailure, Packet, RunStep, StageInit, StepFailure, StepReply,
    ABORT, CONTROL, CREATE, RUN_STEP, TENSORS,
};
use crate::stage::{LossFn, Stage, StageFn};
use crate::timeline::Timeline;

/// Declares a pipeline, stage by stage; [`build`](Self::build) creates it.
///
/// `O` is the output type of the last stage declared so far and `I` what
/// stage 0 takes (one microbatch of the batch), so a stage whose input does
/// not match the previous stage's output, or a loss that does not take the
/// last output, does not compile.
pub struct PipelineBuilder<O, I = Tensor> {
    stages: Vec<(WorkerRef, &'static str, Result<Flat, TreeError>)>,
    schedule: ScheduleSpec,
    microbatches: usize,
    loss: Option<&'static str>,
    scale_grads: bool,
    optimizer: Option<OptimizerKind>,
    timeout: Option<Duration>,
    wait_spin: Duration,
    host_cores: Option<HostCores>,
    return_outputs: bool,
    _types: PhantomData<fn(I) -> O>,
}

/// [`PipelineBuilder::wait_spin`]'s default.
pub const DEFAULT_WAIT_SPIN: Duration = Duration::from_millis(3);

impl<O, I> PipelineBuilder<O, I> {
    /// Adds the next stage, built on `worker` by the constructor `stage`
    /// registered there, from `args`.
    pub fn stage<A, S>(
        self,
        worker: impl Into<WorkerRef>,
        stage: StageFn<A, S>,
        args: A,
    ) -> PipelineBuilder<S::Output, I>
    where
        A: Serialize,
        S: Stage<Input = O>,
    {
        let mut stages = self.stages;
        stages.push((worker.into(), stage.name(), tree::flatten(&args)));
        PipelineBuilder {
            stages,
            schedule: self.schedule,
            microbatches: self.microbatches,
            loss: self.loss,
            scale_grads: self.scale_grads,
            optimizer: self.optimizer,
            timeout: self.timeout,
            wait_spin: self.wait_spin,
            host_cores: self.host_cores,
            return_outputs: self.return_outputs,
            _types: PhantomData,
        }
    }

    /// Whether [`Pipeline::step`] returns the last stage's output of every
    /// microbatch ([`StepOutput::outputs`]; default `true`, as PyTorch's
    /// `step` returns them). Turn it off when only the losses matter: the
    /// outputs then stay on the last stage's worker.
    pub fn return_outputs(mut self, return_outputs: bool) -> Self {
        self.return_outputs = return_outputs;
        self
    }

    /// The schedule: a [`ScheduleKind`](ferry_schedule::ScheduleKind) or a
    /// [`ScheduleSpec::Custom`] one (default: GPipe).
    pub fn schedule(mut self, schedule: impl Into<ScheduleSpec>) -> Self {
        self.schedule = schedule.into();
        self
    }

    /// How many microbatches a batch splits into (default 1), with
    /// `tensor_split` semantics: 10 rows into 4 microbatches are 3, 3, 2
    /// and 2 (see [`Split`](crate::Split)).
    pub fn microbatches(mut self, microbatches: usize) -> Self {
        self.microbatches = microbatches;
        self
    }

    /// The loss function, registered on the last stage's worker.
    pub fn loss(mut self, loss: LossFn<O>) -> Self {
        self.loss = Some(loss.name());
        self
    }

    /// PyTorch's `scale_grads` (default `true`): divide each stage's
    /// accumulated gradients by the microbatch count once, after its last
    /// backward, so that a mean loss per microbatch gives the gradients of
    /// the mean loss over the batch. Turn it off for a sum loss. When the
    /// microbatches are uneven, each microbatch's loss gradient is also
    /// weighted by its share of the targets' rows (`rows × microbatches /
    /// batch rows`), so that the gradients stay exactly those of the mean
    /// over the whole batch.
    pub fn scale_grads(mut self, scale: bool) -> Self {
        self.scale_grads = scale;
        self
    }

    /// An optimizer per stage, on the stage's worker, stepped by
    /// [`Pipeline::optimizer_step`].
    pub fn optimizer(mut self, kind: OptimizerKind) -> Self {
        self.optimizer = Some(kind);
        self
    }

    /// The time limit of every wait for a value inside a step (a rank's
    /// whole step gets twice that; default: the agent's RPC timeout; zero:
    /// no limit, and dropping the pipeline waits at most [`DROP_TIMEOUT`]
    /// per rank).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// How long a rank waiting for an input (an activation or a gradient
    /// from another worker) polls for it before it sleeps (default
    /// [`DEFAULT_WAIT_SPIN`], 3 ms; zero: sleep at once). Polling keeps
    /// the rank's core awake, so the message is handed to the compute at
    /// once instead of after the wake-up of an idle core, which on a
    /// virtual machine can take milliseconds; it yields the CPU between
    /// checks, and runs only during the schedule's bubbles, when the rank
    /// has nothing else to compute. A longer spin saves wake-ups at the
    /// start of a step; a shorter one leaves the cores to other work.
    pub fn wait_spin(mut self, spin: Duration) -> Self {
        self.wait_spin = spin;
        self
    }

    /// Whether the workers' hosts have a core for every busy thread: each
    /// worker's compute (libtorch's intra-op threads), its rank waiting
    /// for input and its ring reader. By default each rank finds out when
    /// it is built ([`HostCores::of`] the CPUs it may run on, its host's
    /// `LOCAL_WORLD_SIZE` workers and libtorch's threads then).
    ///
    /// With cores to spare, a rank waiting for an input has its process's
    /// ring readers poll for it, so the message costs no wake-up of its
    /// reader (tens of µs on a virtual machine); with too few, they sleep
    /// soon, leaving the cores to the compute. Set it where the count is
    /// wrong: a CPU quota below the CPUs the process may run on, or other
    /// busy programs on the host.
    pub fn host_cores(mut self, cores: HostCores) -> Self {
        self.host_cores = Some(cores);
        self
    }

    /// Checks the declaration and the schedule, then builds every stage on
    /// its worker. Nothing is built when a check fails.
    pub fn build(self) -> Result<Pipeline<O, I>, PipelineError>
    where
        O: DeserializeOwned,
        I: Serialize,
    {
        let agent = ferry_rpc::agent()?;
        if agent.layer::<crate::PipelineHost>().is_none() {
            return Err(PipelineError::Config(
                "the pipeline layer is not installed on this worker: start it with ferry::init_rpc \
                 (which installs every layer), or call ferry_pipeline::install(&mut options, stages) \
                 before starting the agent"
                    .into(),
            ));
        }
        let loss = self.loss.ok_or_else(|| {
            PipelineError::Config("no loss function: call PipelineBuilder::loss".into())
        })?;
        let mut workers = Vec::new();
        let mut inits = Vec::new();
        for (index, (worker, constructor, args)) in self.stages.into_iter().enumerate() {
            workers.push(agent.get_worker_info(worker)?.name);
            let args =
                args.map_err(|e| PipelineError::Config(format!("stage {index}: arguments: {e}")))?;
            inits.push(Some((constructor, args)));
        }
        let plan = plan(&workers, &self.schedule, self.microbatches)?;
        let timeout = self.timeout.unwrap_or_else(|| agent.rpc_timeout());
        let optimizer = match &self.optimizer {
            Some(kind) => Some(
                postcard::to_stdvec(kind)
                    .map_err(|e| PipelineError::Config(format!("optimizer: {e}")))?,
            ),
            None => None,
        };
        let id = pipeline_id(&agent);
        let last = workers.len() - 1;
        let creates: Vec<_> = (0..plan.ranks.len())
            .map(|rank| {
                let stages = plan
                    .stages_of(rank)
                    .into_iter()
                    .filter_map(|stage| {
                        let (constructor, args) = inits[stage].take()?;
                        Some(StageInit {
                            stage: stage as u32,
                            constructor: constructor.to_owned(),
                            args: Packet {
                                bytes: args.bytes,
                                tensors: args.tensors.into_iter().map(Tensor::from).collect(),
                            },
                        })
                    })
                    .collect();
                let request = CreateRank {
                    pipeline: id,
                    rank: rank as u32,
                    stage_workers: workers.clone(),
                    stages,
                    program: plan.program(rank).iter().map(ToString::to_string).collect(),
                    microbatches: self.microbatches as u32,
                    loss: (plan.stage_to_rank[last] == rank).then(|| loss.to_owned()),
                    scale_grads: self.scale_grads,
                    optimizer: optimizer.clone(),
                    wait_spin_us: u64::try_from(self.wait_spin.as_micros()).unwrap_or(u64::MAX),
                    spare_cores: self.host_cores.map(|c| c == HostCores::Spare),
                };
                CREATE
                    .agent(&agent)
                    .timeout(timeout)
                    .rpc_async(plan.ranks[rank].as_str(), request)
            })
            .collect();
        let pipeline = Pipeline {
            agent,
            id,
            plan,
            microbatches: self.microbatches,
            next_step: 1,
            trace: false,
            timeout,
            return_outputs: self.return_outputs,
            _types: PhantomData,
        };
        let mut first_error = None;
        for (rank, create) in creates.into_iter().enumerate() {
            let result = match create.wait() {
                Ok(Ok(())) => continue,
                Ok(Err(failure)) => pipeline.host_error(rank, failure),
                Err(source) => pipeline.worker_error(rank, source),
            };
            first_error.get_or_insert(result);
        }
        match first_error {
            // Dropping `pipeline` destroys the ranks that were built.
            Some(e) => Err(e),
            None => Ok(pipeline),
        }
    }
}

/// A unique id per pipeline: the driver's rank and a counter.
fn pipeline_id(agent: &Agent) -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    (u64::from(agent.worker_info().id) << 40) | NEXT.fetch_add(1, Ordering::Relaxed)
}

/// What a step ([`Pipeline::step`]) or an evaluation ([`Pipeline::eval`])
/// returns: PyTorch's `losses` and the last stage's outputs.
#[derive(Debug)]
pub struct StepOutput<O> {
    /// The loss of every microbatch, in microbatch order (empty for an
    /// evaluation without targets).
    pub losses: Vec<f64>,
    /// The last stage's output of every microbatch, in microbatch order
    /// (empty when [`PipelineBuilder::return_outputs`] is off);
    /// [`merged`](Self::merged) concatenates them.
    pub outputs: Vec<O>,
    /// When tracing ([`Pipeline::set_trace`]): the measured start and end of
    /// every action on every rank.
    pub timeline: Option<Timeline>,
}

impl<O: Serialize + DeserializeOwned> StepOutput<O> {
    /// The outputs merged into one value as PyTorch's `step` returns them
    /// (`merge_chunks` with `TensorChunkSpec(0)`): every tensor of the
    /// output concatenated along dimension 0 across the microbatches, what
    /// is not a tensor taken from the first microbatch.
    pub fn merged(&self) -> Result<O, PipelineError> {
        self.merged_along(0)
    }

    /// [`merged`](Self::merged), concatenating along `dim` (negative counts
    /// from the end).
    pub fn merged_along(&self, dim: i64) -> Result<O, PipelineError> {
        let flats = self
            .outputs
            .iter()
            .map(tree::flatten)
            .collect::<Result<Vec<_>, _>>()?;
        let merged = crate::microbatch::merge(&flats, dim).map_err(PipelineError::Merge)?;
        Ok(tree::unflatten(&merged.bytes, merged.tensors)?)
    }
}

/// A pipeline built on its workers, driven from this one. Dropping it drops
/// its stages on their workers. `O` is the last stage's output, `I` what
/// stage 0 takes.
pub struct Pipeline<O, I = Tensor> {
    agent: Agent,
    id: u64,
    plan: Plan,
    microbatches: usize,
    next_step: u64,
    trace: bool,
    timeout: Duration,
    return_outputs: bool,
    _types: PhantomData<fn(I) -> O>,
}

impl Pipeline<()> {
    /// Starts declaring a pipeline whose first stage takes a microbatch of
    /// the batch (a [`Tensor`], the batch split along dimension 0).
    pub fn builder() -> PipelineBuilder<Tensor> {
        Self::builder_for()
    }

    /// Starts declaring a pipeline whose first stage takes `I`: a tuple or
    /// a struct of tensors and plain values, each split along its own
    /// dimension or replicated as its type says (see [`Split`](crate::Split)).
    /// [`Pipeline::step`] then takes any batch that splits into `I`s.
    pub fn builder_for<I>() -> PipelineBuilder<I, I> {
        PipelineBuilder {
            stages: Vec::new(),
            schedule: ScheduleSpec::Kind(ferry_schedule::ScheduleKind::GPipe),
            microbatches: 1,
            loss: None,
            scale_grads: true,
            optimizer: None,
            timeout: None,
            wait_spin: DEFAULT_WAIT_SPIN,
            host_cores: None,
            return_outputs: true,
            _types: PhantomData,
        }
    }
}

impl<O: DeserializeOwned, I: Serialize> Pipeline<O, I> {
    /// The lowered schedule the ranks run (one action list per rank).
    pub fn schedule(&self) -> &Schedule {
        &self.plan.lowered
    }

    /// The worker of every rank.
    pub fn workers(&self) -> &[String] {
        &self.plan.ranks
    }

    /// The rank of every stage.
    pub fn stage_to_rank(&self) -> &[usize] {
        &self.plan.stage_to_rank
    }

    /// Records the timeline of every step from now on (`true`) or not.
    pub fn set_trace(&mut self, trace: bool) {
        self.trace = trace;
    }

    /// The error for what `rank`'s worker refused.
    fn host_error(&self, rank: usize, failure: HostFailure) -> PipelineError {
        let worker = self.plan.ranks[rank].clone();
        match failure {
            HostFailure::NotRegistered { loss, name } => PipelineError::NotRegistered {
                worker,
                what: if loss {
                    "loss function"
                } else {
                    "stage constructor"
                },
                name,
            },
            HostFailure::Construct {
                stage,
                constructor,
                message,
            } => PipelineError::Construct {
                stage: stage as usize,
                worker,
                constructor,
                message,
            },
            HostFailure::Optimizer { stage, message } => PipelineError::Optimizer {
                stage: stage as usize,
                worker,
                message,
            },
            HostFailure::NoOptimizer => PipelineError::Config(
                "an optimizer step on a pipeline built without an optimizer \
                 (PipelineBuilder::optimizer)"
                    .into(),
            ),
            HostFailure::Gradients { stage, message } => PipelineError::Config(format!(
                "worker {worker}: stage {stage}: cannot scale the accumulated gradients: {message}"
            )),
            HostFailure::Malformed(message) => {
                PipelineError::Config(format!("worker {worker} refused the request: {message}"))
            }
            HostFailure::UnknownPipeline => PipelineError::UnknownPipeline {
                worker,
                pipeline: self.id,
            },
            HostFailure::NoAgent(message) => {
                PipelineError::Config(format!("worker {worker} has no running agent: {message}"))
            }
        }
    }

    fn worker_error(&self, rank: usize, source: RpcError) -> PipelineError {
        PipelineError::Worker {
            worker: self.plan.ranks[rank].clone(),
            stages: self.plan.stages_of(rank),
            source: Box::new(source),
        }
    }

    /// Splits the inputs into the microbatches, flattened for the wire.
    fn split_inputs<B>(&self, batch: &B) -> Result<Vec<Packet>, PipelineError>
    where
        B: Split<Part = I> + ?Sized,
    {
        let parts = batch
            .split(self.microbatches)
            .map_err(|source| PipelineError::Split {
                what: "the inputs",
                source,
            })?;
        parts
            .iter()
            .map(|part| Ok(Packet::detached(tree::flatten(part)?)))
            .collect()
    }

    /// Splits the targets along dimension 0.
    fn split_targets(&self, targets: &tch::Tensor) -> Result<Vec<Tensor>, PipelineError> {
        split_tensor(targets, 0, self.microbatches).map_err(|source| PipelineError::Split {
            what: "the targets",
            source,
        })
    }

    /// One training step, as PyTorch's `schedule.step(inputs, target=targets,
    /// losses=losses)`: the batch split into the microbatches (see
    /// [`Split`](crate::Split)), forward and backward through the schedule,
    /// gradients accumulated on every stage. Returns the loss and the last
    /// stage's output of every microbatch.
    pub fn step<B>(
        &mut self,
        inputs: &B,
        targets: &tch::Tensor,
    ) -> Result<StepOutput<O>, PipelineError>
    where
        B: Split<Part = I> + ?Sized,
    {
        let inputs = self.split_inputs(inputs)?;
        let targets = self.split_targets(targets)?;
        self.run(true, inputs, targets)
    }

    /// Forward only, without gradients, as PyTorch's `schedule.eval(inputs,
    /// target=targets, losses=losses)`: the last stage's output of every
    /// microbatch, and with `targets` the loss of every microbatch.
    pub fn eval<B>(
        &mut self,
        inputs: &B,
        targets: Option<&tch::Tensor>,
    ) -> Result<StepOutput<O>, PipelineError>
    where
        B: Split<Part = I> + ?Sized,
    {
        let inputs = self.split_inputs(inputs)?;
        let targets = match targets {
            Some(t) => self.split_targets(t)?,
            None => Vec::new(),
        };
        self.run(false, inputs, targets)
    }

    /// Runs one step on every rank, and on the first failure aborts it on
    /// all of them.
    fn run(
        &mut self,
        train: bool,
        inputs: Vec<Packet>,
        targets: Vec<Tensor>,
    ) -> Result<StepOutput<O>, PipelineError> {
        let step = self.next_step;
        self.next_step += 1;
        let first = self.plan.stage_to_rank[0];
        let last = self.plan.stage_to_rank[self.plan.stage_to_rank.len() - 1];
        let mut inputs = Some(inputs);
        let mut targets = Some(targets);
        // The rank on this very worker, if any, runs on this thread: its
        // inputs and reply skip the wire, and its step starts and ends
        // without a wake-up of another thread.
        let me = &self.agent.worker_info().name;
        let here = self
            .agent
            .layer::<PipelineHost>()
            .and_then(|host| Some((self.plan.ranks.iter().position(|w| w == me)?, host)));
        let mut local = None;
        let calls: FuturesUnordered<_> = (0..self.plan.ranks.len())
            .filter_map(|rank| {
                let request = RunStep {
                    pipeline: self.id,
                    step,
                    train,
                    inputs: if rank == first {
                        inputs.take().unwrap_or_default()
                    } else {
                        Vec::new()
                    },
                    targets: if rank == last {
                        targets.take().unwrap_or_default()
                    } else {
                        Vec::new()
                    },
                    trace: self.trace,
                    outputs: !train || self.return_outputs,
                    wait_limit_ms: u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
                };
                if here.as_ref().is_some_and(|(r, _)| *r == rank) {
                    local = Some(request);
                    return None;
                }
                // A rank's whole step gets twice the limit of one wait, so
                // that a wait that times out is reported (naming the stage
                // that did not deliver) before the call to the stalled rank.
                let call = RUN_STEP
                    .agent(&self.agent)
                    .timeout(self.timeout.saturating_mul(2))
                    .rpc_async(self.plan.ranks[rank].as_str(), request);
                Some(async move { (rank, call.await) })
            })
            .collect();
        // At the first failure of a remote rank, every rank is told to
        // stop the step (this worker's too, whose wait then ends).
        let aborter = self.aborter(step);
        let remote = {
            let aborter = aborter.clone();
            async move {
                let mut calls = calls;
                let mut results = Vec::new();
                let mut aborted = false;
                while let Some((rank, result)) = calls.next().await {
                    if !aborted {
                        if let Some(reason) = aborter.reason(rank, &result) {
                            aborted = true;
                            aborter.abort(&reason);
                        }
                    }
                    results.push((rank, result));
                }
                results
            }
        };
        let mut results = match here.zip(local) {
            Some(((rank, host), request)) => self.run_here(rank, &host, request, &aborter, remote),
            None => futures::executor::block_on(remote),
        };
        results.sort_by_key(|(rank, _)| *rank);
        let mut replies: Vec<StepReply> = Vec::with_capacity(results.len());
        let mut failure: Option<PipelineError> = None;
        for (rank, result) in results {
            let error = match result {
                Ok(Ok(reply)) => {
                    replies.push(reply);
                    continue;
                }
                Ok(Err(failure)) => failure_error(failure, self.id, step),
                Err(source) => self.worker_error(rank, source),
            };
            // The root cause wins over what it caused: a failed action
            // over a value that never came, that over a worker that did
            // not answer in time, and everything over the aborts.
            if failure.as_ref().is_none_or(|f| blame(&error) < blame(f)) {
                failure = Some(error);
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        let timeline = self
            .trace
            .then(|| Timeline::new(&self.plan.lowered, &replies));
        let mut losses: Vec<(u32, f64)> = Vec::new();
        let mut outputs: Vec<(u32, Packet)> = Vec::new();
        for reply in replies {
            losses.extend(reply.losses);
            outputs.extend(reply.outputs);
        }
        losses.sort_by_key(|(mb, _)| *mb);
        outputs.sort_by_key(|(mb, _)| *mb);
        let outputs = outputs
            .into_iter()
            .map(|(_, packet)| {
                let (bytes, tensors) = packet.into_parts();
                Ok(tree::unflatten(&bytes, tensors)?)
            })
            .collect::<Result<Vec<O>, PipelineError>>()?;
        Ok(StepOutput {
            losses: losses.into_iter().map(|(_, loss)| loss).collect(),
            outputs,
            timeline,
        })
    }

    /// Runs `rank`, this worker's, on this thread while `remote` (the
    /// other ranks' calls) runs on the agent's runtime; every rank's
    /// result.
    fn run_here(
        &self,
        rank: usize,
        host: &PipelineHost,
        request: RunStep,
        aborter: &Aborter,
        remote: impl Future<Output = Vec<(usize, RankResult)>> + Send + 'static,
    ) -> Vec<(usize, RankResult)> {
        let (tx, rx) = futures::channel::oneshot::channel();
        self.agent.spawn(async move {
            let _ = tx.send(remote.await);
        });
        // As on a thread of the agent's: the caller's grad mode (a
        // `no_grad` around `step`, say) is not the stages'.
        let result = self.agent.enter(|| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                tch::with_grad(|| host.run_step(&self.agent, request))
            }))
        });
        let result = result.map_err(|panic| RpcError::Remote {
            worker: self.plan.ranks[rank].clone(),
            function: RUN_STEP.name().to_owned(),
            message: ferry_rpc::panic_message(&*panic),
            omitted_bytes: 0,
        });
        if let Some(reason) = aborter.reason(rank, &result) {
            aborter.abort(&reason);
        }
        // The task ends only with every call answered; it is dropped
        // unfinished only by an immediate shutdown.
        let mut results = futures::executor::block_on(rx).unwrap_or_else(|_| {
            (0..self.plan.ranks.len())
                .filter(|&r| r != rank)
                .map(|r| {
                    let shut_down = RpcError::ShutDown {
                        worker: self.plan.ranks[r].clone(),
                        function: RUN_STEP.name().to_owned(),
                    };
                    (r, Err(shut_down))
                })
                .collect()
        });
        results.push((rank, result));
        results
    }

    /// What tells every rank to stop `step`.
    fn aborter(&self, step: u64) -> Aborter {
        Aborter {
            agent: self.agent.clone(),
            ranks: self.plan.ranks.clone(),
            pipeline: self.id,
            step,
            timeout: self.timeout,
        }
    }

    fn control(&self, control: Control) -> Result<(), PipelineError> {
        let calls: Vec<_> = self
            .plan
            .ranks
            .iter()
            .map(|w| {
                CONTROL
                    .agent(&self.agent)
                    .timeout(self.timeout)
                    .rpc_async(w.as_str(), (self.id, control))
            })
            .collect();
        for (rank, call) in calls.into_iter().enumerate() {
            match call.wait() {
                Ok(Ok(())) => {}
                Ok(Err(failure)) => return Err(self.host_error(rank, failure)),
                Err(source) => return Err(self.worker_error(rank, source)),
            }
        }
        Ok(())
    }

    /// Steps every stage's optimizer with the gradients accumulated since
    /// the last [`zero_grad`](Self::zero_grad).
    pub fn optimizer_step(&self) -> Result<(), PipelineError> {
        self.control(Control::OptimizerStep)
    }

    /// Drops every stage's accumulated gradients.
    pub fn zero_grad(&self) -> Result<(), PipelineError> {
        self.control(Control::ZeroGrad)
    }

    fn tensors(&self, grads: bool) -> Result<Vec<Vec<Option<tch::Tensor>>>, PipelineError> {
        let mut per_stage: Vec<Vec<Option<tch::Tensor>>> = (0..self.plan.stage_to_rank.len())
            .map(|_| Vec::new())
            .collect();
        let calls: Vec<_> = self
            .plan
            .ranks
            .iter()
            .map(|w| {
                TENSORS
                    .agent(&self.agent)
                    .timeout(self.timeout)
                    .rpc_async(w.as_str(), (self.id, grads))
            })
            .collect();
        for (rank, call) in calls.into_iter().enumerate() {
            let list = match call.wait() {
                Ok(Ok(list)) => list,
                Ok(Err(failure)) => return Err(self.host_error(rank, failure)),
                Err(source) => return Err(self.worker_error(rank, source)),
            };
            for (stage, tensors) in list {
                if let Some(slot) = per_stage.get_mut(stage as usize) {
                    *slot = tensors
                        .into_iter()
                        .map(|t| t.map(Tensor::into_inner))
                        .collect();
                }
            }
        }
        Ok(per_stage)
    }

    /// A copy of every stage's parameters (those that require grad), per
    /// stage.
    pub fn parameters(&self) -> Result<Vec<Vec<tch::Tensor>>, PipelineError> {
        Ok(self
            .tensors(false)?
            .into_iter()
            .map(|list| list.into_iter().flatten().collect())
            .collect())
    }

    /// A copy of every stage's accumulated gradients, per stage and
    /// parameter (`None`: no gradient yet).
    pub fn gradients(&self) -> Result<Vec<Vec<Option<tch::Tensor>>>, PipelineError> {
        self.tensors(true)
    }
}

/// How far an error is from the root cause of a failed step (lower: closer).
fn blame(error: &PipelineError) -> u8 {
    match error {
        PipelineError::Stage { .. } => 0,
        PipelineError::Timeout { .. } => 1,
        PipelineError::Aborted { .. } => 3,
        _ => 2,
    }
}

/// The driver's error for a rank's failure.
/// A rank's answer to its step, or why none came.
type RankResult = Result<Result<StepReply, StepFailure>, RpcError>;

/// Tells every rank of a pipeline to stop a step.
#[derive(Clone)]
struct Aborter {
    agent: Agent,
    ranks: Vec<String>,
    pipeline: u64,
    step: u64,
    timeout: Duration,
}

impl Aborter {
    /// Why the step is to stop, if `rank`'s `result` is a failure.
    fn reason(&self, rank: usize, result: &RankResult) -> Option<String> {
        match result {
            Ok(Ok(_)) => None,
            Ok(Err(failure)) => {
                Some(failure_error(failure.clone(), self.pipeline, self.step).to_string())
            }
            Err(source) => Some(format!("worker {} failed: {source}", self.ranks[rank])),
        }
    }

    fn abort(&self, reason: &str) {
        for worker in &self.ranks {
            // Best effort: a rank that cannot be reached stops at its own
            // time limit.
            drop(ABORT.agent(&self.agent).timeout(self.timeout).rpc_async(
                worker.as_str(),
                Abort {
                    pipeline: self.pipeline,
                    step: self.step,
                    reason: reason.to_owned(),
                },
            ));
        }
    }
}

fn failure_error(failure: StepFailure, pipeline: u64, step: u64) -> PipelineError {
    match failure {
        StepFailure::Stage {
            stage,
            worker,
            action,
            microbatch,
            message,
        } => PipelineError::Stage {
            stage: stage as usize,
            worker,
            action,
            microbatch: microbatch.map(|m| m as usize),
            message,
        },
        StepFailure::Timeout {
            stage,
            worker,
            forward,
            microbatch,
            action,
            waiting_worker,
            limit_ms,
        } => PipelineError::Timeout {
            stage: stage as usize,
            worker,
            what: if forward {
                Awaited::Activation
            } else {
                Awaited::Gradient
            },
            microbatch: microbatch as usize,
            action,
            waiting_worker,
            limit: Duration::from_millis(limit_ms),
        },
        StepFailure::Aborted { worker, reason } => PipelineError::Aborted {
            worker,
            step,
            reason,
        },
        StepFailure::UnknownPipeline { worker } => {
            PipelineError::UnknownPipeline { worker, pipeline }
        }
    }
}

/// How long dropping a pipeline waits for each rank to drop its part when
/// the pipeline has no time limit (a zero [`PipelineBuilder::timeout`]).
pub const DROP_TIMEOUT: Duration = Duration::from_secs(60);

impl<O, I> Drop for Pipeline<O, I> {
    fn drop(&mut self) {
        // A hung worker must not hang the drop: bounded even without a
        // time limit of the pipeline's own.
        let bound = if self.timeout.is_zero() {
            DROP_TIMEOUT
        } else {
            self.timeout
        };
        let calls: Vec<_> = self
            .plan
            .ranks
            .iter()
            .map(|w| {
                CONTROL
                    .agent(&self.agent)
                    .timeout(bound)
                    .rpc_async(w.as_str(), (self.id, Control::Destroy))
            })
            .collect();
        for call in calls {
            // A worker that is gone has nothing left to drop.
            let _ = call.wait();
        }
    }
}

impl<O, I> std::fmt::Debug for Pipeline<O, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("id", &format_args!("{:#x}", self.id))
            .field("workers", &self.plan.ranks)
            .field("stage_to_rank", &self.plan.stage_to_rank)
            .field("microbatches", &self.microbatches)
            .finish_non_exhaustive()
    }
}
