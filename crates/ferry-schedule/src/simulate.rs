//! The unit-step simulator: one action per rank per step, sends and
//! receives included, blocking on missing inputs.

use std::collections::HashSet;

use crate::action::{Action, ActionKind};
use crate::csv::Schedule;
use crate::pairs::{self, Grid, Numbering, Pairs};
use crate::pairs::{BACKWARD, FORWARD, KINDS, RECV_B, RECV_F};
use crate::prefetch;
use crate::timeline::{Step, Timeline};

mod fast;

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
///
/// Well-formed schedules (simple actions on placed stages, each done by
/// one rank) take a fast path with compact tables; anything else, or a
/// fast path that meets it part-way, runs the general path from the start:
/// the result is the same.
pub fn simulate_unit_steps<'a>(
    lowered: &'a Schedule,
    stage_to_rank: &[usize],
) -> Result<Timeline<'a>, Deadlock> {
    // A run takes at most one step per action (every step runs one): with
    // fewer slots than `u32::MAX`, every step fits in 32 bits.
    let slots = lowered.ranks.iter().map(Vec::len).sum::<usize>();
    if let Some(result) = fast::run(lowered, stage_to_rank, slots) {
        return result;
    }
    general(lowered, stage_to_rank, slots)
}

/// [`simulate_unit_steps`] without its fast path: any schedule.
fn general<'a>(
    lowered: &'a Schedule,
    stage_to_rank: &[usize],
    slots: usize,
) -> Result<Timeline<'a>, Deadlock> {
    let narrow = slots
        .checked_add(1)
        .is_some_and(|n| u32::try_from(n).is_ok());
    // Pairs on a grid of the placed stages, grown while the run goes:
    // no pass over the schedule first.
    let grid = Grid::new(stage_to_rank.len(), slots);
    let run_on_grid = if narrow {
        run::<_, u32>(lowered, stage_to_rank, &grid)
    } else {
        run::<_, usize>(lowered, stage_to_rank, &grid)
    };
    if let Ok(result) = run_on_grid {
        return result;
    }
    // An action on a stage the placement lacks, or microbatch numbers far
    // apart: number the pairs the schedule's actions name, and run again.
    let (Ok(result) | Err(result)) = match (pairs::number(lowered), narrow) {
        (Numbering::Dense(pairs), true) => run::<_, u32>(lowered, stage_to_rank, &pairs),
        (Numbering::Dense(pairs), false) => run::<_, usize>(lowered, stage_to_rank, &pairs),
        (Numbering::Sparse(pairs), true) => run::<_, u32>(lowered, stage_to_rank, &pairs),
        (Numbering::Sparse(pairs), false) => run::<_, usize>(lowered, stage_to_rank, &pairs),
    }
    .map_err(|never| match never {});
    result
}

/// [`simulate_unit_steps`] with the pairs of `lowered` numbered by
/// `pairs`; `Err` if they cannot number one of its actions.
fn run<'a, P: Pairs, S: Step>(
    lowered: &'a Schedule,
    stage_to_rank: &[usize],
    pairs: &P,
) -> Result<Result<Timeline<'a>, Deadlock>, P::Miss> {
    let ranks = lowered.ranks.len();
    let sim = Deps {
        stage_to_rank,
        stages: stage_to_rank.len(),
        ranks,
        pairs,
    };
    let mut state = State::new(pairs.len(), ranks);
    // The step of every slot of `lowered`, rank after rank.
    let mut offsets = Vec::with_capacity(ranks + 1);
    offsets.push(0);
    for row in &lowered.ranks {
        offsets.push(offsets[offsets.len() - 1] + row.len());
    }
    let mut at = vec![S::of(0); offsets[ranks]];
    // Per rank: the next slot, and the first step its next action may take.
    let mut pos = vec![0usize; ranks];
    let mut first_step = vec![0u64; ranks];
    let mut steps = 0u64;
    // Ranks that can go on, most recently woken last.
    let mut runnable: Vec<usize> = (0..ranks).rev().collect();
    while let Some(rank) = runnable.pop() {
        let row = &lowered.ranks[rank];
        let at = &mut at[offsets[rank]..offsets[rank + 1]];
        let mut i = pos[rank];
        // The first half-step (step × 2 + pass) this rank's next action
        // may take.
        let mut earliest = 2 * first_step[rank];
        while let Some(slot) = row.get(i) {
            prefetch::ahead(row, i);
            prefetch::ahead(at, i);
            let Some(action) = slot else {
                i += 1;
                continue;
            };
            let half = if let Some(parts) = action.simple_parts() {
                if let Some(len) = pairs.cover(parts.0, parts.2)? {
                    state.grow(len);
                }
                match sim.run_simple(parts, rank, earliest, &mut state, &mut runnable) {
                    Some(half) => half,
                    None => break,
                }
            } else {
                for leaf in action.sub_actions() {
                    if let Some(len) = pairs.cover(leaf.stage(), leaf.microbatch_slot())? {
                        state.grow(len);
                    }
                }
                let after = match sim.input(action, rank, &mut state) {
                    Input::Wait => break,
                    Input::After(half) => half,
                };
                let half = after.max(earliest);
                for leaf in action.sub_actions() {
                    if leaf.sub_actions().is_empty() {
                        sim.record(leaf, rank, half, &mut state, &mut runnable);
                    }
                }
                half
            };
            let step = half / 2;
            at[i] = S::of(step);
            earliest = 2 * (step + 1);
            i += 1;
        }
        pos[rank] = i;
        first_step[rank] = earliest / 2;
        steps = steps.max(first_step[rank]);
    }
    if let Some(deadlock) = deadlock(lowered, &pos, steps as usize) {
        return Ok(Err(deadlock));
    }
    Ok(Ok(Timeline::new(
        lowered,
        offsets,
        S::steps(at),
        steps as usize,
    )))
}

