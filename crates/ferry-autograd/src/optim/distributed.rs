//! [`DistributedOptimizer`]: one [`LocalOptimizer`] per owner of the
//! parameters, stepped remotely with a context's gradients.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ferry_rpc::{Agent, Function, Functions};
use ferry_rref::RRef;
use ferry_tch::Tensor;
use parking_lot::Mutex;

use super::custom::{self, CustomOptimizer, Spec};
use super::{LocalOptimizer, OptimError, OptimizerKind, OptimizerSpec};
use crate::engine_shim::tensor_id;
use crate::{container_of, AutogradError};

/// Builds a built-in optimizer's part on an owner: (id, kind, parameters).
const NEW: Function<(u64, OptimizerKind, Vec<RRef<Tensor>>), ()> =
    Function::new("ferry_autograd::optimizer_new");
/// Steps an owner's part: (id, context id).
const STEP: Function<(u64, u64), ()> = Function::new("ferry_autograd::optimizer_step");
/// Drops an owner's part: its id.
const DROP: Function<u64, ()> = Function::new("ferry_autograd::optimizer_drop");

/// One distributed optimizer's part on an owner: a built-in optimizer or
/// a user-defined class's.
pub(crate) enum Owned {
    Builtin(LocalOptimizer),
    Custom(CustomOptimizer),
}

impl From<CustomOptimizer> for Owned {
    fn from(custom: CustomOptimizer) -> Self {
        Owned::Custom(custom)
    }
}

impl Owned {
    fn params(&self) -> &[tch::Tensor] {
        match self {
            Owned::Builtin(o) => o.params(),
            Owned::Custom(o) => o.params(),
        }
    }

    fn step(&mut self, grads: &[Option<tch::Tensor>]) -> Result<(), OptimError> {
        match self {
            Owned::Builtin(o) => o.step(grads),
            Owned::Custom(o) => o.step(grads),
        }
    }
}

/// The local optimizers living on this worker, by id.
#[derive(Default)]
pub(crate) struct LocalOptimizers {
    optimizers: Mutex<HashMap<u64, Arc<Mutex<Owned>>>>,
    /// Serialises every step on this worker (PyTorch's `_LocalOptimizer.global_lock`):
    /// concurrent distributed optimizers over the same parameters apply
    /// their updates one at a time.
    step_lock: Mutex<()>,
}

