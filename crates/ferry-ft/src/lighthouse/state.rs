//! The lighthouse's state and its transitions.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use super::quorum::{Decision, ReasonKind};
use super::{quorum_changed, LighthouseOptions};
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
    /// Shared with the requests it was delivered to.
    prev_quorum: Option<Arc<Quorum>>,
    quorum_id: i64,
    last_reason: Option<String>,
    last_kind: Option<ReasonKind>,
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

    /// Forgets the heartbeats older than `heartbeat_timeout` at `now`
    /// (torchft keeps them forever; they count as unhealthy there, exactly
    /// as a replica never heard from does, so no decision changes). Every
    /// tick calls it, so a dead replica id costs nothing after its timeout.
    pub fn expire_heartbeats(&mut self, now: Instant, heartbeat_timeout: std::time::Duration) {
        self.heartbeats
            .retain(|_, last| now.saturating_duration_since(*last) < heartbeat_timeout);
    }

    /// Records a heartbeat from `replica_id` at `now`.
    pub fn heartbeat(&mut self, now: Instant, replica_id: impl Into<String>) {
        self.heartbeats.insert(replica_id.into(), now);
    }

    /// Evaluates the quorum at `now`
    /// ([`quorum_compute`](super::quorum_compute)). When it is ready: bumps
    /// the quorum id if the membership changed since the previous quorum
    /// (or there was none) or if any member reports
    /// `commit_failures > 0`, remembers the quorum as the previous one,
    /// clears the participants, and returns the quorum to deliver to every
    /// waiting requester. Its `created` stamp is left empty; see
    /// [`tick_created`](Self::tick_created).
    ///
    /// Logs (`tracing`) the quorum status at `info` when a quorum is
    /// delivered (`Quorum!`, with the reason) or the kind of reason changes
    /// (e.g. from split brain to waiting for stragglers), other changes of
    /// the reason at `debug`.
    pub fn tick(&mut self, now: Instant, opt: &LighthouseOptions) -> Option<Quorum> {
        self.tick_created_opt(now, None, opt)
    }

    /// As [`tick`](Self::tick), stamping the quorum's `created` field with
    /// the wall-clock time `created` (torchft stamps the time it formed).
    pub fn tick_created(
        &mut self,
        now: Instant,
        created: SystemTime,
        opt: &LighthouseOptions,
    ) -> Option<Quorum> {
        self.tick_created_opt(now, Some(created), opt)
    }

    fn tick_created_opt(
        &mut self,
        now: Instant,
        created: Option<SystemTime>,
        opt: &LighthouseOptions,
    ) -> Option<Quorum> {
        let tick = self.tick_quiet(now, created, opt);
        tick.log.emit();
        tick.quorum.map(Arc::unwrap_or_clone)
    }

    /// [`tick`](Self::tick) for the server: the quorum comes back shared
    /// (the state keeps the same `Arc` as the previous quorum) and nothing
    /// is logged: the lines come back in [`Tick::log`], for the caller to
    /// [`emit`](TickLog::emit) once it has let go of its lock.
    pub(super) fn tick_quiet(
        &mut self,
        now: Instant,
        created: Option<SystemTime>,
        opt: &LighthouseOptions,
    ) -> Tick {
        self.expire_heartbeats(now, opt.heartbeat_timeout);
        let decision = Decision::new(now, self, opt);
        let kind = decision.kind;
        let participants = decision.members();
        let reason = decision.reason(opt);

        let delivered = participants.is_some();
        let kind_changed = self.last_kind != Some(kind);
        let reason_changed = self.last_reason.as_deref() != Some(reason.as_str());
        let mut log = TickLog::default();
        if delivered || kind_changed {
            log.status = Some((reason.clone(), true));
        } else if reason_changed && tracing::enabled!(tracing::Level::DEBUG) {
            log.status = Some((reason.clone(), false));
        }
        if reason_changed {
            self.last_reason = Some(reason);
        }
        self.last_kind = Some(kind);
        let Some(participants) = participants else {
            return Tick { quorum: None, log };
        };

        let changed = self
            .prev_quorum
            .as_ref()
            .is_none_or(|prev| quorum_changed(&participants, &prev.participants));
        if changed {
            self.quorum_id += 1;
            log.bump = Some(Bump::Membership);
        } else {
            let failed: Vec<String> = participants
                .iter()
                .filter(|p| p.commit_failures > 0)
                .map(|p| p.replica_id.clone())
                .collect();
            if !failed.is_empty() {
                self.quorum_id += 1;
                log.bump = Some(Bump::CommitFailures(failed));
            }
        }

        let quorum = Arc::new(Quorum {
            quorum_id: self.quorum_id,
            participants,
            created: created.map(Into::into),
        });
        log.delivered = Some((quorum.quorum_id, quorum.participants.len()));
        self.prev_quorum = Some(Arc::clone(&quorum));
        self.participants.clear();
        Tick {
            quorum: Some(quorum),
            log,
        }
    }

    /// The reason [`quorum_compute`](super::quorum_compute) gives at `now`,
    /// without changing anything (for status pages).
    pub fn status(&self, now: Instant, opt: &LighthouseOptions) -> String {
        Decision::new(now, self, opt).reason(opt)
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
        self.prev_quorum.as_deref()
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

/// What [`LighthouseState::tick_quiet`] did: the quorum it delivered, if
/// any, and the lines to log about it.
#[derive(Debug)]
pub(super) struct Tick {
    /// The quorum delivered, the same `Arc` the state keeps as the
    /// previous quorum.
    pub(super) quorum: Option<Arc<Quorum>>,
    /// What to log, once the caller's lock is released.
    pub(super) log: TickLog,
}

/// The log lines of one tick, deferred ([`emit`](Self::emit)).
#[derive(Debug, Default)]
#[must_use = "the lines are only written by `emit`"]
pub(super) struct TickLog {
    /// The quorum status, when it is logged: at `info` (`true`) when a
    /// quorum was delivered (on its `Quorum!` line) or the kind of reason
    /// changed, else at `debug`.
    status: Option<(String, bool)>,
    /// Why the quorum id went up, when it did.
    bump: Option<Bump>,
    /// The quorum id and size of the quorum delivered.
    delivered: Option<(i64, usize)>,
}

/// Why a delivered quorum got a new id.
#[derive(Debug)]
enum Bump {
    /// Its members differ from the previous quorum's (or there was none).
    Membership,
    /// These members reported commit failures.
    CommitFailures(Vec<String>),
}

impl TickLog {
    /// Writes the lines (`tracing`): for a delivered quorum, why its id
    /// went up (if it did) and `Quorum!` with the reason; otherwise the
    /// quorum status, if it is logged.
    pub(super) fn emit(self) {
        let reason = self.status.as_ref().map(|(reason, _)| reason.as_str());
        let Some((quorum_id, participants)) = self.delivered else {
            match &self.status {
                Some((reason, true)) => tracing::info!("Quorum status: {reason}"),
                Some((reason, false)) => tracing::debug!("Quorum status: {reason}"),
                None => {}
            }
            return;
        };
        match &self.bump {
            Some(Bump::Membership) => tracing::info!(
                quorum_id,
                "Detected quorum change, bumping quorum_id to {quorum_id}"
            ),
            Some(Bump::CommitFailures(failed)) => tracing::info!(
                quorum_id,
                "Detected commit failures in [{}], bumping quorum_id to {quorum_id}",
                failed.join(", ")
            ),
            None => {}
        }
        tracing::info!(
            quorum_id,
            participants,
            "Quorum! {}",
            reason.unwrap_or_default()
        );
    }
}
