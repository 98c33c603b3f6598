//! The should-commit vote of a replica group's ranks.

use std::collections::BTreeSet;

use crate::FtError;

/// The per-step commit vote of a replica group: every one of the
/// `world_size` ranks votes, and the group commits only if none voted
/// false. The last vote to arrive gets the decision (to hand to every rank
/// of the step) and the vote starts over for the next step.
///
/// A rank voting twice counts once; a false vote sticks for the step. A vote
/// for another step than the open round's is refused with
/// [`FtError::StepMismatch`] (torchft leaves this unchecked); an abandoned
/// round is dropped with [`reset`](Self::reset).
#[derive(Debug, Clone)]
pub struct ShouldCommitVotes {
    world_size: u64,
    step: Option<i64>,
    voted: BTreeSet<i64>,
    failures: BTreeSet<i64>,
}

impl ShouldCommitVotes {
    /// The vote of a group of `world_size` ranks, nobody voted yet.
    pub fn new(world_size: u64) -> Self {
        Self {
            world_size,
            step: None,
            voted: BTreeSet::new(),
            failures: BTreeSet::new(),
        }
    }

    /// Rank `group_rank` votes `should_commit` for `step`. Returns the
    /// decision when this was the last vote missing (and resets for the next
    /// step), `None` while other ranks are still to vote. Fails, changing
    /// nothing, on a rank outside `0..world_size` or a vote for another step
    /// than the open round's.
    pub fn vote(
        &mut self,
        group_rank: i64,
        step: i64,
        should_commit: bool,
    ) -> Result<Option<bool>, FtError> {
        if group_rank < 0 {
            return Err(FtError::NegativeGroupRank { group_rank });
        }
        if group_rank as u64 >= self.world_size {
            return Err(FtError::InvalidGroupRank {
                group_rank,
                world_size: self.world_size,
            });
        }
        if let Some(expected) = self.step {
            if expected != step {
                return Err(FtError::StepMismatch {
                    group_rank,
                    step,
                    expected,
                });
            }
        }
        self.step = Some(step);
        if !should_commit {
            self.failures.insert(group_rank);
        }
        self.voted.insert(group_rank);
        if (self.voted.len() as u64) < self.world_size {
            return Ok(None);
        }
        let decision = self.failures.is_empty();
        tracing::info!(step, "should_commit completed should_commit={decision}");
        self.reset();
        Ok(Some(decision))
    }

    /// Drops the open round's votes.
    pub fn reset(&mut self) {
        self.step = None;
        self.voted.clear();
        self.failures.clear();
    }

    /// The step being voted on, if a round is open.
    pub fn step(&self) -> Option<i64> {
        self.step
    }

    /// The group ranks that have voted in the open round, ascending.
    pub fn voted(&self) -> impl Iterator<Item = i64> + '_ {
        self.voted.iter().copied()
    }
}
