//! The planner: given the costs, the ranks, the microbatches and a memory
//! limit, build every schedule PyTorch ships at every stages-per-rank
//! asked for, simulate each with durations ([`crate::simulate_timed`]),
//! and rank them by makespan within the limit. PyTorch has no equivalent.
//!
//! ## The model is held fixed
//!
//! The costs describe **one rank's share of the model** (the model split
//! into `ranks` pieces) for one microbatch. With `v` stages per rank each
//! stage is `1/v` of that share, so the planner scales F, B, I and W by
//! `1/v` ([`Costs::compute_scaled`]); links, activation bytes and
//! UNSHARD/RESHARD/REDUCE_GRAD are not scaled (a boundary moves the same
//! activation whatever the split). Memory is counted in the same unit: a
//! rank's peak of live stage activations divided by `v`, so that
//! "6 activations" means six microbatches' worth of one rank's share,
//! whatever the split. Per-stage cost overrides apply to the stage
//! numbers of each candidate, so they mean most with one stages-per-rank.
//!
//! DualPipeV's OVERLAP_F_B actions cost the max of their forward and
//! backward (see [`crate::timed`]): perfect overlap, DualPipe's best
//! case. Where the forward and backward share one GPU's compute, real
//! overlap is smaller; read DualPipeV's row as a bound.
//!
//! ```
//! use ferry_schedule::{plan, Costs, PlanRequest, ScheduleKind};
//!
//! let request = PlanRequest::new(4, 8, 6.0, "F=1,B=2,I=1,W=1".parse()?);
//! let rows = plan(&request);
//! // GPipe keeps all 8 microbatches' activations: over the limit of 6.
//! let gpipe = rows.iter().find(|r| r.schedule == ScheduleKind::GPipe && r.stages_per_rank == 1);
//! assert!(!gpipe.unwrap().outcome.as_ref().unwrap().fits);
//! // The best schedule fits.
//! assert!(rows[0].outcome.as_ref().unwrap().fits);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::cmp::Ordering;
use std::fmt::Write as _;

use crate::cost::Costs;
use crate::generate::ScheduleKind;
use crate::timed::simulate_timed;

/// What to plan for.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanRequest {
    /// Pipeline ranks.
    pub ranks: usize,
    /// Microbatches per step.
    pub microbatches: usize,
    /// Memory limit: peak live activations per rank, in units of one
    /// microbatch's activation of one rank's share of the model.
    pub memory: f64,
    /// Costs of one rank's share of the model (see the module docs).
    pub costs: Costs,
    /// The stages-per-rank values to try (default: 1 and 2).
    pub stages_per_rank: Vec<usize>,
}

impl PlanRequest {
    /// A request trying 1 and 2 stages per rank.
    pub fn new(ranks: usize, microbatches: usize, memory: f64, costs: Costs) -> PlanRequest {
        PlanRequest {
            ranks,
            microbatches,
            memory,
            costs,
            stages_per_rank: vec![1, 2],
        }
    }
}

/// A schedule's simulated figures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlanStats {
    /// When the last rank finishes.
    pub makespan: f64,
    /// Idle share of ranks × makespan.
    pub bubble: f64,
    /// The highest rank's peak of live activations, in the request's
    /// unit (stage activations / stages per rank).
    pub peak_activations: f64,
    /// Whether the peak is within the memory limit.
    pub fits: bool,
}

/// One candidate: a schedule at one stages-per-rank, and its figures or
/// why it cannot be built or run.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanRow {
    /// The generator.
    pub schedule: ScheduleKind,
    /// Stages per rank.
    pub stages_per_rank: usize,
    /// The figures, or the error text (a [`crate::GenerateError`], or a
    /// placement or simulation error).
    pub outcome: Result<PlanStats, String>,
}

/// Builds and simulates every [`ScheduleKind`] at every stages-per-rank
/// of the request and returns the rows sorted: schedules that fit the
/// memory limit by makespan, then those over the limit by makespan, then
/// those that cannot be built (in generator order). Ties in makespan go
/// to the smaller peak, then to generator order.
pub fn plan(request: &PlanRequest) -> Vec<PlanRow> {
    let mut rows = Vec::new();
    for schedule in ScheduleKind::ALL {
        for &per_rank in &request.stages_per_rank {
            rows.push(PlanRow {
                schedule,
                stages_per_rank: per_rank,
                outcome: candidate(request, schedule, per_rank),
            });
        }
    }
    // Stable sort keeps generator order among equals.
    rows.sort_by(compare);
    rows
}

fn candidate(
    request: &PlanRequest,
    schedule: ScheduleKind,
    per_rank: usize,
) -> Result<PlanStats, String> {
    let compute = schedule
        .generate(request.ranks, per_rank, request.microbatches)
        .map_err(|e| e.to_string())?;
    let placement = schedule
        .placement()
        .stage_to_rank(request.ranks * per_rank, request.ranks)
        .map_err(|e| e.to_string())?;
    let costs = request.costs.compute_scaled(1.0 / per_rank as f64);
    let run = simulate_timed(&compute, &placement, &costs).map_err(|e| e.to_string())?;
    let peak = run.peak_activations() as f64 / per_rank as f64;
    Ok(PlanStats {
        makespan: run.makespan,
        bubble: run.bubble(),
        peak_activations: peak,
        fits: peak <= request.memory + 1e-9,
    })
}

fn compare(a: &PlanRow, b: &PlanRow) -> Ordering {
    match (&a.outcome, &b.outcome) {
        (Ok(x), Ok(y)) => y
            .fits
            .cmp(&x.fits)
            .then(x.makespan.total_cmp(&y.makespan))
            .then(x.peak_activations.total_cmp(&y.peak_activations)),
        (Ok(_), Err(_)) => Ordering::Less,
        (Err(_), Ok(_)) => Ordering::Greater,
        (Err(_), Err(_)) => Ordering::Equal,
    }
}

/// The rows as a text table, one line per row, best first:
/// rank in the plan, schedule, stages per rank, makespan, bubble %,
/// peak activations, whether it fits (`yes` / `over`), and the reason
/// for rows that cannot be built.
pub fn plan_table(rows: &[PlanRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>3}  {:<30} {:>4} {:>10} {:>8} {:>6}  fits",
        "#", "schedule", "spr", "makespan", "bubble", "peak"
    );
    let mut place = 0;
    for row in rows {
        let name = row.schedule.pytorch_name();
        match &row.outcome {
            Ok(s) => {
                place += 1;
                let _ = writeln!(
                    out,
                    "{place:>3}  {name:<30} {spr:>4} {makespan:>10.3} {bubble:>7.1}% {peak:>6.2}  {fits}",
                    spr = row.stages_per_rank,
                    makespan = s.makespan,
                    bubble = s.bubble * 100.0,
                    peak = s.peak_activations,
                    fits = if s.fits { "yes" } else { "over" },
                );
            }
            Err(reason) => {
                let _ = writeln!(
                    out,
                    "{:>3}  {name:<30} {spr:>4} {:>10} {:>8} {:>6}  -  {reason}",
                    "-",
                    "-",
                    "-",
                    "-",
                    spr = row.stages_per_rank,
                );
            }
        }
    }
    out
}
