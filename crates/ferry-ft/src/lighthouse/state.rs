//! The lighthouse's state and its transitions.

use std::collections::BTreeMap;
use std::time::{Instant, SystemTime};

use super::{quorum_changed, quorum_compute, LighthouseOptions};
use crate::proto::{Quorum, QuorumMember};

/// A replica group that has joined the current round.
#[derive(Debug, Clone, PartialEq)]
pub struct MemberDetails {
    /// When it (last) joined.
    pub joined: Instant,
    /// What it sent.
    pub member: QuorumMember,
}

/// Everything the lighthouse remembers: this round's participants, the last
/// heartbeat of every replica it has heard from, the previous quorum and the
/// current quorum id.
///
/// Time is always passed in. The server calls [`join`](Self::join) for each
/// quorum request, [`heartbeat`](Self::heartbeat) for each heartbeat, and
/// [`tick`](Self::tick) on every request and every `quorum_tick`; a replica
/// whose request is answered with a quorum it is not part of joins again
/// (calls [`join`](Self::join) once more) for the next round.
#[derive(Debug, Clone, Default)]
pub struct LighthouseState {
    participants: BTreeMap<String, MemberDetails>,
    heartbeats: BTreeMap<String, Instant>,
    prev_quorum: Option<Quorum>,
    quorum_id: i64,
    last_reason: Option<String>,
}

impl LighthouseState {
    /// A fresh lighthouse: no participants, no heartbeats, no quorum yet,
    /// quorum id 0 (the first quorum gets id 1).
    pub fn new() -> Self {
        Self::default()
    }

    /// `member` joins the current round at `now`, replacing an earlier join
    /// of the same replica id (and its join time). Joining counts as a
    /// heartbeat.
    pub fn join(&mut self, now: Instant, member: QuorumMember) {
        self.heartbeats.insert(member.replica_id.clone(), now);
        self.participants.insert(
            member.replica_id.clone(),
            MemberDetails {
                joined: now,
                member,
            },
        );
    }

    /// Records a heartbeat from `replica_id` at `now`.
    pub fn heartbeat(&mut self, now: Instant, replica_id: impl Into<String>) {
        self.heartbeats.insert(replica_id.into(), now);
    }

    /// Evaluates the quorum at `now` ([`quorum_compute`]). When it is ready:
    /// bumps the quorum id if the membership changed since the previous
    /// quorum (or there was none) or if any member reports
    /// `commit_failures > 0`, remembers the quorum as the previous one,
    /// clears the participants, and returns the quorum to deliver to every
    /// waiting requester. Its `created` stamp is left empty; see
    /// [`tick_created`](Self::tick_created).
    pub fn tick(&mut self, now: Instant, opt: &LighthouseOptions) -> Option<Quorum> {
        self.tick_inner(now, None, opt)
    }

    /// As [`tick`](Self::tick), stamping the quorum's `created` field with
    /// the wall-clock time `created` (torchft stamps the time it formed).
    pub fn tick_created(
        &mut self,
        now: Instant,
        created: SystemTime,
        opt: &LighthouseOptions,
    ) -> Option<Quorum> {
        self.tick_inner(now, Some(created.into()), opt)
    }

    fn tick_inner(
        &mut self,
        now: Instant,
        created: Option<prost_types::Timestamp>,
        opt: &LighthouseOptions,
    ) -> Option<Quorum> {
        let (participants, reason) = quorum_compute(now, self, opt);
        if self.last_reason.as_deref() != Some(reason.as_str()) {
            tracing::info!("Quorum status: {reason}");
            self.last_reason = Some(reason);
        }
        let participants = participants?;

        let changed = self
            .prev_quorum
            .as_ref()
            .is_none_or(|prev| quorum_changed(&participants, &prev.participants));
        if changed {
            self.quorum_id += 1;
            tracing::info!(
                quorum_id = self.quorum_id,
                "Detected quorum change, bumping quorum_id to {}",
                self.quorum_id
            );
        } else {
            let failed: Vec<&str> = participants
                .iter()
                .filter(|p| p.commit_failures > 0)
                .map(|p| p.replica_id.as_str())
                .collect();
            if !failed.is_empty() {
                self.quorum_id += 1;
                tracing::info!(
                    quorum_id = self.quorum_id,
                    "Detected commit failures in [{}], bumping quorum_id to {}",
                    failed.join(", "),
                    self.quorum_id
                );
            }
        }

        let quorum = Quorum {
            quorum_id: self.quorum_id,
            participants,
            created,
        };
        tracing::info!(
            quorum_id = quorum.quorum_id,
            participants = quorum.participants.len(),
            "Quorum!"
        );
        self.prev_quorum = Some(quorum.clone());
        self.participants.clear();
        Some(quorum)
    }

    /// The reason [`quorum_compute`] gives at `now`, without changing
    /// anything (for status pages).
    pub fn status(&self, now: Instant, opt: &LighthouseOptions) -> String {
        quorum_compute(now, self, opt).1
    }

    /// The reason of the last [`tick`](Self::tick), if any.
    pub fn last_reason(&self) -> Option<&str> {
        self.last_reason.as_deref()
    }

    /// The id of the last quorum delivered (0 before the first).
    pub fn quorum_id(&self) -> i64 {
        self.quorum_id
    }

    /// The last quorum delivered.
    pub fn prev_quorum(&self) -> Option<&Quorum> {
        self.prev_quorum.as_ref()
    }

    /// This round's participants, by replica id.
    pub fn participants(&self) -> &BTreeMap<String, MemberDetails> {
        &self.participants
    }

    /// The last heartbeat of every replica heard from, by replica id.
    pub fn heartbeats(&self) -> &BTreeMap<String, Instant> {
        &self.heartbeats
    }
}
