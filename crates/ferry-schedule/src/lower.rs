//! Lowering: from a compute-only schedule to one with its communication.
//!
//! - [`add_send_recv`]: SEND/RECV for every stage boundary that crosses
//!   ranks (PyTorch's `_add_send_recv`).
//! - [`add_unshard_reshard`]: FSDP's UNSHARD/RESHARD with a prefetch
//!   window (PyTorch's `_add_unshard_reshard`).
//! - [`defer_recvs`]: each RECV moved as late as it can without a
//!   deadlock (the rule is in [`defer`]'s docs).
//! - [`add_reduce_grad`], [`merge_input_weight`]: REDUCE_GRAD after a
//!   stage's last backward; an adjacent I and W merged into B.

use std::collections::HashMap;

use crate::action::{Action, ActionKind};
use crate::csv::Schedule;
use crate::done::{leaves, Board, RankSet};
use crate::pairs::{self, BACKWARD, FORWARD, KINDS, RECV_B, RECV_F};
use crate::pairs::{Extent, Numbering, Pairs};
use crate::prefetch;

pub mod defer;
mod fast;
mod unshard;

pub use defer::{defer_recvs, DeferOptions};
pub use unshard::{add_unshard_reshard, DEFAULT_MAX_ACTIVE_STAGES};

/// A schedule that cannot be lowered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LowerError {
    /// No rank can place its next action: each waits for an input no rank
    /// will ever send.
    #[error("malformed compute schedule, can't schedule sends/recvs: every rank waits ({})", waiting.iter().map(|(r, a)| format!("rank {r} at {a}")).collect::<Vec<_>>().join(", "))]
    Stuck {
        /// Each unfinished rank with the action it waits at.
        waiting: Vec<(usize, Action)>,
    },
    /// An action names a stage outside the placement.
    #[error(
        "rank {rank}: action {action} names stage {stage}, but the placement has {stages} stages"
    )]
    UnknownStage {
        /// The rank whose list holds the action.
        rank: usize,
        /// The action.
        action: Action,
        /// Its stage.
        stage: usize,
        /// The number of stages placed.
        stages: usize,
    },
}

/// Inserts SEND/RECV actions for every stage boundary that crosses ranks,
/// as PyTorch's `_add_send_recv`: ranks advance in lockstep rounds (in rank
/// order), an action is placed once its input is on its rank, right after
/// it goes its send, and the receiver's RECV is posted at once on the
/// receiving rank (as early as possible). Idle steps are dropped; two
/// stages on the same rank exchange nothing.
///
/// Well-formed schedules (simple actions on placed stages, each done by
/// one rank, that can be lowered) take a fast path with compact tables;
/// anything else runs the general path from the start, which also builds
/// the errors: the result is the same.
///
/// `stage_to_rank[s]` is the rank of stage `s`.
pub fn add_send_recv(compute: &Schedule, stage_to_rank: &[usize]) -> Result<Schedule, LowerError> {
    if let Some(lowered) = fast::add_send_recv(compute, stage_to_rank) {
        return Ok(lowered);
    }
    general(compute, stage_to_rank)
}

/// [`add_send_recv`] without its fast path: any schedule, and the errors.
fn general(compute: &Schedule, stage_to_rank: &[usize]) -> Result<Schedule, LowerError> {
    let (out_len, extent) = lowered_lengths(compute, stage_to_rank)?;
    match extent.number(compute) {
        Numbering::Dense(pairs) => in_rounds(compute, stage_to_rank, &pairs, &out_len),
        Numbering::Sparse(pairs) => in_rounds(compute, stage_to_rank, &pairs, &out_len),
    }
}

