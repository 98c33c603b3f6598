//! The manager: one per replica group.
//!
//! Its ranks each ask it for the next quorum; [`QuorumGather`] collects
//! them and, once all `world_size` ranks have asked, produces the single
//! request the manager sends to the lighthouse. With the lighthouse's
//! [`Quorum`](crate::proto::Quorum) back, [`compute_quorum_results`] tells
//! each rank its place: replica rank and world size, the max step, the
//! store to use, and whether and from whom to heal. [`ShouldCommitVotes`]
//! runs the per-step commit vote. These rules are sans-IO.
//!
//! [`Manager`] is the server around them: `torchft.ManagerService` over
//! gRPC, asking the lighthouse with retries and back-off and heartbeating to
//! it; [`ManagerClient`] is what a rank uses to talk to it (torchft's Python
//! `ManagerClient`), returning typed [`QuorumResult`]s and
//! [`ManagerClientError`]s.

mod client;
mod commit;
mod gather;
mod results;
mod server;

pub use client::{
    ManagerClient, ManagerClientError, NegativeField, QuorumRequest, QuorumResult,
    DEFAULT_CONNECT_TIMEOUT,
};
pub use commit::ShouldCommitVotes;
pub use gather::{GatheredQuorum, ManagerInfo, QuorumGather};
pub use results::compute_quorum_results;
pub use server::{exit_on_kill, KillHook, Manager, ManagerError, ManagerOptions, ManagerStatus};
