//! The manager's decisions, sans-IO.
//!
//! One manager runs per replica group. Its ranks each ask it for the next
//! quorum; [`QuorumGather`] collects them and, once all `world_size` ranks
//! have asked, produces the single request the manager sends to the
//! lighthouse. With the lighthouse's [`Quorum`](crate::proto::Quorum) back,
//! [`compute_quorum_results`] tells each rank its place: replica rank and
//! world size, the max step, the store to use, and whether and from whom to
//! heal. [`ShouldCommitVotes`] runs the per-step commit vote.

mod commit;
mod gather;
mod results;

pub use commit::ShouldCommitVotes;
pub use gather::{GatheredQuorum, ManagerInfo, QuorumGather};
pub use results::compute_quorum_results;
