//! Where a worker sits on its host: torchrun's `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE` and `GROUP_RANK`.

use crate::RpcError;

/// A worker's place on its host (node), as torchrun describes it.
///
/// Global `rank` and `world_size` name a worker in the group; these say
/// which of its host's workers it is, so that a worker can pick its
/// device (`cuda:{local_rank}`) or a per-host resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalTopology {
    /// This worker's rank among the workers on its host (`LOCAL_RANK`).
    pub local_rank: u32,
    /// How many workers run on this host (`LOCAL_WORLD_SIZE`).
    pub local_world_size: u32,
    /// The rank of this host among the hosts (`GROUP_RANK`, torchrun's
    /// node rank).
    pub group_rank: u32,
}

impl LocalTopology {
    /// Builds the topology from the variables that are set, checking them
    /// against each other and against `rank` and `world_size`. Without
    /// `LOCAL_RANK`/`LOCAL_WORLD_SIZE`, the whole group shares one host;
    /// without `GROUP_RANK`, hosts are taken to run the same number of
    /// workers (`rank / local_world_size`).
    ///
    /// ```
    /// use ferry_rpc::LocalTopology;
    ///
    /// let t = LocalTopology::from_parts(5, 8, Some(1), Some(4), None)?;
    /// assert_eq!((t.local_rank, t.local_world_size, t.group_rank), (1, 4, 1));
    /// let e = LocalTopology::from_parts(5, 8, Some(4), Some(4), None).unwrap_err();
    /// assert!(e.to_string().contains("LOCAL_RANK 4 is not below LOCAL_WORLD_SIZE 4"));
    /// # Ok::<(), ferry_rpc::RpcError>(())
    /// ```
    pub fn from_parts(
        rank: u32,
        world_size: u32,
        local_rank: Option<u32>,
        local_world_size: Option<u32>,
        group_rank: Option<u32>,
    ) -> Result<Self, RpcError> {
        let bad = |text: String| Err(RpcError::Config(text));
        let (local_rank, local_world_size) = match (local_rank, local_world_size) {
            (Some(r), Some(n)) => (r, n),
            (None, None) => (rank, world_size),
            (Some(_), None) => return bad("LOCAL_RANK is set but LOCAL_WORLD_SIZE is not".into()),
            (None, Some(_)) => return bad("LOCAL_WORLD_SIZE is set but LOCAL_RANK is not".into()),
        };
        if local_rank >= local_world_size {
            return bad(format!(
                "LOCAL_RANK {local_rank} is not below LOCAL_WORLD_SIZE {local_world_size}"
            ));
        }
        if local_world_size > world_size {
            return bad(format!(
                "LOCAL_WORLD_SIZE {local_world_size} is above WORLD_SIZE {world_size}"
            ));
        }
        let group_rank = group_rank.unwrap_or(rank / local_world_size);
        if group_rank >= world_size {
            return bad(format!(
                "GROUP_RANK {group_rank} is not below WORLD_SIZE {world_size}"
            ));
        }
        Ok(Self {
            local_rank,
            local_world_size,
            group_rank,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_torchrun_the_group_shares_one_host() {
        let t = LocalTopology::from_parts(3, 4, None, None, None).unwrap();
        assert_eq!(
            t,
            LocalTopology {
                local_rank: 3,
                local_world_size: 4,
                group_rank: 0
            }
        );
    }

    #[test]
    fn torchrun_values_are_kept_and_checked() {
        let t = LocalTopology::from_parts(6, 8, Some(0), Some(2), Some(3)).unwrap();
        assert_eq!((t.local_rank, t.local_world_size, t.group_rank), (0, 2, 3));
        for (args, text) in [
            (
                (Some(1), None, None),
                "LOCAL_RANK is set but LOCAL_WORLD_SIZE is not",
            ),
            (
                (None, Some(2), None),
                "LOCAL_WORLD_SIZE is set but LOCAL_RANK is not",
            ),
            (
                (Some(2), Some(2), None),
                "LOCAL_RANK 2 is not below LOCAL_WORLD_SIZE 2",
            ),
            (
                (Some(0), Some(9), None),
                "LOCAL_WORLD_SIZE 9 is above WORLD_SIZE 8",
            ),
            (
                (Some(0), Some(2), Some(8)),
                "GROUP_RANK 8 is not below WORLD_SIZE 8",
            ),
        ] {
            let e = LocalTopology::from_parts(6, 8, args.0, args.1, args.2).unwrap_err();
            assert!(e.to_string().contains(text), "{e} lacks {text}");
        }
    }
}
