//! The manager as a server: `torchft.ManagerService` over gRPC (tonic), one
//! per replica group.
//!
//! A thin shell around the sans-IO rules:
//! [`QuorumGather`](super::QuorumGather) collects the ranks' quorum
//! requests; when the last of the `world_size` ranks has asked, a task
//! sends the group's one request to the lighthouse (retrying with back-off,
//! reconnecting each time) and hands the outcome to every rank of the
//! round, each of which answers with its own
//! [`compute_quorum_results`](super::compute_quorum_results).
//! [`ShouldCommitVotes`](super::ShouldCommitVotes) runs the per-step commit
//! vote; the consecutive failed commits ride on the next lighthouse
//! request. A background task heartbeats to the lighthouse.

mod grpc;
mod handle;
mod options;
mod round;
mod shared;
mod status;

pub use handle::Manager;
pub use options::{exit_on_kill, KillHook, ManagerOptions};
pub(crate) use round::{ERROR_KIND_KEY, LIGHTHOUSE_UNREACHABLE, RETRIES_KEY};
pub use status::{ManagerError, ManagerStatus};
