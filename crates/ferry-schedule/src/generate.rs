//! Generators: the compute-only schedules PyTorch 2.13 ships, action for
//! action and idle step for idle step; GPipe and 1F1B in the order
//! PyTorch's runtime executes them.

use std::collections::HashSet;
use std::fmt;

use crate::action::{Action, ActionKind};
use crate::csv::Schedule;
use crate::lower::add_reduce_grad_row as add_reduce_grad;
use crate::placement::Placement;

mod v_shape;

/// The published schedules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// GPipe: all forwards, then all backwards (one stage per rank).
    GPipe,
    /// 1F1B (one stage per rank).
    OneFOneB,
    /// Interleaved 1F1B (depth first, several stages per rank).
    Interleaved1F1B,
    /// Looped BFS (breadth first, several stages per rank).
    LoopedBfs,
    /// Interleaved zero bubble (ZB-H1 with the I/W split).
    InterleavedZeroBubble,
    /// ZBV zero bubble: two stages per rank in the V placement.
    ZbvZeroBubble,
    /// DualPipeV: two stages per rank in the V placement, with
    /// OVERLAP_F_B actions.
    DualPipeV,
}

impl ScheduleKind {
    /// Every generator that is implemented.
    pub const ALL: [ScheduleKind; 7] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::LoopedBfs,
        ScheduleKind::InterleavedZeroBubble,
        ScheduleKind::ZbvZeroBubble,
        ScheduleKind::DualPipeV,
    ];

    /// PyTorch's class name for this schedule.
    pub fn pytorch_name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "ScheduleGPipe",
            ScheduleKind::OneFOneB => "Schedule1F1B",
            ScheduleKind::Interleaved1F1B => "ScheduleInterleaved1F1B",
            ScheduleKind::LoopedBfs => "ScheduleLoopedBFS",
            ScheduleKind::InterleavedZeroBubble => "ScheduleInterleavedZeroBubble",
            ScheduleKind::ZbvZeroBubble => "ScheduleZBVZeroBubble",
            ScheduleKind::DualPipeV => "ScheduleDualPipeV",
        }
    }

    /// The placement the schedule's stages follow.
    pub fn placement(self) -> Placement {
        match self {
            ScheduleKind::ZbvZeroBubble | ScheduleKind::DualPipeV => Placement::V,
            _ => Placement::Loop,
        }
    }

    /// Builds the compute-only schedule for `ranks` ranks, `stages_per_rank`
    /// stages on each (loop placement) and `microbatches` microbatches.
    pub fn generate(
        self,
        ranks: usize,
        stages_per_rank: usize,
        microbatches: usize,
    ) -> Result<Schedule, GenerateError> {
        if ranks == 0 || stages_per_rank == 0 || microbatches == 0 {
            return Err(GenerateError::Empty {
                ranks,
                stages_per_rank,
                microbatches,
            });
        }
        let too_large = ranks
            .checked_mul(stages_per_rank)
            .is_none_or(|stages| stages > crate::action::MAX_STAGE)
            || microbatches > crate::action::MAX_MICROBATCH + 1;
        if too_large {
            return Err(GenerateError::TooLarge {
                ranks,
                stages_per_rank,
                microbatches,
            });
        }
        let shape = Shape {
            ranks,
            local: stages_per_rank,
            micro: microbatches,
        };
        match self {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB if stages_per_rank != 1 => {
                Err(GenerateError::SingleStage {
                    schedule: self,
                    stages_per_rank,
                })
            }
            ScheduleKind::GPipe => Ok(gpipe(shape)),
            ScheduleKind::OneFOneB if microbatches < ranks => {
                Err(GenerateError::TooFewMicrobatches {
                    schedule: self,
                    microbatches,
                    stages: ranks,
                })
            }
            ScheduleKind::OneFOneB => Ok(one_f_one_b(shape)),
            ScheduleKind::LoopedBfs => Ok(looped_bfs(shape)),
            ScheduleKind::Interleaved1F1B => interleaved(self, shape, false),
            ScheduleKind::InterleavedZeroBubble => interleaved(self, shape, true),
            ScheduleKind::ZbvZeroBubble | ScheduleKind::DualPipeV if stages_per_rank != 2 => {
                Err(GenerateError::NotTwoStagesPerRank {
                    schedule: self,
                    stages_per_rank,
                })
            }
            ScheduleKind::ZbvZeroBubble => Ok(Schedule::new(
                (0..ranks)
                    .map(|rank| v_shape::zbv_rank(ranks, microbatches, rank))
                    .collect(),
            )),
            ScheduleKind::DualPipeV if microbatches < 2 * ranks => {
                Err(GenerateError::TooFewMicrobatches {
                    schedule: self,
                    microbatches,
                    stages: 2 * ranks,
                })
            }
            ScheduleKind::DualPipeV => Ok(Schedule::new(
                (0..ranks)
                    .map(|rank| v_shape::dualpipev_rank(ranks, microbatches, rank))
                    .collect(),
            )),
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.pytorch_name())
    }
}

