//! The crate's error type.

/// Why a fault-tolerance operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FtError {
    /// The quorum handed to [`compute_quorum_results`](crate::manager::compute_quorum_results)
    /// does not contain this replica (torchft answers `NOT_FOUND`).
    #[error("replica {replica_id} not participating in returned quorum")]
    NotInQuorum {
        /// The replica that looked itself up.
        replica_id: String,
    },
    /// A group rank below zero.
    #[error("group rank {group_rank} is negative")]
    NegativeGroupRank {
        /// The rank received.
        group_rank: i64,
    },
    /// A group rank outside `0..world_size` of the replica group.
    #[error("group rank {group_rank} is outside the replica group's world size {world_size}")]
    InvalidGroupRank {
        /// The rank received.
        group_rank: i64,
        /// The replica group's world size.
        world_size: u64,
    },
    /// A should-commit vote for another step than the round being voted on.
    #[error(
        "should_commit vote from group rank {group_rank} is for step {step}, \
         but the open round is for step {expected}"
    )]
    StepMismatch {
        /// The voting rank.
        group_rank: i64,
        /// The step of its vote.
        step: i64,
        /// The step of the open round.
        expected: i64,
    },
}
