//! A rank of a pipeline on its worker: its stages, its lowered action list,
//! and the loop that runs the list once per step.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ferry_rpc::{Agent, RpcFuture};
use ferry_schedule::{Action, ActionKind};
use ferry_tch::tree::Flat;
use ferry_tch::Tensor;
use ferry_transport::spin::HostCores;
use parking_lot::Mutex;

use crate::erased::ErasedLoss;
use crate::fault::{guarded, Fault};
use crate::mailbox::{Direction, Key, Mailbox, WaitError};
use crate::protocol::{
    ActionSpan, Deliver, HandOffStamps, Packet, RunStep, StepFailure, StepReply, DELIVER,
};
use crate::slot::{Saved, StageSlot};

/// A value waiting for one of this rank's stages, with when it was sent
/// and when it arrived (ns since the Unix epoch; both "now" for a value
/// handed over in memory).
pub(crate) struct Arrival {
    pub value: Delivery,
    pub sent_ns: u64,
    pub received_ns: u64,
    /// Whether it came from another worker.
    pub remote: bool,
}

/// A value for one of this rank's stages.
pub(crate) enum Delivery {
    /// An activation: the flattened value.
    Activation(Vec<u8>, Vec<tch::Tensor>),
    /// Gradients for the tensors of an activation this stage sent.
    Grads(Vec<Option<tch::Tensor>>),
}

/// One rank of one pipeline.
pub(crate) struct RankActor {
    pub pipeline: u64,
    pub rank: usize,
    pub worker: String,
    pub stage_workers: Vec<String>,
    pub program: Vec<Action>,
    pub microbatches: usize,
    pub loss: Option<Arc<dyn ErasedLoss>>,
    pub scale_grads: bool,
    pub slots: Mutex<BTreeMap<usize, StageSlot>>,
    /// The stages in `slots` (fixed at creation; read without the lock,
    /// which a running step holds during compute).
    pub local_stages: Vec<usize>,
    pub mailbox: Mailbox<Arrival>,
    /// How long a wait for an input polls before it sleeps
    /// ([`PipelineBuilder::wait_spin`](crate::PipelineBuilder::wait_spin)).
    pub wait_spin: Duration,
    /// Whether the host has cores to spare: as the driver said
    /// ([`PipelineBuilder::host_cores`](crate::PipelineBuilder::host_cores)),
    /// else [`host_cores`] when the rank was built.
    pub host_cores: HostCores,
}

/// A failure inside a step, before it is named for the driver.
struct Failed {
    action: Action,
    fault: Fault,
}

/// What one step carries from action to action.
struct StepRun<'a> {
    agent: &'a Agent,
    step: u64,
    train: bool,
    limit: Duration,
    inputs: Vec<Option<Packet>>,
    targets: Vec<Option<tch::Tensor>>,
    /// What each microbatch's loss gradient is multiplied by: its share of
    /// the targets' rows times the microbatch count (1 when they split
    /// evenly, or without `scale_grads`).
    loss_weights: Vec<f64>,
    /// Whether the last stage returns its outputs.
    return_outputs: bool,
    /// Values made by a compute action and sent by a later SEND action.
    outbox: HashMap<(usize, Direction, usize), Deliver>,
    sends: Vec<(Action, RpcFuture<Result<(), String>>)>,
    losses: Vec<(u32, f64)>,
    outputs: Vec<(u32, Packet)>,
    /// When the running compute action got its input (its span starts
    /// there: the wait before is idle time, not compute).
    computing_since: Option<u64>,
    /// Whether to record hand-offs (the timeline was asked for).
    trace: bool,
    /// The values received from other workers: their stamps, the start
    /// filled in when the action that took one starts.
    handoffs: Vec<HandOffStamps>,
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Whether this host has a core for each of its workers' compute threads
/// (libtorch's intra-op threads), its waiting stage and its ring reader.
pub(crate) fn host_cores(agent: &Agent) -> HostCores {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let processes = agent.local_topology().local_world_size as usize;
    let compute_threads = usize::try_from(tch::get_num_threads()).unwrap_or(1);
    HostCores::of(cores, processes, compute_threads)
}

impl RankActor {
    fn last_stage(&self) -> usize {
        self.stage_workers.len() - 1
    }

    fn is_local(&self, stage: usize) -> bool {
        self.local_stages.contains(&stage)
    }

