//! The unit-step simulator's fast path: the same rules as
//! [`super::run`], for the schedules nearly everyone simulates (simple
//! actions on placed stages, each (stage, microbatch, kind) done by one
//! rank, fewer than 2^30 slots), with one 32-byte record per (stage,
//! microbatch) pair, 32-bit half-steps, and no per-action check for the
//! rare cases. It gives up ([`None`]) at the first action outside those
//! cases, before its state could differ from the general path's, and
//! [`super::simulate_unit_steps`] then runs the general path from the
//! start: the result is the same either way.

use crate::action::ActionKind;
use crate::csv::Schedule;
use crate::pairs::{BACKWARD, FORWARD, RECV_B, RECV_F};
use crate::prefetch;
use crate::timeline::{Steps, Timeline};

use super::Deadlock;

/// Slots (and so steps) below this keep every half-step (step × 2 +
/// pass, plus one) within 32 bits.
const MAX_SLOTS: usize = 1 << 30;

/// Pairs per action of the schedule the grid may grow to (as the general
/// path's dense limit: 64 cells per action, 4 cells per pair), plus a
/// constant.
const PAIRS_PER_SLOT: usize = 16;

/// Everything the simulation knows of one (stage, microbatch) pair.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
struct Pair {
    /// Per cell (F, B or I, RECV_F, RECV_B): 1 + the rank that did it; 0
    /// while none has.
    done: [u32; 4],
    /// Per send (0: SEND_F, 1: SEND_B): 1 + the half-step in which the
    /// rank its stage is placed on did it; 0 while it has not.
    sent: [u32; 2],
    /// Per send: 1 + the first rank waiting for it (0: none).
    head: [u32; 2],
}

/// Records that the rank tagged `tag` did a cell; `None` (give up) if
/// another rank did it before.
#[inline(always)]
fn mark(cell: &mut u32, tag: u32) -> Option<()> {
    if *cell == 0 {
        *cell = tag;
    } else if *cell != tag {
        return None;
    }
    Some(())
}

/// Simulates `lowered` as [`super::simulate_unit_steps`] does, or gives
/// up (`None`) on a schedule outside the fast path's cases.
pub(super) fn run<'a>(
    lowered: &'a Schedule,
    stage_to_rank: &[usize],
    slots: usize,
) -> Option<Result<Timeline<'a>, Deadlock>> {
    let ranks = lowered.ranks.len();
    let stages = stage_to_rank.len();
    if slots >= MAX_SLOTS
        || ranks >= MAX_SLOTS
        || stages >= MAX_SLOTS
        || stage_to_rank.iter().any(|&r| r >= ranks)
    {
        return None;
    }
    // Pairs on a grid of the placed stages and one more, stage-major (a
    // rank walks its stages' microbatches in order: side by side, fewer
    // cache lines and pages than microbatch-major), widened as larger
    // microbatches appear.
    let width = stages + 1;
    let limit = slots * PAIRS_PER_SLOT + (1 << 10);
    let mut mbs = (slots / width / 5 + 1).min(limit / width);
    let mut pairs = vec![Pair::default(); width * mbs];
    let mut offsets = Vec::with_capacity(ranks + 1);
    offsets.push(0);
    for row in &lowered.ranks {
        offsets.push(offsets[offsets.len() - 1] + row.len());
    }
    let mut at = vec![0u32; slots];
    let mut pos = vec![0usize; ranks];
    let mut first_step = vec![0u32; ranks];
    let mut next_waiter = vec![0u32; ranks];
    let mut steps = 0u32;
    let mut runnable: Vec<usize> = (0..ranks).rev().collect();
    while let Some(rank) = runnable.pop() {
        let row = lowered.ranks[rank].as_slice();
        let at = &mut at[offsets[rank]..][..row.len()];
        let tag = rank as u32 + 1;
        let mut i = pos[rank];
        let mut earliest = 2 * first_step[rank];
        while i < row.len() {
            let (slot, out) = (&row[i], &mut at[i]);
            prefetch::ahead(row, i);
            let Some(action) = slot else {
                i += 1;
                continue;
            };
            let (stage, kind, mb) = action.simple_parts()?;
            if stage >= stages {
                return None;
            }
            if mb >= mbs {
                mbs =
                    crate::pairs::widen_to_fit(&mut pairs, width, mbs, mb, limit, Pair::default())?;
            }
            let p = stage * mbs + mb;
            let half = match kind {
                ActionKind::Forward => {
                    if stage != 0
                        && pairs[p].done[RECV_F] != tag
                        && pairs[p - mbs].done[FORWARD] != tag
                    {
                        break;
                    }
                    mark(&mut pairs[p].done[FORWARD], tag)?;
                    earliest
                }
                ActionKind::BackwardInput | ActionKind::FullBackward => {
                    if stage + 1 < stages
                        && pairs[p].done[RECV_B] != tag
                        && pairs[p + mbs].done[BACKWARD] != tag
                    {
                        break;
                    }
                    mark(&mut pairs[p].done[BACKWARD], tag)?;
                    earliest
                }
                ActionKind::SendF | ActionKind::SendB => {
                    let (dir, cell) = if kind == ActionKind::SendF {
                        (0, FORWARD)
                    } else {
                        (1, BACKWARD)
                    };
                    let pair = &mut pairs[p];
                    if pair.done[cell] != tag {
                        break;
                    }
                    if pair.sent[dir] == 0 && stage_to_rank[stage] == rank {
                        pair.sent[dir] = earliest + 1;
                        let mut at = std::mem::take(&mut pair.head[dir]);
                        while at != 0 {
                            let woken = at as usize - 1;
                            runnable.push(woken);
                            at = std::mem::take(&mut next_waiter[woken]);
                        }
                    }
                    earliest
                }
                ActionKind::RecvF | ActionKind::RecvB => {
                    let (from, q, dir, cell) = if kind == ActionKind::RecvF {
                        if stage == 0 {
                            break;
                        }
                        (stage - 1, p - mbs, 0, RECV_F)
                    } else {
                        if stage + 1 >= stages {
                            break;
                        }
                        (stage + 1, p + mbs, 1, RECV_B)
                    };
                    let sender = &mut pairs[q];
                    let placed = sender.sent[dir];
                    if placed == 0 {
                        next_waiter[rank] = sender.head[dir];
                        sender.head[dir] = tag;
                        break;
                    }
                    // Seen in the same pass after the sender, else in the next.
                    let after = placed - 1 + u32::from(rank <= stage_to_rank[from]);
                    mark(&mut pairs[p].done[cell], tag)?;
                    after.max(earliest)
                }
                ActionKind::BackwardWeight
                | ActionKind::Unshard
                | ActionKind::Reshard
                | ActionKind::ReduceGrad
                | ActionKind::OverlapFB => earliest,
            };
            let step = half / 2;
            *out = step;
            earliest = 2 * (step + 1);
            i += 1;
        }
        pos[rank] = i;
        first_step[rank] = earliest / 2;
        steps = steps.max(first_step[rank]);
    }
    if let Some(deadlock) = super::deadlock(lowered, &pos, steps as usize) {
        return Some(Err(deadlock));
    }
    Some(Ok(Timeline::new(
        lowered,
        offsets,
        Steps::Narrow(at),
        steps as usize,
    )))
}
