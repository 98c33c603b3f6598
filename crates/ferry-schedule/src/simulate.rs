//! The unit-step simulator: one action per rank per step, sends and
//! receives included, blocking on missing inputs.

use crate::action::{Action, ActionKind};
use crate::csv::Schedule;
use crate::done::{leaves, Cells, Done};
use crate::timeline::Timeline;

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
/// (ready when all its sub-actions are). Idle slots of `lowered` are
/// skipped.
///
/// Returns the [`Timeline`]: the step each action of `lowered` runs at
/// ([`Timeline::to_schedule`] draws it as one slot per step, `None` for a
/// stall); [`Timeline::steps`] is its number of steps.
///
/// Runs in time proportional to the number of actions, whatever the
/// number of steps: each action's place in the step-by-step order above
/// (step, pass, rank) is computed from its rank's previous action and,
/// for a receive, the place of the send it needs. A rank whose next
/// action is a receive whose send is not placed yet waits, without being
/// looked at again, until that send is placed. The only other inputs an
/// action needs are on its own rank, done before it or never.
pub fn simulate_unit_steps<'a>(
    lowered: &'a Schedule,
    stage_to_rank: &[usize],
) -> Result<Timeline<'a>, Deadlock> {
    let ranks = lowered.ranks.len();
    let cells = Cells::new(lowered.ranks.iter().flatten().flatten());
    let sim = Deps {
        stage_to_rank,
        stages: stage_to_rank.len(),
        ranks,
        cells: &cells,
    };
    let mut state = State {
        done: Done::new(cells.len()),
        sent: vec![0; cells.len()],
        head: vec![0; cells.len()],
        next_waiter: vec![0; ranks],
        ranks: ranks as u64,
    };
    // The step of every slot of `lowered`, rank after rank.
    let mut offsets = Vec::with_capacity(ranks + 1);
    offsets.push(0);
    for row in &lowered.ranks {
        offsets.push(offsets[offsets.len() - 1] + row.len());
    }
    let mut at = vec![crate::timeline::IDLE; offsets[ranks]];
    // Per rank: the next slot, and the first step its next action may take.
    let mut pos = vec![0usize; ranks];
    let mut first_step = vec![0u64; ranks];
    let mut steps = 0u64;
    // Ranks that can go on, most recently woken last.
    let mut runnable: Vec<usize> = (0..ranks).rev().collect();
    while let Some(rank) = runnable.pop() {
        let row = &lowered.ranks[rank];
        let at = &mut at[offsets[rank]..offsets[rank + 1]];
        while let Some(slot) = row.get(pos[rank]) {
            let Some(action) = slot else {
                pos[rank] += 1;
                continue;
            };
            let after = match sim.input(action, rank, &mut state) {
                Input::Wait => break,
                Input::After(key) => key,
            };
            // The first (step, pass, rank) place of this rank past both
            // its previous action and its input.
            let earliest = first_step[rank] * 2 * state.ranks + rank as u64;
            let key = match after {
                Some(input) => earliest.max(state.place_after(input, rank)),
                None => earliest,
            };
            let step = key / (2 * state.ranks);
            at[pos[rank]] = step as usize;
            steps = steps.max(step + 1);
            first_step[rank] = step + 1;
            pos[rank] += 1;
            for leaf in recorded(action) {
                let Some(cell) = cells.of(leaf) else { continue };
                state.done.insert(rank, cell);
                if sim.sends_from(leaf, rank) && state.sent[cell] == 0 {
                    state.sent[cell] = key + 1;
                    state.wake(cell, &mut runnable);
                }
            }
        }
    }
    let waiting: Vec<(usize, Action)> = lowered
        .ranks
        .iter()
        .enumerate()
        .filter_map(|(r, row)| Some((r, row[pos[r]..].iter().flatten().next()?.clone())))
        .collect();
    if !waiting.is_empty() {
        return Err(Deadlock {
            step: steps as usize,
            waiting,
        });
    }
    Ok(Timeline::new(lowered, offsets, at, steps as usize))
}

/// The tables of a simulation in progress.
struct State {
    /// Which rank did which cell.
    done: Done,
    /// Per send cell: 1 + the place (step, pass, rank) where the rank the
    /// cell's stage is placed on did it first; 0 while it has not.
    sent: Vec<u64>,
    /// Per send cell: 1 + the first rank waiting for it (0: none).
    head: Vec<u32>,
    /// Per rank: 1 + the next rank waiting for the same cell (0: none).
    next_waiter: Vec<u32>,
    /// The number of ranks (places per pass).
    ranks: u64,
}

impl State {
    /// The first place of `rank` after place `input`: places are numbered
    /// (step × 2 + pass) × ranks + rank, in the order the step-by-step
    /// rule looks at them.
    #[inline]
    fn place_after(&self, input: u64, rank: usize) -> u64 {
        let next = input + 1;
        let base = next - next % self.ranks + rank as u64;
        if base >= next {
            base
        } else {
            base + self.ranks
        }
    }