    /// Runs the rank's actions for one step.
    pub(crate) fn run_step(
        &self,
        agent: &Agent,
        request: RunStep,
    ) -> Result<StepReply, StepFailure> {
        let step = request.step;
        // The stages compute between their messages: while the step runs,
        // this process's ring readers give the cores back after a short
        // spin where the host is short of cores, and poll while an input is
        // awaited where it is not (see `compute_bound`).
        let _compute_bound = ferry_transport::spin::compute_bound(self.host_cores);
        let span =
            tracing::debug_span!("pipeline step", worker = %self.worker, rank = self.rank, step);
        let _span = span.enter();
        if let Some(reason) = self.mailbox.aborted(step) {
            return Err(StepFailure::Aborted {
                worker: self.worker.clone(),
                reason,
            });
        }
        let mut run = StepRun {
            agent,
            step,
            train: request.train,
            // Zero: no time limit, as for an RPC timeout.
            limit: match request.wait_limit_ms {
                0 => NO_LIMIT,
                ms => Duration::from_millis(ms),
            },
            loss_weights: loss_weights(&request.targets, self.scale_grads),
            inputs: request.inputs.into_iter().map(Some).collect(),
            targets: request
                .targets
                .into_iter()
                .map(|t| Some(t.into_inner()))
                .collect(),
            return_outputs: request.outputs,
            outbox: HashMap::new(),
            sends: Vec::new(),
            losses: Vec::new(),
            outputs: Vec::new(),
            computing_since: None,
            trace: request.trace,
            handoffs: Vec::new(),
        };
        let mut spans = Vec::new();
        let result = (|| -> Result<(), Failed> {
            for (index, action) in self.program.iter().enumerate() {
                if !run.train && !runs_in_eval(action) {
                    continue;
                }
                let start = now_ns();
                self.execute(&mut run, action)?;
                let start = run.computing_since.take().unwrap_or(start);
                // The values this action received: it started with them.
                for handoff in run.handoffs.iter_mut().rev() {
                    if handoff.started_ns != 0 {
                        break;
                    }
                    handoff.started_ns = start;
                }
                if request.trace {
                    spans.push(ActionSpan {
                        index: index as u32,
                        start_ns: start,
                        end_ns: now_ns(),
                    });
                }
            }
            for (action, send) in std::mem::take(&mut run.sends) {
                let delivered = send.wait().map_err(|e| e.to_string()).and_then(|r| r);
                delivered.map_err(|message| Failed {
                    action,
                    fault: Fault::Failed(format!("the send was not delivered: {message}")),
                })?;
            }
            Ok(())
        })();
        // Whatever happened, nothing of this step stays behind.
        let mut slots = self.slots.lock();
        for slot in slots.values_mut() {
            slot.saved.clear();
            slot.backwards = 0;
        }
        drop(slots);
        match result {
            Ok(()) => {
                self.mailbox.finish(step);
                Ok(StepReply {
                    losses: run.losses,
                    outputs: run.outputs,
                    spans,
                    handoffs: run.handoffs,
                })
            }
            Err(failed) => {
                let message = failed.fault.to_string();
                self.mailbox.abort(step, &message);
                let Failed { action, fault } = failed;
                tracing::warn!(%action, error = %message, "pipeline step failed");
                Err(match fault {
                    Fault::Aborted(reason) => StepFailure::Aborted {
                        worker: self.worker.clone(),
                        reason,
                    },
                    Fault::Missing {
                        from,
                        forward,
                        microbatch,
                        limit,
                    } => StepFailure::Timeout {
                        stage: from as u32,
                        worker: self.stage_workers.get(from).cloned().unwrap_or_default(),
                        forward,
                        microbatch: microbatch as u32,
                        action: action.to_string(),
                        waiting_worker: self.worker.clone(),
                        limit_ms: u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
                    },
                    Fault::Failed(message) => StepFailure::Stage {
                        stage: action.stage() as u32,
                        worker: self.worker.clone(),
                        action: action.to_string(),
                        microbatch: action.microbatch().map(|m| m as u32),
                        message,
                    },
                })
            }
        }
    }

