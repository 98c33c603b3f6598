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

use std::collections::{HashMap, HashSet, VecDeque};

use crate::action::{Action, ActionKind};
use crate::csv::Schedule;

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
    let stages = stage_to_rank.len();
    for (rank, row) in compute.ranks.iter().enumerate() {
        for action in row.iter().flatten() {
            for leaf in leaves(action) {
                if leaf.stage() >= stages {
                    return Err(LowerError::UnknownStage {
                        rank,
                        action: action.clone(),
                        stage: leaf.stage(),
                        stages,
                    });
                }
            }
        }
    }
    let ranks = compute.ranks.len();
    let mut queues: Vec<VecDeque<Option<Action>>> = compute
        .ranks
        .iter()
        .map(|r| r.iter().cloned().collect())
        .collect();
    let mut out: Vec<Vec<Option<Action>>> = vec![Vec::new(); ranks];
    let mut done: Vec<HashSet<Action>> = vec![HashSet::new(); ranks];
    let ctx = Boundaries {
        stage_to_rank,
        stages,
    };
    while queues.iter().any(|q| !q.is_empty()) {
        let mut progress = false;
        for rank in 0..ranks {
            let Some(front) = queues[rank].front() else {
                continue;
            };
            if let Some(action) = front {
                if !leaves(action).iter().all(|a| ctx.ready(a, &done[rank])) {
                    continue;
                }
                let action = action.clone();
                out[rank].push(Some(action.clone()));
                for leaf in leaves(&action) {
                    done[rank].insert(leaf.clone());
                    if let Some((send, recv, to)) = ctx.comms(leaf) {
                        out[rank].push(Some(send.clone()));
                        done[rank].insert(send);
                        out[to].push(Some(recv.clone()));
                        done[to].insert(recv);
                    }
                }
            }
            queues[rank].pop_front();
            progress = true;
        }
        if !progress {
            let waiting = queues
                .iter()
                .enumerate()
                .filter_map(|(r, q)| Some((r, q.front()?.clone()?)))
                .collect();
            return Err(LowerError::Stuck { waiting });
        }
    }
    Ok(Schedule::new(out))
}

fn leaves(action: &Action) -> Vec<&Action> {
    if action.sub_actions().is_empty() {
        vec![action]
    } else {
        action.sub_actions().iter().collect()
    }
}

struct Boundaries<'a> {
    stage_to_rank: &'a [usize],
    stages: usize,
}

impl Boundaries<'_> {
    /// The send, the receive and the receiving rank an action's output
    /// needs, if it crosses ranks.
    fn comms(&self, action: &Action) -> Option<(Action, Action, usize)> {
        let (stage, mb) = (action.stage(), action.microbatch());
        let (next, send, recv) = match action.kind() {
            ActionKind::Forward if stage + 1 < self.stages => {
                (stage + 1, ActionKind::SendF, ActionKind::RecvF)
            }
            ActionKind::BackwardInput | ActionKind::FullBackward if stage > 0 => {
                (stage - 1, ActionKind::SendB, ActionKind::RecvB)
            }
            _ => return None,
        };
        let to = self.stage_to_rank[next];
        (to != self.stage_to_rank[stage]).then(|| {
            (
                Action::new(stage, send, mb),
                Action::new(next, recv, mb),
                to,
            )
        })
    }

    /// Whether an action's input is already on its rank.
    fn ready(&self, action: &Action, done: &HashSet<Action>) -> bool {
        let (stage, mb) = (action.stage(), action.microbatch());
        let has = |s: usize, k: ActionKind| done.contains(&Action::new(s, k, mb));
        match action.kind() {
            ActionKind::Forward if stage > 0 => {
                has(stage, ActionKind::RecvF) || has(stage - 1, ActionKind::Forward)
            }
            ActionKind::BackwardInput | ActionKind::FullBackward if stage + 1 < self.stages => {
                has(stage, ActionKind::RecvB)
                    || has(stage + 1, ActionKind::BackwardInput)
                    || has(stage + 1, ActionKind::FullBackward)
            }
            _ => true,
        }
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
