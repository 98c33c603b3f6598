//! [`super::add_send_recv`]'s fast path: the same rounds as
//! [`super::in_rounds`], for the schedules nearly everyone lowers (simple
//! actions on placed stages, placed on ranks that exist, each (stage,
//! microbatch, kind) done by one rank, and that can be lowered), with one
//! 16-byte record per (stage, microbatch) pair and no pass over the
//! schedule first. It gives up ([`None`]) at the first action outside
//! those cases, or when no rank can go on, and `add_send_recv` then runs
//! the general path from the start (which also builds the error): the
//! result is the same either way.
//!
//! Why a blocked rank needs one cell, not the general path's lists of
//! waiters: a rank blocks on a forward (backward) whose input is neither
//! its receive nor its own neighbour stage's output. It did not do that
//! output before blocking and, blocked, does nothing until woken; so only
//! the receive, which another rank posts to it, can wake it.

use crate::action::{Action, ActionKind};
use crate::csv::Schedule;
use crate::pairs::{BACKWARD, FORWARD, RECV_B, RECV_F};
use crate::prefetch;

/// Pairs per slot of the compute schedule the grid may grow to, plus a
/// constant (the general path's dense limit: 64 cells, 16 pairs, per
/// slot).
const PAIRS_PER_SLOT: usize = 16;

/// A rank's wait cell while it is not blocked (and the cell of an action
/// that records none).
const NOT_WAITING: usize = usize::MAX;

/// No rank: an output that stays on its rank (or goes nowhere).
const NO_RANK: usize = usize::MAX;

/// Where one rank is.
struct RankState<'a> {
    /// Its compute list.
    row: &'a [Option<Action>],
    /// Its next slot.
    next: usize,
    /// The receive cell it waits for while blocked, else [`NOT_WAITING`].
    wait: usize,
}

/// Records that `rank` did a cell; `None` (give up) if another rank did
/// it before.
#[inline(always)]
fn mark(cell: &mut u32, rank: usize) -> Option<()> {
    let tag = rank as u32 + 1;
    if *cell == 0 {
        *cell = tag;
    } else if *cell != tag {
        return None;
    }
    Some(())
}

