//! Deadlock detection before a lowered schedule runs.
//!
//! Each rank runs its list in order and blocks at an action until what it
//! needs is there: a receive until its peer has run the matching send; a
//! forward until its activation is on its rank (its RECV_F, or the forward
//! of the previous stage on the same rank); a backward until its gradient
//! is (its RECV_B, or the backward of the next stage); a send until the
//! compute that makes its data. These are the unit-step simulator's rules
//! ([`crate::simulate_unit_steps`]). Under [`CommModel::Rendezvous`] a send
//! also blocks until the peer reaches the matching receive (both complete
//! together).
//!
//! [`check_deadlock`] runs the ranks as far as they go. If some cannot
//! finish, every stuck rank waits at its next action for one action of one
//! rank; those waits either end at an action no rank will ever run (a
//! receive with no send, a forward whose input never comes before it, ...)
//! or close a cycle of ranks that wait on each other, and the error names
//! the actions of that cycle.

use std::collections::HashSet;
use std::fmt;

use crate::action::{Action, ActionKind};
use crate::csv::Schedule;

/// When a send completes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CommModel {
    /// A send completes at once, its data buffered until the peer receives
    /// it; only receives (and compute, on its inputs) block. PyTorch's
    /// `isend` and `_simulate_comms_compute` work this way.
    #[default]
    Buffered,
    /// A send completes only together with its receive: the sender waits
    /// until the peer reaches the matching receive (a rendezvous, as
    /// unbatched point-to-point transfers on one communication stream).
    Rendezvous,
}

/// One rank of a deadlock cycle and what it waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wait {
    /// The waiting rank.
    pub rank: usize,
    /// The step (position in the rank's list, idle steps counted) of the
    /// action it waits at.
    pub step: usize,
    /// The action it waits at.
    pub action: Action,
    /// The action it waits for.
    pub waits_for: Action,
    /// The rank that must run `waits_for`.
    pub on_rank: usize,
    /// The action `on_rank` is itself stuck at, when that is not
    /// `waits_for` (which then lies behind it).
    pub behind: Option<Action>,
}

impl fmt::Display for Wait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} waits at {} for {} on rank {}",
            self.rank, self.action, self.waits_for, self.on_rank
        )?;
        if let Some(behind) = &self.behind {
            write!(f, " (behind {behind})")?;
        }
        Ok(())
    }
}

/// A lowered schedule that cannot finish, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeadlockError {
    /// A compute-only schedule in which every unfinished rank waits for an
    /// input no rank will ever make, found while adding its sends and
    /// receives ([`LowerError::Stuck`](crate::LowerError::Stuck)).
    #[error("deadlock: every rank waits ({}); none of them can move", waiting.iter().map(|(r, a)| format!("rank {r} at {a}")).collect::<Vec<_>>().join(", "))]
    Stuck {
        /// Each unfinished rank with the action it waits at.
        waiting: Vec<(usize, Action)>,
    },
    /// Ranks that wait on each other in a cycle; the first wait is the
    /// lowest rank's, each next one is the rank the previous waits for.
    #[error("deadlock: {}; none of them can move", waits.iter().map(Wait::to_string).collect::<Vec<_>>().join("; "))]
    Cycle {
        /// The waits that close the cycle.
        waits: Vec<Wait>,
    },
    /// A receive whose matching send the sending rank never runs.
    #[error("rank {rank}, step {step}: {action} waits for {send} on rank {peer}, which rank {peer} never runs{}", elsewhere.map(|r| format!(" (it is on rank {r}, but stage {} lives on rank {peer})", partner(action).stage())).unwrap_or_default(), send = partner(action))]
    NoSend {
        /// The receiving rank.
        rank: usize,
        /// The receive's step.
        step: usize,
        /// The receive (its send is [`partner`]`(action)`).
        action: Action,
        /// The rank of the sending stage.
        peer: usize,
        /// Another rank whose list still holds that send, if any.
        elsewhere: Option<usize>,
    },
    /// A send (under [`CommModel::Rendezvous`]) whose matching receive the
    /// receiving rank never runs.
    #[error("rank {rank}, step {step}: {action} waits for {recv} on rank {peer}, which rank {peer} never runs (a rendezvous send completes only with its receive)", recv = partner(action))]
    NoRecv {
        /// The sending rank.
        rank: usize,
        /// The send's step.
        step: usize,
        /// The send (its receive is [`partner`]`(action)`).
        action: Action,
        /// The rank of the receiving stage.
        peer: usize,
    },
    /// A receive from a stage that does not exist (a RECV_F of the first
    /// stage, a RECV_B of the last).
    #[error("rank {rank}, step {step}: {action} receives from stage {from}, which does not exist (the placement has {stages} stages)")]
    NoPeerStage {
        /// The receiving rank.
        rank: usize,
        /// The receive's step.
        step: usize,
        /// The receive.
        action: Action,
        /// The stage it would receive from (`-1` before stage 0).
        from: i64,
        /// The number of stages placed.
        stages: usize,
    },
    /// An action whose input is made on its own rank, but not before it.
    #[error("rank {rank}, step {step}: {action} waits for {}, which does not come before it on rank {rank}", needs.iter().map(Action::to_string).collect::<Vec<_>>().join(" or "))]
    MissingInput {
        /// The rank.
        rank: usize,
        /// The action's step.
        step: usize,
        /// The action.
        action: Action,
        /// What it needs (any one of them).
        needs: Vec<Action>,
    },
    /// An action names a stage outside the placement.
    #[error("rank {rank}, step {step}: {action} names stage {stage}, but the placement has {stages} stages")]
    UnknownStage {
        /// The rank.
        rank: usize,
        /// The action's step.
        step: usize,
        /// The action.
        action: Action,
        /// Its stage.
        stage: usize,
        /// The number of stages placed.
        stages: usize,
    },
}