    /// `rank` waits for send `cell`.
    fn wait(&mut self, rank: usize, cell: usize) {
        self.next_waiter[rank] = self.head[cell];
        self.head[cell] = rank as u32 + 1;
    }

    /// Send `cell` was placed: every rank waiting for it can go on.
    #[inline]
    fn wake(&mut self, cell: usize, runnable: &mut Vec<usize>) {
        let mut at = std::mem::take(&mut self.head[cell]);
        while at != 0 {
            let rank = at as usize - 1;
            runnable.push(rank);
            at = std::mem::take(&mut self.next_waiter[rank]);
        }
    }
}

/// What an action's input is.
enum Input {
    /// Not there yet (a send not placed), or never: the rank waits.
    Wait,
    /// There: nothing needed from another rank (`None`), or the place of
    /// the latest send it needs.
    After(Option<u64>),
}

/// The number of steps a timeline drawn as a schedule (one slot per step,
/// as [`Timeline::to_schedule`] returns) takes: its longest row.
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

impl Deps<'_> {
    /// The rank of stage `s`, if it is placed on a rank that exists.
    #[inline]
    fn peer(&self, s: usize) -> Option<usize> {
        self.stage_to_rank
            .get(s)
            .copied()
            .filter(|&r| r < self.ranks)
    }

    /// Whether `rank` doing the simple `leaf` is the send a receive can
    /// wait for: a SEND_F or SEND_B by the rank its stage is placed on.
    #[inline]
    fn sends_from(&self, leaf: &Action, rank: usize) -> bool {
        matches!(leaf.kind(), ActionKind::SendF | ActionKind::SendB)
            && self.stage_to_rank.get(leaf.stage()) == Some(&rank)
    }

    /// The input of `action` on `rank`: all its sub-actions' inputs (a
    /// compound action), else its own. Registers the rank as waiting for
    /// the first send missing.
    #[inline]
    fn input(&self, action: &Action, rank: usize, state: &mut State) -> Input {
        if action.sub_actions().is_empty() {
            return self.simple_input(action, rank, state);
        }
        let mut latest = None;
        for sub in action.sub_actions() {
            match self.simple_input(sub, rank, state) {
                Input::Wait => return Input::Wait,
                Input::After(key) => latest = latest.max(key),
            }
        }
        Input::After(latest)
    }

    /// The input of a simple action: a receive needs the send of the rank
    /// its peer stage is placed on; a compute or a send needs an action
    /// this rank did before (the same rule as PyTorch's), else never runs.
    #[inline]
    fn simple_input(&self, action: &Action, rank: usize, state: &mut State) -> Input {
        let (stage, mb) = (action.stage(), action.microbatch());
        let has = |s: usize, k: ActionKind| state.done.has(rank, self.cells.get(s, k, mb));
        let local = match action.kind() {
            ActionKind::Forward => {
                stage == 0 || has(stage, ActionKind::RecvF) || has(stage - 1, ActionKind::Forward)
            }
            ActionKind::BackwardInput | ActionKind::FullBackward => {
                stage + 1 >= self.stages
                    || has(stage, ActionKind::RecvB)
                    || has(stage + 1, ActionKind::BackwardInput)
                    || has(stage + 1, ActionKind::FullBackward)
            }
            ActionKind::SendF => has(stage, ActionKind::Forward),
            ActionKind::SendB => {
                has(stage, ActionKind::BackwardInput) || has(stage, ActionKind::FullBackward)
            }
            ActionKind::RecvF => {
                let send = stage
                    .checked_sub(1)
                    .and_then(|s| Some((self.peer(s)?, self.cells.get(s, ActionKind::SendF, mb)?)));
                return self.remote(send, rank, state);
            }
            ActionKind::RecvB => {
                let send = self
                    .peer(stage + 1)
                    .and_then(|p| Some((p, self.cells.get(stage + 1, ActionKind::SendB, mb)?)));
                return self.remote(send, rank, state);
            }
            ActionKind::BackwardWeight
            | ActionKind::Unshard
            | ActionKind::Reshard
            | ActionKind::ReduceGrad
            | ActionKind::OverlapFB => true,
        };
        if local {
            Input::After(None)
        } else {
            // Only this rank's later actions could provide it: never.
            Input::Wait
        }
    }

    /// A receive's input: `send` (its rank and cell) once placed; a
    /// receive with no such send waits forever.
    #[inline]
    fn remote(&self, send: Option<(usize, usize)>, rank: usize, state: &mut State) -> Input {
        let Some((_, cell)) = send else {
            return Input::Wait;
        };
        match state.sent[cell] {
            0 => {
                state.wait(rank, cell);
                Input::Wait
            }
            placed => Input::After(Some(placed - 1)),
        }
    }
}
