//! The worker side: the registry of stage constructors and losses, the
//! pipelines' ranks living on this worker, and the remote functions the
//! driver and the other stages call.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use ferry_autograd::optim::{LocalOptimizer, OptimizerKind};
use ferry_rpc::{Agent, Functions, RpcOptions};
use ferry_schedule::Action;
use ferry_tch::Tensor;
use ferry_transport::spin::HostCores;
use parking_lot::Mutex;

use crate::actor::RankActor;
use crate::protocol::{
    Abort, Control, CreateRank, HostFailure, RunStep, StageTensors, StepFailure, StepReply, ABORT,
    CONTROL, CREATE, DELIVER, RUN_STEP, TENSORS,
};
use crate::slot::StageSlot;
use crate::stage::Stages;

/// This worker's pipeline layer: what it can build and what it runs.
pub struct PipelineHost {
    stages: Stages,
    ranks: Mutex<HashMap<u64, Arc<RankActor>>>,
}

impl PipelineHost {
    fn rank(&self, pipeline: u64) -> Option<Arc<RankActor>> {
        self.ranks.lock().get(&pipeline).cloned()
    }

    /// How many pipeline ranks live on this worker (dropped pipelines
    /// leave none behind).
    pub fn live_ranks(&self) -> usize {
        self.ranks.lock().len()
    }

