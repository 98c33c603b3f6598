//! What can go wrong with an RRef.

use std::time::Duration;

use ferry_rpc::RpcError;
use ferry_wire::PeerText;

use crate::protocol::RRefId;

/// A text from another worker as an error shows it: escaped (see
/// [`PeerText`]), then `…(N more bytes)` if bytes of it were left out.
struct Shown<'a> {
    text: &'a str,
    omitted_bytes: u64,
}

impl<'a> Shown<'a> {
    fn new(text: &'a str, omitted_bytes: &u64) -> Self {
        Self {
            text,
            omitted_bytes: *omitted_bytes,
        }
    }
}

impl std::fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        PeerText::bounded(self.text, ferry_rpc::MAX_ERROR_TEXT_BYTES).fmt(f)?;
        if self.omitted_bytes > 0 {
            write!(f, "…({} more bytes)", self.omitted_bytes)?;
        }
        Ok(())
    }
}

/// An RRef operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RRefError {
    /// The `remote` call that creates the value timed out or could not be
    /// delivered; the RRef has no value to fetch or share.
    #[error("RRef creation failed/timed out: {rref_id} on owner {owner}: {reason}")]
    CreationFailed {
        /// The RRef.
        rref_id: RRefId,
        /// The owner's name.
        owner: String,
        /// What went wrong with the creating call.
        reason: String,
    },
    /// The function that computes the value failed on the owner; the error
    /// was stored there and is raised by every `to_here`.
    ///
    /// `message` is the function's error text exactly as it was raised
    /// (as [`RpcError::Remote`]'s is), up to
    /// [`MAX_ERROR_TEXT_BYTES`](ferry_rpc::MAX_ERROR_TEXT_BYTES); where the
    /// call was refused instead (no such function, a wrong signature), the
    /// refusal's text. `Display` shows it escaped on one line, followed by
    /// `…(N more bytes)` when it was cut.
    #[error(
        "the function creating {rref_id} failed on owner {owner}: {}",
        Shown::new(.message, .omitted_bytes)
    )]
    ValueFailed {
        /// The RRef.
        rref_id: RRefId,
        /// The owner's name.
        owner: String,
        /// The owner's error text, as raised.
        message: String,
        /// How many bytes of the raised text were left out after
        /// `message` (0: `message` is the whole text).
        omitted_bytes: u64,
    },
    /// `local_value` on a worker that is not the owner.
    #[error("local_value() of {rref_id} called on {worker}, but its owner is {owner}")]
    NotOwner {
        /// The RRef.
        rref_id: RRefId,
        /// The worker that asked.
        worker: String,
        /// The owner's name.
        owner: String,
    },
    /// The value did not become available in time.
    #[error("{rref_id} on owner {owner}: no value after {after:?}")]
    Timeout {
        /// The RRef.
        rref_id: RRefId,
        /// The owner's name.
        owner: String,
        /// The time waited.
        after: Duration,
    },
    /// The value is not of the type the RRef claims.
    #[error("{rref_id} on owner {owner} holds a {actual}, not a {expected}")]
    WrongType {
        /// The RRef.
        rref_id: RRefId,
        /// The owner's name.
        owner: String,
        /// The type asked for.
        expected: String,
        /// The type held.
        actual: String,
    },
    /// The owner no longer has the RRef (deleted, or never created there).
    #[error("{rref_id} is unknown on its owner {owner}")]
    Unknown {
        /// The RRef.
        rref_id: RRefId,
        /// The owner's name.
        owner: String,
    },
    /// The RRef was used after RPC shut down.
    #[error("{rref_id} used after shutdown")]
    ShutDown {
        /// The RRef.
        rref_id: RRefId,
    },
    /// An RRef was serialized outside any RPC message (PyTorch refuses
    /// pickling an RRef outside an RPC call too): only the arguments and
    /// results of `rpc_sync`, `rpc_async` and `remote` may carry one,
    /// because only there does the protocol learn who receives the fork.
    #[error("{rref_id} cannot be serialized outside an RPC message: pass RRefs only inside the arguments or results of rpc_sync, rpc_async or remote")]
    OutsideMessage {
        /// The RRef.
        rref_id: RRefId,
    },
    /// A user RRef that arrived in a function's arguments was not confirmed
    /// by its owner in time, so the function did not run.
    #[error("{rref_id} in the arguments was not confirmed by its owner {owner} within {after:?}")]
    NotConfirmed {
        /// The RRef.
        rref_id: RRefId,
        /// The owner's name.
        owner: String,
        /// The time waited.
        after: Duration,
    },
    /// The RRef layer is not installed on this worker's agent.
    #[error("RRefs are not installed on this worker: start it with ferry::init_rpc (which installs every layer), or call ferry_rref::install(&mut options) before starting the agent")]
    NotInstalled,
    /// The call carrying the request failed.
    #[error(transparent)]
    Rpc(#[from] RpcError),
    /// A message could not be encoded or decoded.
    #[error("{0}")]
    Codec(String),
}
