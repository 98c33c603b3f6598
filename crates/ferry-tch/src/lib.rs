//! # ferry-tch
//!
//! libtorch tensors (the [`tch`] crate) on Ferry's wire. [`Tensor`] wraps a
//! `tch::Tensor` so that it can sit anywhere inside the arguments and results
//! of `rpc_sync`, `rpc_async` and `remote`: the payload carries only its
//! index in the message's tensor table, its bytes leave from its own storage
//! (contiguous or not, nothing is copied) and arrive straight in a tensor the
//! receiver allocated from the descriptor ([`TchAllocator`]). Every element
//! type libtorch has travels, except the quantized ones.
//!
//! Distributed autograd ([`grad`]) hooks in here: inside an autograd context
//! a tensor that requires grad records a send function as it serialises,
//! and its receiver records the matching recv function.
//!
//! ```no_run
//! use ferry_rpc::{Functions, RpcOptions};
//! use ferry_tch::Tensor;
//!
//! # fn main() -> Result<(), ferry_rpc::RpcError> {
//! let mut functions = Functions::new();
//! functions.register("add", |(a, b): (Tensor, Tensor)| Tensor::from(&*a + &*b));
//! let mut options = RpcOptions::from_env("worker0")?.functions(functions);
//! ferry_tch::install(&mut options);
//! ferry_rpc::init_rpc(options)?;
//! let a = Tensor::from(tch::Tensor::ones([2, 2], (tch::Kind::Float, tch::Device::Cpu)));
//! let sum: Tensor = ferry_rpc::rpc_sync("worker1", "add", (a.clone(), a))?;
//! assert_eq!(sum.size(), [2, 2]);
//! ferry_rpc::shutdown()?;
//! # Ok(()) }
//! ```

/// The `tch` crate this one is built on, for code that reaches libtorch
/// through `ferry::tensor` only.
pub use tch;

mod alloc;
mod dtype;
pub mod grad;
mod outgoing;
mod tensor;

use std::sync::Arc;

use ferry_rpc::RpcOptions;

pub use alloc::TchAllocator;
pub use dtype::{dtype_of, kind_of};
pub use tensor::Tensor;

// SAFETY: libtorch tensors are shared between threads in PyTorch itself:
// reads are thread-safe, and the handle's reference count is atomic. Ferry
// keeps results as shared values (`Send + Sync`); code that mutates a tensor
// in place from several threads must synchronise, as in PyTorch.
unsafe impl Sync for Tensor {}

/// Why a tensor cannot travel.
#[derive(Debug, thiserror::Error)]
pub enum TchError {
    /// An undefined tensor (`tch::Tensor::new()`).
    #[error("an undefined tensor cannot be sent")]
    Undefined,
    /// A tensor on a device this version does not send.
    #[error(
        "a tensor on {0} cannot be sent: ferry-tch sends cpu tensors (device maps come later)"
    )]
    Device(String),
    /// A kind the wire has no type for.
    #[error("a {0:?} tensor cannot be sent: quantized tensors are not supported")]
    Kind(tch::Kind),
    /// libtorch refused.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// Makes a worker receive tensors as libtorch tensors (installs
/// [`TchAllocator`]). Tensors sent as `ferry_transport::RawTensor` then
/// still decode as [`Tensor`] (with one copy), not as `RawTensor`.
pub fn install(options: &mut RpcOptions) {
    options.allocator = Arc::new(TchAllocator);
}

/// A libtorch tensor in a payload: its entry in the message's tensor table
/// plus its autograd metadata, so its shape differs from a `RawTensor`'s.
///
/// ```
/// use ferry_rpc::Schema;
///
/// assert_eq!(<ferry_tch::Tensor as Schema>::SHAPE.to_string(), "Tensor");
/// ```
impl ferry_rpc::Schema for Tensor {
    const SHAPE: &'static ferry_rpc::schema::Shape = &ferry_rpc::schema::Shape::Opaque {
        name: "Tensor",
        params: &[],
    };
}
