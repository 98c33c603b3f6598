//! The duration-aware simulator: every action takes its cost
//! ([`Costs`]), transfers take latency and bandwidth, and the result is
//! when each action starts and ends, each rank's busy time and bubble,
//! the makespan and the peak number of live activations.
//!
//! ## Semantics
//!
//! The input is a lowered schedule (with SEND/RECV actions, as
//! [`crate::add_send_recv`] makes them), or a compute-only one. A
//! compute-only schedule is simulated as its [`crate::add_send_recv`]
//! lowering would be, without building it: that lowering keeps each
//! rank's compute order, puts every send right after the compute that
//! makes its data and every receive before the compute that needs it, so
//! a boundary between ranks is a transfer from the producer's end
//! (`tests/timed.rs` checks the two give the same times for every
//! generator). Each rank runs its list in order, one action at a time, as
//! PyTorch's pipeline runtime does (`_PipelineScheduleRuntime`):
//!
//! - **F**, **B**, **I**, **W** start when the rank is free and their
//!   inputs exist, and take the stage's cost. F of stage `s > 0` needs
//!   stage `s - 1`'s output: F of `s - 1` if that stage is on the same
//!   rank (a local handoff, no cost), else the data of its RECV_F. B and I
//!   need their own F and, below the last stage, the output gradient: B or
//!   I of `s + 1` locally, else the data of RECV_B. W needs its I.
//! - **SEND_F** / **SEND_B** take no time on the rank (an `isend`); the
//!   data is sent when the rank reaches the send (after the compute that
//!   made it).
//! - **RECV_F** / **RECV_B** take no time on the rank (an `irecv` is
//!   posted); the rank does not wait there but at the compute that needs
//!   the data. Transfers are eager: the data is usable at the send's time
//!   plus [`Costs::transfer`] (latency + bytes / bandwidth of the
//!   boundary), whenever the receive was posted; a consumer placed before
//!   its receive in the list waits forever (a [`TimedError::Stuck`]).
//! - **OVERLAP_F_B** runs its sub-actions as one action: it starts when
//!   the inputs of all of them exist and costs the **maximum** of their
//!   costs (the forward and the backward overlap perfectly, which is what
//!   DualPipe's overlap aims at); their outputs all exist at its end.
//! - **UNSHARD**, **RESHARD**, **REDUCE_GRAD** take [`Costs::unshard`],
//!   [`Costs::reshard`], [`Costs::reduce_grad`] (0 by default) and wait
//!   for nothing but the rank.
//!
//! ## Memory
//!
//! An activation of (stage, microbatch) is live from the start of its F
//! until the end of its B, or, when the backward is split, until the end
//! of its W: as in PyTorch, I keeps the autograd graph for W. A rank's
//! peak is the most activations of its stages live at once (counted in
//! the rank's action order, which is its time order; an OVERLAP_F_B holds
//! its forward's new activation and its backward's old one together).
//!
//! ## Cost
//!
//! The simulator is event driven and O(actions): it never steps a clock.
//! Each action's start is the max of its rank's free time and its inputs'
//! times, computed once those are known; a rank whose next action waits
//! on an unknown input parks on that input and is woken when it is set.

use std::collections::HashMap;
use std::fmt;

use crate::action::{Action, ActionKind};
use crate::cost::{CostError, Costs, StageCosts};
use crate::csv::Schedule;

/// When one action of a rank ran.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    /// The action's step (column) in [`TimedRun::schedule`]'s row.
    pub step: usize,
    /// When it started.
    pub start: f64,
    /// When it ended (equal to `start` for sends and receives).
    pub end: f64,
}

/// One rank's totals.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankStats {
    /// Time spent running actions.
    pub busy: f64,
    /// When the rank's last action ended.
    pub finish: f64,
    /// Idle share of the overall makespan: `(makespan - busy) / makespan`
    /// (0 when the makespan is 0).
    pub bubble: f64,
    /// The most activations of the rank's stages live at once.
    pub peak_activations: usize,
}

