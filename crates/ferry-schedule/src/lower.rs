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
use crate::done::{leaves, Done, RankSet, Waiters};
use crate::pairs::{self, BACKWARD, FORWARD, KINDS, RECV_B, RECV_F};
use crate::pairs::{Extent, Numbering, Pairs};

pub mod defer;
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
/// `stage_to_rank[s]` is the rank of stage `s`.
pub fn add_send_recv(compute: &Schedule, stage_to_rank: &[usize]) -> Result<Schedule, LowerError> {
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
            for leaf in leaves(action) {
                extent.add(leaf);
                if leaf.stage() >= stages {
                    return Err(LowerError::UnknownStage {
                        rank,
                        action: action.clone(),
                        stage: leaf.stage(),
                        stages,
                    });
                }
                if let Some((_, _, to)) = ctx.next(leaf) {
                    out_len[rank] += 1;
                    if let Some(n) = out_len.get_mut(to) {
                        *n += 1;
                    }
                }
            }
        }
    }
    Ok((out_len, extent))
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
    let ctx = Boundaries {
        stage_to_rank,
        stages: stage_to_rank.len(),
    };
    let mut done = Done::new(pairs.len() * KINDS);
    let mut waiters = Waiters::new(pairs.len() * KINDS, ranks);
    let mut next = vec![0usize; ranks];
    let mut out: Vec<Vec<Option<Action>>> =
        out_len.iter().map(|&n| Vec::with_capacity(n)).collect();
    // Ranks to look at in this round, and in the next. A rank whose next
    // action is not ready waits, without being looked at again, until a
    // rank puts what it needs on its rank (this round if that rank comes
    // before it, else the next): the same order as looking at every rank
    // in every round, in time proportional to the number of actions.
    let (mut current, mut following) = (RankSet::new(ranks), RankSet::new(ranks));
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
            if let Some(action) = &row[next[rank]] {
                if !leaves(action)
                    .iter()
                    .all(|a| ready(a, rank, ctx.stages, pairs, &done))
                {
                    waiters.block(rank);
                    for leaf in leaves(action) {
                        wait(leaf, rank, ctx.stages, pairs, &mut waiters);
                    }
                    continue;
                }
                out[rank].push(Some(action.clone()));
                let mut wake = |woken: usize| {
                    if woken > rank {
                        current.insert(woken);
                    } else {
                        following.insert(woken);
                    }
                };
                for leaf in leaves(action) {
                    // What readiness asks about: a rank's own compute (or
                    // receive) leaves and the receives posted to it.
                    if leaf.sub_actions().is_empty() {
                        if let Some(cell) = pairs::kind_slot(leaf.kind()).and_then(|k| {
                            Some(pairs.pair(leaf.stage(), leaf.microbatch_slot())? * KINDS + k)
                        }) {
                            done.insert(rank, cell);
                            waiters.done(rank, cell, &mut wake);
                        }
                    }
                    if let Some((next_stage, recv_kind, to)) = ctx.next(leaf) {
                        let send_kind = if recv_kind == ActionKind::RecvF {
                            ActionKind::SendF
                        } else {
                            ActionKind::SendB
                        };
                        out[rank].push(Some(leaf.with_stage_kind(leaf.stage(), send_kind)));
                        out[to].push(Some(leaf.with_stage_kind(next_stage, recv_kind)));
                        let k = if recv_kind == ActionKind::RecvF {
                            RECV_F
                        } else {
                            RECV_B
                        };
                        if let Some(pair) = pairs.pair(next_stage, leaf.microbatch_slot()) {
                            done.insert(to, pair * KINDS + k);
                            waiters.done(to, pair * KINDS + k, &mut wake);
                        }
                    }
                }
            }
            next[rank] += 1;
            progress = true;
            if next[rank] < row.len() {
                following.insert(rank);
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
        current.take_all(&mut following);
    }
    Ok(Schedule::new(out))
}

/// What an action's input can come from on its rank: nothing needed
/// (`None`), or any one of up to three cells (slot within the pair, stage).
#[inline]
fn needs(action: &Action, stages: usize) -> Option<([(usize, usize); 3], usize)> {
    let stage = action.stage();
    match action.kind() {
        ActionKind::Forward if stage > 0 => {
            Some(([(RECV_F, stage), (FORWARD, stage - 1), (0, 0)], 2))
        }
        ActionKind::BackwardInput | ActionKind::FullBackward if stage + 1 < stages => {
            Some(([(RECV_B, stage), (BACKWARD, stage + 1), (0, 0)], 2))
        }
        _ => None,
    }
}

/// Whether an action's input is already on its rank.
#[inline]
fn ready<P: Pairs>(action: &Action, rank: usize, stages: usize, pairs: &P, done: &Done) -> bool {
    let Some((cells, n)) = needs(action, stages) else {
        return true;
    };
    let mb = action.microbatch_slot();
    cells[..n].iter().any(|&(k, s)| {
        pairs
            .pair(s, mb)
            .is_some_and(|p| done.has_cell(rank, p * KINDS + k))
    })
}

/// Registers `rank` (blocked) as waiting for `action`'s input.
fn wait<P: Pairs>(action: &Action, rank: usize, stages: usize, pairs: &P, waiters: &mut Waiters) {
    if let Some((cells, n)) = needs(action, stages) {
        let mb = action.microbatch_slot();
        for &(k, s) in &cells[..n] {
            waiters.wait(rank, rank, pairs.pair(s, mb).map(|p| p * KINDS + k));
        }
    }
}

struct Boundaries<'a> {
    stage_to_rank: &'a [usize],
    stages: usize,
}

impl Boundaries<'_> {
    /// The stage an action's output goes to, its receive's kind and the
    /// receiving rank, if it crosses ranks.
    #[inline]
    fn next(&self, action: &Action) -> Option<(usize, ActionKind, usize)> {
        let stage = action.stage();
        let (next, recv) = match action.kind() {
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
