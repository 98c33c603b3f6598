//! # ferry-rpc
//!
//! The RPC agent of Ferry, the way PyTorch's `torch.distributed.rpc` works:
//! workers rendezvous through a key-value store that rank 0 hosts, then call
//! each other's registered functions, tensors anywhere inside the arguments
//! and results.
//!
//! - Remote functions are declared once, as typed [`Function`] handles in
//!   code every worker shares, registered on every worker with
//!   [`Functions::add`] (plain, fallible or async bodies) and called with
//!   `F.rpc_sync(to, args)` or `F.rpc_async(to, args)`; a wrong argument or
//!   result type does not compile, and the callee checks the declared
//!   [`Schema`]s again. Options go on the call (`F.timeout(d)`,
//!   `F.agent(&agent)`: [`Call`]); [`by_name`] calls a function named at
//!   run time.
//! - Worker names are unique in the group; calls go to a name or a rank,
//!   including the caller itself.
//! - A failing function, an unknown function or worker, a wrong type, a dead
//!   peer, a malformed frame and a timeout each give their own [`RpcError`].
//! - [`Agent::shutdown`] is graceful (like PyTorch's: every worker waits
//!   until no worker has calls outstanding). A worker that does not take
//!   part is named by [`RpcError::Absent`]: at once when it was killed (its
//!   connection closed, its address refuses), else after
//!   [`RpcOptions::shutdown_timeout`] without progress; other stalls fail
//!   with [`RpcError::Join`] after it. [`Agent::shutdown_now`] is immediate.
//! - Connections to peers have TCP keepalive and `TCP_USER_TIMEOUT`
//!   ([`RpcOptions::keepalive`]), so a partition fails calls with
//!   [`RpcError::PeerUnreachable`] within bounds.
//! - Started by `torchrun --no-python`, [`RpcOptions::from_env`] reads
//!   torchrun's variables ([`TorchElastic`]): the workers join through the
//!   c10d store torchrun's agent hosts, each restart in a namespace of its
//!   own (the `torchrun_worker` example).
//! - [`service`] lets the layers above (RRef, autograd) handle their own
//!   message kinds and see every call.
//!
//! A program starts its worker with the facade's `ferry::init_rpc`, which
//! installs every layer (RRefs, and with libtorch tensors, distributed
//! autograd and pipelines) and makes the worker the process's, the one
//! calls without `.agent(..)` and the free functions ([`shutdown`],
//! [`get_worker_info`], ...) use. An embedder that needs the agent alone
//! starts it with [`Agent::start`] and calls through it, as here:
//!
//! ```no_run
//! use ferry_rpc::{Agent, Function, Functions, RpcOptions};
//!
//! // Declared once, in code every worker shares.
//! const ADD: Function<(i64, i64), i64> = Function::new("add");
//!
//! # fn main() -> Result<(), ferry_rpc::BoxError> {
//! let mut functions = Functions::new();
//! functions.add(ADD, |(a, b)| a + b);
//! // MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE come from the environment.
//! let rank: u32 = std::env::var("RANK")?.parse()?;
//! let agent = Agent::start(RpcOptions::from_env(format!("worker{rank}"))?.functions(functions))?;
//! if rank == 0 {
//!     assert_eq!(ADD.agent(&agent).rpc_sync("worker1", (2, 3))?, 5);
//! }
//! agent.shutdown()?;
//! # Ok(()) }
//! ```

// The derive's generated code names this crate `::ferry_rpc`, here too.
extern crate self as ferry_rpc;

mod agent;
mod blocking_pool;
mod boxed;
mod call;
mod calling;
mod current;
pub mod describe;
mod dynamic;
mod error;
mod fallible;
mod functions;
mod inline;
mod join;
mod name;
mod options;
mod outbox;
mod pending;
mod protocol;
mod rendezvous;
pub mod reply;
pub mod schema;
mod schema_impls;
pub mod scope;
pub mod service;
mod tally;
mod termination;
mod throttle;
mod topology;
mod torchelastic;
mod typed;
mod value;
pub mod watch;