/// A shape a schedule does not accept (PyTorch's constraints).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GenerateError {
    /// Ranks, stages per rank and microbatches must all be at least 1.
    #[error("a schedule needs at least one rank, stage per rank and microbatch, got {ranks} ranks, {stages_per_rank} stages per rank, {microbatches} microbatches")]
    Empty {
        /// Ranks asked for.
        ranks: usize,
        /// Stages per rank asked for.
        stages_per_rank: usize,
        /// Microbatches asked for.
        microbatches: usize,
    },
    /// More stages or microbatches than an action can number
    /// ([`crate::MAX_STAGE`], [`crate::MAX_MICROBATCH`]).
    #[error("a schedule numbers at most {} stages and {} microbatches, got {ranks} ranks × {stages_per_rank} stages per rank, {microbatches} microbatches", crate::MAX_STAGE, crate::MAX_MICROBATCH + 1)]
    TooLarge {
        /// Ranks asked for.
        ranks: usize,
        /// Stages per rank asked for.
        stages_per_rank: usize,
        /// Microbatches asked for.
        microbatches: usize,
    },
    /// GPipe and 1F1B run one stage per rank.
    #[error("{schedule} is a single-stage schedule: it runs exactly 1 stage per rank, got {stages_per_rank}")]
    SingleStage {
        /// The schedule.
        schedule: ScheduleKind,
        /// Stages per rank asked for.
        stages_per_rank: usize,
    },
    /// The schedule needs at least as many microbatches as stages.
    #[error("{schedule}: number of microbatches ({microbatches}) must be greater than or equal to the number of stages ({stages})")]
    TooFewMicrobatches {
        /// The schedule.
        schedule: ScheduleKind,
        /// Microbatches asked for.
        microbatches: usize,
        /// Stages in the pipeline.
        stages: usize,
    },
    /// ZBV and DualPipeV run exactly two stages per rank, in a V.
    #[error(
        "{schedule} requires exactly 2 stages per rank (V placement), but got {stages_per_rank}"
    )]
    NotTwoStagesPerRank {
        /// The schedule.
        schedule: ScheduleKind,
        /// Stages per rank asked for.
        stages_per_rank: usize,
    },
    /// Interleaved schedules split microbatches into whole rounds.
    #[error("{schedule} requires the number of microbatches to be a multiple of the number of rounds ({rounds}), but got {microbatches}")]
    UnevenRounds {
        /// The schedule.
        schedule: ScheduleKind,
        /// Rounds: max(1, microbatches / ranks).
        rounds: usize,
        /// Microbatches asked for.
        microbatches: usize,
    },
}

#[derive(Clone, Copy)]
struct Shape {
    ranks: usize,
    local: usize,
    micro: usize,
}

fn act(stage: usize, kind: ActionKind, mb: usize) -> Option<Action> {
    Some(Action::new(stage, kind, Some(mb)))
}

fn idle(row: &mut Vec<Option<Action>>, n: usize) {
    row.extend(std::iter::repeat_n(None, n));
}

