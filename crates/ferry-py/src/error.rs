//! ferry-py's errors, and the Python exceptions they become: PyTorch's
//! types and message shapes where `torch.distributed.rpc` raises one for
//! the same cause (its tests match them with regular expressions), Ferry's
//! own text otherwise.

use std::time::Duration;

use ferry::rpc::RpcError;
use ferry::RRefError;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::PyErr;

/// What PyTorch raises when no agent runs (`_get_current_rpc_agent`).
pub const NOT_INITIALIZED: &str = "Current RPC agent is not set! Did you initialize the RPC \
                                   framework (e.g. by calling `rpc.init_rpc`)?";

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
    /// An argument from Python is not one this call takes.
    #[error("{0}")]
    Argument(String),
    /// Python code (pickling, the function, a callback) raised.
    #[error(transparent)]
    Python(#[from] PyErr),
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
            Error::Python(e) => e,
        }
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
}