    fn execute(&self, run: &mut StepRun<'_>, action: &Action) -> Result<(), Failed> {
        let fail = |fault: Fault| Failed {
            action: action.clone(),
            fault,
        };
        let stage = action.stage();
        let mb = action.microbatch();
        match action.kind() {
            ActionKind::OverlapFB => {
                for sub in action.sub_actions() {
                    if run.train || runs_in_eval(sub) {
                        self.execute(run, sub)?;
                    }
                }
                Ok(())
            }
            ActionKind::Forward => self.forward(run, stage, mb.unwrap_or(0)).map_err(fail),
            ActionKind::FullBackward => guarded("backward", || {
                self.backward(run, stage, mb.unwrap_or(0), Part::Full)
            })
            .map_err(fail),
            ActionKind::BackwardInput => guarded("backward", || {
                self.backward(run, stage, mb.unwrap_or(0), Part::Input)
            })
            .map_err(fail),
            ActionKind::BackwardWeight => guarded("backward", || {
                self.backward(run, stage, mb.unwrap_or(0), Part::Weight)
            })
            .map_err(fail),
            ActionKind::SendF | ActionKind::SendB => {
                let (direction, to) = if action.kind() == ActionKind::SendF {
                    (Direction::Forward, stage + 1)
                } else {
                    (Direction::Backward, stage.wrapping_sub(1))
                };
                let mb = mb.unwrap_or(0);
                let message = run
                    .outbox
                    .remove(&(stage, direction, mb))
                    .ok_or_else(|| fail(format!("nothing to send: the compute action for microbatch {mb} has not run on this rank").into()))?;
                let worker = self
                    .stage_workers
                    .get(to)
                    .ok_or_else(|| fail(format!("there is no stage {to} to send to").into()))?;
                let mut message = message;
                message.sent_ns = now_ns();
                let send = DELIVER
                    .agent(run.agent)
                    .timeout(run.limit)
                    .rpc_async(worker.as_str(), message);
                run.sends.push((action.clone(), send));
                Ok(())
            }
            // Receives are posted from the start: values wait in the
            // mailbox and the compute action takes its own.
            ActionKind::RecvF | ActionKind::RecvB => Ok(()),
            // No sharding and no data parallelism inside a pipeline.
            ActionKind::Unshard | ActionKind::Reshard | ActionKind::ReduceGrad => Ok(()),
        }
    }

    /// Takes the value `key` names, waiting for it.
    fn receive(&self, run: &mut StepRun<'_>, key: Key) -> Result<Delivery, Fault> {
        let asked_ns = if run.trace { now_ns() } else { 0 };
        let arrival = self
            .mailbox
            .take(key, run.limit, self.wait_spin)
            .map_err(|e| match e {
                WaitError::Aborted(reason) => Fault::Aborted(reason),
                WaitError::TimedOut(limit) => {
                    let forward = key.direction == Direction::Forward;
                    let from = if forward {
                        key.stage.wrapping_sub(1)
                    } else {
                        key.stage + 1
                    };
                    Fault::Missing {
                        from,
                        forward,
                        microbatch: key.microbatch,
                        limit,
                    }
                }
            })?;
        if run.trace && arrival.remote {
            run.handoffs.push(HandOffStamps {
                stage: key.stage as u32,
                microbatch: key.microbatch as u32,
                forward: key.direction == Direction::Forward,
                sent_ns: arrival.sent_ns,
                received_ns: arrival.received_ns,
                asked_ns,
                started_ns: 0,
            });
        }
        Ok(arrival.value)
    }

