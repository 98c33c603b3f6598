//! Errors of distributed autograd.

use ferry_rpc::RpcError;

/// What went wrong in distributed autograd.
#[derive(Debug, thiserror::Error)]
pub enum AutogradError {
    /// The agent has no autograd layer (`ferry_autograd::install` was not called).
    #[error("distributed autograd is not installed on this worker (call ferry_autograd::install on its options)")]
    NotInstalled,
    /// `context()` on a thread that is already inside one.
    #[error("this thread is already inside distributed autograd context {existing}: contexts do not nest")]
    NestedContext {
        /// The context the thread is in.
        existing: u64,
    },
    /// No context with this id on this worker.
    #[error("distributed autograd context {context_id} does not exist on worker {worker} (never created, or already released)")]
    UnknownContext {
        /// The id asked for.
        context_id: u64,
        /// This worker's name.
        worker: String,
    },
    /// A root of `backward` is not usable.
    #[error("backward root {index}: {reason}")]
    BadRoot {
        /// Position in the roots.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The context's graph was released by an earlier backward without `retain_graph`.
    #[error("the graph of distributed autograd context {0} was released by an earlier backward; pass retain_graph=true to run backward more than once")]
    GraphReleased(u64),
    /// libtorch's engine failed on this worker.
    #[error("the local autograd engine failed on worker {worker}: {message}")]
    Engine {
        /// This worker.
        worker: String,
        /// libtorch's message.
        message: String,
    },
    /// Another worker's part failed (its error inside).
    #[error("error on worker {worker}: {message}")]
    Remote {
        /// The worker whose part failed.
        worker: String,
        /// Its error.
        message: String,
    },
    /// The RPC layer failed.
    #[error(transparent)]
    Rpc(#[from] RpcError),
    /// The RRef layer failed (optimizer parameters).
    #[error(transparent)]
    RRef(#[from] ferry_rref::RRefError),
    /// An optimizer failed.
    #[error("optimizer on worker {worker}: {message}")]
    Optimizer {
        /// The owner whose optimizer failed.
        worker: String,
        /// Why.
        message: String,
    },
}

impl AutogradError {
    /// An error from another worker's part, named by that worker.
    pub(crate) fn from_remote(worker: &str, error: RpcError) -> Self {
        match error {
            RpcError::Remote { message, .. } => AutogradError::Remote {
                worker: worker.to_string(),
                message,
            },
            other => AutogradError::Remote {
                worker: worker.to_string(),
                message: other.to_string(),
            },
        }
    }
}
