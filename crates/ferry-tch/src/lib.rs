//! # ferry-tch
//!
//! libtorch tensors (the [`tch`] crate) on Ferry's wire. [`Tensor`] wraps a
//! `tch::Tensor` so that it can sit anywhere inside the arguments and results
//! of `rpc_sync`, `rpc_async` and `remote`: the payload carries only its
//! index in the message's tensor table, its bytes leave from its own storage
//! (contiguous or not, nothing is copied) and arrive straight in a tensor the
//! receiver allocated from the descriptor ([`TchAllocator`]). That
//! receiver's `RawTensor`s take the same memory, also without a copy, so
//! one worker serves both kinds. Every element
//! type libtorch has travels, except the quantized ones. A sparse COO
//! tensor travels as PyTorch's RPC sends one: its indices and values
//! tensors through the table, its size, `sparse_dim`, `dense_dim` and
//! whether it is coalesced in the payload (`ferry_wire::sparse`); the
//! receiver checks them and rebuilds it with libtorch's
//! `sparse_coo_tensor`.
//!
//! Distributed autograd ([`grad`]) hooks in here: inside an autograd context
//! a tensor that requires grad records a send function as it serialises,
//! and its receiver records the matching recv function.
//!
//! A worker started with the facade's `ferry::init_rpc` has this layer;
//! here with the agent alone ([`install`] first):
//!
//! ```no_run
//! use ferry_rpc::{Agent, Function, Functions, RpcOptions};
//! use ferry_tch::Tensor;
//!
//! const ADD: Function<(Tensor, Tensor), Tensor> = Function::new("add");
//!
//! # fn main() -> Result<(), ferry_rpc::BoxError> {
//! let mut functions = Functions::new();
//! functions.add(ADD, |(a, b)| Tensor::from(&*a + &*b));
//! let rank: u32 = std::env::var("RANK")?.parse()?;
//! let mut options = RpcOptions::from_env(format!("worker{rank}"))?.functions(functions);
//! ferry_tch::install(&mut options);
//! let agent = Agent::start(options)?;
//! if rank == 0 {
//!     let a = Tensor::from(tch::Tensor::ones([2, 2], (tch::Kind::Float, tch::Device::Cpu)));
//!     let sum = ADD.agent(&agent).rpc_sync("worker1", (a.clone(), a))?;
//!     assert_eq!(sum.size(), [2, 2]);
//! }
//! agent.shutdown()?;
//! # Ok(()) }
//! ```

/// The `tch` crate this one is built on, for code that reaches libtorch
/// through `ferry::tensor` only.
pub use tch;

mod alloc;
#[cfg(feature = "cuda")]
mod cuda;
mod dtype;
pub mod grad;
mod outgoing;
mod raw;
mod sparse;
mod tensor;
pub mod tree;

use std::sync::Arc;

use ferry_rpc::RpcOptions;

pub use alloc::TchAllocator;
#[cfg(feature = "cuda")]
pub use cuda::load_cuda_backend;
pub use dtype::{dtype_of, kind_of};
pub use raw::AsRaw;
pub use tensor::Tensor;

// SAFETY: a `Tensor` is a handle (an intrusive pointer) on a libtorch
// `TensorImpl`; no method taking `&self` writes the handle, and libtorch
// makes the `TensorImpl`'s reference count atomic and its metadata reads
// thread-safe, as PyTorch's own threads rely on. Sharing `&Tensor` therefore
// allows no more than `tch::Tensor` already does safely (it is `Send`, and
// `shallow_clone(&self)` gives another thread its own handle on the same
// `TensorImpl`): several threads reading, or code mutating a tensor's data
// in place, which must synchronise as in PyTorch.
//
// Why it is needed: ferry-rpc asks only `Send` of results, but an RRef's
// owner shares its value by reference (`RRef::local_value` hands out an
// `Arc<T>` with `T: Sync`; `to_here` encodes it from any thread), and
// `RRef<Tensor>` is how distributed autograd's optimizer reaches the
// parameters it updates (`ferry-autograd`'s `optim/distributed.rs`). The
// test below exercises what this guards: one tensor read, encoded and
// shallow-cloned by several threads at once through a shared reference.
unsafe impl Sync for Tensor {}

