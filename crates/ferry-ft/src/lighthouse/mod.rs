//! The lighthouse's decisions, sans-IO.
//!
//! The lighthouse collects quorum requests from replica groups (one per
//! group, sent by the group's manager) and heartbeats, and decides when the
//! next quorum is ready and who is in it. Everything here takes `now` as an
//! argument: [`quorum_compute`] is a pure function of (now, state, options),
//! and [`LighthouseState`] holds the participants, heartbeats and the previous
//! quorum, with [`LighthouseState::tick`] turning a ready decision into the
//! [`Quorum`](crate::proto::Quorum) to deliver. [`LighthouseStatus`] is what
//! the dashboard shows, computed from the state.
//!
//! [`Lighthouse`] is the server around them: `torchft.LighthouseService`
//! over gRPC and the status dashboard over HTTP on one port. It only feeds
//! requests in and hands quorums out; the rules stay in the pure core.

mod dashboard;
mod host;
mod options;
mod quorum;
mod replica_id;
mod server;
mod state;
mod status;

pub use dashboard::PAGE_SIZE as DASHBOARD_PAGE_SIZE;
pub use host::BadAllowedHost;
pub use options::LighthouseOptions;
pub use quorum::{quorum_changed, quorum_compute};
pub use replica_id::{check_replica_id, ReplicaIdTooLong, MAX_REPLICA_ID_BYTES};
pub use server::{Lighthouse, LighthouseError};
pub use state::{LighthouseState, MemberDetails};
pub use status::{
    HeartbeatStatus, KillOutcome, LighthouseStatus, MemberStatus, OptionsStatus, QuorumStatus,
};
