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
//! References). With the `torch` feature, `tensor` (libtorch tensors,
//! `ferry-tch`) and `autograd` (distributed autograd and the distributed
//! optimizer, `ferry-autograd`) too. [`init_rpc`] starts the agent with
//! every layer installed.
//! [`launch`] starts a group of local worker processes, like `torchrun` on
//! one host.
//!
//! ```no_run
//! use ferry::launch::{self, Role};
//! use ferry::rpc::{self, Functions, RpcOptions};
//! use ferry::transport::RawTensor;
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let Role::Worker { rank, .. } = launch::local(2)? else { return Ok(()) };
//!     let mut functions = Functions::new();
//!     functions.register("sum", |t: RawTensor| t.as_slice::<f32>().unwrap().iter().sum::<f32>());
//!     ferry::init_rpc(RpcOptions::from_env(format!("worker{rank}"))?.functions(functions))?;
//!     if rank == 0 {
//!         let t = RawTensor::from_slice(&[1.0f32, 2.0, 3.0], &[3])?;
//!         let s: f32 = rpc::rpc_sync("worker1", "sum", t.clone())?;
//!         assert_eq!(s, 6.0);
//!         // The result stays on worker1; fetch it when needed.
//!         let r: ferry::RRef<f32> = ferry::remote("worker1", "sum", t)?;
//!         assert_eq!(r.to_here()?, 6.0);
//!     }
//!     rpc::shutdown()?;
//!     Ok(())
//! }
//! ```

pub mod launch;

pub use ferry_rpc as rpc;
pub use ferry_rref as rref;
pub use ferry_transport as transport;
pub use ferry_wire as wire;

pub use ferry_rpc::{
    rpc_async, rpc_sync, shutdown, Agent, Functions, RpcError, RpcFuture, RpcOptions, WorkerInfo,
};
pub use ferry_rref::{remote, RRef, RRefError};
// Typed remote functions: `Function` declarations, the `Schema` of their
// types (trait and derive), `remote` on a declaration, any error with `?`.
pub use ferry_rpc::{BoxError, Function, Schema};
pub use ferry_rref::RemoteExt;

/// libtorch tensors on the wire (`ferry-tch`; feature `torch`).
#[cfg(feature = "torch")]
pub use ferry_tch as tensor;

/// Distributed autograd and the distributed optimizer (`ferry-autograd`;
/// feature `torch`).
#[cfg(feature = "torch")]
pub use ferry_autograd as autograd;

/// Starts this process's worker with every layer installed (RRefs, and with
/// the `torch` feature libtorch tensors and distributed autograd), then makes
/// it the target of the free functions ([`rpc_sync`], [`remote`], ...).
pub fn init_rpc(mut options: RpcOptions) -> Result<(), RpcError> {
    #[cfg(feature = "torch")]
    if !options
        .hooks
        .has_layer::<ferry_autograd::DistAutogradContainer>()
    {
        ferry_autograd::install(&mut options);
    }
    if !options.hooks.has_layer::<ferry_rref::RRefContext>() {
        ferry_rref::install(&mut options);
    }
    ferry_rpc::init_rpc(options)
}
pub use ferry_transport::RawTensor;
pub use ferry_wire::{DType, Device};