/// The rendezvous store the agent meets its group through: the
/// [`ferry_store`] crate, re-exported so that `ferry_rpc::store::…` paths
/// (and [`RpcOptions::store`]'s argument type) need no extra dependency.
pub use ferry_store as store;

use std::time::Duration;

use parking_lot::Mutex;

pub use agent::{Agent, LinkInfo, WeakAgent};
pub use blocking_pool::on_body_thread;
pub use boxed::BoxFuture;
pub use call::{wait_all, RawFuture, RpcFuture};
pub use calling::{by_name, ByName, Call, CallOptions};
pub use error::{Absence, RemoteError, RpcError, MAX_ERROR_TEXT_BYTES};
pub use fallible::{error_text, BoxError};
pub use functions::{
    panic_message, short_type_name, Functions, LateFunctions, Signature, SignatureId,
    SignatureSchema,
};
pub use name::{validate_name, WorkerInfo, WorkerRef, MAX_NAME_LEN};
pub use options::{
    RpcOptions, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_INIT_TIMEOUT, DEFAULT_RPC_TIMEOUT,
};
pub use protocol::Extension;
pub use reply::Reply;
pub use schema::Schema;
pub use scope::CallScope;
pub use service::{Hooks, IncomingCall, Interceptor, OutgoingCall, Service, ThreadStart};
pub use topology::LocalTopology;
pub use torchelastic::TorchElastic;
pub use typed::{Arg, Function, Ret};
pub use value::Value;

/// The process's agent, set by [`set_process_agent`] and cleared by
/// [`shutdown`].
static AGENT: Mutex<Option<Agent>> = Mutex::new(None);

/// Makes `agent` the process's: the one that calls without
/// [`.agent(..)`](Call::agent) and the free functions of this crate
/// ([`shutdown`], [`get_worker_info`], ...) and of the layers above use.
/// The facade's `ferry::init_rpc` does this for the worker it starts; an
/// embedder calls it after [`Agent::start`] where it wants the same.
/// Fails with [`RpcError::AlreadyInitialized`] while another running agent
/// is the process's.
pub fn set_process_agent(agent: &Agent) -> Result<(), RpcError> {
    let mut slot = AGENT.lock();
    if let Some(running) = slot.as_ref().filter(|a| a.is_running()) {
        return Err(RpcError::AlreadyInitialized {
            name: running.worker_info().name.clone(),
        });
    }
    *slot = Some(agent.clone());
    Ok(())
}

/// The process's agent ([`set_process_agent`]).
pub fn agent() -> Result<Agent, RpcError> {
    AGENT.lock().clone().ok_or(RpcError::NotInitialized)
}

/// The process's default timeout of calls (zero: none), PyTorch's
/// `rpc._get_rpc_timeout` ([`Agent::rpc_timeout`]).
pub fn get_rpc_timeout() -> Result<Duration, RpcError> {
    Ok(agent()?.rpc_timeout())
}

/// Changes the process's default timeout of the calls started from now on
/// (zero: none), PyTorch's `rpc._set_rpc_timeout` ([`Agent::set_rpc_timeout`]).
pub fn set_rpc_timeout(timeout: Duration) -> Result<(), RpcError> {
    agent()?.set_rpc_timeout(timeout);
    Ok(())
}

/// Looks a worker up by name or rank; `None` gives this worker.
pub fn get_worker_info(worker: Option<WorkerRef>) -> Result<WorkerInfo, RpcError> {
    let a = agent()?;
    match worker {
        Some(w) => a.get_worker_info(w),
        None => Ok(a.worker_info().clone()),
    }
}

/// Graceful shutdown of this process's agent (see [`Agent::shutdown`]).
/// Afterwards every call returns [`RpcError::NotInitialized`].
pub fn shutdown() -> Result<(), RpcError> {
    let a = agent()?;
    let r = a.shutdown();
    AGENT.lock().take();
    r
}

/// Immediate shutdown of this process's agent (see [`Agent::shutdown_now`]).
pub fn shutdown_now() -> Result<(), RpcError> {
    let a = AGENT.lock().take().ok_or(RpcError::NotInitialized)?;
    a.shutdown_now();
    Ok(())
}
