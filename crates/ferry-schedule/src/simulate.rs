//! The unit-step simulator: one action per rank per step, sends and
//! receives included, blocking on missing inputs.

use std::collections::{HashSet, VecDeque};

use crate::action::{Action, ActionKind};
use crate::csv::Schedule;

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
pub fn simulate_unit_steps(
    lowered: &Schedule,
    stage_to_rank: &[usize],
) -> Result<Schedule, Deadlock> {
    let ranks = lowered.ranks.len();
    let stages = stage_to_rank.len();
    let mut queues: Vec<VecDeque<Action>> = lowered
        .ranks
        .iter()
        .map(|row| row.iter().flatten().cloned().collect())
        .collect();
    let mut timeline: Vec<Vec<Option<Action>>> = vec![Vec::new(); ranks];
    let mut done: Vec<HashSet<Action>> = vec![HashSet::new(); ranks];
    let sim = Deps {
        stage_to_rank,
        stages,
    };
    let mut step = 0;
    while queues.iter().any(|q| !q.is_empty()) {
        let mut progress = false;
        let mut stalled = Vec::new();
        for rank in 0..ranks {
            let Some(action) = queues[rank].front() else {
                continue;
            };
            if sim.ready(action, rank, &done) {
                let action = queues[rank].pop_front().expect("front exists");
                record(&mut done[rank], &action);
                timeline[rank].push(Some(action));
                progress = true;
            } else {
                timeline[rank].push(None);
                stalled.push(rank);
            }
        }
        for rank in stalled {
            let Some(action) = queues[rank].front() else {
                continue;
            };
            if sim.ready(action, rank, &done) {
                let action = queues[rank].pop_front().expect("front exists");
                record(&mut done[rank], &action);
                if let Some(last) = timeline[rank].last_mut() {
                    *last = Some(action);
                }
            }
        }
        if !progress {
            let waiting = queues
                .iter()
                .enumerate()
                .filter_map(|(r, q)| Some((r, q.front()?.clone())))
                .collect();
            return Err(Deadlock { step, waiting });
        }
        step += 1;
    }
    Ok(Schedule::new(timeline))
}

/// The number of steps a simulated timeline takes.
pub fn steps(timeline: &Schedule) -> usize {
    timeline.ranks.iter().map(Vec::len).max().unwrap_or(0)
}

fn record(done: &mut HashSet<Action>, action: &Action) {
    for sub in action.sub_actions() {
        done.insert(sub.clone());
    }
    done.insert(action.clone());
}

struct Deps<'a> {
    stage_to_rank: &'a [usize],
    stages: usize,
}

impl Deps<'_> {
    fn ready(&self, action: &Action, rank: usize, done: &[HashSet<Action>]) -> bool {
        if !action.sub_actions().is_empty() {
            return action
                .sub_actions()
                .iter()
                .all(|a| self.ready(a, rank, done));
        }
        let (stage, mb) = (action.stage(), action.microbatch());
        let here = &done[rank];
        let has =
            |set: &HashSet<Action>, s: usize, k: ActionKind| set.contains(&Action::new(s, k, mb));
        let peer = |s: usize| self.stage_to_rank.get(s).and_then(|&r| done.get(r));
        match action.kind() {
            ActionKind::Forward => {
                stage == 0
                    || has(here, stage, ActionKind::RecvF)
                    || has(here, stage - 1, ActionKind::Forward)
            }
            ActionKind::BackwardInput | ActionKind::FullBackward => {
                stage + 1 >= self.stages
                    || has(here, stage, ActionKind::RecvB)
                    || has(here, stage + 1, ActionKind::BackwardInput)
                    || has(here, stage + 1, ActionKind::FullBackward)
            }
            ActionKind::SendF => has(here, stage, ActionKind::Forward),
            ActionKind::SendB => {
                has(here, stage, ActionKind::BackwardInput)
                    || has(here, stage, ActionKind::FullBackward)
            }
            ActionKind::RecvF => stage
                .checked_sub(1)
                .and_then(peer)
                .is_some_and(|p| has(p, stage - 1, ActionKind::SendF)),
            ActionKind::RecvB => {
                peer(stage + 1).is_some_and(|p| has(p, stage + 1, ActionKind::SendB))
            }
            ActionKind::BackwardWeight
            | ActionKind::Unshard
            | ActionKind::Reshard
            | ActionKind::ReduceGrad
            | ActionKind::OverlapFB => true,
        }
    }
}