/// Checks that a lowered schedule finishes when sends are buffered and
/// receives block ([`CommModel::Buffered`], the unit-step simulator's
/// rules), without running it: `Ok` exactly when
/// [`crate::simulate_unit_steps`] finishes.
///
/// `stage_to_rank[s]` is the rank of stage `s`.
///
/// ```
/// use ferry_schedule::{check_deadlock, Schedule};
///
/// // Each rank receives before it sends what the other waits for.
/// let lowered = Schedule::from_csv(
///     "0F0,0SEND_F0,0RECV_B0,0F1,0SEND_F1,0B0\r\n\
///      1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1B1\r\n",
/// )?;
/// let err = check_deadlock(&lowered, &[0, 1]).unwrap_err();
/// assert_eq!(
///     err.to_string(),
///     "deadlock: rank 0 waits at 0RECV_B0 for 1SEND_B0 on rank 1 (behind 1RECV_F1); \
///      rank 1 waits at 1RECV_F1 for 0SEND_F1 on rank 0 (behind 0RECV_B0); \
///      none of them can move"
/// );
/// # Ok::<(), ferry_schedule::CsvError>(())
/// ```
pub fn check_deadlock(lowered: &Schedule, stage_to_rank: &[usize]) -> Result<(), DeadlockError> {
    check_deadlock_with(lowered, stage_to_rank, CommModel::Buffered)
}

/// [`check_deadlock`] under a given [`CommModel`].
pub fn check_deadlock_with(
    lowered: &Schedule,
    stage_to_rank: &[usize],
    model: CommModel,
) -> Result<(), DeadlockError> {
    let mut run = Run::new(lowered, stage_to_rank, model)?;
    run.advance_all();
    run.diagnose()
}

/// What one simple action needs before it can run (send-side rendezvous
/// aside).
pub(crate) enum Input {
    /// Nothing.
    Nothing,
    /// Any one of these, run earlier on the same rank.
    Local(Vec<Action>),
    /// The matching send, run by the peer rank.
    Send {
        /// The sending stage's rank.
        peer: usize,
        /// The send.
        send: Action,
    },
    /// The sending stage does not exist.
    NoPeer {
        /// The stage it would be.
        from: i64,
    },
}

