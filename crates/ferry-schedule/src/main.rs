//! `ferry-schedule`: show a generated pipeline schedule, or check one
//! written as a PyTorch CSV.
//!
//! ```text
//! ferry-schedule show --schedule zbv --ranks 4 --stages-per-rank 2 --microbatches 8 \
//!     --svg zbv.svg --trace zbv.json
//! ferry-schedule check my.csv
//! ferry-schedule compare --ranks 4 --microbatches 8 --costs F=1,B=2,I=1,W=1 --memory 6
//! ```

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use ferry_schedule::{
    add_send_recv, check_deadlock, chrome_trace, chrome_trace_timed, grid, plan, plan_table,
    simulate_timed, simulate_unit_steps, svg, svg_timed, validate, CostError, Costs, PlanRequest,
    Schedule, ScheduleKind,
};

/// Pipeline schedules: generate, check, simulate and draw them.
#[derive(Parser)]
#[command(name = "ferry-schedule", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a schedule, lower and simulate it, print its timeline.
    Show {
        /// Which schedule.
        #[arg(long)]
        schedule: Kind,
        /// Pipeline ranks.
        #[arg(long)]
        ranks: usize,
        /// Stages per rank (default: 2 for zbv and dualpipev, else 1).
        #[arg(long)]
        stages_per_rank: Option<usize>,
        /// Microbatches.
        #[arg(long)]
        microbatches: usize,
        /// Also write the SVG timeline here.
        #[arg(long)]
        svg: Option<PathBuf>,
        /// Also write the Chrome-trace JSON here.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Also simulate with these costs (e.g. F=1,B=2,I=1,W=1,latency=0.1)
        /// and print the makespan, bubble and peak activations; --svg and
        /// --trace then draw the timed run (time across) instead of the
        /// unit steps.
        #[arg(long, value_parser = parse_costs)]
        costs: Option<Costs>,
    },
    /// Load a PyTorch CSV (compute-only or with comms), validate it, lower
    /// it if it is compute-only, simulate it and print its step count.
    Check {
        /// The CSV file (one row per rank).
        csv: PathBuf,
        /// Microbatches (default: the highest microbatch in the file + 1).
        #[arg(long)]
        microbatches: Option<usize>,
    },
    /// Plan: simulate every schedule at every stages-per-rank with the
    /// given costs and print them ranked by makespan within the memory
    /// limit.
    Compare {
        /// Pipeline ranks.
        #[arg(long)]
        ranks: usize,
        /// Microbatches.
        #[arg(long)]
        microbatches: usize,
        /// Costs of one rank's share of the model, e.g. F=1,B=2,I=1,W=1
        /// (also UNSHARD=, RESHARD=, REDUCE_GRAD=, latency=, bandwidth=,
        /// bytes=, and KEY@N= for stage or boundary N).
        #[arg(long, value_parser = parse_costs, default_value = "F=1,B=2,I=1,W=1")]
        costs: Costs,
        /// Memory limit: peak live activations per rank (in microbatches of
        /// one rank's share of the model).
        #[arg(long)]
        memory: f64,
        /// Latency of every stage boundary (overrides latency= in --costs).
        #[arg(long)]
        latency: Option<f64>,
        /// Stages per rank to try, comma-separated (default: 1,2).
        #[arg(long, value_delimiter = ',')]
        stages_per_rank: Option<Vec<usize>>,
    },
}

fn parse_costs(text: &str) -> Result<Costs, CostError> {
    text.parse()
}

#[derive(Clone, Copy, ValueEnum)]
enum Kind {
    Gpipe,
    #[value(name = "1f1b")]
    OneFOneB,
    #[value(name = "interleaved1f1b")]
    Interleaved1F1B,
    Loopedbfs,
    #[value(name = "interleavedzb")]
    InterleavedZb,
    Zbv,
    Dualpipev,
}

