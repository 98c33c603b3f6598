//! What the lighthouse tells about itself: the data behind its dashboard
//! and its `/status` JSON, computed from the state (sans-IO).

use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use super::quorum::Decision;
use super::{LighthouseOptions, LighthouseState};
use crate::proto::QuorumMember;

/// A snapshot of the lighthouse, as the dashboard shows it and `GET /status`
/// returns it (JSON). The fields torchft's status page has (`quorum_id`,
/// `quorum_status`, `max_step`, `num_participants`, the previous quorum's
/// members and the heartbeats) keep their names and their `-1` for "no
/// quorum yet".
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LighthouseStatus {
    /// The id of the last quorum delivered (0 before the first).
    pub quorum_id: i64,
    /// Whether [`quorum_compute`](super::quorum_compute) would deliver the
    /// next quorum now.
    pub next_quorum_ready: bool,
    /// [`quorum_compute`](super::quorum_compute)'s reason: why the next
    /// quorum is or is not ready.
    pub quorum_status: String,
    /// The highest step in the previous quorum, `-1` without one.
    pub max_step: i64,
    /// The size of the previous quorum, `-1` without one.
    pub num_participants: i64,
    /// The last quorum delivered.
    pub prev_quorum: Option<QuorumStatus>,
    /// The replica groups that have joined the next round, by replica id.
    pub participants: Vec<MemberStatus>,
    /// Every replica heard from, by replica id.
    pub heartbeats: Vec<HeartbeatStatus>,
    /// The lighthouse's options.
    pub options: OptionsStatus,
    /// What the last kill asked from the dashboard did, if any.
    pub last_kill: Option<KillOutcome>,
}

/// The previous quorum, as shown on the dashboard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QuorumStatus {
    /// Its id.
    pub quorum_id: i64,
    /// When it formed (its `created` stamp), in milliseconds since the Unix
    /// epoch.
    pub created_unix_ms: Option<i64>,
    /// How long ago it formed, in milliseconds.
    pub age_ms: Option<u64>,
    /// The highest step among its members.
    pub max_step: i64,
    /// Its members, sorted by replica id.
    pub members: Vec<MemberStatus>,
}

/// One replica group: a member of the previous quorum or a participant of
/// the next round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemberStatus {
    /// The replica group's id.
    pub replica_id: String,
    /// Its manager's gRPC address (where the dashboard sends `Kill`).
    pub address: String,
    /// Its store address.
    pub store_address: String,
    /// The step it reported.
    pub step: i64,
    /// Its number of ranks.
    pub world_size: u64,
    /// Whether it asked for a shrink-only quorum.
    pub shrink_only: bool,
    /// The commit failures it reported.
    pub commit_failures: i64,
    /// Its opaque user data.
    pub data: String,
    /// Whether its step is behind the highest step of its list (the previous
    /// quorum, or this round's participants): it heals before training on.
    pub recovering: bool,
    /// Milliseconds since its last heartbeat (joining counts as one).
    pub heartbeat_age_ms: Option<u64>,
    /// Whether that heartbeat is younger than the heartbeat timeout.
    pub healthy: bool,
    /// For a participant, milliseconds since it joined this round.
    pub joined_age_ms: Option<u64>,
}

/// The last heartbeat of one replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HeartbeatStatus {
    /// The replica's id.
    pub replica_id: String,
    /// Milliseconds since its last heartbeat.
    pub age_ms: u64,
    /// Whether that is younger than the heartbeat timeout.
    pub healthy: bool,
}

/// The lighthouse's options, in milliseconds as on its command line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OptionsStatus {
    /// [`LighthouseOptions::min_replicas`].
    pub min_replicas: u64,
    /// [`LighthouseOptions::join_timeout`].
    pub join_timeout_ms: u64,
    /// [`LighthouseOptions::quorum_tick`].
    pub quorum_tick_ms: u64,
    /// [`LighthouseOptions::heartbeat_timeout`].
    pub heartbeat_timeout_ms: u64,
}