/// How many actions each rank's lowered list gets (its own, its sends and
/// the receives posted to it, if every action runs) and the extent of the
/// pairs to number; an error for an action whose stage is not placed.
fn lowered_lengths(
    compute: &Schedule,
    stage_to_rank: &[usize],
) -> Result<(Vec<usize>, Extent), LowerError> {
    let stages = stage_to_rank.len();
    let ctx = Boundaries {
        stage_to_rank,
        stages,
    };
    let mut out_len: Vec<usize> = vec![0; compute.ranks.len()];
    let mut extent = Extent::default();
    for (rank, row) in compute.ranks.iter().enumerate() {
        extent.count += row.len();
        for action in row.iter().flatten() {
            out_len[rank] += 1;
            extent.count += action.sub_actions().len();
            if let Some((stage, kind, mb)) = action.simple_parts() {
                extent.stages = extent.stages.max(stage);
                extent.mbs = extent.mbs.max(mb);
                count_leaf(&ctx, &mut out_len, rank, action, stage, kind)?;
            } else {
                for sub in leaves(action) {
                    extent.add(sub);
                    count_leaf(&ctx, &mut out_len, rank, action, sub.stage(), sub.kind())?;
                }
            }
        }
    }
    Ok((out_len, extent))
}

/// Counts the send and the receive a leaf (`stage`, `kind`) of `action`,
/// on `rank`, adds to the lowered lists; an error if its stage is not
/// placed.
#[inline(always)]
fn count_leaf(
    ctx: &Boundaries<'_>,
    out_len: &mut [usize],
    rank: usize,
    action: &Action,
    stage: usize,
    kind: ActionKind,
) -> Result<(), LowerError> {
    if stage >= ctx.stages {
        return Err(LowerError::UnknownStage {
            rank,
            action: action.clone(),
            stage,
            stages: ctx.stages,
        });
    }
    if let Some((_, _, to)) = ctx.next(stage, kind) {
        out_len[rank] += 1;
        if let Some(n) = out_len.get_mut(to) {
            *n += 1;
        }
    }
    Ok(())
}

/// [`add_send_recv`] with the pairs of `compute` numbered and the length of
/// each lowered list known.
fn in_rounds<P: Pairs>(
    compute: &Schedule,
    stage_to_rank: &[usize],
    pairs: &P,
    out_len: &[usize],
) -> Result<Schedule, LowerError> {
    let ranks = compute.ranks.len();
    let mut l = Rounds {
        ctx: Boundaries {
            stage_to_rank,
            stages: stage_to_rank.len(),
        },
        pairs,
        board: Board::new(pairs.len() * KINDS, ranks),
        out: out_len.iter().map(|&n| Vec::with_capacity(n)).collect(),
        current: RankSet::new(ranks),
        following: RankSet::new(ranks),
    };
    let mut next = vec![0usize; ranks];
    // Ranks to look at in this round, and in the next. A rank whose next
    // action is not ready waits, without being looked at again, until a
    // rank puts what it needs on its rank (this round if that rank comes
    // before it, else the next): the same order as looking at every rank
    // in every round, in time proportional to the number of actions.
    let mut left = 0;
    for (rank, row) in compute.ranks.iter().enumerate() {
        if !row.is_empty() {
            l.current.insert(rank);
            left += 1;
        }
    }
    while left > 0 {
        let mut progress = false;
        let mut cursor = 0;
        while let Some(rank) = l.current.take_from(cursor) {
            cursor = rank + 1;
            let row = &compute.ranks[rank];
            prefetch::ahead(row, next[rank]);
            if let Some(action) = &row[next[rank]] {
                if !l.place(action, rank) {
                    continue;
                }
            }
            next[rank] += 1;
            progress = true;
            if next[rank] < row.len() {
                l.following.insert(rank);
            } else {
                left -= 1;
            }
        }
        if !progress {
            let waiting = compute
                .ranks
                .iter()
                .enumerate()
                .filter_map(|(r, row)| Some((r, row.get(next[r])?.clone()?)))
                .collect();
            return Err(LowerError::Stuck { waiting });
        }
        let Rounds {
            current, following, ..
        } = &mut l;
        current.take_all(following);
    }
    Ok(Schedule::new(l.out))
}

/// The stage, kind and microbatch slot of a simple action
/// ([`Action::simple_parts`]).
type Parts = (usize, ActionKind, usize);

/// Lowering in progress: the lists built so far, what each rank has, who
/// waits for what, and the ranks to look at.
struct Rounds<'a, P> {
    ctx: Boundaries<'a>,
    pairs: &'a P,
    board: Board,
    out: Vec<Vec<Option<Action>>>,
    current: RankSet,
    following: RankSet,
}