/// The deadlock of a run that stopped with each rank's next slot at
/// `pos` after `steps` steps, if any rank has an action left.
fn deadlock(lowered: &Schedule, pos: &[usize], steps: usize) -> Option<Deadlock> {
    let waiting: Vec<(usize, Action)> = lowered
        .ranks
        .iter()
        .enumerate()
        .filter_map(|(r, row)| Some((r, row[pos[r]..].iter().flatten().next()?.clone())))
        .collect();
    (!waiting.is_empty()).then_some(Deadlock {
        step: steps,
        waiting,
    })
}

/// The tables of a simulation in progress.
struct State {
    /// Per pair, everything the simulation knows of it, in one place so
    /// that an action's lookups touch one cache line (the tables outgrow
    /// the core's cache on large schedules).
    pairs: Vec<PairState>,
    /// Any other rank that did a cell (rank, pair × [`KINDS`] + kind slot),
    /// besides the first one kept in [`PairState::done`] (only in a
    /// malformed schedule).
    others: HashSet<(usize, usize)>,
    /// Per rank: 1 + the next rank waiting for the same send (0: none).
    next_waiter: Vec<u32>,
}

/// What the simulation knows of one (stage, microbatch) pair.
#[derive(Clone, Copy, Default)]
struct PairState {
    /// Per cell (F, B or I, RECV_F, RECV_B): 1 + the first rank that did
    /// it; 0 while none has.
    done: [u32; KINDS],
    /// Per send (0: SEND_F, 1: SEND_B): 1 + the first rank waiting for it
    /// (0: none).
    head: [u32; 2],
    /// Per send: 1 + the half-step (step × 2 + pass) in which the rank
    /// its stage is placed on did it first; 0 while it has not.
    sent: [u64; 2],
}

impl State {
    fn new(pairs: usize, ranks: usize) -> State {
        State {
            pairs: vec![PairState::default(); pairs],
            others: HashSet::new(),
            next_waiter: vec![0; ranks],
        }
    }

    /// Makes room for `pairs` pairs (numbers never change as it grows).
    #[cold]
    fn grow(&mut self, pairs: usize) {
        self.pairs.resize(pairs, PairState::default());
    }

    /// Records that `rank` did `cell` (pair × [`KINDS`] + kind slot).
    #[inline]
    fn insert(&mut self, rank: usize, cell: usize) {
        let tag = rank as u32 + 1;
        let slot = &mut self.pairs[cell / KINDS].done[cell % KINDS];
        if *slot == 0 {
            *slot = tag;
        } else if *slot != tag {
            self.others.insert((rank, cell));
        }
    }

    /// Whether `rank` did `cell`.
    #[inline]
    fn has_cell(&self, rank: usize, cell: usize) -> bool {
        self.pairs[cell / KINDS].done[cell % KINDS] == rank as u32 + 1
            || (!self.others.is_empty() && self.others.contains(&(rank, cell)))
    }

    /// Where send `send` (pair × 2 + direction) was placed (see
    /// [`PairState::sent`]).
    #[inline]
    fn sent(&self, send: usize) -> u64 {
        self.pairs[send / 2].sent[send % 2]
    }

