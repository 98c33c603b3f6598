//! # ferry-py
//!
//! Ferry from Python: the extension module `ferry._ferry` of the Python
//! package `ferry`, whose `ferry.rpc` is a drop-in for
//! `torch.distributed.rpc` (`import ferry.rpc as rpc`). Built with maturin
//! against the torch installed beside it (`pyproject.toml`; `cargo xtask
//! test` installs it into the project's `.venv`).
//!
//! The work is split where the GIL is:
//!
//! - **Python's side** (`python/ferry/rpc/`) is the public API and the
//!   pickling: `(function, args, kwargs)` and results are pickled with
//!   protocol 5, functions and classes by reference; every `torch.Tensor`
//!   and every RRef inside becomes a persistent id, an index into a list
//!   of its own.
//! - **This crate** takes those lists into a [`wire::Pickled`]: each
//!   tensor as a libtorch alias of the Python tensor ([`tensor`], a C++
//!   shim, no copy), so it travels out of band through Ferry's tensor
//!   channels and arrives in a fresh tensor's storage; each RRef as a fork
//!   by Ferry's RRef protocol. Calls are two functions every Python worker
//!   registers ([`wire::CALL`], [`wire::REMOTE`]), called through
//!   ferry-rpc and ferry-rref's public API with the GIL released.
//! - **On the callee** those functions run on the agent's body threads
//!   (which keep their Python thread state: [`gil::attach`]) or blocking
//!   pool and take the GIL only around the Python work (unpickle, call,
//!   pickle). A
//!   future of `rpc_async` is completed by a runtime of this crate's own
//!   ([`rpc::complete`]), its Python callbacks on that runtime's blocking
//!   pool: no agent runtime thread ever waits for the GIL, but the owner of
//!   a Python RRef's value answering `to_here`, which pickles inside
//!   `block_in_place` ([`gil`]).
//!
//! - **Mixed groups** ([`interop`], `ferry._ferry.interop`): a function
//!   named by a `str` is one a worker registered by name, a Rust
//!   function's or one `ferry.rpc.register`ed in Python; values are
//!   converted by the types' shapes its worker describes, into the Rust
//!   types' own serde layout and back.
//!
//! One Rust module per Python submodule: [`rpc`] is `ferry._ferry.rpc`,
//! [`autograd`] is `ferry._ferry.autograd` (`ferry.autograd`: contexts,
//! `backward` and `get_gradients` on ferry-autograd's engine).
//! `ferry.optim` (the `DistributedOptimizer`) is Python alone, over
//! `ferry.rpc` and `ferry.autograd`, as PyTorch's is.

pub mod autograd;
pub mod error;
pub mod future;
pub mod gil;
pub mod interop;
pub mod malloc;
pub mod pickle;
pub mod pyobj;
pub mod rpc;
pub mod tensor;
pub mod wire;

use pyo3::prelude::*;

/// The extension module `ferry._ferry`.
#[pymodule]
#[pyo3(name = "_ferry")]
fn ferry_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    rpc::register(m)?;
    interop::register_module(m)?;
    autograd::register(m)
}