    fn forward(&self, run: &mut StepRun<'_>, stage: usize, mb: usize) -> Result<(), Fault> {
        let (bytes, tensors) = if stage == 0 {
            let input = run
                .inputs
                .get_mut(mb)
                .and_then(Option::take)
                .ok_or_else(|| {
                    format!(
                        "no input for microbatch {mb} (this rank got {} microbatches)",
                        run.inputs.len()
                    )
                })?;
            input.into_parts()
        } else {
            let key = Key {
                step: run.step,
                stage,
                direction: Direction::Forward,
                microbatch: mb,
            };
            match self.receive(run, key)? {
                Delivery::Activation(bytes, tensors) => (bytes, tensors),
                Delivery::Grads(_) => {
                    return Err("a gradient arrived where an activation was expected".into())
                }
            }
        };
        run.computing_since.get_or_insert_with(now_ns);
        let mut saved = Saved::default();
        let tensors: Vec<tch::Tensor> = if run.train && stage > 0 {
            tensors
                .into_iter()
                .map(|t| {
                    if t.is_floating_point() {
                        let leaf = t.set_requires_grad(true);
                        saved.leaves.push(Some(leaf.shallow_clone()));
                        leaf
                    } else {
                        saved.leaves.push(None);
                        t
                    }
                })
                .collect()
        } else {
            tensors
        };
        let mut slots = self.slots.lock();
        let slot = slots
            .get_mut(&stage)
            .ok_or_else(|| format!("stage {stage} is not on this rank"))?;
        let output: Flat = guarded("forward", || {
            if run.train {
                slot.stage.forward(&bytes, tensors)
            } else {
                tch::no_grad(|| slot.stage.forward(&bytes, tensors))
            }
            .map_err(|e| format!("forward failed: {}", ferry_rpc::error_text(&*e)).into())
        })?;
        if stage == self.last_stage() {
            if run.return_outputs {
                let copy = Flat {
                    bytes: output.bytes.clone(),
                    tensors: output.tensors.iter().map(|t| t.shallow_clone()).collect(),
                };
                run.outputs.push((mb as u32, Packet::detached(copy)));
            }
            let Some(target) = run.targets.get_mut(mb).and_then(Option::take) else {
                if run.train {
                    return Err(format!("no target for microbatch {mb}").into());
                }
                // An evaluation without targets: no loss.
                return Ok(());
            };
            let loss_fn = self
                .loss
                .as_ref()
                .ok_or("the last stage has no loss function")?;
            let loss = guarded("the loss", || {
                let compute = || {
                    loss_fn
                        .loss(&output.bytes, output.tensors, Tensor::from(target))
                        .map_err(|e| {
                            format!("the loss failed: {}", ferry_rpc::error_text(&*e)).into()
                        })
                };
                if run.train {
                    compute()
                } else {
                    tch::no_grad(compute)
                }
            })?;
            if loss.numel() != 1 {
                return Err(format!(
                    "the loss must be a single number, not a tensor of shape {:?}",
                    loss.size()
                )
                .into());
            }
            run.losses.push((mb as u32, loss.double_value(&[])));
            if run.train {
                let seed = match run.loss_weights.get(mb) {
                    Some(&w) if w != 1.0 => loss.ones_like() * w,
                    _ => loss.ones_like(),
                };
                saved.seeds = Some(vec![seed]);
                saved.roots = vec![loss];
                saved.root_positions = vec![0];
                slot.saved.insert(mb, saved);
            }
            return Ok(());
        }
        if run.train {
            for (position, t) in output.tensors.iter().enumerate() {
                if t.requires_grad() {
                    saved.roots.push(t.shallow_clone());
                    saved.root_positions.push(position);
                }
            }
            slot.saved.insert(mb, saved);
        }
        drop(slots);
        let packet = Packet::detached(output);
        if self.is_local(stage + 1) {
            // Same worker: handed over in memory.
            let (bytes, tensors) = packet.into_parts();
            self.put_local(
                run.step,
                stage + 1,
                Direction::Forward,
                mb,
                Delivery::Activation(bytes, tensors),
            )
        } else {
            run.outbox.insert(
                (stage, Direction::Forward, mb),
                Deliver {
                    pipeline: self.pipeline,
                    step: run.step,
                    stage: (stage + 1) as u32,
                    forward: true,
                    microbatch: mb as u32,
                    activation: Some(packet),
                    grads: Vec::new(),
                    sent_ns: 0,
                },
            );
            Ok(())
        }
    }

    fn put_local(
        &self,
        step: u64,
        stage: usize,
        direction: Direction,
        mb: usize,
        value: Delivery,
    ) -> Result<(), Fault> {
        let key = Key {
            step,
            stage,
            direction,
            microbatch: mb,
        };
        let now = now_ns();
        let value = Arrival {
            value,
            sent_ns: now,
            received_ns: now,
            remote: false,
        };
        self.mailbox
            .put(key, value)
            .map(|_| ())
            .map_err(|_| format!("microbatch {mb} was handed to stage {stage} twice").into())
    }