/// What `leaf` (a simple action) needs, by the simulator's rules.
pub(crate) fn input(leaf: &Action, stage_to_rank: &[usize]) -> Input {
    let (stage, mb) = (leaf.stage(), leaf.microbatch());
    let stages = stage_to_rank.len();
    let at = |s: usize, k: ActionKind| Action::new(s, k, mb);
    let from_peer = |from: i64, kind: ActionKind| match usize::try_from(from)
        .ok()
        .and_then(|s| Some((s, *stage_to_rank.get(s)?)))
    {
        Some((s, peer)) => Input::Send {
            peer,
            send: at(s, kind),
        },
        None => Input::NoPeer { from },
    };
    let signed = i64::try_from(stage).unwrap_or(i64::MAX);
    match leaf.kind() {
        ActionKind::Forward if stage > 0 => Input::Local(vec![
            at(stage, ActionKind::RecvF),
            at(stage - 1, ActionKind::Forward),
        ]),
        ActionKind::BackwardInput | ActionKind::FullBackward if stage + 1 < stages => {
            Input::Local(vec![
                at(stage, ActionKind::RecvB),
                at(stage + 1, ActionKind::BackwardInput),
                at(stage + 1, ActionKind::FullBackward),
            ])
        }
        ActionKind::SendF => Input::Local(vec![at(stage, ActionKind::Forward)]),
        ActionKind::SendB => Input::Local(vec![
            at(stage, ActionKind::BackwardInput),
            at(stage, ActionKind::FullBackward),
        ]),
        ActionKind::RecvF => from_peer(signed.saturating_sub(1), ActionKind::SendF),
        ActionKind::RecvB => from_peer(signed.saturating_add(1), ActionKind::SendB),
        _ => Input::Nothing,
    }
}

/// The other end of a send or receive: `1RECV_F0` for `0SEND_F0`,
/// `0SEND_F0` for `1RECV_F0` (and so for the backward kinds). Any other
/// action, or one at the edge of the stage numbers, is its own partner.
pub fn partner(action: &Action) -> Action {
    let (stage, mb) = (action.stage(), action.microbatch());
    let other = match action.kind() {
        ActionKind::SendF => stage.checked_add(1).map(|s| (s, ActionKind::RecvF)),
        ActionKind::RecvF => stage.checked_sub(1).map(|s| (s, ActionKind::SendF)),
        ActionKind::SendB => stage.checked_sub(1).map(|s| (s, ActionKind::RecvB)),
        ActionKind::RecvB => stage.checked_add(1).map(|s| (s, ActionKind::SendB)),
        _ => None,
    }
    .filter(|&(s, _)| s <= crate::action::MAX_STAGE);
    other.map_or_else(|| action.clone(), |(s, k)| Action::new(s, k, mb))
}

/// The receive matching a send, and the receiving rank; `None` for a
/// send to a stage that does not exist, or for any other action.
pub(crate) fn matching_recv(send: &Action, stage_to_rank: &[usize]) -> Option<(usize, Action)> {
    let (to, kind) = match send.kind() {
        ActionKind::SendF => (send.stage().checked_add(1)?, ActionKind::RecvF),
        ActionKind::SendB => (send.stage().checked_sub(1)?, ActionKind::RecvB),
        _ => return None,
    };
    Some((
        *stage_to_rank.get(to)?,
        Action::new(to, kind, send.microbatch()),
    ))
}

/// The simple actions an action is made of: its sub-actions, or itself.
pub(crate) fn leaves(action: &Action) -> &[Action] {
    if action.sub_actions().is_empty() {
        std::slice::from_ref(action)
    } else {
        action.sub_actions()
    }
}

/// The ranks of a schedule run as far as they go.
struct Run<'a> {
    /// Each rank's actions with their steps, idle steps dropped.
    rows: Vec<Vec<(usize, &'a Action)>>,
    /// How far each rank has run.
    pos: Vec<usize>,
    /// What each rank has run (compound actions and their leaves).
    done: Vec<HashSet<&'a Action>>,
    stage_to_rank: &'a [usize],
    model: CommModel,
}

