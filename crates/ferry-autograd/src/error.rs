//! Errors of distributed autograd.

use ferry_rpc::{RemoteError, RpcError};

/// What went wrong in distributed autograd.
#[derive(Debug, thiserror::Error)]
pub enum AutogradError {
    /// The agent has no autograd layer (`ferry_autograd::install` was not called).
    #[error("distributed autograd is not installed on this worker: start it with ferry::init_rpc (which installs every layer), or call ferry_autograd::install(&mut options) before starting the agent")]
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
    /// `backward` was given no roots (PyTorch: "No tensors provided for
    /// gradient computation"); the context's graph is left as it was.
    #[error("no tensors provided for gradient computation: backward needs at least one root")]
    NoRoots,
    /// A root of `backward` is an undefined tensor.
    #[error("backward root {index} is an undefined tensor")]
    UndefinedRoot {
        /// Position in the roots.
        index: usize,
    },
    /// A root of `backward` does not require grad (PyTorch: "requires_grad
    /// not set on root"). Checked first: a tensor that does not require
    /// grad has no autograd history at all.
    #[error("requires_grad not set on backward root {index}: it does not require grad, so it has no autograd history")]
    RootDoesNotRequireGrad {
        /// Position in the roots.
        index: usize,
    },
    /// A root of `backward` has more (or fewer) than one element (PyTorch:
    /// "is not a scalar, all roots need to be scalar"). Checked after
    /// `requires_grad`, before the gradient function.
    #[error("backward root {index} of shape {shape:?} is not a scalar, all roots need to be scalar (one element)")]
    RootNotScalar {
        /// Position in the roots.
        index: usize,
        /// The root's shape.
        shape: Vec<i64>,
    },
    /// A root of `backward` is a leaf: a scalar that requires grad but was
    /// not computed from anything (PyTorch: "does not have a valid gradient
    /// function"). Checked last.
    #[error("backward root {index} does not have a valid gradient function: it is a leaf tensor (a root must be computed from tensors that require grad)")]
    RootWithoutGradFn {
        /// Position in the roots.
        index: usize,
    },
    /// [`current_context`](crate::current_context) on a thread that is in
    /// no distributed autograd context (PyTorch: "Current thread doesn't
    /// have a valid autograd context").
    #[error("this thread is not inside a distributed autograd context: open one with ferry_autograd::context(), or call from a function that an RPC made inside one runs")]
    NoCurrentContext,
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
    /// Another worker's part failed: the worker where the error started
    /// ([`RemoteError::origin`]), its message, and the workers that relayed
    /// it here ([`RemoteError::hops`]).
    #[error(transparent)]
    Remote(RemoteError),
    /// The RPC layer failed (boxed: an RPC error's texts would make every
    /// `Result` of this crate large).
    #[error(transparent)]
    Rpc(Box<RpcError>),
    /// The RRef layer failed (optimizer parameters; boxed, as `Rpc`).
    #[error(transparent)]
    RRef(Box<ferry_rref::RRefError>),
    /// An owner of parameters given to a `DistributedOptimizer` has no
    /// user-defined optimizer class of this name registered.
    #[error("worker {worker} has no optimizer class {class:?} registered: register it on every worker that owns parameters (OptimizerClass::register on the functions it serves)")]
    UnknownOptimizerClass {
        /// The owner.
        worker: String,
        /// The class's name.
        class: String,
    },
    /// An optimizer failed. `message` may be an owner's error text as
    /// raised there ([`RpcError::Remote`]'s `message`); `Display` shows it
    /// escaped, as `RpcError` does.
    #[error(
        "optimizer on worker {worker}: {}",
        ferry_wire::PeerText::bounded(.message, ferry_rpc::MAX_ERROR_TEXT_BYTES)
    )]
    Optimizer {
        /// The owner whose optimizer failed.
        worker: String,
        /// Why.
        message: String,
    },
}

impl From<RpcError> for AutogradError {
    fn from(e: RpcError) -> Self {
        AutogradError::Rpc(Box::new(e))
    }
}

impl From<ferry_rref::RRefError> for AutogradError {
    fn from(e: ferry_rref::RRefError) -> Self {
        AutogradError::RRef(Box::new(e))
    }
}

impl AutogradError {
    /// An error in the reply of `worker`, sent a gradient by this worker:
    /// a failed call names `worker` as its origin.
    pub(crate) fn from_remote(worker: &str, error: RpcError) -> Self {
        match error {
            RpcError::Remote { message, .. } => {
                AutogradError::Remote(RemoteError::new(worker, message))
            }
            other => AutogradError::from(other),
        }
    }

    /// This worker's part failed with `self`: the error as it travels
    /// back to the worker that sent the gradient, `me` named as its origin
    /// unless it started further away (then `me` is one more hop).
    pub(crate) fn into_remote(self, me: &str) -> RemoteError {
        match self {
            AutogradError::Remote(r) => r.relayed_by(me),
            AutogradError::Engine { worker, message } => {
                RemoteError::new(worker, format!("{message} (in the local autograd engine)"))
            }
            other => RemoteError::new(me, other.to_string()),
        }
    }
}

/// The error proper of a libtorch error text: without the C++ backtrace
/// libtorch appends ("Exception raised from ..., frame #0: ...").
pub(crate) fn error_proper(text: &str) -> String {
    let cut = [
        "\nException raised from ",
        "Exception raised from ",
        "\nframe #",
    ]
    .iter()
    .filter_map(|m| text.find(m))
    .min()
    .unwrap_or(text.len());
    text[..cut].trim_end().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_backtraces_are_cut_from_error_texts() {
        let text = "one of the variables needed for gradient computation has been modified by an inplace operation\nException raised from unpack at /pytorch/torch/csrc/autograd/saved_variable.cpp:180 (most recent call first):\nframe #0: c10::Error::Error() + 0x9e";
        assert_eq!(
            error_proper(text),
            "one of the variables needed for gradient computation has been modified by an inplace operation"
        );
        assert_eq!(error_proper("plain"), "plain");
        assert_eq!(error_proper("two\nlines"), "two\nlines");
    }

    #[test]
    fn errors_relayed_back_name_their_origin_once() {
        let engine = AutogradError::Engine {
            worker: "worker2".into(),
            message: "inplace".into(),
        };
        let at_w2 = engine.into_remote("worker2");
        let at_w0 = AutogradError::Remote(at_w2).into_remote("worker0");
        let at_root = AutogradError::Remote(at_w0.relayed_by("worker3"));
        let AutogradError::Remote(r) = &at_root else {
            unreachable!()
        };
        assert_eq!(r.origin(), "worker2");
        assert_eq!(r.hops(), ["worker2", "worker0", "worker3"]);
        assert_eq!(
            at_root.to_string(),
            "error on worker worker2: inplace (in the local autograd engine) (relayed by worker0 -> worker3)"
        );
    }
}
