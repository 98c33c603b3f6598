//! Errors of the replica-group collectives.

use std::time::Duration;

use ferry_store::StoreError;

/// Why a collective operation, or setting one up, failed. Any of them
/// means the step must not be committed.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// The process group's listening socket could not be bound.
    #[error("process group: cannot bind {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The quorum handed to [`ProcessGroup::configure`](super::ProcessGroup::configure)
    /// cannot be used (a rank outside the world, another replica's id at
    /// this rank, no store address).
    #[error("invalid quorum for the process group: {reason}")]
    InvalidQuorum {
        /// What is wrong.
        reason: String,
    },
    /// The quorum's store address is not `host:port`, or does not
    /// resolve.
    #[error("store address {address:?}: {reason}")]
    StoreAddress {
        /// The store address of the quorum.
        address: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// The store could not be reached or failed.
    #[error("store at {address}: {source}")]
    Store {
        /// The store's address.
        address: String,
        /// What failed.
        #[source]
        source: StoreError,
    },
    /// Keys did not appear in the store in time (members of the quorum
    /// that never arrived).
    #[error("store at {address}: keys {keys:?} not set within {waited:?}")]
    StoreTimeout {
        /// The store's address.
        address: String,
        /// The keys still missing.
        keys: Vec<String>,
        /// How long.
        waited: Duration,
    },
    /// A peer replica group could not be connected to.
    #[error("cannot connect to replica rank {rank} at {address}: {reason}")]
    Connect {
        /// The peer's replica rank.
        rank: u64,
        /// Its address.
        address: String,
        /// What failed.
        reason: String,
    },
    /// A peer's connection was lost (the peer died or gave up).
    #[error("lost replica rank {rank} ({replica_id}): {reason}")]
    PeerLost {
        /// The peer's replica rank.
        rank: u64,
        /// Its replica id.
        replica_id: String,
        /// What the transport said.
        reason: String,
    },
    /// A peer sent something off protocol.
    #[error("replica rank {rank} ({replica_id}) sent malformed data: {reason}")]
    Protocol {
        /// The peer's replica rank.
        rank: u64,
        /// Its replica id.
        replica_id: String,
        /// What was wrong.
        reason: String,
    },
    /// The operation did not finish in time (a peer stalled, or never
    /// joined the group).
    #[error("{what} did not finish within {timeout:?}")]
    Timeout {
        /// The operation.
        what: &'static str,
        /// The limit.
        timeout: Duration,
    },
    /// No group is configured yet.
    #[error("the process group is not configured: call configure with a quorum first")]
    NotConfigured,
    /// An earlier operation of this group failed; its connections are gone
    /// and it can only be rebuilt for a new quorum.
    #[error(
        "the process group of quorum {quorum_id} failed earlier ({reason}); \
         it is rebuilt with the next quorum"
    )]
    Broken {
        /// The quorum of the failed group.
        quorum_id: i64,
        /// The first failure.
        reason: String,
    },
}