impl LocalOptimizers {
    /// Keeps distributed optimizer `id`'s part on this worker.
    pub(crate) fn insert(&self, id: u64, owned: impl Into<Owned>) {
        self.optimizers
            .lock()
            .insert(id, Arc::new(Mutex::new(owned.into())));
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// Registers the remote functions the distributed optimizer calls on owners.
pub(crate) fn register(functions: &mut Functions) {
    functions.add(
        NEW,
        |(id, kind, params): (u64, OptimizerKind, Vec<RRef<Tensor>>)| {
            let agent = Agent::current().ok_or("no agent")?;
            let container = container_of(&agent).map_err(|e| e.to_string())?;
            let mut tensors = Vec::with_capacity(params.len());
            for p in &params {
                let v = p.local_value().map_err(|e| e.to_string())?;
                tensors.push(v.0.shallow_clone());
            }
            let local = LocalOptimizer::new(kind, tensors).map_err(|e| e.to_string())?;
            container.optimizers.insert(id, Owned::Builtin(local));
            Ok::<_, String>(())
        },
    );
    functions.add(STEP, |(id, context_id): (u64, u64)| {
        let agent = Agent::current().ok_or("no agent")?;
        step_local(&agent, id, context_id)
    });
    functions.add(DROP, |id: u64| {
        if let Some(container) = Agent::current().and_then(|a| container_of(&a).ok()) {
            container.optimizers.optimizers.lock().remove(&id);
        }
    });
}

/// Steps local optimizer `id` of this worker with context `context_id`'s
/// gradients, under the worker's optimizer lock.
fn step_local(agent: &Agent, id: u64, context_id: u64) -> Result<(), String> {
    let container = container_of(agent).map_err(|e| e.to_string())?;
    let local = container
        .optimizers
        .optimizers
        .lock()
        .get(&id)
        .cloned()
        .ok_or_else(|| format!("no optimizer {id} on this worker"))?;
    let ctx = container.get(context_id).map_err(|e| e.to_string())?;
    let _serial = container.optimizers.step_lock.lock();
    let mut local = local.lock();
    let grads: Vec<Option<tch::Tensor>> = {
        let state = ctx.state.lock();
        local
            .params()
            .iter()
            .map(|p| {
                state
                    .grads
                    .get(&tensor_id(p))
                    .map(|(_, g)| g.shallow_clone())
            })
            .collect()
    };
    local.step(&grads).map_err(|e| e.to_string())
}

/// Optimizes parameters that live on any workers, given as RRefs, with the
/// gradients of a distributed autograd context (PyTorch's
/// `torch.distributed.optim.DistributedOptimizer`).
///
/// Construction creates one local optimizer of `kind` on each distinct
/// owner, holding that owner's parameters; [`step`](Self::step) runs them
/// all in parallel, each applying the context's gradients on its owner.
pub struct DistributedOptimizer {
    agent: Agent,
    id: u64,
    /// Owner rank → owner name.
    owners: BTreeMap<u32, String>,
}

impl DistributedOptimizer {
    /// Builds an optimizer on each owner of `params` (the process's
    /// agent): a built-in one from an [`OptimizerKind`], or a user-defined
    /// [`OptimizerClass`](super::OptimizerClass) with its arguments
    /// ([`OptimizerClass::with`](super::OptimizerClass::with)), which every
    /// owner must have registered. An error names the owner where building
    /// failed; [`AutogradError::UnknownOptimizerClass`] if an owner has no
    /// such class.
    pub fn new(
        optimizer: impl Into<OptimizerSpec>,
        params: Vec<RRef<Tensor>>,
    ) -> Result<Self, AutogradError> {
        Self::with_agent(&ferry_rpc::agent()?, optimizer, params)
    }

    /// [`new`](Self::new) on a given agent.
    pub fn with_agent(
        agent: &Agent,
        optimizer: impl Into<OptimizerSpec>,
        params: Vec<RRef<Tensor>>,
    ) -> Result<Self, AutogradError> {
        let spec = optimizer.into();
        spec.validate(&agent.worker_info().name)?;
        let mut by_owner: BTreeMap<u32, Vec<RRef<Tensor>>> = BTreeMap::new();
        for p in params {
            by_owner.entry(p.owner()).or_default().push(p);
        }
        let id =
            (u64::from(agent.worker_info().id) << 48) | NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let calls: Vec<_> = by_owner
            .into_iter()
            .map(|(owner, ps)| {
                let call = match &spec.0 {
                    Spec::Builtin(kind) => {
                        NEW.agent(agent).rpc_async(owner, (id, kind.clone(), ps))
                    }
                    Spec::Class { create, .. } => create(agent, owner, id, ps),
                };
                (owner, call)
            })
            .collect();
        let mut owners = BTreeMap::new();
        let mut first_error = None;
        for (owner, call) in calls {
            let name = owner_name(agent, owner);
            match call.wait() {
                Ok(()) => {
                    owners.insert(owner, name);
                }
                Err(e) => {
                    first_error.get_or_insert(optimizer_error(&name, e));
                }
            }
        }
        tracing::debug!(
            id,
            ?spec,
            owners = owners.len(),
            "distributed optimizer built"
        );
        let this = DistributedOptimizer {
            agent: agent.clone(),
            id,
            owners,
        };
        match first_error {
            Some(e) => Err(e),
            None => Ok(this),
        }
    }

    /// Applies the gradients of context `context_id` on every owner, in
    /// parallel across owners; returns once all are applied. An error names
    /// the owner whose step failed.
    pub fn step(&self, context_id: u64) -> Result<(), AutogradError> {
        let me = self.agent.worker_info().id;
        let calls: Vec<_> = self
            .owners
            .iter()
            .filter(|(&owner, _)| owner != me)
            .map(|(&owner, name)| {
                let call = STEP
                    .agent(&self.agent)
                    .rpc_async(owner, (self.id, context_id));
                (name, call)
            })
            .collect();
        let mut first_error = None;
        // This worker's own parameters: stepped here while the others run.
        if let Some(name) = self.owners.get(&me) {
            if let Err(message) = step_local(&self.agent, self.id, context_id) {
                first_error.get_or_insert(AutogradError::Optimizer {
                    worker: name.clone(),
                    message,
                });
            }
        }
        for (name, call) in calls {
            if let Err(e) = call.wait() {
                first_error.get_or_insert(optimizer_error(name, e));
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The workers holding parameters of this optimizer.
    pub fn owners(&self) -> Vec<String> {
        self.owners.values().cloned().collect()
    }
}

impl Drop for DistributedOptimizer {
    fn drop(&mut self) {
        // Best effort: the local optimizers also go when their workers stop.
        let calls: Vec<_> = self
            .owners
            .keys()
            .map(|&o| DROP.agent(&self.agent).rpc_async(o, self.id))
            .collect();
        for c in calls {
            let _ = c.wait();
        }
    }
}

impl std::fmt::Debug for DistributedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedOptimizer")
            .field("id", &self.id)
            .field("owners", &self.owners)
            .finish()
    }
}

fn owner_name(agent: &Agent, owner: u32) -> String {
    agent
        .get_worker_info(owner)
        .map(|w| w.name)
        .unwrap_or_else(|_| format!("rank {owner}"))
}

fn optimizer_error(owner: &str, e: ferry_rpc::RpcError) -> AutogradError {
    let message = match e {
        ferry_rpc::RpcError::UnknownFunction { worker, function } => {
            if let Some(class) = custom::class_of(&function) {
                return AutogradError::UnknownOptimizerClass {
                    worker,
                    class: class.to_string(),
                };
            }
            ferry_rpc::RpcError::UnknownFunction { worker, function }.to_string()
        }
        ferry_rpc::RpcError::Remote { message, .. } => message,
        other => other.to_string(),
    };
    AutogradError::Optimizer {
        worker: owner.to_string(),
        message,
    }
}
