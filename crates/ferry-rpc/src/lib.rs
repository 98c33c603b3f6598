//! # ferry-rpc
//!
//! The RPC agent of Ferry, the way PyTorch's `torch.distributed.rpc` works:
//! workers rendezvous through a key-value store that rank 0 hosts, then call
//! each other's registered functions by name with [`rpc_sync`] and
//! [`rpc_async`], tensors anywhere inside the arguments and results.
//!
//! - Worker names are unique in the group; calls go to a name or a rank,
//!   including the caller itself.
//! - Remote functions are ordinary Rust functions registered under a stable
//!   name on every worker ([`Functions`]); arguments and results are serde
//!   types, checked against the registration's signature.
//! - A failing function, an unknown function or worker, a wrong type, a dead
//!   peer, a malformed frame and a timeout each give their own [`RpcError`].
//! - [`shutdown`] is graceful (like PyTorch's: every worker waits until no
//!   worker has calls outstanding). A worker that does not take part is
//!   named by [`RpcError::Absent`]: at once when it was killed (its
//!   connection closed, its address refuses), else after
//!   [`RpcOptions::shutdown_timeout`] without progress; other stalls fail
//!   with [`RpcError::Join`] after it. [`shutdown_now`] is immediate.
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
//! ```no_run
//! use ferry_rpc::{Functions, RpcOptions};
//!
//! # fn main() -> Result<(), ferry_rpc::RpcError> {
//! let mut functions = Functions::new();
//! functions.register("add", |(a, b): (i64, i64)| a + b);
//! // MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE come from the environment.
//! let rank: u32 = std::env::var("RANK").unwrap().parse().unwrap();
//! ferry_rpc::init_rpc(RpcOptions::from_env(format!("worker{rank}"))?.functions(functions))?;
//! if rank == 0 {
//!     let sum: i64 = ferry_rpc::rpc_sync("worker1", "add", (2i64, 3i64))?;
//!     assert_eq!(sum, 5);
//! }
//! ferry_rpc::shutdown()?;
//! # Ok(()) }
//! ```

// The derive's generated code names this crate `::ferry_rpc`, here too.
extern crate self as ferry_rpc;

mod agent;
mod boxed;
mod call;
mod current;
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
use serde::de::DeserializeOwned;
use serde::Serialize;

pub use agent::{Agent, LinkInfo, ServiceFuture, WeakAgent};
pub use boxed::BoxFuture;
pub use call::{wait_all, RpcFuture};
pub use error::{Absence, RemoteError, RpcError, MAX_ERROR_TEXT_BYTES};
pub use fallible::{error_text, BoxError};
pub use functions::{
    panic_message, short_type_name, Functions, Signature, SignatureId, SignatureSchema,
};
pub use name::{validate_name, WorkerInfo, WorkerRef, MAX_NAME_LEN};
pub use options::{
    RpcOptions, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_INIT_TIMEOUT, DEFAULT_RPC_TIMEOUT,
};
pub use protocol::Extension;
pub use schema::Schema;
pub use scope::CallScope;
pub use service::{Hooks, IncomingCall, Interceptor, OutgoingCall, Service, ThreadStart};
pub use topology::LocalTopology;
pub use torchelastic::TorchElastic;
pub use typed::{Arg, Function, Ret};
pub use value::Value;

/// The process's agent, set by [`init_rpc`] and cleared by shutdown.
static AGENT: Mutex<Option<Agent>> = Mutex::new(None);

/// Starts this process's worker and makes it the target of the free
/// functions of this crate; returns its agent. A second init while one
/// runs is an error.
pub fn init_rpc(options: RpcOptions) -> Result<Agent, RpcError> {
    let mut slot = AGENT.lock();
    if let Some(a) = slot.as_ref() {
        return Err(RpcError::AlreadyInitialized {
            name: a.worker_info().name.clone(),
        });
    }
    let agent = Agent::start(options)?;
    *slot = Some(agent.clone());
    Ok(agent)
}

/// The process's agent.
pub fn agent() -> Result<Agent, RpcError> {
    AGENT.lock().clone().ok_or(RpcError::NotInitialized)
}

/// Calls `function` on worker `to` and blocks for its result ([`Agent::rpc_sync`]).
pub fn rpc_sync<R: DeserializeOwned, A: Serialize>(
    to: impl Into<WorkerRef>,
    function: &str,
    args: A,
) -> Result<R, RpcError> {
    agent()?.rpc_sync(to, function, args)
}

/// Calls `function` on worker `to` and returns a future of its result ([`Agent::rpc_async`]).
pub fn rpc_async<R: DeserializeOwned, A: Serialize>(
    to: impl Into<WorkerRef>,
    function: &str,
    args: A,
) -> RpcFuture<R> {
    match agent() {
        Ok(a) => a.rpc_async(to, function, args),
        Err(e) => RpcFuture::failed(e, function, Signature::of::<A, R>()),
    }
}

/// [`rpc_sync`] with a per-call timeout; zero means none.
pub fn rpc_sync_timeout<R: DeserializeOwned, A: Serialize>(
    to: impl Into<WorkerRef>,
    function: &str,
    args: A,
    timeout: Duration,
) -> Result<R, RpcError> {
    agent()?.rpc_sync_timeout(to, function, args, timeout)
}

/// [`rpc_async`] with a per-call timeout; zero means none.
pub fn rpc_async_timeout<R: DeserializeOwned, A: Serialize>(
    to: impl Into<WorkerRef>,
    function: &str,
    args: A,
    timeout: Duration,
) -> RpcFuture<R> {
    match agent() {
        Ok(a) => a.rpc_async_timeout(to, function, args, timeout),
        Err(e) => RpcFuture::failed(e, function, Signature::of::<A, R>()),
    }
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