    fn create(&self, agent: &Agent, request: CreateRank) -> Result<(), HostFailure> {
        let worker = agent.worker_info().name.clone();
        let program = request
            .program
            .iter()
            .map(|text| {
                text.parse::<Action>()
                    .map_err(|e| HostFailure::Malformed(format!("action {text:?}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let optimizer: Option<OptimizerKind> = match &request.optimizer {
            Some(bytes) => Some(
                postcard::from_bytes(bytes)
                    .map_err(|e| HostFailure::Malformed(format!("optimizer: {e}")))?,
            ),
            None => None,
        };
        let mut slots = BTreeMap::new();
        for init in request.stages {
            let stage = init.stage as usize;
            let builder = self.stages.builders.get(&init.constructor).ok_or_else(|| {
                HostFailure::NotRegistered {
                    loss: false,
                    name: init.constructor.clone(),
                }
            })?;
            let (bytes, tensors) = init.args.into_parts();
            let built = builder(&bytes, tensors).map_err(|e| HostFailure::Construct {
                stage: init.stage,
                constructor: init.constructor.clone(),
                message: ferry_rpc::error_text(&*e),
            })?;
            let mut slot = StageSlot::new(built);
            if let Some(kind) = &optimizer {
                let params = slot.params.iter().map(|p| p.shallow_clone()).collect();
                slot.optimizer = Some(LocalOptimizer::new(kind.clone(), params).map_err(|e| {
                    HostFailure::Optimizer {
                        stage: init.stage,
                        message: e.to_string(),
                    }
                })?);
            }
            slots.insert(stage, slot);
        }
        let loss = match &request.loss {
            Some(name) => Some(self.stages.losses.get(name).cloned().ok_or_else(|| {
                HostFailure::NotRegistered {
                    loss: true,
                    name: name.clone(),
                }
            })?),
            None => None,
        };
        let local_stages = slots.keys().copied().collect();
        let actor = RankActor {
            pipeline: request.pipeline,
            rank: request.rank as usize,
            worker,
            stage_workers: request.stage_workers,
            program,
            microbatches: request.microbatches as usize,
            loss,
            scale_grads: request.scale_grads,
            slots: Mutex::new(slots),
            local_stages,
            mailbox: Default::default(),
            wait_spin: Duration::from_micros(request.wait_spin_us),
            host_cores: match request.spare_cores {
                Some(true) => HostCores::Spare,
                Some(false) => HostCores::Scarce,
                None => crate::actor::host_cores(agent),
            },
        };
        tracing::debug!(worker = %actor.worker, pipeline = request.pipeline, rank = actor.rank, stages = ?actor.local_stages, "pipeline rank created");
        self.ranks.lock().insert(request.pipeline, Arc::new(actor));
        Ok(())
    }

    pub(crate) fn run_step(
        &self,
        agent: &Agent,
        request: RunStep,
    ) -> Result<StepReply, StepFailure> {
        let Some(actor) = self.rank(request.pipeline) else {
            return Err(StepFailure::UnknownPipeline {
                worker: agent.worker_info().name.clone(),
            });
        };
        actor.run_step(agent, request)
    }

    fn control(&self, pipeline: u64, control: Control) -> Result<(), HostFailure> {
        if let Control::Destroy = control {
            self.ranks.lock().remove(&pipeline);
            return Ok(());
        }
        let actor = self.rank(pipeline).ok_or(HostFailure::UnknownPipeline)?;
        let mut slots = actor.slots.lock();
        for (&stage, slot) in slots.iter_mut() {
            match control {
                Control::OptimizerStep => {
                    if slot.optimizer.is_none() {
                        return Err(HostFailure::NoOptimizer);
                    }
                    slot.optimizer_step().map_err(|e| HostFailure::Optimizer {
                        stage: stage as u32,
                        message: e.to_string(),
                    })?;
                }
                Control::ZeroGrad => slot.zero_grad(),
                Control::Destroy => {}
            }
        }
        Ok(())
    }

    fn tensors(&self, pipeline: u64, grads: bool) -> Result<StageTensors, HostFailure> {
        let actor = self.rank(pipeline).ok_or(HostFailure::UnknownPipeline)?;
        let mut slots = actor.slots.lock();
        if grads {
            for (&stage, slot) in slots.iter_mut() {
                slot.settle().map_err(|e| HostFailure::Gradients {
                    stage: stage as u32,
                    message: e.to_string(),
                })?;
            }
        }
        Ok(slots
            .iter()
            .map(|(&stage, slot)| {
                let list = if grads {
                    slot.grads
                        .iter()
                        .map(|g| g.as_ref().map(|g| Tensor::from(g.copy())))
                        .collect()
                } else {
                    slot.params
                        .iter()
                        .map(|p| Some(Tensor::from(p.detach().copy())))
                        .collect()
                };
                (stage as u32, list)
            })
            .collect())
    }
}

fn agent() -> Result<Agent, String> {
    Agent::current()
        .ok_or(())
        .or_else(|()| ferry_rpc::agent())
        .map_err(|e| format!("no agent: {e}"))
}

/// Installs the pipeline layer on a worker's options: the stage
/// constructors and losses this worker can run (`stages`), and the remote
/// functions through which drivers build and run pipelines on it. The
/// facade's `ferry::init_rpc` installs an empty registry where this was not
/// called.
///
/// It changes nothing outside `options`: keeping freed tensor memory for
/// the next microbatch, which retunes the process's allocator, is a
/// separate choice ([`retain_freed_memory`](crate::retain_freed_memory)).
pub fn install(options: &mut RpcOptions, stages: Stages) -> Arc<PipelineHost> {
    let host = Arc::new(PipelineHost {
        stages,
        ranks: Mutex::new(HashMap::new()),
    });
    ferry_tch::install(options);
    options.hooks.layer(host.clone());
    register(&mut options.functions, host.clone());
    host
}

fn register(functions: &mut Functions, host: Arc<PipelineHost>) {
    let h = host.clone();
    functions.add(CREATE, move |request: CreateRank| {
        h.create(&agent().map_err(HostFailure::NoAgent)?, request)
    });
    let h = host.clone();
    functions.add(RUN_STEP, move |request: RunStep| match agent() {
        Ok(agent) => h.run_step(&agent, request),
        Err(reason) => Err(StepFailure::Aborted {
            worker: String::new(),
            reason,
        }),
    });
    let h = host.clone();
    functions.add(DELIVER, move |message| {
        let result = match h.rank(message.pipeline) {
            Some(actor) => actor.deliver(message),
            None => Err(format!(
                "no pipeline {:#x} on this worker",
                message.pipeline
            )),
        };
        std::future::ready(Ok::<_, std::convert::Infallible>(result))
    });
    let h = host.clone();
    functions.add(ABORT, move |abort: Abort| {
        if let Some(actor) = h.rank(abort.pipeline) {
            actor.mailbox.abort(abort.step, &abort.reason);
        }
        std::future::ready(Ok::<_, std::convert::Infallible>(()))
    });
    let h = host.clone();
    functions.add(CONTROL, move |(pipeline, control)| {
        h.control(pipeline, control)
    });
    let h = host;
    functions.add(TENSORS, move |(pipeline, grads)| h.tensors(pipeline, grads));
}
