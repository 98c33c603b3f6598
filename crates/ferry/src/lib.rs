//! # ferry
//!
//! Tensor-aware RPC for distributed deep learning in Rust, after PyTorch's
//! RPC framework: workers call each other's functions with tensors anywhere
//! in the arguments; tensor bytes travel out of band, straight from the
//! sender's memory into a destination the receiver allocated.
//!
//! This facade re-exports Ferry's crates, each usable on its own:
//! [`wire`] (the sans-IO wire format), [`transport`] (connections and tensor
//! channels, embeddable alone), [`rpc`] (the agent) and [`rref`] (Remote
//! References), [`schedule`] (pipeline schedules as data). With the
//! `torch` feature, `tensor` (libtorch tensors, `ferry-tch`, and the `tch`
//! it is built on: `ferry::tensor::tch`), `autograd` (distributed autograd
//! and the distributed optimizer, `ferry-autograd`) and `pipeline`
//! (pipeline-parallel training, `ferry-pipeline`) too; with the `ft`
//! feature, `ft` (torchft-compatible fault tolerance, `ferry-ft`). A
//! program needs no other Ferry crate. [`init_rpc`] starts the agent with
//! every layer installed and returns the [`Worker`], the way to them.
//! [`launch`] starts a group of local worker processes, like `torchrun` on
//! one host.
//!
//! ```no_run
//! use ferry::launch::{self, Role};
//! use ferry::{BoxError, Function, Functions, RRef, RawTensor, RemoteExt, RpcOptions};
//!
//! // Declared once, in code every worker shares.
//! const SUM: Function<RawTensor, f32> = Function::new("sum");
//!
//! fn main() -> Result<(), BoxError> {
//!     let Role::Worker { rank, .. } = launch::local(2)? else { return Ok(()) };
//!     let mut functions = Functions::new();
//!     functions.add(SUM, |t: RawTensor| {
//!         t.as_slice::<f32>().map(|v| v.iter().sum()).ok_or("not contiguous f32")
//!     });
//!     ferry::init_rpc(RpcOptions::from_env(format!("worker{rank}"))?.functions(functions))?;
//!     if rank == 0 {
//!         let t = RawTensor::from_slice(&[1.0f32, 2.0, 3.0], &[3])?;
//!         assert_eq!(SUM.rpc_sync("worker1", t.clone())?, 6.0);
//!         // The result stays on worker1; fetch it when needed.
//!         let r: RRef<f32> = SUM.remote(1, t)?;
//!         assert_eq!(r.to_here()?, 6.0);
//!     }
//!     ferry::shutdown()?;
//!     Ok(())
//! }
//! ```
//!
//! Everything a user calls is re-exported here: typed declarations
//! ([`Function`], [`Method`], [`Schema`]) and their calls (`rpc_sync`,
//! `rpc_async`, `remote`, with options on the call: [`Call`]), functions
//! named at run time ([`by_name`], for dynamic use), the free functions of
//! the process's worker ([`shutdown`], ...), [`launch`], and with
//! `torch` the `tensor`, `autograd` and `pipeline` layers
//! (`ferry::autograd::context`, `DistributedOptimizer`,
//! `ferry::pipeline::Pipeline`, ...).

pub mod launch;
mod worker;

pub use worker::Worker;

pub use ferry_rpc as rpc;
pub use ferry_rref as rref;
pub use ferry_schedule as schedule;
pub use ferry_transport as transport;
pub use ferry_wire as wire;

// The RPC layer: options, the agent, errors, and the free functions of
// the process's worker.
pub use ferry_rpc::{
    get_rpc_timeout, get_worker_info, set_rpc_timeout, shutdown, shutdown_now, wait_all, Agent,
    Functions, LocalTopology, RpcError, RpcFuture, RpcOptions, TorchElastic, WorkerInfo, WorkerRef,
};
// Calls: typed `Function` declarations, the `Schema` of their types (trait
// and derive), the bounds generic code over them names (`Arg`, `Ret`), a
// call's options (`Call`, `CallOptions`), functions named at run time
// (`by_name`), what a registered body returns (`Reply`), any error with `?`.
pub use ferry_rpc::{
    by_name, Arg, BoxError, ByName, Call, CallOptions, Function, Reply, Ret, Schema,
};
// RRefs: `remote` on a call handle (`RemoteExt`), typed methods.
pub use ferry_rref::{debug_info, Method, MethodsExt, RRef, RRefError, RemoteExt, ToHere};

/// libtorch tensors on the wire (`ferry-tch`; feature `torch`).
#[cfg(feature = "torch")]
pub use ferry_tch as tensor;

/// Distributed autograd and the distributed optimizer (`ferry-autograd`;
/// feature `torch`).
#[cfg(feature = "torch")]
pub use ferry_autograd as autograd;

/// Pipeline-parallel training: stages on their workers, any schedule
/// (`ferry-pipeline`; feature `torch`).
#[cfg(feature = "torch")]
pub use ferry_pipeline as pipeline;

/// torchft-compatible fault tolerance: the lighthouse, the replica groups'
/// managers, checkpoint recovery and their allreduce (`ferry-ft`; feature
/// `ft`).
#[cfg(feature = "ft")]
pub use ferry_ft as ft;

/// Starts this process's worker with every layer installed (RRefs, and with
/// the `torch` feature libtorch tensors, distributed autograd and the
/// pipeline layer), then makes it the process's: the one that calls
/// without `.agent(..)` (`ADD.rpc_sync(..)`, `ADD.remote(..)`) and the
/// free functions ([`shutdown`], [`get_worker_info`], ...) use. Returns the
/// started [`Worker`], the way to its agent, RRef context and autograd
/// container. Fails with [`RpcError::AlreadyInitialized`] while a worker
/// runs in this process.
///
/// This is the one way to start a worker. (An embedder that needs the bare
/// agent, with no layer and not the process's, starts one with
/// [`Agent::start`].) A layer already installed on
/// `options` is kept: the pipeline layer installed here can build no
/// stage, so a worker that owns stages registers their constructors
/// first, with `ferry::pipeline::install(&mut options, stages)`.
pub fn init_rpc(mut options: RpcOptions) -> Result<Worker, RpcError> {
    #[cfg(feature = "torch")]
    let autograd = match options
        .hooks
        .get_layer::<ferry_autograd::DistAutogradContainer>()
    {
        Some(container) => container,
        None => ferry_autograd::install(&mut options),
    };
    #[cfg(feature = "torch")]
    if !options.hooks.has_layer::<ferry_pipeline::PipelineHost>() {
        ferry_pipeline::install(&mut options, ferry_pipeline::Stages::new());
    }
    let rrefs = match options.hooks.get_layer::<ferry_rref::RRefContext>() {
        Some(context) => context,
        None => ferry_rref::install(&mut options),
    };
    // Refused before the rendezvous where it can be; checked again below.
    if let Ok(running) = ferry_rpc::agent() {
        if running.is_running() {
            return Err(RpcError::AlreadyInitialized {
                name: running.worker_info().name.clone(),
            });
        }
    }
    let agent = Agent::start(options)?;
    if let Err(e) = ferry_rpc::set_process_agent(&agent) {
        agent.shutdown_now();
        return Err(e);
    }
    Ok(Worker::new(
        agent,
        rrefs,
        #[cfg(feature = "torch")]
        autograd,
    ))
}
pub use ferry_transport::RawTensor;
pub use ferry_wire::{DType, Device};

/// The README's code, compiled (not run) as a doctest so it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

// The user guide's code is compiled by `tests/facade-only`, a crate that
// depends on this one alone, so that a guide example needing another Ferry
// crate fails there.