/// GPipe as PyTorch's runtime (`ScheduleGPipe._step_microbatches`) runs
/// it on every rank: all forwards, then all backwards, then REDUCE_GRAD.
/// The order only: the simulator decides when each action can start.
fn gpipe(s: Shape) -> Schedule {
    let rows = (0..s.ranks)
        .map(|rank| {
            let mut row: Vec<Option<Action>> = (0..s.micro)
                .map(|mb| act(rank, ActionKind::Forward, mb))
                .collect();
            row.extend((0..s.micro).map(|mb| act(rank, ActionKind::FullBackward, mb)));
            add_reduce_grad(row, s.micro)
        })
        .collect();
    Schedule::new(rows)
}

/// 1F1B as PyTorch's runtime (`Schedule1F1B._step_microbatches`) runs it,
/// not as its `_get_pipeline_order` table draws it (that table starts the
/// last rank at F1 and cannot be lowered): rank r runs min(M, p - r)
/// warm-up forwards, then alternates one backward and one forward until
/// the forwards run out, then the remaining backwards, then REDUCE_GRAD.
fn one_f_one_b(s: Shape) -> Schedule {
    let p = s.ranks;
    let rows = (0..p)
        .map(|rank| {
            let warmup = s.micro.min(p - rank);
            let mut row: Vec<Option<Action>> = (0..warmup)
                .map(|mb| act(rank, ActionKind::Forward, mb))
                .collect();
            let mut forward_mb = warmup;
            for backward_mb in 0..s.micro {
                row.push(act(rank, ActionKind::FullBackward, backward_mb));
                if forward_mb < s.micro {
                    row.push(act(rank, ActionKind::Forward, forward_mb));
                    forward_mb += 1;
                }
            }
            add_reduce_grad(row, s.micro)
        })
        .collect();
    Schedule::new(rows)
}

fn looped_bfs(s: Shape) -> Schedule {
    let rows = (0..s.ranks)
        .map(|rank| {
            let stages: Vec<usize> = (0..s.local).map(|l| l * s.ranks + rank).collect();
            let mut row = Vec::new();
            idle(&mut row, rank);
            for &stage in &stages {
                row.extend((0..s.micro).map(|mb| act(stage, ActionKind::Forward, mb)));
            }
            idle(&mut row, 2 * (s.ranks - 1 - rank));
            for &stage in stages.iter().rev() {
                row.extend(
                    (0..s.micro)
                        .rev()
                        .map(|mb| act(stage, ActionKind::FullBackward, mb)),
                );
            }
            row
        })
        .collect();
    Schedule::new(rows)
}

fn interleaved(kind: ScheduleKind, s: Shape, zero_bubble: bool) -> Result<Schedule, GenerateError> {
    let rounds = (s.micro / s.ranks).max(1);
    if s.micro % rounds != 0 {
        return Err(GenerateError::UnevenRounds {
            schedule: kind,
            rounds,
            microbatches: s.micro,
        });
    }
    let per_round = s.micro / rounds;
    let rows: Vec<_> = (0..s.ranks)
        .map(|rank| interleaved_rank(s, rank, per_round, zero_bubble))
        .collect();
    let schedule = Schedule::new(rows);
    Ok(if zero_bubble {
        add_bubbles(&schedule, s.ranks * s.local)
    } else {
        schedule
    })
}