impl From<Kind> for ScheduleKind {
    fn from(kind: Kind) -> ScheduleKind {
        match kind {
            Kind::Gpipe => ScheduleKind::GPipe,
            Kind::OneFOneB => ScheduleKind::OneFOneB,
            Kind::Interleaved1F1B => ScheduleKind::Interleaved1F1B,
            Kind::Loopedbfs => ScheduleKind::LoopedBfs,
            Kind::InterleavedZb => ScheduleKind::InterleavedZeroBubble,
            Kind::Zbv => ScheduleKind::ZbvZeroBubble,
            Kind::Dualpipev => ScheduleKind::DualPipeV,
        }
    }
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Show {
            schedule,
            ranks,
            stages_per_rank,
            microbatches,
            svg: svg_path,
            trace,
            costs,
        } => {
            let kind = ScheduleKind::from(schedule);
            let per_rank = stages_per_rank.unwrap_or(match kind {
                ScheduleKind::ZbvZeroBubble | ScheduleKind::DualPipeV => 2,
                _ => 1,
            });
            let compute = kind.generate(ranks, per_rank, microbatches)?;
            let placement = kind.placement().stage_to_rank(ranks * per_rank, ranks)?;
            let lowered = add_send_recv(&compute, &placement)?;
            let timeline = simulate_unit_steps(&lowered, &placement)?;
            println!("{kind}: {ranks} ranks x {per_rank} stages, {microbatches} microbatches");
            print!("{}", grid(&compute, usize::MAX, 0));
            println!("{} unit steps with comms", timeline.steps());
            if let Some(costs) = costs {
                let run = simulate_timed(&lowered, &placement, &costs)?;
                println!(
                    "with costs {costs}: makespan {:.3}, bubble {:.1}%, peak activations {}",
                    run.makespan,
                    run.bubble() * 100.0,
                    run.peak_activations()
                );
                for (rank, stats) in run.ranks.iter().enumerate() {
                    println!(
                        "  rank {rank}: busy {:.3}, bubble {:.1}%, peak activations {}",
                        stats.busy,
                        stats.bubble * 100.0,
                        stats.peak_activations
                    );
                }
                return write_files(
                    svg_path.map(|p| (p, svg_timed(&run))),
                    trace.map(|p| (p, chrome_trace_timed(&run, 1000.0))),
                );
            }
            write_pictures(&timeline.to_schedule(), svg_path, trace)
        }
        Command::Check { csv, microbatches } => {
            let text = std::fs::read_to_string(&csv)
                .with_context(|| format!("reading {}", csv.display()))?;
            let schedule =
                Schedule::from_csv(&text).with_context(|| format!("parsing {}", csv.display()))?;
            let (placement, highest) = infer(&schedule)?;
            let microbatches = microbatches.unwrap_or(highest + 1);
            validate(&schedule, microbatches)?;
            let has_comms = schedule.has_comms();
            let lowered = if has_comms {
                schedule
            } else {
                add_send_recv(&schedule, &placement)?
            };
            // Refused before simulating, naming the actions that wait on
            // each other.
            check_deadlock(&lowered, &placement)?;
            let timeline = simulate_unit_steps(&lowered, &placement)?;
            println!(
                "valid: {} ranks, {} stages, {microbatches} microbatches{}",
                placement.iter().max().map_or(0, |r| r + 1),
                placement.len(),
                if has_comms { "" } else { " (lowered)" }
            );
            println!("{} unit steps", timeline.steps());
            Ok(())
        }
        Command::Compare {
            ranks,
            microbatches,
            costs,
            memory,
            latency,
            stages_per_rank,
        } => {
            if !(memory.is_finite() && memory >= 0.0) {
                bail!("--memory {memory}: must be a finite number >= 0");
            }
            let costs = match latency {
                Some(latency) => costs.with_latency(latency),
                None => costs,
            };
            costs.check()?;
            let mut request = PlanRequest::new(ranks, microbatches, memory, costs.clone());
            if let Some(list) = stages_per_rank {
                request.stages_per_rank = list;
            }
            println!(
                "{ranks} ranks, {microbatches} microbatches, memory {memory} activations, costs {costs}"
            );
            print!("{}", plan_table(&plan(&request)));
            Ok(())
        }
    }
}

/// The stage-to-rank placement a schedule implies (the rank each stage's
/// actions are on) and its highest microbatch.
fn infer(schedule: &Schedule) -> Result<(Vec<usize>, usize)> {
    let mut owner: HashMap<usize, usize> = HashMap::new();
    let mut highest = None;
    for (rank, row) in schedule.ranks.iter().enumerate() {
        for action in row.iter().flatten() {
            let leaves = if action.is_compound() {
                action.sub_actions().to_vec()
            } else {
                vec![action.clone()]
            };
            for leaf in leaves {
                owner.entry(leaf.stage()).or_insert(rank);
                highest = highest.max(leaf.microbatch());
            }
        }
    }
    let stages = owner.keys().max().map_or(0, |s| s + 1);
    let placement = (0..stages)
        .map(|stage| {
            owner
                .get(&stage)
                .copied()
                .ok_or_else(|| anyhow!("stage {stage} has no action on any rank"))
        })
        .collect::<Result<Vec<_>>>()?;
    let Some(highest) = highest else {
        bail!("the schedule has no microbatch action");
    };
    Ok((placement, highest))
}

fn write_pictures(
    timeline: &Schedule,
    svg_path: Option<PathBuf>,
    trace: Option<PathBuf>,
) -> Result<()> {
    write_files(
        svg_path.map(|p| (p, svg(timeline))),
        trace.map(|p| (p, chrome_trace(timeline, 1000))),
    )
}

fn write_files(
    svg_file: Option<(PathBuf, String)>,
    trace: Option<(PathBuf, String)>,
) -> Result<()> {
    for (path, text) in [svg_file, trace].into_iter().flatten() {
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
