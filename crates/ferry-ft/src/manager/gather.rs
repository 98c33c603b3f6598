//! Gathering the ranks of a replica group into one lighthouse request.

use std::collections::BTreeMap;

use crate::proto::{LighthouseQuorumRequest, ManagerQuorumRequest, QuorumMember};
use crate::FtError;

/// Who a manager is: what it tells the lighthouse about its replica group
/// besides the per-round fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagerInfo {
    /// The replica group's id (torchft: `{name}:{uuid}` or a uuid).
    pub replica_id: String,
    /// The manager's address, where healing replicas reach it.
    pub address: String,
    /// The replica group's store address.
    pub store_address: String,
    /// Ranks in the replica group.
    pub world_size: u64,
}

/// One round gathered: every rank of the group has asked.
#[derive(Debug, Clone, PartialEq)]
pub struct GatheredQuorum {
    /// The request to send to the lighthouse.
    pub request: LighthouseQuorumRequest,
    /// `init_sync` for this round's [`compute_quorum_results`](super::compute_quorum_results):
    /// true if any rank asked for it.
    pub init_sync: bool,
    /// The group ranks that asked, ascending.
    pub group_ranks: Vec<i64>,
}

/// Collects the quorum requests of a replica group's ranks. When all
/// `world_size` ranks have asked, [`join`](Self::join) returns the one
/// lighthouse request for the group and the round starts over.
///
/// The ranks' fields are folded: `step` and `commit_failures` are the
/// highest asked, `shrink_only` and `init_sync` hold if any rank asked. (All
/// ranks of a healthy group ask with the same values; torchft sends the
/// last rank's.) A rank asking twice in one round counts once, with its last
/// request. The checkpoint metadata each rank sends is kept across rounds
/// for [`checkpoint_metadata`](Self::checkpoint_metadata).
#[derive(Debug, Clone)]
pub struct QuorumGather {
    info: ManagerInfo,
    pending: BTreeMap<i64, ManagerQuorumRequest>,
    checkpoint_metadata: BTreeMap<i64, String>,
}

impl QuorumGather {
    /// A manager's gather, nothing asked yet.
    pub fn new(info: ManagerInfo) -> Self {
        Self {
            info,
            pending: BTreeMap::new(),
            checkpoint_metadata: BTreeMap::new(),
        }
    }

    /// Rank `req.group_rank` asks for the next quorum. Returns the gathered
    /// round when this was the last rank missing, `None` while others are
    /// still to come. Fails, changing nothing, on a rank outside
    /// `0..world_size`.
    pub fn join(&mut self, req: &ManagerQuorumRequest) -> Result<Option<GatheredQuorum>, FtError> {
        let group_rank = req.group_rank;
        if group_rank < 0 {
            return Err(FtError::NegativeGroupRank { group_rank });
        }
        if group_rank as u64 >= self.info.world_size {
            return Err(FtError::InvalidGroupRank {
                group_rank,
                world_size: self.info.world_size,
            });
        }
        self.checkpoint_metadata
            .insert(group_rank, req.checkpoint_metadata.clone());
        self.pending.insert(group_rank, req.clone());
        if (self.pending.len() as u64) < self.info.world_size {
            return Ok(None);
        }

        let pending = std::mem::take(&mut self.pending);
        let requests = pending.values();
        let step = requests.clone().map(|r| r.step).max().unwrap_or(req.step);
        let commit_failures = requests
            .clone()
            .map(|r| r.commit_failures)
            .max()
            .unwrap_or(req.commit_failures);
        let shrink_only = requests.clone().any(|r| r.shrink_only);
        let init_sync = requests.clone().any(|r| r.init_sync);
        tracing::info!(
            replica_id = %self.info.replica_id,
            step,
            "All workers joined - starting quorum"
        );
        Ok(Some(GatheredQuorum {
            request: LighthouseQuorumRequest {
                requester: Some(QuorumMember {
                    replica_id: self.info.replica_id.clone(),
                    address: self.info.address.clone(),
                    store_address: self.info.store_address.clone(),
                    step,
                    world_size: self.info.world_size,
                    shrink_only,
                    data: String::new(),
                    commit_failures,
                }),
            },
            init_sync,
            group_ranks: pending.keys().copied().collect(),
        }))
    }

    /// Forgets the ranks waiting in the open round (for instance after the
    /// lighthouse request failed and they were answered with an error).
    pub fn reset(&mut self) {
        self.pending.clear();
    }

    /// The group ranks that have asked in the open round, ascending.
    pub fn waiting(&self) -> impl Iterator<Item = i64> + '_ {
        self.pending.keys().copied()
    }

    /// The checkpoint metadata rank `rank` sent with its last quorum
    /// request (torchft's `CheckpointMetadata` answers "rank not found"
    /// without one).
    pub fn checkpoint_metadata(&self, rank: i64) -> Option<&str> {
        self.checkpoint_metadata.get(&rank).map(String::as_str)
    }

    /// The manager this gather belongs to.
    pub fn info(&self) -> &ManagerInfo {
        &self.info
    }
}