/// Lowers `compute` as [`super::add_send_recv`] does, or gives up
/// (`None`) on a schedule outside the fast path's cases.
pub(super) fn add_send_recv(compute: &Schedule, stage_to_rank: &[usize]) -> Option<Schedule> {
    let ranks = compute.ranks.len();
    let stages = stage_to_rank.len();
    if ranks >= u32::MAX as usize || stage_to_rank.iter().any(|&r| r >= ranks) {
        return None;
    }
    let slots: usize = compute.ranks.iter().map(Vec::len).sum();
    // Pairs on a grid of the placed stages and one more, stage-major (a
    // rank walks its stages' microbatches in order: side by side), widened
    // as larger microbatches appear; per pair, 1 + the rank that did F, B
    // or I, RECV_F and RECV_B.
    let width = stages.checked_add(1)?;
    let limit = slots
        .checked_mul(PAIRS_PER_SLOT)?
        .checked_add(1 << 10)?
        .max(width);
    let mut mbs = (slots / width / 2 + 1).min(limit / width);
    let mut done = vec![[0u32; 4]; width * mbs];
    // Per stage, the rank its forward's (backward's) output goes to when
    // that crosses ranks, else `NO_RANK`.
    let onward: Vec<[usize; 2]> = (0..stages)
        .map(|s| {
            let here = stage_to_rank[s];
            let to = |t: Option<usize>| match t.and_then(|t| stage_to_rank.get(t)) {
                Some(&r) if r != here => r,
                _ => NO_RANK,
            };
            [to(Some(s + 1)), to(s.checked_sub(1))]
        })
        .collect();
    // Per rank: its compute list, its next slot, the receive cell it waits
    // for if blocked, and its lowered list (each action, its send and a
    // receive posted to the rank: as much as most lowered lists need,
    // grown if one needs more).
    let mut state: Vec<RankState<'_>> = compute
        .ranks
        .iter()
        .map(|row| RankState {
            row,
            next: 0,
            wait: NOT_WAITING,
        })
        .collect();
    let mut out: Vec<Vec<Option<Action>>> = compute
        .ranks
        .iter()
        .map(|row| Vec::with_capacity(row.len() * 3 + 4))
        .collect();
    // The ranks to look at in this round and in the next, as bit sets.
    let words = ranks.div_ceil(64);
    let mut current = vec![0u64; words];
    let mut following = vec![0u64; words];
    let mut left = 0;
    for (rank, row) in compute.ranks.iter().enumerate() {
        if !row.is_empty() {
            current[rank / 64] |= 1 << (rank % 64);
            left += 1;
        }
    }
    while left > 0 {
        let mut progress = false;
        let mut w = 0;
        while w < words {
            // Read again each time: ranks woken in this round come after.
            let bits = current[w];
            if bits == 0 {
                w += 1;
                continue;
            }
            let rank = w * 64 + bits.trailing_zeros() as usize;
            current[w] = bits & (bits - 1);
            let st = &mut state[rank];
            let i = st.next;
            let row = st.row;
            prefetch::ahead(row, i);
            if let Some(action) = &row[i] {
                let (stage, kind, mb) = action.simple_parts()?;
                if stage >= stages {
                    return None;
                }
                if mb >= mbs {
                    mbs = crate::pairs::widen_to_fit(&mut done, width, mbs, mb, limit, [0; 4])?;
                }
                let p = stage * mbs + mb;
                // Where a blocked rank's receive cell is, whatever the layout.
                let key = (mb * width + stage) * 4;
                let tag = rank as u32 + 1;
                // The cell this action records, and where its output goes:
                // the rank, the next stage, its pair, the receive's kind
                // and cell.
                let (cell, to, to_stage, q, recv, recv_cell) = match kind {
                    ActionKind::Forward => {
                        if stage > 0 && done[p][RECV_F] != tag && done[p - mbs][FORWARD] != tag {
                            st.wait = key + RECV_F;
                            continue;
                        }
                        let to = onward[stage][0];
                        (FORWARD, to, stage + 1, p + mbs, ActionKind::RecvF, RECV_F)
                    }
                    ActionKind::BackwardInput | ActionKind::FullBackward => {
                        if stage + 1 < stages
                            && done[p][RECV_B] != tag
                            && done[p + mbs][BACKWARD] != tag
                        {
                            st.wait = key + RECV_B;
                            continue;
                        }
                        let to = onward[stage][1];
                        // `stage - 1` only when the output goes on (stage > 0).
                        let back = stage.wrapping_sub(1);
                        (
                            BACKWARD,
                            to,
                            back,
                            p.wrapping_sub(mbs),
                            ActionKind::RecvB,
                            RECV_B,
                        )
                    }
                    ActionKind::RecvF => (RECV_F, NO_RANK, 0, 0, kind, 0),
                    ActionKind::RecvB => (RECV_B, NO_RANK, 0, 0, kind, 0),
                    _ => (NOT_WAITING, NO_RANK, 0, 0, kind, 0),
                };
                st.next = i + 1;
                prefetch::push_ahead(&mut out[rank]);
                out[rank].push(Some(Action::from_parts(stage, kind, mb)));
                if cell != NOT_WAITING {
                    mark(&mut done[p][cell], rank)?;
                }
                if to != NO_RANK {
                    let send = if recv == ActionKind::RecvF {
                        ActionKind::SendF
                    } else {
                        ActionKind::SendB
                    };
                    out[rank].push(Some(Action::from_parts(stage, send, mb)));
                    prefetch::push_ahead(&mut out[to]);
                    out[to].push(Some(Action::from_parts(to_stage, recv, mb)));
                    mark(&mut done[q][recv_cell], to)?;
                    // The receive wakes its rank if it waits for it: in this
                    // round if it comes after `rank`, else in the next.
                    let waiting = &mut state[to].wait;
                    if *waiting == (mb * width + to_stage) * 4 + recv_cell {
                        *waiting = NOT_WAITING;
                        let set = if to > rank {
                            &mut current
                        } else {
                            &mut following
                        };
                        set[to / 64] |= 1 << (to % 64);
                    }
                }
            } else {
                st.next = i + 1;
            }
            progress = true;
            if i + 1 < row.len() {
                following[rank / 64] |= 1 << (rank % 64);
            } else {
                left -= 1;
            }
        }
        if !progress {
            return None;
        }
        for (a, b) in current.iter_mut().zip(following.iter_mut()) {
            *a = std::mem::take(b);
        }
    }
    Some(Schedule::new(out))
}