    fn backward(
        &self,
        run: &mut StepRun<'_>,
        stage: usize,
        mb: usize,
        part: Part,
    ) -> Result<(), Fault> {
        let last = stage == self.last_stage();
        // The gradients of this stage's outputs.
        let needs_seeds = {
            let slots = self.slots.lock();
            let slot = slots
                .get(&stage)
                .ok_or_else(|| format!("stage {stage} is not on this rank"))?;
            let saved = slot
                .saved
                .get(&mb)
                .ok_or_else(|| format!("microbatch {mb} has no forward state on stage {stage} (F did not run, or its backward already did)"))?;
            saved.seeds.is_none()
        };
        let received = if needs_seeds && !last {
            let key = Key {
                step: run.step,
                stage,
                direction: Direction::Backward,
                microbatch: mb,
            };
            match self.receive(run, key)? {
                Delivery::Grads(grads) => Some(grads),
                Delivery::Activation(..) => {
                    return Err("an activation arrived where a gradient was expected".into())
                }
            }
        } else {
            None
        };
        run.computing_since.get_or_insert_with(now_ns);
        let mut slots = self.slots.lock();
        let slot = slots
            .get_mut(&stage)
            .ok_or_else(|| format!("stage {stage} is not on this rank"))?;
        let mut saved = slot.saved.remove(&mb).ok_or("forward state vanished")?;
        if let Some(grads) = received {
            // Keep the roots whose output got a gradient.
            let mut roots = Vec::new();
            let mut seeds = Vec::new();
            for (root, &position) in saved.roots.iter().zip(&saved.root_positions) {
                match grads.get(position) {
                    Some(Some(g)) => {
                        roots.push(root.shallow_clone());
                        seeds.push(g.shallow_clone());
                    }
                    Some(None) => {}
                    None => {
                        return Err(format!(
                            "{} gradients arrived for an output of {} tensors",
                            grads.len(),
                            saved.root_positions.len()
                        )
                        .into())
                    }
                }
            }
            saved.roots = roots;
            saved.seeds = Some(seeds);
        }
        let seeds: Vec<tch::Tensor> = saved
            .seeds
            .as_ref()
            .map(|s| s.iter().map(|t| t.shallow_clone()).collect())
            .unwrap_or_default();
        let leaves: Vec<tch::Tensor> = saved
            .leaves
            .iter()
            .flatten()
            .map(|t| t.shallow_clone())
            .collect();
        let (want_inputs, want_params) = match part {
            Part::Full => (true, true),
            Part::Input => (true, false),
            Part::Weight => (false, true),
        };
        let want_inputs = want_inputs && stage > 0 && !leaves.is_empty();
        let mut inputs: Vec<tch::Tensor> = Vec::new();
        if want_inputs {
            inputs.extend(leaves.iter().map(|t| t.shallow_clone()));
        }
        if want_params {
            inputs.extend(slot.params.iter().map(|t| t.shallow_clone()));
        }
        let failed = |e: ferry_autograd::AutogradError| format!("backward failed: {e}");
        // B and W add into the accumulated gradients in place: a deferred
        // scale_grads division goes first.
        if want_params {
            slot.settle()
                .map_err(|e| format!("cannot scale gradients: {e}"))?;
        }
        let grads: Vec<Option<tch::Tensor>> = if saved.roots.is_empty() || inputs.is_empty() {
            (0..inputs.len()).map(|_| None).collect()
        } else {
            match part {
                // I: the input gradients, and what W needs to reach the
                // parameters without going through the input path again.
                Part::Input => {
                    let params: Vec<tch::Tensor> =
                        slot.params.iter().map(|t| t.shallow_clone()).collect();
                    let (grads, weight) =
                        ferry_autograd::backward_input(&saved.roots, &seeds, &inputs, &params)
                            .map_err(failed)?;
                    saved.weight = Some(weight);
                    grads
                }
                Part::Weight => match saved.weight.take() {
                    // Linear layers' weight gradients go straight into the
                    // accumulated ones; the rest comes back to add below.
                    Some(weight) => weight
                        .run_accumulating(&saved.roots, &seeds, &inputs, &mut slot.grads)
                        .map_err(failed)?,
                    // Stage 0 (no I ran): the whole backward, weights only,
                    // linear layers' straight into the accumulated ones.
                    None => ferry_autograd::grad_accumulating(
                        &saved.roots,
                        &seeds,
                        &inputs,
                        &mut slot.grads,
                    )
                    .map_err(failed)?,
                },
                // B: linear layers' weight gradients go straight into the
                // accumulated ones; the rest comes back to add below.
                Part::Full => {
                    let mut accumulated: Vec<Option<tch::Tensor>> = (0..inputs.len()
                        - slot.params.len())
                        .map(|_| None)
                        .collect();
                    accumulated.extend(
                        slot.grads
                            .iter()
                            .map(|g| g.as_ref().map(tch::Tensor::shallow_clone)),
                    );
                    ferry_autograd::grad_accumulating(
                        &saved.roots,
                        &seeds,
                        &inputs,
                        &mut accumulated,
                    )
                    .map_err(failed)?
                }
            }
        };
        let mut grads = grads.into_iter();
        let input_grads: Vec<Option<tch::Tensor>> = if want_inputs {
            // Back in the order the tensors arrived, `None` where no leaf.
            let mut per_leaf = grads.by_ref().take(leaves.len());
            saved
                .leaves
                .iter()
                .map(|leaf| leaf.as_ref().and_then(|_| per_leaf.next().flatten()))
                .collect()
        } else {
            Vec::new()
        };
        if want_params {
            slot.accumulate(grads)
                .map_err(|e| format!("cannot accumulate gradients: {e}"))?;
            slot.backwards += 1;
            if slot.backwards == self.microbatches && self.scale_grads {
                slot.scale(self.microbatches as f64);
            }
        } else {
            // I: the graph stays for W.
            saved.leaves.clear();
            slot.saved.insert(mb, saved);
        }
        drop(slots);
        if matches!(part, Part::Weight) || stage == 0 {
            return Ok(());
        }
        let grads = if want_inputs {
            input_grads
        } else {
            // No input gradient: the previous stage's outputs get none.
            Vec::new()
        };
        if self.is_local(stage - 1) {
            self.put_local(
                run.step,
                stage - 1,
                Direction::Backward,
                mb,
                Delivery::Grads(grads),
            )
        } else {
            run.outbox.insert(
                (stage, Direction::Backward, mb),
                Deliver {
                    pipeline: self.pipeline,
                    step: run.step,
                    stage: (stage - 1) as u32,
                    forward: false,
                    microbatch: mb as u32,
                    activation: None,
                    grads: grads.into_iter().map(|g| g.map(Tensor::from)).collect(),
                    sent_ns: 0,
                },
            );
            Ok(())
        }
    }

