//! Quorum results for one rank: replica rank, max step, store, recovery.

use std::collections::{BTreeMap, BTreeSet};

use crate::proto::{ManagerQuorumResponse, Quorum, QuorumMember};
use crate::FtError;

/// What rank `group_rank` of replica group `replica_id` learns from
/// `quorum`, exactly as torchft's manager computes it:
///
/// - participants are sorted by replica id; `replica_rank` is this replica's
///   index, `replica_world_size` their number, `replica_ids` their ids;
/// - `max_step` is the highest step; the replicas at it are the *max*
///   replicas (`max_replica_rank`, `max_world_size`);
/// - `store_address` is that of the primary for this group rank: max replica
///   number `group_rank mod max_world_size`;
/// - a replica must recover when it is behind `max_step`, or, with
///   `init_sync` and `max_step == 0`, when it is not that primary (so every
///   replica starts from the same weights); the others are up to date;
/// - the i-th recovering replica (in replica-rank order) recovers from
///   up-to-date replica number `(i + group_rank) mod n_up_to_date`, so the
///   group ranks of a group spread the load over the sources;
/// - `heal` says this replica recovers, `recover_src_replica_rank` and
///   `recover_src_manager_address` from whom, `recover_dst_replica_ranks`
///   who recovers from it;
/// - `commit_failures` is the highest among the participants.
///
/// Fails when the quorum does not contain `replica_id` or `group_rank` is
/// negative.
pub fn compute_quorum_results(
    replica_id: &str,
    group_rank: i64,
    quorum: &Quorum,
    init_sync: bool,
) -> Result<ManagerQuorumResponse, FtError> {
    let group_rank_u =
        u64::try_from(group_rank).map_err(|_| FtError::NegativeGroupRank { group_rank })?;

    let mut participants: Vec<&QuorumMember> = quorum.participants.iter().collect();
    participants.sort_by(|a, b| a.replica_id.cmp(&b.replica_id));

    let replica_rank = participants
        .iter()
        .position(|p| p.replica_id == replica_id)
        .ok_or_else(|| FtError::NotInQuorum {
            replica_id: replica_id.to_owned(),
        })?;
    let step = participants[replica_rank].step;

    // The replicas at the max step (at least this one exists: non-empty).
    let max_step = participants.iter().map(|p| p.step).max().unwrap_or(step);
    let max_participants: Vec<&QuorumMember> = participants
        .iter()
        .copied()
        .filter(|p| p.step == max_step)
        .collect();
    let max_replica_rank = max_participants
        .iter()
        .position(|p| p.replica_id == replica_id)
        .map(|i| i as i64);

    // The primary store for this group rank: one store per replica group.
    let primary = max_participants[index_mod(group_rank_u, 0, max_participants.len())];

    // Recovering: behind the max step, or (init_sync at step 0) not the primary.
    let force_recover = init_sync && max_step == 0;
    let recover_dst: Vec<usize> = participants
        .iter()
        .enumerate()
        .filter(|(_, p)| {
            p.step != max_step || (force_recover && p.replica_id != primary.replica_id)
        })
        .map(|(i, _)| i)
        .collect();
    let recover_dst_set: BTreeSet<usize> = recover_dst.iter().copied().collect();
    let up_to_date: Vec<usize> = (0..participants.len())
        .filter(|i| !recover_dst_set.contains(i))
        .collect();

    // Source replica rank -> the replica ranks recovering from it.
    let mut assignments: BTreeMap<usize, Vec<i64>> = BTreeMap::new();
    let mut recover_src_replica_rank: Option<i64> = None;
    for (i, &dst) in recover_dst.iter().enumerate() {
        // The primary is never recovering, so `up_to_date` is not empty.
        let src = up_to_date[index_mod(group_rank_u, i, up_to_date.len())];
        assignments.entry(src).or_default().push(dst as i64);
        if dst == replica_rank {
            recover_src_replica_rank = Some(src as i64);
        }
    }

    let heal = recover_src_replica_rank.is_some();
    let recover_src_manager_address = match recover_src_replica_rank {
        Some(src) => participants[src as usize].address.clone(),
        None => String::new(),
    };
    if let Some(src) = recover_src_replica_rank {
        tracing::info!(
            replica_id,
            "healing is required step={step}, max_step={max_step}, recover_src_replica_rank={src}"
        );
    }

    Ok(ManagerQuorumResponse {
        quorum_id: quorum.quorum_id,
        recover_src_manager_address,
        recover_src_replica_rank,
        recover_dst_replica_ranks: assignments.remove(&replica_rank).unwrap_or_default(),
        store_address: primary.store_address.clone(),
        max_step,
        max_replica_rank,
        max_world_size: max_participants.len() as i64,
        replica_rank: replica_rank as i64,
        replica_world_size: participants.len() as i64,
        heal,
        commit_failures: participants
            .iter()
            .map(|p| p.commit_failures)
            .max()
            .unwrap_or(0),
        replica_ids: participants.iter().map(|p| p.replica_id.clone()).collect(),
    })
}

/// `(offset + group_rank) mod n` without overflow; `n > 0`.
fn index_mod(group_rank: u64, offset: usize, n: usize) -> usize {
    let n = n as u64;
    ((offset as u64 % n + group_rank % n) % n) as usize
}