/// The result of [`simulate_timed`].
#[derive(Clone, Debug, PartialEq)]
pub struct TimedRun {
    /// The schedule that was simulated (the input, idle slots kept), which
    /// [`Span::step`] indexes.
    pub schedule: Schedule,
    /// Per rank, when each of its actions ran, in list order.
    pub spans: Vec<Vec<Span>>,
    /// Per rank totals.
    pub ranks: Vec<RankStats>,
    /// When the last action of any rank ended.
    pub makespan: f64,
}

impl TimedRun {
    /// The overall bubble: idle share of `ranks × makespan`
    /// (the mean of the ranks' bubbles).
    pub fn bubble(&self) -> f64 {
        if self.makespan == 0.0 || self.ranks.is_empty() {
            return 0.0;
        }
        let busy: f64 = self.ranks.iter().map(|r| r.busy).sum();
        1.0 - busy / (self.makespan * self.ranks.len() as f64)
    }

    /// The highest peak of live activations over the ranks.
    pub fn peak_activations(&self) -> usize {
        self.ranks
            .iter()
            .map(|r| r.peak_activations)
            .max()
            .unwrap_or(0)
    }

    /// Every action with its rank and times: `(rank, action, start, end)`,
    /// rank by rank, in list order.
    pub fn actions(&self) -> impl Iterator<Item = (usize, &Action, f64, f64)> + '_ {
        self.spans
            .iter()
            .enumerate()
            .flat_map(move |(rank, spans)| {
                spans.iter().filter_map(move |span| {
                    let action = self.schedule.ranks[rank].get(span.step)?.as_ref()?;
                    Some((rank, action, span.start, span.end))
                })
            })
    }
}

/// An action that can never start, and what it waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiting {
    /// The rank.
    pub rank: usize,
    /// The action at the front of its list.
    pub action: Action,
    /// What it waits for (e.g. `0SEND_F1 on the rank of stage 0`).
    pub needs: String,
}

impl fmt::Display for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} waits at {} for {}",
            self.rank, self.action, self.needs
        )
    }
}

/// A schedule the duration-aware simulator cannot run.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum TimedError {
    /// The costs are not usable.
    #[error(transparent)]
    Costs(#[from] CostError),
    /// An action names a stage outside the placement.
    #[error(
        "rank {rank}: action {action} names stage {stage}, but the placement has {stages} stages"
    )]
    UnknownStage {
        /// The rank whose list holds it.
        rank: usize,
        /// The action.
        action: Action,
        /// Its stage.
        stage: usize,
        /// The number of stages placed.
        stages: usize,
    },
    /// An action is on a rank that does not own its stage.
    #[error("rank {rank}: action {action} is on rank {rank}, but the placement puts stage {stage} on rank {owner}")]
    WrongRank {
        /// The rank whose list holds it.
        rank: usize,
        /// The action.
        action: Action,
        /// Its stage.
        stage: usize,
        /// The rank the placement gives the stage.
        owner: usize,
    },
    /// The same action (stage, kind, microbatch) runs twice.
    #[error("rank {rank}: action {action} runs a second time")]
    Duplicate {
        /// The rank of the second one.
        rank: usize,
        /// The action.
        action: Action,
    },
    /// Some ranks can never finish: each waits for something no rank
    /// will produce (a deadlock, or a missing action).
    #[error("schedule cannot finish: {}", waiting.iter().map(Waiting::to_string).collect::<Vec<_>>().join("; "))]
    Stuck {
        /// Every unfinished rank, its next action and what it waits for.
        waiting: Vec<Waiting>,
    },
}

