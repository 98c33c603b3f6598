//! The agent's error type.

use std::time::Duration;

use ferry_transport::TransportError;

use crate::store::StoreError;

/// Why an RPC call, an init or a shutdown failed. Every variant names what
/// was wrong: the worker, the function, the limit.
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    /// No agent is running in this process (before init or after shutdown).
    #[error("RPC is not initialized: call init_rpc first (or it was shut down)")]
    NotInitialized,
    /// `init_rpc` was called while an agent is running.
    #[error("RPC is already initialized in this process as worker {name:?}")]
    AlreadyInitialized {
        /// Name of the running worker.
        name: String,
    },
    /// A worker name breaks the naming rules.
    #[error("invalid worker name {name:?}: {reason}")]
    InvalidName {
        /// The name given.
        name: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// Two workers registered the same name.
    #[error("duplicate worker name {name:?} used by ranks {ranks:?}")]
    DuplicateName {
        /// The name.
        name: String,
        /// The ranks that claimed it.
        ranks: Vec<u32>,
    },
    /// A rank outside `0..world_size`.
    #[error("invalid rank {rank}: world size is {world_size}")]
    InvalidRank {
        /// The rank given.
        rank: u32,
        /// The world size.
        world_size: u32,
    },
    /// A rank given as a number no rank can be (negative, or over `u32`).
    #[error("invalid rank {rank}: world size is {world_size}")]
    RankOutOfRange {
        /// The rank given.
        rank: i128,
        /// The world size.
        world_size: u32,
    },
    /// No worker has this name.
    #[error("unknown worker {0:?}")]
    UnknownWorker(String),
    /// The callee has no function registered under this name.
    #[error("worker {worker:?} has no function {function:?} registered")]
    UnknownFunction {
        /// The callee.
        worker: String,
        /// The name called.
        function: String,
    },
    /// The arguments or result type of a call do not match the callee's registration.
    #[error(
        "wrong type calling {function:?} on worker {worker:?}: it takes {expected}, the call sent {got}"
    )]
    WrongType {
        /// The callee.
        worker: String,
        /// The function.
        function: String,
        /// The signature registered on the callee.
        expected: String,
        /// The signature the caller used.
        got: String,
    },
    /// The remote function failed (returned an error or panicked).
    #[error("function {function:?} failed on worker {worker:?}: {message}")]
    Remote {
        /// The callee.
        worker: String,
        /// The function.
        function: String,
        /// The error's text.
        message: String,
    },
    /// The call did not complete in time; a late reply is dropped.
    #[error("call of {function:?} on worker {worker:?} timed out after {after:?}")]
    Timeout {
        /// The callee.
        worker: String,
        /// The function.
        function: String,
        /// The timeout that expired.
        after: Duration,
    },
    /// The connection to a worker failed or was lost with the call outstanding.
    #[error("worker {worker:?} is unreachable: {reason}")]
    PeerUnreachable {
        /// The peer.
        worker: String,
        /// What happened.
        reason: String,
    },
    /// The call is over a limit the callee stated in its handshake (e.g.
    /// its largest message): it was not sent, and the connection and the
    /// other calls on it are unaffected.
    #[error(
        "call of {function:?} on worker {worker:?} not sent: its {what} of {len} exceeds the worker's limit of {max}"
    )]
    TooLarge {
        /// The callee.
        worker: String,
        /// The function.
        function: String,
        /// Which length (`"message tensor bytes"`, `"payload length"`, ...).
        what: &'static str,
        /// The call's length.
        len: u64,
        /// The callee's limit.
        max: u64,
    },
    /// The call was cut short by an immediate shutdown.
    #[error("call of {function:?} on worker {worker:?} aborted: RPC is shutting down")]
    ShutDown {
        /// The callee.
        worker: String,
        /// The function.
        function: String,
    },
    /// Arguments or a result could not be encoded or decoded.
    #[error("cannot {action} for {function:?}: {message}")]
    Codec {
        /// "encode the arguments", "decode the result", ...
        action: &'static str,
        /// The function.
        function: String,
        /// The codec's error.
        message: String,
    },
    /// Rendezvous through the store failed.
    #[error("rendezvous failed: {0}")]
    Rendezvous(#[from] StoreError),
    /// A transport failure outside any single call.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// Options are missing or inconsistent.
    #[error("invalid RPC options: {0}")]
    Config(String),
    /// Graceful shutdown could not complete.
    #[error("graceful shutdown failed: {0}")]
    Join(String),
}

impl RpcError {
    /// The error of a call to `function` on `worker` that a check against
    /// the worker's limits refused.
    pub(crate) fn too_large(worker: String, function: String, e: ferry_wire::WireError) -> Self {
        match e {
            ferry_wire::WireError::TooLarge { what, len, max } => RpcError::TooLarge {
                worker,
                function,
                what,
                len,
                max,
            },
            other => RpcError::Codec {
                action: "check the call against the worker's limits",
                function,
                message: other.to_string(),
            },
        }
    }
}

/// An error that started on one worker and reached this one through a
/// chain of others (a backward pass that failed three workers away, a
/// call made from inside a call): the worker where it started and its
/// message, with the workers it crossed kept as context.
///
/// ```
/// use ferry_rpc::RemoteError;
///
/// let e = RemoteError::new("worker2", "the engine failed")
///     .relayed_by("worker0")
///     .relayed_by("worker3");
/// assert_eq!(e.origin(), "worker2");
/// assert_eq!(e.message(), "the engine failed");
/// assert_eq!(e.hops(), ["worker2", "worker0", "worker3"]);
/// assert_eq!(
///     e.to_string(),
///     "error on worker worker2: the engine failed (relayed by worker0 -> worker3)"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, crate::Schema)]
pub struct RemoteError {
    origin: String,
    message: String,
    hops: Vec<String>,
}

impl RemoteError {
    /// An error raised on `origin` with `message` (the error proper, not
    /// prefixed with the worker's name).
    pub fn new(origin: impl Into<String>, message: impl Into<String>) -> Self {
        let origin = origin.into();
        Self {
            hops: vec![origin.clone()],
            origin,
            message: message.into(),
        }
    }

    /// The same error, passed on by `worker` (added once to the hops).
    #[must_use]
    pub fn relayed_by(mut self, worker: impl Into<String>) -> Self {
        let worker = worker.into();
        if self.hops.last() != Some(&worker) {
            self.hops.push(worker);
        }
        self
    }

    /// The worker where the error started.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The error as raised on its origin.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The workers the error crossed: its origin first, then each worker
    /// that passed it on, the one that reported it here last.
    pub fn hops(&self) -> &[String] {
        &self.hops
    }
}

impl std::fmt::Display for RemoteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "error on worker {}: {}", self.origin, self.message)?;
        if self.hops.len() > 1 {
            write!(f, " (relayed by {})", self.hops[1..].join(" -> "))?;
        }
        Ok(())
    }
}

impl std::error::Error for RemoteError {}
