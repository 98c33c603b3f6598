//! Errors of live recovery.

use std::time::Duration;

use ferry_transport::TransportError;

/// Why fetching a checkpoint from a source replica failed.
#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    /// The checkpoint address does not resolve.
    #[error("invalid checkpoint address {address:?}: {reason}")]
    InvalidAddress {
        /// The address (checkpoint metadata) given.
        address: String,
        /// Why it was refused.
        reason: String,
    },
    /// The source could not be reached: nothing listens there, or the
    /// connection or its handshake failed (a dead source).
    #[error("cannot reach the checkpoint server at {address}: {reason}")]
    SourceUnreachable {
        /// The source's checkpoint address.
        address: String,
        /// What failed.
        reason: String,
    },
    /// The connection to the source was lost during the transfer (the
    /// source died or closed it).
    #[error("lost the connection to the checkpoint server at {address}: {reason}")]
    SourceLost {
        /// The source's checkpoint address.
        address: String,
        /// What the transport said.
        reason: String,
    },
    /// The source sent nothing for too long.
    #[error("checkpoint server at {address} sent nothing for {timeout:?} while {waiting_for}")]
    Timeout {
        /// The source's checkpoint address.
        address: String,
        /// What was awaited.
        waiting_for: &'static str,
        /// How long.
        timeout: Duration,
    },
    /// The source serves the checkpoint of another step.
    #[error(
        "checkpoint server at {address} serves step {serving}, \
         but step {requested} was asked for"
    )]
    StepMismatch {
        /// The source's checkpoint address.
        address: String,
        /// The step asked for.
        requested: i64,
        /// The step the source serves.
        serving: i64,
    },
    /// The source allowed no checkpoint within the wait.
    #[error("checkpoint server at {address} served no checkpoint for step {requested} within {waited:?}")]
    NotServing {
        /// The source's checkpoint address.
        address: String,
        /// The step asked for.
        requested: i64,
        /// How long the client let it wait.
        waited: Duration,
    },
    /// The source refused the request as invalid.
    #[error("checkpoint server at {address} refused the request: {reason}")]
    Refused {
        /// The source's checkpoint address.
        address: String,
        /// Its reason.
        reason: String,
    },
    /// The source sent something that does not follow the protocol: a
    /// malformed frame or payload, an inconsistent manifest, a chunk that
    /// is not the one planned, a wrong chunk count.
    #[error("malformed data from the checkpoint server at {address}: {reason}")]
    Malformed {
        /// The source's checkpoint address.
        address: String,
        /// What was wrong.
        reason: String,
    },
    /// The destinations given to
    /// [`fetch_checkpoint_into`](super::fetch_checkpoint_into) do not fit
    /// the checkpoint (names, dtypes, shapes), or are not contiguous and
    /// exclusively owned.
    #[error("destination does not fit the checkpoint: {reason}")]
    Destination {
        /// What does not fit.
        reason: String,
    },
    /// The fetch options cannot work.
    #[error("invalid fetch options: {reason}")]
    InvalidOptions {
        /// What is wrong.
        reason: String,
    },
    /// A lane task panicked or was cancelled.
    #[error("checkpoint transfer task ended abnormally: {0}")]
    Task(#[source] tokio::task::JoinError),
}

/// Why a checkpoint server could not start.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointServerError {
    /// The listening socket could not be bound.
    #[error("checkpoint server: cannot bind {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A tensor of the state could not be prepared for serving (a copy of
    /// a non-contiguous view failed).
    #[error("checkpoint server: cannot serve tensor {name:?}: {source}")]
    Tensor {
        /// The tensor's name.
        name: String,
        /// Why.
        #[source]
        source: TransportError,
    },
}