impl<P: Pairs> Rounds<'_, P> {
    /// Places `action`, the next of `rank`, with its sends and the
    /// receives they post, if its input is on the rank; else registers the
    /// rank as waiting and returns false. The sub-actions of a compound
    /// action are its leaves (a nested compound one needs and does
    /// nothing).
    #[inline]
    fn place(&mut self, action: &Action, rank: usize) -> bool {
        match action.simple_parts() {
            Some(parts) => {
                let here = self.pairs.pair(parts.0, parts.2);
                if !self.ready(parts, here, rank) {
                    self.board.block(rank);
                    self.wait(parts, rank);
                    return false;
                }
                prefetch::push_ahead(&mut self.out[rank]);
                self.out[rank].push(Some(Action::from_parts(parts.0, parts.1, parts.2)));
                self.emit(parts, here, rank);
            }
            None => {
                let leaves = || action.sub_actions().iter().filter_map(Action::simple_parts);
                let here = |(stage, _, mb): Parts| self.pairs.pair(stage, mb);
                if !leaves().all(|parts| self.ready(parts, here(parts), rank)) {
                    self.board.block(rank);
                    for parts in leaves() {
                        self.wait(parts, rank);
                    }
                    return false;
                }
                self.out[rank].push(Some(action.clone()));
                for parts in leaves() {
                    self.emit(parts, self.pairs.pair(parts.0, parts.2), rank);
                }
            }
        }
        true
    }

    /// Whether the input of a leaf, whose pair is `here`, is already on
    /// `rank`: its receive, else the output of the neighbour stage.
    #[inline(always)]
    fn ready(&self, (stage, kind, mb): Parts, here: Option<usize>, rank: usize) -> bool {
        let Some([(k_here, _), (k_other, other)]) = needs(stage, kind, self.ctx.stages) else {
            return true;
        };
        here.is_some_and(|p| self.board.has_cell(rank, p * KINDS + k_here))
            || self
                .pairs
                .pair(other, mb)
                .is_some_and(|p| self.board.has_cell(rank, p * KINDS + k_other))
    }

    /// Registers `rank` (blocked) as waiting for a leaf's input.
    fn wait(&mut self, (stage, kind, mb): Parts, rank: usize) {
        if let Some(cells) = needs(stage, kind, self.ctx.stages) {
            for (k, s) in cells {
                let cell = self.pairs.pair(s, mb).map(|p| p * KINDS + k);
                self.board.wait(rank, rank, cell);
            }
        }
    }

    /// Records a leaf placed on `rank` (its pair is `here`): the cell
    /// readiness asks about, and
    /// where its output crosses ranks, its send here and the receive
    /// posted to the receiving rank (recorded there).
    #[inline(always)]
    fn emit(&mut self, (stage, kind, mb): Parts, here: Option<usize>, rank: usize) {
        if let (Some(k), Some(pair)) = (pairs::kind_slot(kind), here) {
            self.record(rank, pair * KINDS + k, rank);
        }
        if let Some((next_stage, recv_kind, to)) = self.ctx.next(stage, kind) {
            let (send_kind, k) = if recv_kind == ActionKind::RecvF {
                (ActionKind::SendF, RECV_F)
            } else {
                (ActionKind::SendB, RECV_B)
            };
            self.out[rank].push(Some(Action::from_parts(stage, send_kind, mb)));
            prefetch::push_ahead(&mut self.out[to]);
            self.out[to].push(Some(Action::from_parts(next_stage, recv_kind, mb)));
            if let Some(pair) = self.pairs.pair(next_stage, mb) {
                self.record(to, pair * KINDS + k, rank);
            }
        }
    }

    /// `by` did `cell` while `rank` was placing: the ranks waiting for it
    /// go on, in this round if they come after `rank`, else in the next.
    #[inline]
    fn record(&mut self, by: usize, cell: usize, rank: usize) {
        let Rounds {
            board,
            current,
            following,
            ..
        } = self;
        board.record(by, cell, |woken| {
            if woken > rank {
                current.insert(woken);
            } else {
                following.insert(woken);
            }
        });
    }
}

