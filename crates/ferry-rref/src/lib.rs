//! # ferry-rref
//!
//! Remote References (RRefs) for Ferry, as in PyTorch's
//! `torch.distributed.rpc`: `remote` ([`RemoteExt`]) runs a function on
//! another worker and returns at once an [`RRef`] to its result, which
//! stays on that worker (the owner). Any worker holding the RRef can fetch
//! a copy ([`RRef::to_here`]), run methods on the value where it lives
//! ([`RRef::rpc_sync`], [`RRef::rpc_async`], [`RRef::remote`]), and pass
//! the RRef on inside the arguments or results of any call.
//!
//! The owner keeps the value exactly as long as some worker can still reach
//! it, by the reference-counting protocol of PyTorch's [Remote Reference
//! Protocol](https://pytorch.org/docs/stable/rpc/rref.html) ([`protocol`], a sans-IO state machine proven by a simulator
//! under reordered, duplicated and dropped messages).
//!
//! A program gets this layer from the facade's `ferry::init_rpc`, and its
//! calls need no `.agent(..)`. Here, with the agent alone ([`install`]
//! first, on every worker):
//!
//! ```no_run
//! use ferry_rpc::{Agent, BoxError, Function, Functions, RpcOptions};
//! use ferry_rref::{RRef, RemoteExt};
//!
//! const ADD: Function<(i64, i64), i64> = Function::new("add");
//! const GET: Function<RRef<i64>, i64> = Function::new("get");
//!
//! # fn main() -> Result<(), BoxError> {
//! let mut functions = Functions::new();
//! functions.add(ADD, |(a, b)| a + b);
//! functions.add(GET, |r: RRef<i64>| r.to_here());
//! let rank: u32 = std::env::var("RANK")?.parse()?;
//! let mut options = RpcOptions::from_env(format!("worker{rank}"))?.functions(functions);
//! ferry_rref::install(&mut options);
//! let agent = Agent::start(options)?;
//! if rank == 0 {
//!     let sum: RRef<i64> = ADD.agent(&agent).remote(1, (2, 3))?;
//!     assert_eq!(sum.to_here()?, 5);
//!     // Pass it on: worker2 fetches it from worker1 directly.
//!     assert_eq!(GET.agent(&agent).rpc_sync(2, sum.clone())?, 5);
//! }
//! agent.shutdown()?;
//! # Ok(()) }
//! ```
//!
//! Methods of the value run where it lives, declared as typed [`Method`]s
//! (see there); `ferry_rpc::by_name(..).remote(..)` and the proxies'
//! `call_by_name` are the string-named forms for dynamic use.

mod context;
mod dynamic;
mod error;
mod message;
mod method;
pub mod protocol;
mod proxy;
mod rref;
mod slot;
mod typed;
mod wait;

use std::sync::Arc;
use std::time::Duration;

use ferry_rpc::{Agent, RpcOptions, Signature, WorkerRef};
use ferry_wire::payload;
use serde::de::DeserializeOwned;
use serde::Serialize;

pub use context::{DebugInfo, RRefContext};
pub use dynamic::DynRRef;
pub use error::RRefError;
pub use message::RREF_SERVICE;
pub use method::{Method, MethodsExt};
pub use protocol::{ForkId, RRefId};
pub use proxy::{kind, Proxy, RemoteProxy, RpcAsyncProxy, RpcSyncProxy};
pub use rref::{RRef, ToHere};
pub use typed::RemoteExt;

/// Installs the RRef layer into `options` (its service and its context);
/// call it on every worker before starting the agent. `ferry::init_rpc`
/// does it for you.
pub fn install(options: &mut RpcOptions) -> Arc<RRefContext> {
    let ctx = Arc::new(RRefContext::new());
    options
        .hooks
        .service(RREF_SERVICE, Arc::new(context::RRefService(ctx.clone())))
        .layer(ctx.clone());
    ctx
}

/// Starts a `remote` call whose caller's signature is `signature`.
pub(crate) fn remote_signed<R, A>(
    agent: &Agent,
    to: WorkerRef,
    function: &str,
    signature: Signature,
    args: A,
    timeout: Duration,
) -> Result<RRef<R>, RRefError>
where
    R: Serialize + DeserializeOwned + Send + 'static,
    A: Serialize,
{
    let caller = Caller {
        signature: signature.id(),
        shown: signature.shown(true),
        names: signature.shown(false),
    };
    let (ctx, rref_id, holder, owner) = remote_with(agent, to, function, &caller, &args, timeout)?;
    Ok(RRef::from_parts(ctx, rref_id, holder, owner))
}

/// Starts a `remote` call of `function` on `to` with `args`, as `caller`:
/// the new RRef's parts.
pub(crate) fn remote_with<A: Serialize + ?Sized>(
    agent: &Agent,
    to: WorkerRef,
    function: &str,
    caller: &Caller,
    args: &A,
    timeout: Duration,
) -> Result<
    (
        Arc<RRefContext>,
        RRefId,
        protocol::Holder,
        protocol::WorkerId,
    ),
    RRefError,
> {
    let ctx = RRefContext::of(agent)?;
    let owner = agent.get_worker_info(to)?.id;

    // RRefs in the arguments are forked into this message: undone if the
    // owner never decodes it.
    let (args, watches) = ferry_rpc::watch::encoding_message(|| payload::encode(args));
    let args = match args {
        Ok(args) => args,
        Err(e) => {
            watches.settle(ferry_rpc::watch::Delivery::NotDecoded);
            return Err(RRefError::Codec(format!(
                "cannot encode the arguments of {function}: {e}"
            )));
        }
    };
    let (rref_id, holder) = ctx.remote(agent, owner, function, caller, (args, watches), timeout);
    Ok((ctx, rref_id, holder, owner))
}

/// What a `remote` call tells its owner of its caller's signature: what
/// the type check compares, and how a refusal writes it.
pub(crate) struct Caller {
    /// The signature's hashes.
    pub(crate) signature: ferry_rpc::SignatureId,
    /// As declared shapes if typed, else type names (`shown(true)`).
    pub(crate) shown: String,
    /// As type names (`shown(false)`).
    pub(crate) names: String,
}

/// Counts of this process's RRef tables.
pub fn debug_info() -> Result<DebugInfo, RRefError> {
    Ok(RRefContext::current()?.debug_info())
}

fn agent_of<T>(rref: &RRef<T>) -> Result<Agent, RRefError> {
    rref.agent()
}
