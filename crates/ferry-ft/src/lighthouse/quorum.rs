//! The quorum decision: a pure function of (now, state, options).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::{LighthouseOptions, LighthouseState, MemberDetails};
use crate::proto::QuorumMember;

/// Whether two quorums differ in membership: the replica ids, in order
/// (both lists are sorted by replica id). Addresses, steps and the other
/// fields do not count, as in torchft.
pub fn quorum_changed(a: &[QuorumMember], b: &[QuorumMember]) -> bool {
    a.len() != b.len() || a.iter().zip(b).any(|(x, y)| x.replica_id != y.replica_id)
}

/// Decides whether the next quorum is ready at `now`, returning its
/// participants (sorted by replica id) or `None`, and the reason either way.
///
/// A replica is *healthy* when its last heartbeat (joining counts as one) is
/// younger than `opt.heartbeat_timeout`; *healthy participants* are the
/// healthy replicas that have joined this round. The rules, in order:
///
/// 1. With a previous quorum: if any healthy participant asked for
///    `shrink_only`, candidates that were not in the previous quorum are
///    dropped; and if every previous member is a healthy participant, the
///    candidates are the quorum at once (*fast quorum*).
/// 2. Fewer healthy participants than `opt.min_replicas`: not ready.
/// 3. Healthy participants not more than half of the healthy (heartbeating)
///    replicas: not ready (split brain).
/// 4. Healthy replicas that have not joined, and the first healthy
///    participant joined less than `opt.join_timeout` ago: wait for them.
/// 5. Otherwise the quorum is the candidates.
///
/// Every reason ends with `[h/p participants healthy][n heartbeating][shrink_only=b]`,
/// torchft's wording.
pub fn quorum_compute(
    now: Instant,
    state: &LighthouseState,
    opt: &LighthouseOptions,
) -> (Option<Vec<QuorumMember>>, String) {
    let decision = Decision::new(now, state, opt);
    (decision.members(), decision.reason(opt))
}

/// Which rule [`quorum_compute`] decided by: the kind of its reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReasonKind {
    /// Rule 1: every previous member is back (ready).
    FastQuorum,
    /// Rule 2: fewer healthy participants than `min_replicas`.
    TooFew,
    /// Rule 3: not more than half of the heartbeating replicas.
    SplitBrain,
    /// Rule 4: waiting for heartbeating stragglers.
    Stragglers,
    /// Rule 5: a valid quorum (ready).
    Valid,
}

/// [`quorum_compute`]'s decision, taken on counts alone: it borrows the
/// state and clones nothing. The member list is built only by
/// [`members`](Self::members), when the quorum is ready; the reason only by
/// [`reason`](Self::reason).
#[derive(Debug, Clone, Copy)]
pub(super) struct Decision<'a> {
    state: &'a LighthouseState,
    now: Instant,
    heartbeat_timeout: Duration,
    /// The rule that decided.
    pub(super) kind: ReasonKind,
    /// Healthy participants.
    healthy: usize,
    /// Healthy (heartbeating) replicas, participants or not.
    heartbeating: usize,
    /// Whether a healthy participant asked for `shrink_only`.
    shrink_only: bool,
}