    /// Places send `send` in half-step `half`, if it was not placed yet:
    /// every rank waiting for it can go on.
    #[inline]
    fn place_send(&mut self, send: usize, half: u64, runnable: &mut Vec<usize>) {
        let pair = &mut self.pairs[send / 2];
        if pair.sent[send % 2] != 0 {
            return;
        }
        pair.sent[send % 2] = half + 1;
        let mut at = std::mem::take(&mut pair.head[send % 2]);
        while at != 0 {
            let rank = at as usize - 1;
            runnable.push(rank);
            at = std::mem::take(&mut self.next_waiter[rank]);
        }
    }

    /// `rank` waits for send `send`.
    fn wait(&mut self, rank: usize, send: usize) {
        let head = &mut self.pairs[send / 2].head[send % 2];
        self.next_waiter[rank] = *head;
        *head = rank as u32 + 1;
    }
}

/// What an action's input is.
enum Input {
    /// Not there yet (a send not placed), or never: the rank waits.
    Wait,
    /// There: the first half-step (step × 2 + pass) in which the rank
    /// sees it (0 when nothing from another rank is needed).
    After(u64),
}

/// The number of steps a timeline drawn as a schedule (one slot per step,
/// as [`Timeline::to_schedule`] returns) takes: its longest row.
pub fn steps(timeline: &Schedule) -> usize {
    timeline.ranks.iter().map(Vec::len).max().unwrap_or(0)
}

struct Deps<'a, P> {
    stage_to_rank: &'a [usize],
    stages: usize,
    ranks: usize,
    pairs: &'a P,
}

