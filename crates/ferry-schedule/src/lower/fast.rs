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
use crate::done::RankSet;
use crate::pairs::{BACKWARD, FORWARD, RECV_B, RECV_F};
use crate::prefetch;

/// Pairs per slot of the compute schedule the grid may grow to, plus a
/// constant (the general path's dense limit: 64 cells, 16 pairs, per
/// slot).
const PAIRS_PER_SLOT: usize = 16;

/// A rank's wait cell while it is not blocked.
const NOT_WAITING: usize = usize::MAX;

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
    // Pairs on a grid of the placed stages and one more, microbatch-major,
    // grown as larger microbatches appear (numbers never change); per
    // pair, 1 + the rank that did F, B or I, RECV_F and RECV_B.
    let width = stages.checked_add(1)?;
    let limit = slots
        .checked_mul(PAIRS_PER_SLOT)?
        .checked_add(1 << 10)?
        .max(width);
    let mut mbs = (slots / width / 2 + 1).min(limit / width);
    let mut done = vec![[0u32; 4]; width * mbs];
    // Each action, its send and a receive posted to the rank: as much as
    // most lowered lists need, grown if one needs more.
    let mut out: Vec<Vec<Option<Action>>> = compute
        .ranks
        .iter()
        .map(|row| Vec::with_capacity(row.len() * 3 + 4))
        .collect();
    let mut next = vec![0usize; ranks];
    let mut wait = vec![NOT_WAITING; ranks];
    let mut current = RankSet::new(ranks);
    let mut following = RankSet::new(ranks);
    let mut left = 0;
    for (rank, row) in compute.ranks.iter().enumerate() {
        if !row.is_empty() {
            current.insert(rank);
            left += 1;
        }
    }
    while left > 0 {
        let mut progress = false;
        let mut cursor = 0;
        while let Some(rank) = current.take_from(cursor) {
            cursor = rank + 1;
            let row = &compute.ranks[rank];
            let i = next[rank];
            prefetch::ahead(row, i);
            if let Some(action) = &row[i] {
                let (stage, kind, mb) = action.simple_parts()?;
                if stage >= stages {
                    return None;
                }
                if mb >= mbs {
                    let grown = (mb + 1).max(mbs + mbs / 2).min(limit / width);
                    if mb >= grown {
                        return None;
                    }
                    mbs = grown;
                    done.resize(width * mbs, [0; 4]);
                }
                let p = mb * width + stage;
                let tag = rank as u32 + 1;
                // The cell this action records, and where its output goes
                // (the next stage's pair, its receive's kind and cell).
                let (cell, onward) = match kind {
                    ActionKind::Forward => {
                        if stage > 0 && done[p][RECV_F] != tag && done[p - 1][FORWARD] != tag {
                            wait[rank] = p * 4 + RECV_F;
                            continue;
                        }
                        let onward = (stage + 1 < stages).then_some((
                            stage + 1,
                            p + 1,
                            ActionKind::RecvF,
                            RECV_F,
                        ));
                        (FORWARD, onward)
                    }
                    ActionKind::BackwardInput | ActionKind::FullBackward => {
                        if stage + 1 < stages
                            && done[p][RECV_B] != tag
                            && done[p + 1][BACKWARD] != tag
                        {
                            wait[rank] = p * 4 + RECV_B;
                            continue;
                        }
                        let onward =
                            (stage > 0).then(|| (stage - 1, p - 1, ActionKind::RecvB, RECV_B));
                        (BACKWARD, onward)
                    }
                    ActionKind::RecvF => (RECV_F, None),
                    ActionKind::RecvB => (RECV_B, None),
                    _ => (NOT_WAITING, None),
                };
                prefetch::push_ahead(&mut out[rank]);
                out[rank].push(Some(Action::from_parts(stage, kind, mb)));
                if cell != NOT_WAITING {
                    mark(&mut done[p][cell], rank)?;
                }
                if let Some((to_stage, q, recv, recv_cell)) = onward {
                    let to = stage_to_rank[to_stage];
                    if to != stage_to_rank[stage] {
                        let send = if recv == ActionKind::RecvF {
                            ActionKind::SendF
                        } else {
                            ActionKind::SendB
                        };
                        out[rank].push(Some(Action::from_parts(stage, send, mb)));
                        prefetch::push_ahead(&mut out[to]);
                        out[to].push(Some(Action::from_parts(to_stage, recv, mb)));
                        mark(&mut done[q][recv_cell], to)?;
                        // The receive wakes its rank if it waits for it:
                        // in this round if it comes after `rank`, else in
                        // the next.
                        if wait[to] == q * 4 + recv_cell {
                            wait[to] = NOT_WAITING;
                            if to > rank {
                                current.insert(to);
                            } else {
                                following.insert(to);
                            }
                        }
                    }
                }
            }
            next[rank] = i + 1;
            progress = true;
            if i + 1 < row.len() {
                following.insert(rank);
            } else {
                left -= 1;
            }
        }
        if !progress {
            return None;
        }
        current.take_all(&mut following);
    }
    Some(Schedule::new(out))
}
