//! The unit-step simulator: one action per rank per step, sends and
//! receives included, blocking on missing inputs.

use crate::action::{Action, ActionKind};
use crate::csv::Schedule;
use crate::done::{leaves, Cells, Done, RankSet, Waiters};

/// A lowered schedule that cannot finish: every unfinished rank waits.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("schedule is not progressing (deadlock at step {step}): {}", waiting.iter().map(|(r, a)| format!("rank {r} waits at {a}")).collect::<Vec<_>>().join(", "))]
pub struct Deadlock {
    /// The step at which no rank could move.
    pub step: usize,
    /// Each unfinished rank with the action it waits at.
    pub waiting: Vec<(usize, Action)>,
}

/// Simulates a lowered (compute + comms) schedule step by step, as
/// PyTorch's `_simulate_comms_compute`: in each step every rank in rank
/// order runs its next action if its input is there (a send after its
/// compute, a receive after the peer's send, a forward after its receive
/// or the previous local stage, ...), else idles; then idle ranks get a
/// second chance in the same step. Unlike PyTorch's, it also runs
/// UNSHARD, RESHARD and REDUCE_GRAD (local, always ready) and OVERLAP_F_B
/// (ready when all its sub-actions are).
///
/// Returns the timeline (one row per rank, `None` for a stall); its
/// number of steps is the longest row.
///
/// Runs in time proportional to the number of actions plus the number of
/// steps, not steps × ranks: a rank whose next action is not ready waits,
/// without being looked at again, until the action it needs is done; it is
/// then put in the first pass, step by step and in rank order, in which the
/// step-by-step rule above would have found it ready.
pub fn simulate_unit_steps(
    lowered: &Schedule,
    stage_to_rank: &[usize],
) -> Result<Schedule, Deadlock> {
    let ranks = lowered.ranks.len();
    let rows: Vec<Vec<&Action>> = lowered
        .ranks
        .iter()
        .map(|row| row.iter().flatten().collect())
        .collect();
    let cells = Cells::new(rows.iter().flatten().copied());
    let sim = Deps {
        stage_to_rank,
        stages: stage_to_rank.len(),
        ranks,
        cells: &cells,
    };
    let mut done = Done::new(cells.len());
    let mut waiters = Waiters::new(cells.len(), ranks);
    let mut next = vec![0usize; ranks];
    // The step each action runs at, per rank; the timeline is built from
    // them at the end, each row allocated once.
    let mut at: Vec<Vec<usize>> = rows
        .iter()
        .map(|row| Vec::with_capacity(row.len()))
        .collect();
    // Ranks to look at in the first pass of this step, in the second pass
    // of this step, and in the first pass of the next step.
    let (mut first, mut second, mut following) = (
        RankSet::new(ranks),
        RankSet::new(ranks),
        RankSet::new(ranks),
    );
    let mut left = 0;
    for (rank, row) in rows.iter().enumerate() {
        if !row.is_empty() {
            first.insert(rank);
            left += 1;
        }
    }
    let mut step = 0;
    while left > 0 {
        let mut progress = false;
        for pass in [Pass::First, Pass::Second] {
            let mut cursor = 0;
            loop {
                let set = match pass {
                    Pass::First => &mut first,
                    Pass::Second => &mut second,
                };
                let Some(rank) = set.take_from(cursor) else {
                    break;
                };
                cursor = rank + 1;
                let action = rows[rank][next[rank]];
                if !sim.ready(action, rank, &done) {
                    waiters.block(rank);
                    sim.wait(action, rank, &done, &mut waiters);
                    continue;
                }
                progress |= pass == Pass::First;
                at[rank].push(step);
                next[rank] += 1;
                if next[rank] < rows[rank].len() {
                    following.insert(rank);
                } else {
                    left -= 1;
                }
                // Record it, and wake the ranks that waited for it: a
                // rank after this one in the same pass, a rank before it
                // in this step's second pass (after the first) or the
                // next step's first (after the second).
                for leaf in recorded(action) {
                    let Some(cell) = cells.of(leaf) else { continue };
                    done.insert(rank, cell);
                    waiters.done(rank, cell, |woken| match (pass, woken > rank) {
                        (Pass::First, true) => first.insert(woken),
                        (Pass::First, false) | (Pass::Second, true) => second.insert(woken),
                        (Pass::Second, false) => following.insert(woken),
                    });
                }
            }
        }
        if !progress {
            let waiting = rows
                .iter()
                .enumerate()
                .filter_map(|(r, row)| Some((r, (*row.get(next[r])?).clone())))
                .collect();
            return Err(Deadlock { step, waiting });
        }
        first.take_all(&mut following);
        step += 1;
    }
    let timeline = rows
        .iter()
        .zip(&at)
        .map(|(row, at)| {
            let mut line = Vec::with_capacity(at.last().map_or(0, |&s| s + 1));
            for (&action, &step) in row.iter().zip(at) {
                line.resize(step, None);
                line.push(Some(action.clone()));
            }
            line
        })
        .collect();
    Ok(Schedule::new(timeline))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    First,
    Second,
}

/// The number of steps a simulated timeline takes.
pub fn steps(timeline: &Schedule) -> usize {
    timeline.ranks.iter().map(Vec::len).max().unwrap_or(0)
}

