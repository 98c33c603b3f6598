//! ferry-py's errors, and the Python exceptions they become: PyTorch's
//! types and message shapes where `torch.distributed.rpc` raises one for
//! the same cause (its tests match them with regular expressions), Ferry's
//! own text otherwise.

use std::time::Duration;

use ferry::autograd::AutogradError;
use ferry::rpc::RpcError;
use ferry::RRefError;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::PyErr;

/// What PyTorch's API functions (`rpc_sync`, `remote`, `shutdown`, ...)
/// raise when no agent runs (its `_require_initialized`), naming Ferry's
/// `init_rpc`.
pub const NOT_INITIALIZED: &str = "RPC has not been initialized. Call ferry.rpc.init_rpc first.";

/// What PyTorch's `torch.distributed.autograd` raises when no agent runs,
/// naming Ferry's `init_rpc`.
pub const AGENT_NOT_SET: &str = "Current RPC agent is not set! Did you initialize the RPC \
                                 framework (ferry.rpc.init_rpc)?";

/// What PyTorch raises when a `remote` call's creation timed out.
pub const CREATION_TIMED_OUT: &str = "RRef creation via rpc.remote() timed out, and it is \
                                      possible that the RRef on the owner node does not exist.";

/// A ferry-py operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An RPC failed.
    #[error(transparent)]
    Rpc(#[from] RpcError),
    /// An RRef operation failed.
    #[error(transparent)]
    RRef(#[from] RRefError),
    /// A tensor could not be converted between Python and libtorch.
    #[error("tensor conversion failed: {0}")]
    Tensor(String),
    /// A `torch.futures.Future` could not be completed with an error (not
    /// a torch future, or done already).
    #[error("{0}")]
    Future(String),
    /// An argument from Python is not one this call takes.
    #[error("{0}")]
    Argument(String),
    /// Python code (pickling, the function, a callback) raised.
    #[error(transparent)]
    Python(#[from] PyErr),
    /// Distributed autograd (a context, `backward`, gradients) failed.
    #[error(transparent)]
    Autograd(#[from] AutogradError),
}

/// PyTorch's text for a call that ran past its timeout.
pub fn timeout_message(after: Duration) -> String {
    format!(
        "RPC ran for more than set timeout ({} ms) and will now be marked with an error",
        after.as_millis()
    )
}

fn rpc_to_py(e: RpcError) -> PyErr {
    match e {
        RpcError::Timeout { after, .. } => PyRuntimeError::new_err(timeout_message(after)),
        RpcError::NotInitialized => PyRuntimeError::new_err(NOT_INITIALIZED),
        RpcError::Config(_) | RpcError::InvalidName { .. } => PyValueError::new_err(e.to_string()),
        // PyTorch's agent: "name:{},rank:{} could not find destination name {}".
        RpcError::UnknownWorker(ref name) => {
            PyRuntimeError::new_err(format!("could not find destination name {name}: {e}"))
        }
        // PyTorch's rendezvous: "Worker name {} is not unique. Workers ...".
        RpcError::DuplicateName {
            ref name,
            ref ranks,
        } => PyRuntimeError::new_err(format!(
            "Worker name {name} is not unique: ranks {ranks:?} use it"
        )),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        match e {
            Error::Rpc(e) => rpc_to_py(e),
            Error::RRef(RRefError::Rpc(e)) => rpc_to_py(e),
            Error::RRef(RRefError::Timeout { after, .. }) => {
                PyRuntimeError::new_err(timeout_message(after))
            }
            Error::RRef(e @ RRefError::CreationFailed { .. }) => {
                PyRuntimeError::new_err(format!("{CREATION_TIMED_OUT} ({e})"))
            }
            Error::RRef(RRefError::NotOwner { owner, .. }) => PyRuntimeError::new_err(format!(
                "Cannot call localValue() on a non-local reference. Call it on {owner}"
            )),
            Error::RRef(RRefError::ShutDown { .. }) => PyRuntimeError::new_err(NOT_INITIALIZED),
            Error::RRef(e) => PyRuntimeError::new_err(e.to_string()),
            Error::Tensor(_) => PyRuntimeError::new_err(e.to_string()),
            Error::Argument(m) => PyTypeError::new_err(m),
            Error::Future(m) => PyRuntimeError::new_err(m),
            Error::Python(e) => e,
            Error::Autograd(e) => autograd_to_py(e),
        }
    }
}

/// A distributed autograd error as PyTorch's `torch.distributed.autograd`
/// raises it for the same cause: RPC and RRef errors as those layers'
/// are raised, the rest as a `RuntimeError` of [`autograd_message`].
fn autograd_to_py(e: AutogradError) -> PyErr {
    match e {
        AutogradError::Rpc(e) if matches!(*e, RpcError::NotInitialized) => {
            PyRuntimeError::new_err(AGENT_NOT_SET)
        }
        AutogradError::Rpc(e) => rpc_to_py(*e),
        AutogradError::RRef(e) => Error::RRef(*e).into(),
        other => PyRuntimeError::new_err(autograd_message(&other)),
    }
}

/// The text of a distributed autograd error raised in Python: PyTorch's
/// text for the same cause first (its tests match it), Ferry's details
/// after it. An error on another worker reads `Error on Node <rank>: ...`,
/// the rank of the worker where it started (its name when no agent runs).
pub fn autograd_message(e: &AutogradError) -> String {
    match e {
        AutogradError::UnknownContext { context_id, worker } => format!(
            "Could not find autograd context with id: {context_id} (on worker {worker}: never \
             created, or already released)"
        ),
        AutogradError::NestedContext { existing } => format!(
            "Already have an autograd context id for this thread: {existing} (distributed \
             autograd contexts do not nest)"
        ),
        AutogradError::NoCurrentContext => "Current thread doesn't have a valid autograd \
                                            context. Please wrap your code using: `with \
                                            ferry.autograd.context() as context_id` to \
                                            generate a valid context"
            .to_string(),
        AutogradError::NoRoots => "No tensors provided for gradient computation".to_string(),
        e @ AutogradError::GraphReleased(_) => {
            format!("Trying to backward through the graph a second time: {e}")
        }
        AutogradError::Remote(r) => {
            let node =
                ferry::get_worker_info(Some(ferry::rpc::WorkerRef::Name(r.origin().to_string())))
                    .map(|w| w.id.to_string())
                    .unwrap_or_else(|_| r.origin().to_string());
            let relayed = match r.hops() {
                [_, rest @ ..] if !rest.is_empty() => {
                    format!(" (relayed by {})", rest.join(" -> "))
                }
                _ => String::new(),
            };
            format!("Error on Node {node}: {}{relayed}", r.message())
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_reads_as_pytorchs() {
        let e = RpcError::Timeout {
            worker: "worker1".into(),
            function: "ferry.py.call".into(),
            after: Duration::from_millis(1500),
        };
        let text = Error::from(e).to_string();
        assert!(text.contains("timed out"), "{text}");
        assert_eq!(
            timeout_message(Duration::from_millis(1500)),
            "RPC ran for more than set timeout (1500 ms) and will now be marked with an error"
        );
    }

    #[test]
    fn autograd_errors_start_with_pytorchs_text() {
        let cases = [
            (
                AutogradError::UnknownContext {
                    context_id: 42,
                    worker: "worker1".into(),
                },
                "Could not find autograd context with id: 42 ",
            ),
            (
                AutogradError::NestedContext { existing: 7 },
                "Already have an autograd context id for this thread",
            ),
            (
                AutogradError::NoCurrentContext,
                "Current thread doesn't have a valid autograd context",
            ),
            (
                AutogradError::NoRoots,
                "No tensors provided for gradient computation",
            ),
            (
                AutogradError::GraphReleased(3),
                "Trying to backward through the graph a second time",
            ),
            (
                AutogradError::RootNotScalar {
                    index: 0,
                    shape: vec![2],
                },
                "backward root 0 of shape [2] is not a scalar, all roots need to be scalar",
            ),
        ];
        for (e, start) in cases {
            let text = autograd_message(&e);
            assert!(
                text.starts_with(start),
                "{text:?} does not start with {start:?}"
            );
        }
        // No agent here: the node is named by the worker's name.
        let remote =
            ferry::rpc::RemoteError::new("worker2", "Simulate error").relayed_by("worker1");
        assert_eq!(
            autograd_message(&AutogradError::Remote(remote)),
            "Error on Node worker2: Simulate error (relayed by worker1)"
        );
    }
}