/// Simulates `schedule` (lowered, or compute-only: then as its
/// [`crate::add_send_recv`] lowering) with durations; `stage_to_rank[s]` is
/// the rank of stage `s`. See the [module docs](self) for the rules.
///
/// ```
/// use ferry_schedule::{simulate_timed, Costs, Placement, ScheduleKind};
///
/// let compute = ScheduleKind::GPipe.generate(4, 1, 8)?;
/// let placement = Placement::Loop.stage_to_rank(4, 4)?;
/// let run = simulate_timed(&compute, &placement, &Costs::uniform(1.0, 1.0, 1.0, 1.0))?;
/// // (m + p - 1)(F + B) and a bubble of (p - 1) / (m + p - 1).
/// assert_eq!(run.makespan, 22.0);
/// assert!((run.bubble() - 3.0 / 11.0).abs() < 1e-12);
/// assert_eq!(run.peak_activations(), 8);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn simulate_timed(
    schedule: &Schedule,
    stage_to_rank: &[usize],
    costs: &Costs,
) -> Result<TimedRun, TimedError> {
    costs.check()?;
    check_placement(schedule, stage_to_rank)?;
    let has_comms = schedule.has_comms();
    let schedule = schedule.clone();
    Sim::new(&schedule, stage_to_rank, costs, !has_comms)?.run(schedule)
}

/// What a time is known for, per (stage, microbatch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    /// End of F.
    ForwardEnd = 0,
    /// End of B or I (the input gradient exists).
    GradEnd = 1,
    /// End of W or B (for duplicate detection).
    WeightEnd = 2,
    /// A SEND_F was issued.
    SendF = 3,
    /// A SEND_B was issued.
    SendB = 4,
    /// A RECV_F was posted.
    RecvF = 5,
    /// A RECV_B was posted.
    RecvB = 6,
}

const SLOTS: usize = 7;
const NONE: u32 = u32::MAX;

/// A dependency: the time of `key` plus `delay`.
#[derive(Clone, Copy)]
struct Dep {
    key: usize,
    delay: f64,
}

/// How (stage, microbatch) pairs map to key numbers: a dense table for
/// schedules whose microbatch numbers are compact (every generated one),
/// or a map of the pairs that occur (and their neighbours) when a
/// hand-written schedule names huge microbatch numbers, so memory stays
/// proportional to the schedule.
enum Pairs {
    /// `stage * micro + mb`.
    Dense { micro: usize },
    /// Pair numbers, and each number's pair.
    Sparse {
        index: HashMap<(usize, usize), usize>,
        pairs: Vec<(usize, usize)>,
    },
}

impl Pairs {
    fn build(schedule: &Schedule, stages: usize, micro: usize) -> Pairs {
        let actions: usize = schedule.ranks.iter().map(Vec::len).sum();
        let budget = actions.saturating_mul(16).saturating_add(1 << 16);
        let dense = stages
            .checked_mul(micro)
            .filter(|&n| n.saturating_mul(SLOTS) <= budget);
        if dense.is_some() {
            return Pairs::Dense { micro };
        }
        let mut index = HashMap::new();
        let mut pairs = Vec::new();
        for action in schedule.ranks.iter().flatten().flatten() {
            for leaf in leaves(action) {
                let (stage, Some(mb)) = (leaf.stage(), leaf.microbatch()) else {
                    continue;
                };
                let neighbours = [stage.checked_sub(1), Some(stage), Some(stage + 1)];
                for s in neighbours.into_iter().flatten().filter(|&s| s < stages) {
                    index.entry((s, mb)).or_insert_with(|| {
                        pairs.push((s, mb));
                        pairs.len() - 1
                    });
                }
            }
        }
        Pairs::Sparse { index, pairs }
    }

    fn len(&self, stages: usize) -> usize {
        match self {
            Pairs::Dense { micro } => stages * micro,
            Pairs::Sparse { pairs, .. } => pairs.len(),
        }
    }

    fn number(&self, stage: usize, mb: usize) -> usize {
        match self {
            Pairs::Dense { micro } => stage * micro + mb,
            // Every pair a dependency names was inserted by `build`.
            Pairs::Sparse { index, .. } => index.get(&(stage, mb)).copied().unwrap_or(0),
        }
    }