impl<P: Pairs> Deps<'_, P> {
    /// The rank of stage `s`, if it is placed on a rank that exists.
    #[inline]
    fn peer(&self, s: usize) -> Option<usize> {
        self.stage_to_rank
            .get(s)
            .copied()
            .filter(|&r| r < self.ranks)
    }

    /// Runs the simple `action` on `rank` if its input is there: records
    /// it and returns its half-step, the first at or after `earliest` in
    /// which the rank sees its input. `None`: the rank waits (registered
    /// for the send it needs, if one can come).
    #[inline(always)]
    fn run_simple(
        &self,
        (stage, kind, mb): (usize, ActionKind, usize),
        rank: usize,
        earliest: u64,
        state: &mut State,
        runnable: &mut Vec<usize>,
    ) -> Option<u64> {
        let here = self.pairs.pair(stage, mb);
        let has = |pair: Option<usize>, k: usize| {
            pair.is_some_and(|p| state.has_cell(rank, p * KINDS + k))
        };
        let below = || stage.checked_sub(1).and_then(|s| self.pairs.pair(s, mb));
        let above = || self.pairs.pair(stage + 1, mb);
        // The cell this action records, once it runs.
        let (ready, cell) = match kind {
            ActionKind::Forward => (
                stage == 0 || has(here, RECV_F) || has(below(), FORWARD),
                FORWARD,
            ),
            ActionKind::BackwardInput | ActionKind::FullBackward => (
                stage + 1 >= self.stages || has(here, RECV_B) || has(above(), BACKWARD),
                BACKWARD,
            ),
            ActionKind::SendF | ActionKind::SendB => {
                let ready = if kind == ActionKind::SendF {
                    has(here, FORWARD)
                } else {
                    has(here, BACKWARD)
                };
                if !ready {
                    return None;
                }
                // Only the place of a send by its stage's rank is ever
                // asked about (by the receive).
                if let Some(p) = here.filter(|_| self.stage_to_rank.get(stage) == Some(&rank)) {
                    let cell = p * 2 + usize::from(kind == ActionKind::SendB);
                    state.place_send(cell, earliest, runnable);
                }
                return Some(earliest);
            }
            kind @ (ActionKind::RecvF | ActionKind::RecvB) => {
                // The send of the peer stage, by the rank it is placed on;
                // with no such send the receive waits forever.
                let (from, dir, cell) = if kind == ActionKind::RecvF {
                    (stage.checked_sub(1)?, 0, RECV_F)
                } else {
                    (stage + 1, 1, RECV_B)
                };
                let peer = self.peer(from)?;
                let send = self.pairs.pair(from, mb)? * 2 + dir;
                let after = match state.sent(send) {
                    0 => {
                        state.wait(rank, send);
                        return None;
                    }
                    // Seen in the same pass after the sender, else in the next.
                    placed => placed - 1 + u64::from(rank <= peer),
                };
                if let Some(p) = here {
                    state.insert(rank, p * KINDS + cell);
                }
                return Some(after.max(earliest));
            }
            ActionKind::BackwardWeight
            | ActionKind::Unshard
            | ActionKind::Reshard
            | ActionKind::ReduceGrad
            | ActionKind::OverlapFB => return Some(earliest),
        };
        if !ready {
            return None;
        }
        if let Some(p) = here {
            state.insert(rank, p * KINDS + cell);
        }
        Some(earliest)
    }

    /// Records that `rank` did the simple `leaf` in half-step `half`: its
    /// cell, and for a send by the rank its stage is placed on, the
    /// half-step the receives wait for (waking the ranks waiting).
    #[inline]
    fn record(
        &self,
        leaf: &Action,
        rank: usize,
        half: u64,
        state: &mut State,
        runnable: &mut Vec<usize>,
    ) {
        let Some(pair) = self.pairs.pair(leaf.stage(), leaf.microbatch_slot()) else {
            return;
        };
        match leaf.kind() {
            kind @ (ActionKind::SendF | ActionKind::SendB) => {
                if self.stage_to_rank.get(leaf.stage()) == Some(&rank) {
                    let cell = pair * 2 + usize::from(kind == ActionKind::SendB);
                    state.place_send(cell, half, runnable);
                }
            }
            kind => {
                if let Some(k) = pairs::kind_slot(kind) {
                    state.insert(rank, pair * KINDS + k);
                }
            }
        }
    }

    /// The input of `action` on `rank`: all its sub-actions' inputs (a
    /// compound action), else its own. Registers the rank as waiting for
    /// the first send missing.
    #[inline]
    fn input(&self, action: &Action, rank: usize, state: &mut State) -> Input {
        if action.sub_actions().is_empty() {
            return self.simple_input(action, rank, state);
        }
        let mut latest = 0;
        for sub in action.sub_actions() {
            match self.simple_input(sub, rank, state) {
                Input::Wait => return Input::Wait,
                Input::After(half) => latest = latest.max(half),
            }
        }
        Input::After(latest)
    }

    /// The input of a simple action: a receive needs the send of the rank
    /// its peer stage is placed on; a compute or a send needs an action
    /// this rank did before (the same rule as PyTorch's), else never runs.
    #[inline]
    fn simple_input(&self, action: &Action, rank: usize, state: &mut State) -> Input {
        let (stage, mb) = (action.stage(), action.microbatch_slot());
        let has = |s: usize, k: usize| {
            self.pairs
                .pair(s, mb)
                .is_some_and(|p| state.has_cell(rank, p * KINDS + k))
        };
        let local = match action.kind() {
            ActionKind::Forward => stage == 0 || has(stage, RECV_F) || has(stage - 1, FORWARD),
            ActionKind::BackwardInput | ActionKind::FullBackward => {
                stage + 1 >= self.stages || has(stage, RECV_B) || has(stage + 1, BACKWARD)
            }
            ActionKind::SendF => has(stage, FORWARD),
            ActionKind::SendB => has(stage, BACKWARD),
            ActionKind::RecvF => {
                let Some(from) = stage.checked_sub(1) else {
                    return Input::Wait;
                };
                return self.remote(from, mb, 0, rank, state);
            }
            ActionKind::RecvB => return self.remote(stage + 1, mb, 1, rank, state),
            ActionKind::BackwardWeight
            | ActionKind::Unshard
            | ActionKind::Reshard
            | ActionKind::ReduceGrad
            | ActionKind::OverlapFB => true,
        };
        if local {
            Input::After(0)
        } else {
            // Only this rank's later actions could provide it: never.
            Input::Wait
        }
    }

    /// A receive's input: the send (`dir` 0: SEND_F, 1: SEND_B) of
    /// microbatch slot `mb` by stage `from`'s rank, once placed; a receive
    /// with no such rank waits forever.
    #[inline]
    fn remote(&self, from: usize, mb: usize, dir: usize, rank: usize, state: &mut State) -> Input {
        let (Some(peer), Some(pair)) = (self.peer(from), self.pairs.pair(from, mb)) else {
            return Input::Wait;
        };
        let cell = pair * 2 + dir;
        match state.sent(cell) {
            0 => {
                state.wait(rank, cell);
                Input::Wait
            }
            // Seen in the same pass after the sender, else in the next.
            placed => Input::After(placed - 1 + u64::from(rank <= peer)),
        }
    }
}