impl<'a> Run<'a> {
    fn new(
        lowered: &'a Schedule,
        stage_to_rank: &'a [usize],
        model: CommModel,
    ) -> Result<Run<'a>, DeadlockError> {
        let stages = stage_to_rank.len();
        let mut rows = Vec::with_capacity(lowered.ranks.len());
        for (rank, row) in lowered.ranks.iter().enumerate() {
            let mut actions = Vec::with_capacity(row.len());
            for (step, slot) in row.iter().enumerate() {
                let Some(action) = slot else { continue };
                if let Some(leaf) = leaves(action).iter().find(|l| l.stage() >= stages) {
                    return Err(DeadlockError::UnknownStage {
                        rank,
                        step,
                        action: action.clone(),
                        stage: leaf.stage(),
                        stages,
                    });
                }
                actions.push((step, action));
            }
            rows.push(actions);
        }
        let ranks = rows.len();
        Ok(Run {
            rows,
            pos: vec![0; ranks],
            done: vec![HashSet::new(); ranks],
            stage_to_rank,
            model,
        })
    }

    fn front(&self, rank: usize) -> Option<&'a Action> {
        self.rows.get(rank)?.get(self.pos[rank]).map(|&(_, a)| a)
    }

    fn has_run(&self, rank: usize, action: &Action) -> bool {
        self.done.get(rank).is_some_and(|d| d.contains(action))
    }

    fn local_ready(&self, rank: usize, leaf: &Action) -> bool {
        match input(leaf, self.stage_to_rank) {
            Input::Nothing => true,
            Input::Local(any) => any.iter().any(|a| self.has_run(rank, a)),
            Input::Send { peer, send } => self.done.get(peer).is_some_and(|d| d.contains(&send)),
            Input::NoPeer { .. } => false,
        }
    }

    fn pop(&mut self, rank: usize) {
        let (_, action) = self.rows[rank][self.pos[rank]];
        self.done[rank].insert(action);
        for sub in action.sub_actions() {
            self.done[rank].insert(sub);
        }
        self.pos[rank] += 1;
    }

    /// Runs the front action of `rank` (and, for a rendezvous, its peer's
    /// matching one) if it can run; whether it did.
    fn step(&mut self, rank: usize) -> bool {
        let Some(action) = self.front(rank) else {
            return false;
        };
        if self.model == CommModel::Rendezvous && action.sub_actions().is_empty() {
            if let Some(paired) = self.step_pair(rank, action) {
                return paired;
            }
        }
        if leaves(action).iter().all(|l| self.local_ready(rank, l)) {
            self.pop(rank);
            true
        } else {
            false
        }
    }

    /// A rendezvous send or receive: runs it together with its peer's
    /// matching action if both are there; `None` when `action` is not a
    /// rendezvous (not a comm, or its peer stage is on its own rank or
    /// missing: those complete as buffered).
    fn step_pair(&mut self, rank: usize, action: &Action) -> Option<bool> {
        let (peer, send, recv) = match action.kind() {
            ActionKind::SendF | ActionKind::SendB => {
                let (peer, recv) = matching_recv(action, self.stage_to_rank)?;
                (peer, action.clone(), recv)
            }
            ActionKind::RecvF | ActionKind::RecvB => {
                let Input::Send { peer, send } = input(action, self.stage_to_rank) else {
                    return None;
                };
                if self.has_run(peer, &send) {
                    // Its send already met another receive.
                    return None;
                }
                if matching_recv(&send, self.stage_to_rank).map(|(to, _)| to) != Some(rank) {
                    // The placement puts this receive's stage elsewhere:
                    // the send will look for it there.
                    return Some(false);
                }
                (peer, send, action.clone())
            }
            _ => return None,
        };
        if peer == rank {
            return None;
        }
        let (sender, receiver) = if action.kind() == send.kind() {
            (rank, peer)
        } else {
            (peer, rank)
        };
        let met = self.front(sender) == Some(&send)
            && self.front(receiver) == Some(&recv)
            && self.local_ready(sender, &send);
        if met {
            self.pop(sender);
            self.pop(receiver);
        }
        Some(met)
    }

    fn advance_all(&mut self) {
        loop {
            let mut progress = false;
            for rank in 0..self.rows.len() {
                while self.step(rank) {
                    progress = true;
                }
            }
            if !progress {
                return;
            }
        }
    }

    fn remaining_has(&self, rank: usize, action: &Action) -> bool {
        self.rows
            .get(rank)
            .is_some_and(|row| row[self.pos[rank]..].iter().any(|&(_, a)| a == action))
    }

    /// `Ok` when every rank finished, else why not.
    fn diagnose(&self) -> Result<(), DeadlockError> {
        let mut waits: Vec<Option<Wait>> = Vec::with_capacity(self.rows.len());
        for (rank, row) in self.rows.iter().enumerate() {
            waits.push(match row.get(self.pos[rank]) {
                Some(&(step, action)) => Some(self.wait_of(rank, step, action)?),
                None => None,
            });
        }
        let Some(start) = waits.iter().position(Option::is_some) else {
            return Ok(());
        };
        // Every stuck rank waits for one action still ahead on a stuck
        // rank: following the waits from any of them closes a cycle.
        let mut path: Vec<usize> = Vec::new();
        let mut rank = start;
        while !path.contains(&rank) {
            path.push(rank);
            match &waits[rank] {
                Some(wait) => rank = wait.on_rank,
                None => break,
            }
        }
        let from = path.iter().position(|&r| r == rank).unwrap_or(0);
        let mut cycle: Vec<Wait> = path[from..]
            .iter()
            .filter_map(|&r| waits[r].clone())
            .collect();
        if let Some(lowest) = cycle
            .iter()
            .enumerate()
            .min_by_key(|(_, w)| w.rank)
            .map(|(i, _)| i)
        {
            cycle.rotate_left(lowest);
        }
        Err(DeadlockError::Cycle { waits: cycle })
    }

    /// What the stuck `rank` waits for at `action`: another rank's action
    /// (`Ok`), or an error when that can never come.
    fn wait_of(&self, rank: usize, step: usize, action: &Action) -> Result<Wait, DeadlockError> {
        let rendezvous = self.model == CommModel::Rendezvous && action.sub_actions().is_empty();
        let wait = |waits_for: Action, on_rank: usize| {
            let behind = self.front(on_rank).filter(|f| **f != waits_for).cloned();
            Wait {
                rank,
                step,
                action: action.clone(),
                waits_for,
                on_rank,
                behind,
            }
        };
        for leaf in leaves(action) {
            match input(leaf, self.stage_to_rank) {
                Input::Nothing => {}
                Input::Local(needs) => {
                    if !needs.iter().any(|a| self.has_run(rank, a)) {
                        return Err(DeadlockError::MissingInput {
                            rank,
                            step,
                            action: action.clone(),
                            needs,
                        });
                    }
                }
                Input::NoPeer { from } => {
                    return Err(DeadlockError::NoPeerStage {
                        rank,
                        step,
                        action: action.clone(),
                        from,
                        stages: self.stage_to_rank.len(),
                    })
                }
                Input::Send { peer, send } => {
                    if self.has_run(peer, &send) {
                        continue;
                    }
                    if peer == rank && self.remaining_has(rank, &send) {
                        return Err(DeadlockError::MissingInput {
                            rank,
                            step,
                            action: action.clone(),
                            needs: vec![send],
                        });
                    }
                    if peer == rank || !self.remaining_has(peer, &send) {
                        let elsewhere = (0..self.rows.len())
                            .find(|&r| r != peer && self.remaining_has(r, &send));
                        return Err(DeadlockError::NoSend {
                            rank,
                            step,
                            action: action.clone(),
                            peer,
                            elsewhere,
                        });
                    }
                    return Ok(wait(send, peer));
                }
            }
            if rendezvous {
                if let Some((peer, recv)) =
                    matching_recv(leaf, self.stage_to_rank).filter(|&(peer, _)| peer != rank)
                {
                    if !self.remaining_has(peer, &recv) {
                        return Err(DeadlockError::NoRecv {
                            rank,
                            step,
                            action: action.clone(),
                            peer,
                        });
                    }
                    return Ok(wait(recv, peer));
                }
            }
        }
        // Unreachable for a stuck rank: its action would have run. Report
        // it as waiting on itself rather than panic.
        Ok(wait(action.clone(), rank))
    }
}