impl<'a> Decision<'a> {
    /// Applies the rules of [`quorum_compute`] at `now`.
    pub(super) fn new(now: Instant, state: &'a LighthouseState, opt: &LighthouseOptions) -> Self {
        let heartbeat_timeout = opt.heartbeat_timeout;
        let is_healthy = |last: &Instant| now.saturating_duration_since(*last) < heartbeat_timeout;
        let heartbeating = state
            .heartbeats()
            .values()
            .filter(|t| is_healthy(t))
            .count();

        let mut healthy = 0;
        let mut shrink_only = false;
        let mut first_joined: Option<Instant> = None;
        for details in healthy_participants(now, state, heartbeat_timeout) {
            healthy += 1;
            shrink_only |= details.member.shrink_only;
            first_joined = Some(first_joined.map_or(details.joined, |t| t.min(details.joined)));
        }
        let decision = |kind| Decision {
            state,
            now,
            heartbeat_timeout,
            kind,
            healthy,
            heartbeating,
            shrink_only,
        };

        if let Some(prev_quorum) = state.prev_quorum() {
            // Fast quorum: every member of the previous quorum is back and healthy.
            let is_fast_quorum = prev_quorum.participants.iter().all(|prev| {
                state.participants().contains_key(&prev.replica_id)
                    && state
                        .heartbeats()
                        .get(&prev.replica_id)
                        .is_some_and(is_healthy)
            });
            if is_fast_quorum {
                return decision(ReasonKind::FastQuorum);
            }
        }

        if (healthy as u64) < opt.min_replicas {
            return decision(ReasonKind::TooFew);
        }
        // Avoid split brain: more than half of the replicas known to be alive.
        if healthy <= heartbeating / 2 {
            return decision(ReasonKind::SplitBrain);
        }
        // Valid; wait a while for heartbeating replicas that have not joined.
        let all_healthy_joined = healthy == heartbeating;
        let first_joined = first_joined.unwrap_or(now);
        if !all_healthy_joined && now.saturating_duration_since(first_joined) < opt.join_timeout {
            return decision(ReasonKind::Stragglers);
        }
        decision(ReasonKind::Valid)
    }

    /// Whether the next quorum is ready.
    pub(super) fn ready(&self) -> bool {
        matches!(self.kind, ReasonKind::FastQuorum | ReasonKind::Valid)
    }

    /// The quorum's members, sorted by replica id, when it is ready: the
    /// healthy participants, less those not in the previous quorum when one
    /// of them asked for `shrink_only`.
    pub(super) fn members(&self) -> Option<Vec<QuorumMember>> {
        if !self.ready() {
            return None;
        }
        let prev_ids: Option<BTreeSet<&str>> = self
            .state
            .prev_quorum()
            .filter(|_| self.shrink_only)
            .map(|prev| {
                prev.participants
                    .iter()
                    .map(|p| p.replica_id.as_str())
                    .collect()
            });
        // Participants are keyed by replica id in a BTreeMap: already sorted.
        let members = healthy_participants(self.now, self.state, self.heartbeat_timeout)
            .filter(|details| {
                prev_ids
                    .as_ref()
                    .is_none_or(|ids| ids.contains(details.member.replica_id.as_str()))
            })
            .map(|details| details.member.clone())
            .collect();
        Some(members)
    }

    /// The reason, in torchft's words.
    pub(super) fn reason(&self, opt: &LighthouseOptions) -> String {
        let metadata = format!(
            "[{}/{} participants healthy][{} heartbeating][shrink_only={}]",
            self.healthy,
            self.state.participants().len(),
            self.heartbeating,
            self.shrink_only,
        );
        let healthy = self.healthy;
        match self.kind {
            ReasonKind::FastQuorum => format!("Fast quorum found! {metadata}"),
            ReasonKind::TooFew => format!(
                "New quorum not ready, only have {healthy} participants, need min_replicas {} {metadata}",
                opt.min_replicas
            ),
            ReasonKind::SplitBrain => format!(
                "New quorum not ready, only have {healthy} participants, need at least half of {} healthy workers {metadata}",
                self.heartbeating
            ),
            ReasonKind::Stragglers => format!(
                "Valid quorum with {healthy} participants, waiting for {} healthy but not participating stragglers due to join timeout {metadata}",
                self.heartbeating - healthy
            ),
            ReasonKind::Valid => format!("Valid quorum found {metadata}"),
        }
    }
}

/// This round's participants whose last heartbeat is younger than
/// `heartbeat_timeout` at `now`, sorted by replica id.
fn healthy_participants(
    now: Instant,
    state: &LighthouseState,
    heartbeat_timeout: Duration,
) -> impl Iterator<Item = &MemberDetails> {
    state
        .participants()
        .iter()
        .filter(move |(replica_id, _)| {
            state
                .heartbeats()
                .get(*replica_id)
                .is_some_and(|last| now.saturating_duration_since(*last) < heartbeat_timeout)
        })
        .map(|(_, details)| details)
}
