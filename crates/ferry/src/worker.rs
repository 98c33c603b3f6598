//! The handle [`init_rpc`](crate::init_rpc) returns.

use std::sync::Arc;

use ferry_rpc::{Agent, WorkerInfo};
use ferry_rref::RRefContext;

/// This process's started worker, as [`init_rpc`](crate::init_rpc) returns
/// it: the way to its agent and to the layers installed on it (the RRef
/// context, and with the `torch` feature the distributed autograd
/// container). Cheap to clone; every clone is the same worker. Dropping it
/// does not stop the worker: [`shutdown`](crate::shutdown) does.
///
/// ```no_run
/// use std::time::Duration;
/// use ferry::{BoxError, Functions, RpcOptions};
///
/// # fn main() -> Result<(), BoxError> {
/// let worker = ferry::init_rpc(RpcOptions::from_env("worker0")?.functions(Functions::new()))?;
/// assert_eq!(worker.info().name, "worker0");
/// worker.agent().set_rpc_timeout(Duration::from_secs(5));
/// println!("{:?}", worker.rref_context().debug_info());
/// ferry::shutdown()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Worker {
    agent: Agent,
    rrefs: Arc<RRefContext>,
    #[cfg(feature = "torch")]
    autograd: Arc<ferry_autograd::DistAutogradContainer>,
}

impl Worker {
    pub(crate) fn new(
        agent: Agent,
        rrefs: Arc<RRefContext>,
        #[cfg(feature = "torch")] autograd: Arc<ferry_autograd::DistAutogradContainer>,
    ) -> Self {
        Self {
            agent,
            rrefs,
            #[cfg(feature = "torch")]
            autograd,
        }
    }

    /// The worker's RPC agent: calls through it, the group's workers and
    /// store, the default timeout
    /// ([`set_rpc_timeout`](Agent::set_rpc_timeout)), and what each
    /// connection runs on ([`link_info`](Agent::link_info)).
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// This worker's name and rank.
    pub fn info(&self) -> &WorkerInfo {
        self.agent.worker_info()
    }

    /// The worker's RRef layer: its tables' counts
    /// ([`debug_info`](RRefContext::debug_info)), a wait until every RRef
    /// it owns or uses is released
    /// ([`wait_until_empty`](RRefContext::wait_until_empty)), what leaked
    /// at shutdown ([`leaked`](RRefContext::leaked)).
    pub fn rref_context(&self) -> &Arc<RRefContext> {
        &self.rrefs
    }

    /// The worker's distributed autograd container: its contexts by id,
    /// the gradients they hold (feature `torch`).
    #[cfg(feature = "torch")]
    pub fn autograd_container(&self) -> &Arc<ferry_autograd::DistAutogradContainer> {
        &self.autograd
    }
}

/// Names the worker: `Worker { name: "worker0", rank: 0 }`.
impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let info = self.info();
        f.debug_struct("Worker")
            .field("name", &info.name)
            .field("rank", &info.id)
            .finish()
    }
}
