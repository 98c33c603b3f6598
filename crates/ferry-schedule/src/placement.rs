//! Stage placement: which rank owns which stage.

/// How stages are laid out over ranks, as PyTorch's
/// `generate_stage_to_rank_mapping` styles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// `loop`: stage `s` on rank `s mod p`.
    Loop,
    /// `v`: zig-zag; each pass of `p` stages walks the ranks forth, the next
    /// one back (4 stages on 2 ranks: `{0: 0, 1: 1, 2: 1, 3: 0}`).
    V,
}

/// A placement that cannot be laid out.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// There are no ranks to place stages on.
    #[error("a placement needs at least one rank")]
    NoRanks,
    /// The V placement needs a whole number of passes.
    #[error("num_stages {stages} must be evenly divisible by pp_size {ranks} for V schedules")]
    UnevenV {
        /// Number of stages asked for.
        stages: usize,
        /// Number of ranks.
        ranks: usize,
    },
}

impl Placement {
    /// The rank of `stage` when `stages` stages lie on `ranks` ranks.
    pub fn rank_of(
        self,
        stage: usize,
        stages: usize,
        ranks: usize,
    ) -> Result<usize, PlacementError> {
        check(self, stages, ranks)?;
        Ok(rank_unchecked(self, stage, ranks))
    }

    /// The rank of every stage, indexed by stage.
    pub fn stage_to_rank(self, stages: usize, ranks: usize) -> Result<Vec<usize>, PlacementError> {
        check(self, stages, ranks)?;
        Ok((0..stages)
            .map(|s| rank_unchecked(self, s, ranks))
            .collect())
    }

    /// The stages of every rank, indexed by rank, each in increasing order.
    pub fn rank_to_stages(
        self,
        stages: usize,
        ranks: usize,
    ) -> Result<Vec<Vec<usize>>, PlacementError> {
        let mut out = vec![Vec::new(); ranks];
        for (stage, rank) in self.stage_to_rank(stages, ranks)?.into_iter().enumerate() {
            out[rank].push(stage);
        }
        Ok(out)
    }
}

fn check(placement: Placement, stages: usize, ranks: usize) -> Result<(), PlacementError> {
    if ranks == 0 {
        return Err(PlacementError::NoRanks);
    }
    if placement == Placement::V && stages % ranks != 0 {
        return Err(PlacementError::UnevenV { stages, ranks });
    }
    Ok(())
}

fn rank_unchecked(placement: Placement, stage: usize, ranks: usize) -> usize {
    let within = stage % ranks;
    match placement {
        Placement::Loop => within,
        Placement::V if (stage / ranks) % 2 == 0 => within,
        Placement::V => ranks - 1 - within,
    }
}
