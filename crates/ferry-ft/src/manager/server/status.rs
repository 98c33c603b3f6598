//! What a manager reports: [`ManagerError`] and [`ManagerStatus`].

use crate::access::EndpointError;

/// Why the manager server could not start or stopped badly.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// The options cannot work (a zero world size).
    #[error("manager {replica_id}: invalid options: {reason}")]
    InvalidOptions {
        /// The replica group.
        replica_id: String,
        /// What is wrong.
        reason: String,
    },
    /// The lighthouse address is not a valid URI, or does not fit
    /// [`lighthouse_tls`](super::ManagerOptions::lighthouse_tls).
    #[error("manager {replica_id}: invalid lighthouse address {address:?}: {source}")]
    InvalidLighthouseAddress {
        /// The replica group.
        replica_id: String,
        /// The address given.
        address: String,
        /// Why it was refused.
        source: EndpointError,
    },
    /// The listening socket could not be bound.
    #[error("manager {replica_id}: cannot bind {addr}: {source}")]
    Bind {
        /// The replica group.
        replica_id: String,
        /// The address asked for.
        addr: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("manager: server failed: {0}")]
    Serve(#[source] tonic::transport::Error),
    /// The server task panicked or was cancelled.
    #[error("manager: server task ended abnormally: {0}")]
    Task(#[source] tokio::task::JoinError),
}

/// What a manager has done so far, for logs and tests
/// ([`Manager::status`](super::Manager::status), [`Manager::wait_for_status`](super::Manager::wait_for_status)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ManagerStatus {
    /// The group ranks that have asked in the open quorum round, ascending.
    pub waiting_ranks: Vec<i64>,
    /// Quorum rounds started (every rank asked).
    pub rounds: u64,
    /// Quorum rounds answered with a quorum.
    pub quorums: u64,
    /// Quorum rounds answered with an error (the lighthouse unreachable
    /// after every retry).
    pub failed_rounds: u64,
    /// The id of the last quorum received from the lighthouse.
    pub quorum_id: Option<i64>,
    /// Lighthouse quorum requests sent, retries included.
    pub lighthouse_attempts: u64,
    /// Lighthouse quorum requests that failed.
    pub lighthouse_failures: u64,
    /// Why the last one failed.
    pub last_lighthouse_error: Option<String>,
    /// The group ranks that have voted in the open should-commit round,
    /// ascending.
    pub voted_ranks: Vec<i64>,
    /// Should-commit rounds decided.
    pub commit_decisions: u64,
    /// Consecutive should-commit rounds decided false, reset by a true one;
    /// sent with the next quorum request.
    pub commit_failures: i64,
    /// Heartbeats the lighthouse acknowledged.
    pub heartbeats: u64,
    /// Heartbeats that failed.
    pub heartbeat_failures: u64,
    /// `Kill` requests received.
    pub kills: u64,
}