    fn pair(&self, number: usize) -> (usize, usize) {
        match self {
            Pairs::Dense { micro } => (number / micro, number % micro),
            Pairs::Sparse { pairs, .. } => pairs[number],
        }
    }
}

struct Sim<'a> {
    stage_to_rank: &'a [usize],
    costs: &'a Costs,
    stages: usize,
    pairs: Pairs,
    /// Number of (stage, microbatch) pairs: keys are `slot * count + pair`.
    count: usize,
    /// Known times by key (NaN: not yet).
    times: Vec<f64>,
    /// First rank waiting on each key.
    waiters: Vec<u32>,
    /// Next rank in the same waiting list.
    next_waiter: Vec<u32>,
    /// Per-stage transfer times, by boundary.
    transfer: Vec<f64>,
    /// Compute costs, by stage.
    stage_costs: Vec<StageCosts>,
    /// Compute-only input: a boundary between ranks is a transfer from
    /// the producer's end (no SEND/RECV actions to wait for).
    implicit_comms: bool,
}

impl<'a> Sim<'a> {
    fn new(
        lowered: &Schedule,
        stage_to_rank: &'a [usize],
        costs: &'a Costs,
        implicit_comms: bool,
    ) -> Result<Sim<'a>, TimedError> {
        let stages = stage_to_rank.len();
        let micro = check_placement(lowered, stage_to_rank)?;
        let pairs = Pairs::build(lowered, stages, micro);
        let count = pairs.len(stages);
        let keys = SLOTS * count;
        Ok(Sim {
            stage_to_rank,
            costs,
            stages,
            pairs,
            count,
            times: vec![f64::NAN; keys],
            waiters: vec![NONE; keys],
            next_waiter: vec![NONE; lowered.ranks.len()],
            transfer: (0..stages.saturating_sub(1))
                .map(|b| costs.transfer(b))
                .collect(),
            implicit_comms,
            stage_costs: (0..stages).map(|s| costs.stage(s)).collect(),
        })
    }

    fn key(&self, slot: Slot, stage: usize, mb: usize) -> usize {
        slot as usize * self.count + self.pairs.number(stage, mb)
    }

    fn describe(&self, key: usize) -> String {
        let (stage, mb) = self.pairs.pair(key % self.count);
        let slot = key / self.count;
        let what = match slot {
            0 => format!("{stage}F{mb} to end"),
            1 => format!("{stage}B{mb} or {stage}I{mb} to end"),
            2 => format!("{stage}W{mb} to end"),
            3 => format!("{stage}SEND_F{mb}"),
            4 => format!("{stage}SEND_B{mb}"),
            5 => format!("{stage}RECV_F{mb} to be posted (before this action)"),
            _ => format!("{stage}RECV_B{mb} to be posted (before this action)"),
        };
        format!("{what} on rank {}", self.stage_to_rank[stage])
    }

    /// The inputs a leaf action needs.
    fn deps(&self, leaf: &Action, out: &mut Vec<Dep>) {
        let stage = leaf.stage();
        let Some(mb) = leaf.microbatch() else { return };
        let here = self.stage_to_rank[stage];
        let dep = |slot, s, delay| Dep {
            key: self.key(slot, s, mb),
            delay,
        };
        match leaf.kind() {
            ActionKind::Forward if stage > 0 => {
                if self.stage_to_rank[stage - 1] == here {
                    out.push(dep(Slot::ForwardEnd, stage - 1, 0.0));
                } else if self.implicit_comms {
                    out.push(dep(Slot::ForwardEnd, stage - 1, self.transfer[stage - 1]));
                } else {
                    out.push(dep(Slot::RecvF, stage, 0.0));
                    out.push(dep(Slot::SendF, stage - 1, self.transfer[stage - 1]));
                }
            }
            ActionKind::FullBackward | ActionKind::BackwardInput => {
                out.push(dep(Slot::ForwardEnd, stage, 0.0));
                if stage + 1 < self.stages {
                    if self.stage_to_rank[stage + 1] == here {
                        out.push(dep(Slot::GradEnd, stage + 1, 0.0));
                    } else if self.implicit_comms {
                        out.push(dep(Slot::GradEnd, stage + 1, self.transfer[stage]));
                    } else {
                        out.push(dep(Slot::RecvB, stage, 0.0));
                        out.push(dep(Slot::SendB, stage + 1, self.transfer[stage]));
                    }
                }
            }
            ActionKind::BackwardWeight => out.push(dep(Slot::GradEnd, stage, 0.0)),
            ActionKind::SendF => out.push(dep(Slot::ForwardEnd, stage, 0.0)),
            ActionKind::SendB => out.push(dep(Slot::GradEnd, stage, 0.0)),
            _ => {}
        }
    }

    /// The cost of a leaf action on the rank.
    fn cost(&self, leaf: &Action) -> f64 {
        let c = || self.stage_costs[leaf.stage()];
        match leaf.kind() {
            ActionKind::Forward => c().forward,
            ActionKind::FullBackward => c().backward,
            ActionKind::BackwardInput => c().backward_input,
            ActionKind::BackwardWeight => c().backward_weight,
            ActionKind::Unshard => self.costs.unshard,
            ActionKind::Reshard => self.costs.reshard,
            ActionKind::ReduceGrad => self.costs.reduce_grad,
            _ => 0.0,
        }
    }

    /// The keys a leaf action sets when it ends.
    fn outputs(&self, leaf: &Action) -> [Option<usize>; 2] {
        let Some(mb) = leaf.microbatch() else {
            return [None, None];
        };
        let stage = leaf.stage();
        let key = |slot| Some(self.key(slot, stage, mb));
        match leaf.kind() {
            ActionKind::Forward => [key(Slot::ForwardEnd), None],
            ActionKind::FullBackward => [key(Slot::GradEnd), key(Slot::WeightEnd)],
            ActionKind::BackwardInput => [key(Slot::GradEnd), None],
            ActionKind::BackwardWeight => [key(Slot::WeightEnd), None],
            ActionKind::SendF => [key(Slot::SendF), None],
            ActionKind::SendB => [key(Slot::SendB), None],
            ActionKind::RecvF => [key(Slot::RecvF), None],
            ActionKind::RecvB => [key(Slot::RecvB), None],
            _ => [None, None],
        }
    }

    fn run(mut self, lowered: Schedule) -> Result<TimedRun, TimedError> {
        let ranks = lowered.ranks.len();
        let mut cursor = vec![0usize; ranks];
        let mut free = vec![0.0f64; ranks];
        let mut spans: Vec<Vec<Span>> = lowered
            .ranks
            .iter()
            .map(|row| Vec::with_capacity(row.len()))
            .collect();
        let mut ready: Vec<usize> = (0..ranks).rev().collect();
        let mut deps = Vec::with_capacity(6);
        while let Some(rank) = ready.pop() {
            let row = &lowered.ranks[rank];
            while let Some(slot) = row.get(cursor[rank]) {
                let step = cursor[rank];
                let Some(action) = slot else {
                    cursor[rank] += 1;
                    continue;
                };
                deps.clear();
                for leaf in leaves(action) {
                    self.deps(leaf, &mut deps);
                }
                let mut start = free[rank];
                let mut blocked = None;
                for dep in &deps {
                    let t = self.times[dep.key];
                    if t.is_nan() {
                        blocked = Some(dep.key);
                        break;
                    }
                    start = start.max(t + dep.delay);
                }
                if let Some(key) = blocked {
                    self.next_waiter[rank] = self.waiters[key];
                    self.waiters[key] = rank as u32;
                    break;
                }
                let cost = leaves(action)
                    .iter()
                    .map(|leaf| self.cost(leaf))
                    .fold(0.0, f64::max);
                let end = start + cost;
                // Sends and receives are instants at the rank's free time.
                if action.kind().is_comm() {
                    spans[rank].push(Span { step, start, end });
                } else {
                    free[rank] = end;
                    spans[rank].push(Span { step, start, end });
                }
                for leaf in leaves(action) {
                    for key in self.outputs(leaf).into_iter().flatten() {
                        if !self.times[key].is_nan() {
                            return Err(TimedError::Duplicate {
                                rank,
                                action: leaf.clone(),
                            });
                        }
                        self.times[key] = end;
                        let mut waiter = std::mem::replace(&mut self.waiters[key], NONE);
                        while waiter != NONE {
                            ready.push(waiter as usize);
                            waiter =
                                std::mem::replace(&mut self.next_waiter[waiter as usize], NONE);
                        }
                    }
                }
                cursor[rank] += 1;
            }
        }
        let mut waiting = Vec::new();
        for (rank, row) in lowered.ranks.iter().enumerate() {
            if let Some(Some(action)) = row.get(cursor[rank]) {
                deps.clear();
                for leaf in leaves(action) {
                    self.deps(leaf, &mut deps);
                }
                let needs = deps
                    .iter()
                    .find(|d| self.times[d.key].is_nan())
                    .map_or_else(|| "its inputs".to_owned(), |d| self.describe(d.key));
                waiting.push(Waiting {
                    rank,
                    action: action.clone(),
                    needs,
                });
            }
        }
        if !waiting.is_empty() {
            return Err(TimedError::Stuck { waiting });
        }
        let makespan = spans.iter().flatten().map(|s| s.end).fold(0.0, f64::max);
        let stats = spans
            .iter()
            .enumerate()
            .map(|(rank, spans)| {
                let busy: f64 = spans.iter().map(|s| s.end - s.start).sum();
                RankStats {
                    busy,
                    finish: spans.iter().map(|s| s.end).fold(0.0, f64::max),
                    bubble: if makespan > 0.0 {
                        (makespan - busy) / makespan
                    } else {
                        0.0
                    },
                    peak_activations: peak_activations(&lowered.ranks[rank]),
                }
            })
            .collect();
        Ok(TimedRun {
            schedule: lowered,
            spans,
            ranks: stats,
            makespan,
        })
    }
}