/// What a kill asked from the dashboard (`POST /replica/{id}/kill`) did;
/// also the JSON body of that request's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KillOutcome {
    /// The replica asked to be killed.
    pub replica_id: String,
    /// Its manager's address, when the lighthouse knows the replica.
    pub address: Option<String>,
    /// Whether the manager acknowledged the `Kill`.
    pub ok: bool,
    /// Why not, when it did not.
    pub error: Option<String>,
    /// When the kill was asked, in milliseconds since the Unix epoch.
    pub at_unix_ms: i64,
}

impl LighthouseStatus {
    /// The status of `state` at `now` (`wall_now` is the same moment on the
    /// wall clock, for the age of the previous quorum's `created` stamp).
    /// [`last_kill`](Self::last_kill) is left empty: the server fills it in.
    pub fn new(
        now: Instant,
        wall_now: SystemTime,
        state: &LighthouseState,
        opt: &LighthouseOptions,
    ) -> Self {
        let decision = Decision::new(now, state, opt);
        let (ready, quorum_status) = (decision.ready(), decision.reason(opt));
        let heartbeat_age = |replica_id: &str| {
            state
                .heartbeats()
                .get(replica_id)
                .map(|last| now.saturating_duration_since(*last))
        };
        let member_status = |member: &QuorumMember, max_step: i64, joined: Option<Instant>| {
            let age = heartbeat_age(&member.replica_id);
            MemberStatus {
                replica_id: member.replica_id.clone(),
                address: member.address.clone(),
                store_address: member.store_address.clone(),
                step: member.step,
                world_size: member.world_size,
                shrink_only: member.shrink_only,
                commit_failures: member.commit_failures,
                data: member.data.clone(),
                recovering: member.step < max_step,
                heartbeat_age_ms: age.map(millis),
                healthy: age.is_some_and(|age| age < opt.heartbeat_timeout),
                joined_age_ms: joined.map(|joined| millis(now.saturating_duration_since(joined))),
            }
        };

        let prev_quorum = state.prev_quorum().map(|quorum| {
            let max_step = quorum
                .participants
                .iter()
                .map(|p| p.step)
                .max()
                .unwrap_or(-1);
            let created_unix_ms = quorum.created.as_ref().map(|created| {
                created
                    .seconds
                    .saturating_mul(1000)
                    .saturating_add(i64::from(created.nanos / 1_000_000))
            });
            let age_ms = quorum
                .created
                .as_ref()
                .and_then(|created| SystemTime::try_from(*created).ok())
                .map(|created| millis(wall_now.duration_since(created).unwrap_or_default()));
            QuorumStatus {
                quorum_id: quorum.quorum_id,
                created_unix_ms,
                age_ms,
                max_step,
                members: quorum
                    .participants
                    .iter()
                    .map(|member| member_status(member, max_step, None))
                    .collect(),
            }
        });

        let participants_max_step = state
            .participants()
            .values()
            .map(|details| details.member.step)
            .max()
            .unwrap_or(-1);
        let participants = state
            .participants()
            .values()
            .map(|details| {
                member_status(&details.member, participants_max_step, Some(details.joined))
            })
            .collect();

        let heartbeats = state
            .heartbeats()
            .iter()
            .map(|(replica_id, last)| {
                let age = now.saturating_duration_since(*last);
                HeartbeatStatus {
                    replica_id: replica_id.clone(),
                    age_ms: millis(age),
                    healthy: age < opt.heartbeat_timeout,
                }
            })
            .collect();

        Self {
            quorum_id: state.quorum_id(),
            next_quorum_ready: ready,
            quorum_status,
            max_step: prev_quorum.as_ref().map_or(-1, |q| q.max_step),
            num_participants: prev_quorum
                .as_ref()
                .map_or(-1, |q| i64::try_from(q.members.len()).unwrap_or(i64::MAX)),
            prev_quorum,
            participants,
            heartbeats,
            options: OptionsStatus {
                min_replicas: opt.min_replicas,
                join_timeout_ms: millis(opt.join_timeout),
                quorum_tick_ms: millis(opt.quorum_tick),
                heartbeat_timeout_ms: millis(opt.heartbeat_timeout),
            },
            last_kill: None,
        }
    }
}

/// A duration in whole milliseconds, saturating.
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