/// What a leaf's input can come from on its rank: nothing needed
/// (`None`), or either of two cells (slot within the pair, stage): its
/// own receive (the leaf's stage) or the neighbour stage's output.
#[inline]
fn needs(stage: usize, kind: ActionKind, stages: usize) -> Option<[(usize, usize); 2]> {
    match kind {
        ActionKind::Forward if stage > 0 => Some([(RECV_F, stage), (FORWARD, stage - 1)]),
        ActionKind::BackwardInput | ActionKind::FullBackward if stage + 1 < stages => {
            Some([(RECV_B, stage), (BACKWARD, stage + 1)])
        }
        _ => None,
    }
}

struct Boundaries<'a> {
    stage_to_rank: &'a [usize],
    stages: usize,
}

impl Boundaries<'_> {
    /// The stage the output of a leaf (`stage`, `kind`) goes to, its
    /// receive's kind and the receiving rank, if it crosses ranks.
    #[inline]
    fn next(&self, stage: usize, kind: ActionKind) -> Option<(usize, ActionKind, usize)> {
        let (next, recv) = match kind {
            ActionKind::Forward if stage + 1 < self.stages => (stage + 1, ActionKind::RecvF),
            ActionKind::BackwardInput | ActionKind::FullBackward if stage > 0 => {
                (stage - 1, ActionKind::RecvB)
            }
            _ => return None,
        };
        let to = self.stage_to_rank[next];
        (to != self.stage_to_rank[stage]).then_some((next, recv, to))
    }
}

/// Puts a stage's REDUCE_GRAD right after its last backward (B or W) on
/// every rank, as PyTorch's `_add_reduce_grad`; idle steps are dropped.
pub fn add_reduce_grad(schedule: &Schedule, microbatches: usize) -> Schedule {
    Schedule::new(
        schedule
            .ranks
            .iter()
            .map(|row| add_reduce_grad_row(row.clone(), microbatches))
            .collect(),
    )
}

/// Merges an I directly followed by the W of the same stage and
/// microbatch into one full backward B.
pub fn merge_input_weight(schedule: &Schedule) -> Schedule {
    let rows = schedule
        .ranks
        .iter()
        .map(|row| {
            let mut out: Vec<Option<Action>> = Vec::with_capacity(row.len());
            for slot in row {
                if let (Some(Some(prev)), Some(w)) = (out.last(), slot) {
                    if prev.kind() == ActionKind::BackwardInput
                        && w.kind() == ActionKind::BackwardWeight
                        && prev.stage() == w.stage()
                        && prev.microbatch() == w.microbatch()
                    {
                        let merged =
                            Action::new(w.stage(), ActionKind::FullBackward, w.microbatch());
                        if let Some(last) = out.last_mut() {
                            *last = Some(merged);
                        }
                        continue;
                    }
                }
                out.push(slot.clone());
            }
            out
        })
        .collect();
    Schedule::new(rows)
}

/// PyTorch's `_add_reduce_grad`: drops idle steps and puts a stage's
/// REDUCE_GRAD right after its last B or W.
pub(crate) fn add_reduce_grad_row(row: Vec<Option<Action>>, micro: usize) -> Vec<Option<Action>> {
    let mut done: HashMap<usize, usize> = HashMap::new();
    let mut out = Vec::with_capacity(row.len() + 2);
    for action in row.into_iter().flatten() {
        let leaves: Vec<Action> = if action.sub_actions().is_empty() {
            vec![action.clone()]
        } else {
            action.sub_actions().to_vec()
        };
        out.push(Some(action));
        for leaf in leaves {
            if matches!(
                leaf.kind(),
                ActionKind::FullBackward | ActionKind::BackwardWeight
            ) {
                let count = done.entry(leaf.stage()).or_default();
                *count += 1;
                if *count == micro {
                    out.push(Some(Action::per_stage(
                        leaf.stage(),
                        ActionKind::ReduceGrad,
                    )));
                }
            }
        }
    }
    out
}