/// Checks every action's stage is placed, on the action's rank; returns
/// the number of microbatches (highest + 1).
fn check_placement(schedule: &Schedule, stage_to_rank: &[usize]) -> Result<usize, TimedError> {
    let mut micro = 0;
    for (rank, row) in schedule.ranks.iter().enumerate() {
        for action in row.iter().flatten() {
            for leaf in leaves(action) {
                let stage = leaf.stage();
                let Some(&owner) = stage_to_rank.get(stage) else {
                    return Err(TimedError::UnknownStage {
                        rank,
                        action: action.clone(),
                        stage,
                        stages: stage_to_rank.len(),
                    });
                };
                if owner != rank {
                    return Err(TimedError::WrongRank {
                        rank,
                        action: action.clone(),
                        stage,
                        owner,
                    });
                }
                if let Some(mb) = leaf.microbatch() {
                    micro = micro.max(mb.saturating_add(1));
                }
            }
        }
    }
    Ok(micro)
}

/// The most activations live at once along one rank's list: +1 at an F,
/// -1 at a B, or at a W (I keeps the graph for W).
fn peak_activations(row: &[Option<Action>]) -> usize {
    let (mut live, mut peak) = (0usize, 0usize);
    for action in row.iter().flatten() {
        let leaves = leaves(action);
        for leaf in leaves {
            if leaf.kind() == ActionKind::Forward {
                live += 1;
            }
        }
        peak = peak.max(live);
        for leaf in leaves {
            if matches!(
                leaf.kind(),
                ActionKind::FullBackward | ActionKind::BackwardWeight
            ) {
                live = live.saturating_sub(1);
            }
        }
    }
    peak
}

fn leaves(action: &Action) -> &[Action] {
    if action.sub_actions().is_empty() {
        std::slice::from_ref(action)
    } else {
        action.sub_actions()
    }
}
