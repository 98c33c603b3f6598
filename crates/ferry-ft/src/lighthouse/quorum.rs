//! The quorum decision: a pure function of (now, state, options).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

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
    let healthy_replicas: BTreeSet<&str> = state
        .heartbeats()
        .iter()
        .filter(|(_, last)| now.saturating_duration_since(**last) < opt.heartbeat_timeout)
        .map(|(replica_id, _)| replica_id.as_str())
        .collect();

    // Participants are keyed by replica id in a BTreeMap: already sorted.
    let healthy_participants: BTreeMap<&str, &MemberDetails> = state
        .participants()
        .iter()
        .filter(|(replica_id, _)| healthy_replicas.contains(replica_id.as_str()))
        .map(|(replica_id, details)| (replica_id.as_str(), details))
        .collect();

    let mut candidates: Vec<QuorumMember> = healthy_participants
        .values()
        .map(|details| details.member.clone())
        .collect();

    let shrink_only = healthy_participants
        .values()
        .any(|details| details.member.shrink_only);

    let metadata = format!(
        "[{}/{} participants healthy][{} heartbeating][shrink_only={}]",
        healthy_participants.len(),
        state.participants().len(),
        healthy_replicas.len(),
        shrink_only,
    );

    if let Some(prev_quorum) = state.prev_quorum() {
        if shrink_only {
            let prev_ids: BTreeSet<&str> = prev_quorum
                .participants
                .iter()
                .map(|p| p.replica_id.as_str())
                .collect();
            candidates.retain(|p| prev_ids.contains(p.replica_id.as_str()));
        }

        // Fast quorum: every member of the previous quorum is back and healthy.
        let is_fast_quorum = prev_quorum
            .participants
            .iter()
            .all(|prev| healthy_participants.contains_key(prev.replica_id.as_str()));
        if is_fast_quorum {
            return (Some(candidates), format!("Fast quorum found! {metadata}"));
        }
    }

    let healthy = healthy_participants.len();
    if (healthy as u64) < opt.min_replicas {
        return (
            None,
            format!(
                "New quorum not ready, only have {healthy} participants, need min_replicas {} {metadata}",
                opt.min_replicas
            ),
        );
    }

    // Avoid split brain: more than half of the replicas known to be alive.
    if healthy <= healthy_replicas.len() / 2 {
        return (
            None,
            format!(
                "New quorum not ready, only have {healthy} participants, need at least half of {} healthy workers {metadata}",
                healthy_replicas.len()
            ),
        );
    }

    // Valid; wait a while for heartbeating replicas that have not joined.
    let all_healthy_joined = healthy == healthy_replicas.len();
    let first_joined = healthy_participants
        .values()
        .map(|details| details.joined)
        .min()
        .unwrap_or(now);
    if !all_healthy_joined && now.saturating_duration_since(first_joined) < opt.join_timeout {
        return (
            None,
            format!(
                "Valid quorum with {healthy} participants, waiting for {} healthy but not participating stragglers due to join timeout {metadata}",
                healthy_replicas.len() - healthy
            ),
        );
    }

    (Some(candidates), format!("Valid quorum found {metadata}"))
}