/// One rank of PyTorch's `_get_1f1b_rank_ops` (warm-up, 1F1B, cool-down;
/// with the I/W split for zero bubble).
fn interleaved_rank(s: Shape, rank: usize, per_round: usize, zb: bool) -> Vec<Option<Action>> {
    let (p, local) = (s.ranks, s.local);
    let factor = if zb { 1 } else { 2 };
    let warmup = ((local - 1) * per_round + factor * (p - 1 - rank)).min(s.micro * local);
    let micro_ops = local * s.micro;
    let fwd_bwd = micro_ops - warmup;
    // Warm-up forwards, then 1F1B pairs, then as many cool-down backwards
    // as there were warm-up forwards.
    let total = micro_ops + warmup;
    let forward_stage = |op: usize| ((op / per_round) % local) * p + rank;
    let backward_stage = |op: usize| (local - 1 - ((op - warmup) / per_round) % local) * p + rank;
    let post_warmup = if zb {
        p - rank - 1
    } else {
        // Negative in PyTorch when warm-up is capped by the microbatches:
        // `[None] * n` then adds nothing.
        (local * p + 2 * (p - 1 - rank)).saturating_sub(warmup + rank)
    };
    let backward_kind = if zb {
        ActionKind::BackwardInput
    } else {
        ActionKind::FullBackward
    };
    let one_f_one_b_micro = rank;

    // The next microbatch of each (kind, stage of this rank): the rank's
    // stages are `rank`, `rank + p`, ...; kinds F, then B or I, then W.
    let mut next_mb = vec![0usize; 3 * local];
    let mut take = |kind: ActionKind, stage: usize| {
        let k = match kind {
            ActionKind::Forward => 0,
            ActionKind::BackwardWeight => 2,
            _ => 1,
        };
        let mb = &mut next_mb[k * local + stage / p];
        *mb += 1;
        act(stage, kind, *mb - 1)
    };
    let mut row = Vec::with_capacity(rank + 2 * total + post_warmup);
    idle(&mut row, rank);
    let mut backward_ops = Vec::new();
    let mut weights_done = 0;
    for op in 0..total {
        if op < warmup {
            row.push(take(ActionKind::Forward, forward_stage(op)));
            if op == warmup - 1 {
                idle(&mut row, post_warmup);
            }
            continue;
        }
        if op < warmup + fwd_bwd {
            row.push(take(ActionKind::Forward, forward_stage(op)));
        } else if !zb {
            row.push(None);
        }
        row.push(take(backward_kind, backward_stage(op)));
        backward_ops.push(op);
        if zb && op - warmup >= one_f_one_b_micro {
            row.push(take(
                ActionKind::BackwardWeight,
                backward_stage(backward_ops[weights_done]),
            ));
            weights_done += 1;
        }
    }
    while zb && weights_done < backward_ops.len() {
        row.push(take(
            ActionKind::BackwardWeight,
            backward_stage(backward_ops[weights_done]),
        ));
        weights_done += 1;
    }
    row
}

/// PyTorch's `ScheduleInterleavedZeroBubble._add_bubbles_to_actions`:
/// steps all ranks in lockstep and idles a rank whose next F (or B) has
/// not had its input produced in an earlier step.
fn add_bubbles(schedule: &Schedule, stages: usize) -> Schedule {
    let ranks = schedule.ranks.len();
    let mut seen: HashSet<(usize, ActionKind, usize)> = HashSet::new();
    let mut next = vec![0usize; ranks];
    let mut out = vec![Vec::new(); ranks];
    loop {
        let mut running = false;
        let mut produced = Vec::new();
        for rank in 0..ranks {
            let Some(slot) = schedule.ranks[rank].get(next[rank]) else {
                continue;
            };
            running = true;
            let Some(action) = slot else {
                next[rank] += 1;
                out[rank].push(None);
                continue;
            };
            if needs_bubble(action, stages, &seen) {
                out[rank].push(None);
            } else {
                out[rank].push(Some(action.clone()));
                if let Some(mb) = action.microbatch() {
                    produced.push((action.stage(), action.kind(), mb));
                }
                next[rank] += 1;
            }
        }
        seen.extend(produced);
        if !running {
            return Schedule::new(out);
        }
    }
}

fn needs_bubble(
    action: &Action,
    stages: usize,
    seen: &HashSet<(usize, ActionKind, usize)>,
) -> bool {
    let (stage, kind) = (action.stage(), action.kind());
    let Some(mb) = action.microbatch() else {
        return false;
    };
    match kind {
        ActionKind::Forward => stage != 0 && !seen.contains(&(stage - 1, kind, mb)),
        ActionKind::FullBackward if stage == stages - 1 => {
            !seen.contains(&(stage, ActionKind::Forward, mb))
        }
        ActionKind::FullBackward => !seen.contains(&(stage + 1, kind, mb)),
        _ => false,
    }
}
