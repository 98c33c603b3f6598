//! Stage placement: which rank owns which stage, by one of PyTorch's
//! styles or as a schedule's own action lists declare it.

use crate::csv::Schedule;

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
    /// A generated schedule needs the same number of stages on every rank.
    #[error("{stages} stages do not spread evenly over {ranks} ranks (a generated schedule puts the same number of stages on every rank)")]
    Uneven {
        /// Number of stages.
        stages: usize,
        /// Number of ranks.
        ranks: usize,
    },
    /// A stage is declared on another worker than the one the placement
    /// puts it on.
    #[error("stage {stage} is on worker {worker}, but {by} puts it on rank {rank} with stage {with_stage} (worker {expected})")]
    Misplaced {
        /// The stage.
        stage: usize,
        /// The worker it was declared on.
        worker: String,
        /// What placed it: "the Loop placement of 4 stages on 2 ranks", "the schedule".
        by: String,
        /// The rank the placement puts it on.
        rank: usize,
        /// The first stage on that rank.
        with_stage: usize,
        /// That stage's worker.
        expected: String,
    },
    /// A schedule runs actions of one stage on two ranks.
    #[error("stage {stage} has actions on rank {first} ({first_action}) and on rank {second} ({second_action}): a stage lives on one rank")]
    TwoRanks {
        /// The stage.
        stage: usize,
        /// The first rank running it.
        first: usize,
        /// An action of it there.
        first_action: crate::Action,
        /// The second rank.
        second: usize,
        /// An action of it there.
        second_action: crate::Action,
    },
    /// No rank of the schedule runs a stage.
    #[error("no rank of the schedule runs stage {stage}")]
    Unplaced {
        /// The stage.
        stage: usize,
    },
    /// A rank of the schedule runs no stage.
    #[error("rank {rank} of the schedule runs no stage")]
    EmptyRank {
        /// The rank.
        rank: usize,
    },
    /// Two ranks of a schedule would share one worker.
    #[error(
        "ranks {first} and {second} are both on worker {worker}: each rank needs its own worker"
    )]
    SharedWorker {
        /// The worker.
        worker: String,
        /// One rank.
        first: usize,
        /// The other.
        second: usize,
    },
}

/// The rank of every stage of `schedule`, as its action lists declare it:
/// a stage lives on the rank whose list holds its actions (PyTorch's
/// `stage_index_to_group_rank` for a schedule read from CSV). Any map is
/// accepted (for instance stages 0 and 1 on rank 0, 2 and 3 on rank 1), as
/// long as every one of the `stages` stages has actions on exactly one
/// rank and every rank runs a stage. Actions naming a stage at or past
/// `stages` are left to the caller's checks.
///
/// ```
/// use ferry_schedule::{placement::stage_to_rank_of, Schedule};
/// let schedule = Schedule::from_csv("0F0,1F0,1B0,0B0\n2F0,3F0,3B0,2B0\n")?;
/// assert_eq!(stage_to_rank_of(&schedule, 4)?, [0, 0, 1, 1]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn stage_to_rank_of(schedule: &Schedule, stages: usize) -> Result<Vec<usize>, PlacementError> {
    let mut owner: Vec<Option<(usize, crate::Action)>> = vec![None; stages];
    for (rank, list) in schedule.ranks.iter().enumerate() {
        let mut any = false;
        for action in list.iter().flatten() {
            let mut actions = vec![action];
            actions.extend(action.sub_actions());
            for a in actions.into_iter().filter(|a| !a.is_compound()) {
                let Some(slot) = owner.get_mut(a.stage()) else {
                    continue;
                };
                any = true;
                match slot {
                    None => *slot = Some((rank, a.clone())),
                    Some((first, first_action)) if *first != rank => {
                        return Err(PlacementError::TwoRanks {
                            stage: a.stage(),
                            first: *first,
                            first_action: first_action.clone(),
                            second: rank,
                            second_action: a.clone(),
                        })
                    }
                    Some(_) => {}
                }
            }
        }
        if !any {
            return Err(PlacementError::EmptyRank { rank });
        }
    }
    owner
        .into_iter()
        .enumerate()
        .map(|(stage, o)| {
            o.map(|(rank, _)| rank)
                .ok_or(PlacementError::Unplaced { stage })
        })
        .collect()
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