    /// Takes a value another worker sent.
    pub(crate) fn deliver(&self, message: Deliver) -> Result<(), String> {
        let direction = if message.forward {
            Direction::Forward
        } else {
            Direction::Backward
        };
        let stage = message.stage as usize;
        if !self.is_local(stage) {
            return Err(format!("stage {stage} is not on worker {}", self.worker));
        }
        let value = match (direction, message.activation) {
            (Direction::Forward, Some(packet)) => {
                let (bytes, tensors) = packet.into_parts();
                Delivery::Activation(bytes, tensors)
            }
            (Direction::Forward, None) => return Err("an activation without a value".into()),
            (Direction::Backward, _) => Delivery::Grads(
                message
                    .grads
                    .into_iter()
                    .map(|g| g.map(Tensor::into_inner))
                    .collect(),
            ),
        };
        let key = Key {
            step: message.step,
            stage,
            direction,
            microbatch: message.microbatch as usize,
        };
        let value = Arrival {
            value,
            sent_ns: message.sent_ns,
            received_ns: now_ns(),
            remote: true,
        };
        self.mailbox.put(key, value).map(|_| ()).map_err(|_| {
            format!(
                "a second {direction:?} value for stage {stage}, microbatch {} of step {}",
                message.microbatch, message.step
            )
        })
    }
}

/// A wait "without a time limit": long enough never to end first, short
/// enough to add to an `Instant`.
const NO_LIMIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// Which part of a backward an action runs.
#[derive(Clone, Copy)]
enum Part {
    /// B: input and weight gradients.
    Full,
    /// I: input gradients, keeping the graph for W.
    Input,
    /// W: weight gradients.
    Weight,
}

/// The loss gradient's weight of every microbatch (see
/// [`StepRun::loss_weights`]): `rows × microbatches / batch rows` under
/// `scale_grads`, where rows are the targets' (dimension 0; 1 for a
/// 0-dimensional target).
fn loss_weights(targets: &[Tensor], scale_grads: bool) -> Vec<f64> {
    let rows: Vec<i64> = targets
        .iter()
        .map(|t| t.size().first().copied().unwrap_or(1))
        .collect();
    let total: i64 = rows.iter().sum();
    let m = rows.len() as f64;
    rows.iter()
        .map(|&r| {
            if scale_grads && total > 0 {
                r as f64 * m / total as f64
            } else {
                1.0
            }
        })
        .collect()
}

/// Whether `action` runs when evaluating (forward only).
fn runs_in_eval(action: &Action) -> bool {
    match action.kind() {
        ActionKind::Forward | ActionKind::SendF | ActionKind::RecvF => true,
        ActionKind::OverlapFB => action.sub_actions().iter().any(runs_in_eval),
        _ => false,
    }
}