/// Why a tensor cannot travel.
#[derive(Debug, thiserror::Error)]
pub enum TchError {
    /// An undefined tensor (`tch::Tensor::new()`).
    #[error("an undefined tensor cannot be sent")]
    Undefined,
    /// A tensor on a device this version does not send.
    #[error("a tensor on {0} cannot be sent: ferry-tch sends cpu and cuda tensors")]
    Device(String),
    /// A tensor without strides or storage of its own (sparse CSR/CSC/BSR,
    /// nested, mkldnn, or with no storage at all): the wire carries
    /// strided views of a storage's bytes (a sparse COO tensor travels as
    /// two of them, its indices and values). The text is libtorch's reason.
    #[error(
        "a {layout}tensor cannot be sent: ferry-tch sends strided tensors with storage ({reason})"
    )]
    NotStrided {
        /// `"sparse "` for a sparse tensor, empty otherwise.
        layout: &'static str,
        /// What libtorch said when asked for the tensor's view.
        reason: String,
    },
    /// A sparse COO tensor whose parts do not fit its layout: indices or
    /// values of the wrong shape, type or device for its size, an index
    /// out of bounds, or indices not sorted and unique where it claims to
    /// be coalesced.
    #[error("invalid sparse COO tensor: {0}")]
    Sparse(String),
    /// A kind the wire has no type for.
    #[error("a {0:?} tensor cannot be sent: quantized tensors are not supported")]
    Kind(tch::Kind),
    /// libtorch refused.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// Makes a worker receive tensors into libtorch memory (installs
/// [`TchAllocator`]). Each received tensor is then taken, without a copy,
/// as whatever type the value asks for at its place: a [`Tensor`] gets the
/// libtorch tensor, a `ferry_transport::RawTensor` a view of the same host
/// memory. One worker so serves functions taking either kind, and values
/// holding both, whatever the sender sent. (A worker without it receives
/// into `RawTensor`s, which a [`Tensor`] takes with one copy.) With
/// feature `cuda` it also loads libtorch's CUDA backend
/// (`load_cuda_backend`; without it, CUDA stays unavailable to libtorch).
///
/// It also makes the agent's threads, which run the registered functions,
/// use the process's libtorch intra-op thread count
/// ([`tch::set_num_threads`]; set it before the agent starts). OpenMP and
/// MKL keep that count per thread, and a thread that libtorch's own
/// parallel ops have not touched yet uses every core in its GEMMs, so
/// without this a worker set to one thread would run its functions'
/// matrix products on all of them (PyTorch's autograd and inter-op
/// threads apply the count the same way, with `at::init_num_threads`).
pub fn install(options: &mut RpcOptions) {
    #[cfg(feature = "cuda")]
    if let Err(reason) = load_cuda_backend() {
        tracing::info!(%reason, "libtorch has no CUDA in this process");
    }
    options.allocator = Arc::new(TchAllocator);
    options.hooks.on_thread_start(Arc::new(apply_thread_count));
}

/// Applies the process's libtorch intra-op thread count to this thread:
/// libtorch's first query of the count on a thread sets OpenMP's and MKL's
/// for it from the count the process set.
fn apply_thread_count() {
    let _ = tch::get_num_threads();
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;

    use ferry_rpc::Value;
    use tch::{Device, Kind};

    use crate::Tensor;

    /// What `Sync` for [`Tensor`] guards, the way an RRef's owner shares
    /// its value: eight threads at once read one tensor through a shared
    /// reference, encode the value holding it (as concurrent `to_here`
    /// calls do) and take shallow clones of it (as the distributed
    /// optimizer does). Every read sees the same data, and the tensor is
    /// intact afterwards.
    #[test]
    fn one_tensor_is_read_encoded_and_cloned_by_many_threads_at_once() {
        let data: Vec<f32> = (0..4096).map(|i| i as f32).collect();
        let t = tch::Tensor::from_slice(&data).reshape([64, 64]);
        let expected_sum = t.sum(Kind::Double).double_value(&[]);
        let ptr = t.data_ptr();
        let value = Value::new(Tensor::from(t));
        let shared: Arc<Tensor> = value.downcast::<Tensor>().unwrap();
        let expected_payload = value.encode().unwrap().payload;
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (value, shared) = (value.clone(), shared.clone());
                let expected_payload = expected_payload.clone();
                std::thread::spawn(move || {
                    for _ in 0..100 {
                        let encoded = value.encode().unwrap();
                        assert_eq!(encoded.payload, expected_payload);
                        assert_eq!(encoded.tensors.len(), 1);
                        let sum = shared.sum(Kind::Double).double_value(&[]);
                        assert_eq!(sum, expected_sum);
                        let clone = shared.shallow_clone();
                        assert_eq!(clone.data_ptr(), shared.data_ptr());
                        assert_eq!(clone.size(), [64, 64]);
                        drop(clone);
                        assert_eq!(shared.device(), Device::Cpu);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(shared.data_ptr(), ptr);
        assert_eq!(shared.sum(Kind::Double).double_value(&[]), expected_sum);
        assert_eq!(Vec::<f32>::try_from(shared.flatten(0, -1)).unwrap(), data);
    }
}