/// What doing `action` records, as far as readiness can ever ask: its
/// simple sub-actions, or itself when it is simple (a compound action
/// never stands for a simple one).
fn recorded(action: &Action) -> impl Iterator<Item = &Action> {
    leaves(action).iter().filter(|a| a.sub_actions().is_empty())
}

struct Deps<'a> {
    stage_to_rank: &'a [usize],
    stages: usize,
    ranks: usize,
    cells: &'a Cells,
}

/// What a simple action needs: nothing, something never done, or any one
/// of up to three (rank, cell) pairs done.
enum Needs {
    Nothing,
    Never,
    Any([(usize, Option<usize>); 3], usize),
}

impl Deps<'_> {
    /// The rank of stage `s`, if it is placed on a rank that exists.
    #[inline]
    fn peer(&self, s: usize) -> Option<usize> {
        self.stage_to_rank
            .get(s)
            .copied()
            .filter(|&r| r < self.ranks)
    }

    fn needs(&self, action: &Action, rank: usize) -> Needs {
        let (stage, mb) = (action.stage(), action.microbatch());
        let cell = |s: usize, k: ActionKind| self.cells.get(s, k, mb);
        let here = |s: usize, k: ActionKind| (rank, cell(s, k));
        let peer = |s: usize| self.peer(s);
        let none = (rank, None);
        match action.kind() {
            ActionKind::Forward if stage == 0 => Needs::Nothing,
            ActionKind::Forward => Needs::Any(
                [
                    here(stage, ActionKind::RecvF),
                    here(stage - 1, ActionKind::Forward),
                    none,
                ],
                2,
            ),
            ActionKind::BackwardInput | ActionKind::FullBackward if stage + 1 >= self.stages => {
                Needs::Nothing
            }
            ActionKind::BackwardInput | ActionKind::FullBackward => Needs::Any(
                [
                    here(stage, ActionKind::RecvB),
                    here(stage + 1, ActionKind::BackwardInput),
                    here(stage + 1, ActionKind::FullBackward),
                ],
                3,
            ),
            ActionKind::SendF => Needs::Any([here(stage, ActionKind::Forward), none, none], 1),
            ActionKind::SendB => Needs::Any(
                [
                    here(stage, ActionKind::BackwardInput),
                    here(stage, ActionKind::FullBackward),
                    none,
                ],
                2,
            ),
            ActionKind::RecvF => match stage.checked_sub(1).and_then(|s| Some((s, peer(s)?))) {
                Some((s, p)) => Needs::Any([(p, cell(s, ActionKind::SendF)), none, none], 1),
                None => Needs::Never,
            },
            ActionKind::RecvB => match peer(stage + 1) {
                Some(p) => Needs::Any([(p, cell(stage + 1, ActionKind::SendB)), none, none], 1),
                None => Needs::Never,
            },
            ActionKind::BackwardWeight
            | ActionKind::Unshard
            | ActionKind::Reshard
            | ActionKind::ReduceGrad
            | ActionKind::OverlapFB => Needs::Nothing,
        }
    }

    fn ready(&self, action: &Action, rank: usize, done: &Done) -> bool {
        if !action.sub_actions().is_empty() {
            return action
                .sub_actions()
                .iter()
                .all(|a| self.ready(a, rank, done));
        }
        // The same rule as [`Deps::needs`], without building the list.
        let (stage, mb) = (action.stage(), action.microbatch());
        let has = |r: usize, s: usize, k: ActionKind| done.has(r, self.cells.get(s, k, mb));
        match action.kind() {
            ActionKind::Forward => {
                stage == 0
                    || has(rank, stage, ActionKind::RecvF)
                    || has(rank, stage - 1, ActionKind::Forward)
            }
            ActionKind::BackwardInput | ActionKind::FullBackward => {
                stage + 1 >= self.stages
                    || has(rank, stage, ActionKind::RecvB)
                    || has(rank, stage + 1, ActionKind::BackwardInput)
                    || has(rank, stage + 1, ActionKind::FullBackward)
            }
            ActionKind::SendF => has(rank, stage, ActionKind::Forward),
            ActionKind::SendB => {
                has(rank, stage, ActionKind::BackwardInput)
                    || has(rank, stage, ActionKind::FullBackward)
            }
            ActionKind::RecvF => stage
                .checked_sub(1)
                .is_some_and(|s| self.peer(s).is_some_and(|p| has(p, s, ActionKind::SendF))),
            ActionKind::RecvB => self
                .peer(stage + 1)
                .is_some_and(|p| has(p, stage + 1, ActionKind::SendB)),
            ActionKind::BackwardWeight
            | ActionKind::Unshard
            | ActionKind::Reshard
            | ActionKind::ReduceGrad
            | ActionKind::OverlapFB => true,
        }
    }

    /// Registers `rank` (blocked at `action`) as waiting for whatever the
    /// parts of `action` that are not ready need.
    fn wait(&self, action: &Action, rank: usize, done: &Done, waiters: &mut Waiters) {
        if !action.sub_actions().is_empty() {
            for sub in action.sub_actions() {
                self.wait(sub, rank, done, waiters);
            }
            return;
        }
        if self.ready(action, rank, done) {
            return;
        }
        if let Needs::Any(pairs, n) = self.needs(action, rank) {
            for &(producer, cell) in &pairs[..n] {
                waiters.wait(rank, producer, cell);
            }
        }
    }
}
