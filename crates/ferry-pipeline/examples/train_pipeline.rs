//! Pipeline-parallel training, complete: a model of several stages
//! (Linear + ReLU blocks) trained on synthetic data on 2 worker processes
//! that this program starts itself, with an interleaved (Interleaved1F1B)
//! or V-shaped (ZBVZeroBubble) schedule.
//!
//! Worker 0 drives: it builds the pipeline (each stage is built on its
//! worker by the constructor registered there), runs `step` per batch,
//! then `optimizer_step` and `zero_grad`, and prints the loss falling.
//! The last steps are traced: the measured timeline (the actual start and
//! end of every action on every rank) of the median one is printed beside
//! the simulator's prediction for the same per-action costs, and written
//! as a Chrome trace (`--trace FILE`) and as an SVG of both (`--svg FILE`). Then the same
//! training runs in one process (same initial parameters, same batches) for
//! the speedup and to show that both loss curves agree.
//!
//! ```text
//! cargo run --release -p ferry-pipeline --example train_pipeline -- \
//!     --schedule zbv --trace step.json --svg step.svg
//! ```
//! (libtorch from the `.venv`: `LIBTORCH_USE_PYTORCH=1 VIRTUAL_ENV=.venv
//! PATH=.venv/bin:$PATH`; `cargo xtask demo` runs it.)

// The model and the one-process run; the pictures; the progress bar.
#[path = "train_pipeline/model.rs"]
mod model;
#[path = "train_pipeline/picture.rs"]
mod picture;
#[path = "train_pipeline/progress.rs"]
mod progress;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use ferry_pipeline::{HandOffSummary, Pipeline, Timeline};
use ferry_rpc::RpcOptions;
use ferry_schedule::ScheduleKind;

use model::{block_args, train_in_one_process, Task, BLOCK, MSE};
use progress::Progress;

/// The pipeline's workers.
const WORKERS: usize = 2;

/// Which schedule runs the stages.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum Schedule {
    /// Interleaved 1F1B: stages looped over the workers (0, 1, 0, 1, ...).
    Interleaved,
    /// ZBV zero bubble: 2 stages per worker in a V (0, 1, 1, 0), the
    /// backward split into I and W.
    Zbv,
}

impl Schedule {
    fn kind(self) -> ScheduleKind {
        match self {
            Schedule::Interleaved => ScheduleKind::Interleaved1F1B,
            Schedule::Zbv => ScheduleKind::ZbvZeroBubble,
        }
    }
}

/// Trains a pipelined model on 2 local worker processes, then the same
/// model in one process.
#[derive(Debug, Parser)]
#[command(name = "train_pipeline")]
struct Args {
    /// The schedule.
    #[arg(long, value_enum, default_value_t = Schedule::Interleaved)]
    schedule: Schedule,
    /// Training steps (one batch each).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    /// Stages (spread over the 2 workers; ZBV needs exactly 4).
    #[arg(long, default_value_t = 4)]
    stages: usize,
    /// Linear layers per stage.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Hidden width.
    #[arg(long, default_value_t = 512)]
    width: i64,
    /// Rows per batch.
    #[arg(long, default_value_t = 256)]
    batch: i64,
    /// Microbatches per batch (the batch splits evenly on dimension 0;
    /// on one core a matrix product of fewer than about 64 rows runs well
    /// below its full speed, so more microbatches cost more compute).
    #[arg(long, default_value_t = 4)]
    microbatches: usize,
    /// libtorch intra-op threads per process (also for the one-process run).
    #[arg(long, default_value_t = 1)]
    threads: i32,
    /// Write the Chrome trace of the last (measured) step to this file.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Write an SVG of the last step, measured and simulated, to this file.
    #[arg(long)]
    svg: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let rank = match ferry::launch::local(WORKERS as u32)? {
        ferry::launch::Role::Launcher => return Ok(()),
        ferry::launch::Role::Worker { rank, .. } => rank,
    };
    tch::set_num_threads(args.threads);
    // Freed tensors are reused, not faulted in again, in the pipeline's
    // workers and in the one-process run alike.
    ferry_pipeline::retain_freed_memory()?;
    let mut options = RpcOptions::from_env(format!("worker{rank}"))?;
    ferry_pipeline::install(&mut options, model::stages());
    ferry::init_rpc(options)?;
    let result = if rank == 0 { drive(&args) } else { Ok(()) };
    // Every worker shuts down, also when driving failed.
    ferry_rpc::shutdown()?;
    result
}

/// What the pipelined run measured.
struct Run {
    losses: Vec<f64>,
    step_ms: Vec<f64>,
    /// Of which `optimizer_step` and `zero_grad`.
    update_ms: Vec<f64>,
    /// The median of the traced steps, and its step number (1-based).
    traced: Timeline,
    traced_step: usize,
    /// The makespans of all the traced steps (ms).
    traced_ms: Vec<f64>,
    /// Every traced step's measured makespan over its own simulation.
    traced_ratios: Vec<f64>,
    /// The hand-offs of all the traced steps to idle receivers.
    handoffs: Option<HandOffSummary>,
    /// Those whose receiver was already waiting at the send.
    waiting: Option<HandOffSummary>,
    stage_to_rank: Vec<usize>,
}

/// The driver: pipelined training, the one-process run, the report.
fn drive(args: &Args) -> Result<()> {
    let steps = usize::try_from(args.steps)?;
    let kind = args.schedule.kind();
    if args.stages % WORKERS != 0 {
        bail!("--stages {}: must be a multiple of {WORKERS}", args.stages);
    }
    let task = Task::new(args.width, args.batch);
    let stage_args = block_args(args.stages, args.width, args.layers);
    eprintln!(
        "Pipeline: {} stages of {} x (Linear({w}, {w}) + ReLU) on {WORKERS} worker processes, {kind}, \
         {} microbatches of {} rows, SGD(lr 0.02, momentum 0.9), {steps} steps, {} intra-op thread(s) per process",
        args.stages,
        args.layers,
        args.microbatches,
        args.batch / args.microbatches.max(1) as i64,
        args.threads,
        w = args.width,
    );
    let run = train_pipelined(args, kind, &stage_args, &task, steps)?;
    let mut one_losses = Vec::with_capacity(steps);
    let mut one_ms = Vec::with_capacity(steps);
    let progress = Progress::new("1 process ", steps);
    train_in_one_process(&stage_args, &task, steps, |step, loss, seconds| {
        one_losses.push(loss);
        one_ms.push(seconds * 1e3);
        progress.step(step + 1, loss);
    })
    .map_err(|e| anyhow::anyhow!("one-process run: {e}"))?;
    progress.finish();
    report(args, kind, &run, &one_losses, &one_ms)
}

/// How many of the last steps are traced (the median one is pictured: one
/// step can be slowed down by anything else running on the machine).
const TRACED: usize = 5;

/// Trains on the pipeline; the last steps are traced.
fn train_pipelined(
    args: &Args,
    kind: ScheduleKind,
    stage_args: &[model::BlockArgs],
    task: &Task,
    steps: usize,
) -> Result<Run> {
    let placement = kind.placement().stage_to_rank(args.stages, WORKERS)?;
    let mut builder = Pipeline::builder();
    for (stage, rank) in stage_args.iter().zip(&placement) {
        builder = builder.stage(*rank as u32, BLOCK, *stage);
    }
    let mut pipeline = builder
        .schedule(kind)
        .microbatches(args.microbatches)
        .loss(MSE)
        .optimizer(model::optimizer())
        .build()
        .context("building the pipeline")?;
    let mut losses = Vec::with_capacity(steps);
    let mut step_ms = Vec::with_capacity(steps);
    let mut update_ms = Vec::with_capacity(steps);
    let mut traced = Vec::new();
    let progress = Progress::new("pipeline  ", steps);
    for step in 0..steps {
        let (x, y) = task.batch(step);
        pipeline.set_trace(step + TRACED >= steps);
        let started = Instant::now();
        let out = pipeline
            .step(&x, &y)
            .with_context(|| format!("step {step}"))?;
        let stepped = started.elapsed().as_secs_f64() * 1e3;
        pipeline.optimizer_step()?;
        pipeline.zero_grad()?;
        let total = started.elapsed().as_secs_f64() * 1e3;
        step_ms.push(total);
        update_ms.push(total - stepped);
        // Equal microbatches: the batch's mean loss is their losses' mean.
        let loss = out.losses.iter().sum::<f64>() / out.losses.len() as f64;
        losses.push(loss);
        progress.step(step + 1, loss);
        if let Some(timeline) = out.timeline {
            traced.push((step + 1, timeline));
        }
    }
    progress.finish();
    let traced_ms = traced.iter().map(|(_, t)| t.makespan_ms()).collect();
    let stage_to_rank = pipeline.stage_to_rank().to_vec();
    let traced_ratios = traced
        .iter()
        .map(|(_, t)| Ok(t.makespan_ms() / t.simulated(&stage_to_rank)?.makespan.max(1e-9)))
        .collect::<Result<Vec<f64>>>()?;
    let handoffs = HandOffSummary::of(traced.iter().flat_map(|(_, t)| t.handoffs()));
    let waiting = HandOffSummary::of_waiting(traced.iter().flat_map(|(_, t)| t.handoffs()));
    traced.sort_by(|a, b| a.1.makespan_ms().total_cmp(&b.1.makespan_ms()));
    let middle = traced.len() / 2;
    let (traced_step, traced) = traced
        .into_iter()
        .nth(middle)
        .context("the traced steps returned no timeline")?;
    Ok(Run {
        losses,
        step_ms,
        update_ms,
        traced,
        traced_step,
        traced_ms,
        traced_ratios,
        handoffs,
        waiting,
        stage_to_rank,
    })
}

/// Prints the loss curves, the step times, the speedup, and the traced
/// step beside its simulation; writes the trace and the SVG.
fn report(
    args: &Args,
    kind: ScheduleKind,
    run: &Run,
    one_losses: &[f64],
    one_ms: &[f64],
) -> Result<()> {
    let steps = run.losses.len();
    println!();
    println!("  step   pipeline loss   1-process loss");
    for step in (0..steps).filter(|s| s % (steps / 10).max(1) == 0 || s + 1 == steps) {
        println!(
            "  {:>4}   {:>13.6}   {:>14.6}",
            step + 1,
            run.losses[step],
            one_losses[step]
        );
    }
    let differences: Vec<f64> = run
        .losses
        .iter()
        .zip(one_losses)
        .map(|(a, b)| ((a - b) / b.abs().max(1e-12)).abs())
        .collect();
    let worst_of = |n: usize| differences.iter().take(n).copied().fold(0.0, f64::max);
    let (early, worst) = (worst_of(10), worst_of(steps));
    println!(
        "  the two loss curves agree (same initial parameters, same batches): largest relative \
         difference {early:.1e} over the first {} steps, {worst:.1e} over all {steps} \
         (float rounding of sums taken in another order, amplified by training)",
        steps.min(10)
    );
    let (pipe, one) = (median(&run.step_ms), median(one_ms));
    println!();
    println!(
        "  step time (median; step + optimizer_step + zero_grad): pipeline on {WORKERS} processes {pipe:.2} ms, \
         one process {one:.2} ms: speedup {:.2}x",
        one / pipe
    );
    println!(
        "  of the pipeline's step, optimizer_step + zero_grad on every stage take {:.2} ms (median)",
        median(&run.update_ms)
    );
    let measured = run.traced.timed_run();
    let simulated = run
        .traced
        .simulated(&run.stage_to_rank)
        .context("simulating the traced step")?;
    let traced = run.traced_step;
    let all: Vec<String> = run.traced_ms.iter().map(|ms| format!("{ms:.1}")).collect();
    println!(
        "  traced the last {} steps, from the first action's start to the last one's end: {} ms",
        run.traced_ms.len(),
        all.join(", ")
    );
    println!(
        "  the median, step {traced} ({kind}, {} microbatches): measured {:.2} ms (bubble {:.0}%), \
         simulated from its own per-action costs {:.2} ms (bubble {:.0}%): measured/simulated {:.2}",
        args.microbatches,
        measured.makespan,
        measured.bubble() * 100.0,
        simulated.makespan,
        simulated.bubble() * 100.0,
        measured.makespan / simulated.makespan.max(1e-9)
    );
    let mut ratios = run.traced_ratios.clone();
    ratios.sort_by(f64::total_cmp);
    if let Some(h) = &run.handoffs {
        println!(
            "  over the {} traced steps: measured/simulated median {:.2} (from {:.2} to {:.2}); \
             hand-off from a send to the start of the action it feeds on an idle receiver: \
             median {:.0} µs, p90 {:.0} µs over {} values (in transit {:.0} µs, waking the \
             receiver {:.0} µs, medians)",
            ratios.len(),
            median(&ratios),
            ratios.first().copied().unwrap_or(f64::NAN),
            ratios.last().copied().unwrap_or(f64::NAN),
            h.median_us,
            h.p90_us,
            h.count,
            h.transit_median_us,
            h.wake_median_us,
        );
    }
    if let Some(w) = &run.waiting {
        println!(
            "  of those, to receivers already waiting when the value was sent: median {:.0} µs, \
             p90 {:.0} µs over {} values (the others were still computing at the send)",
            w.median_us, w.p90_us, w.count,
        );
    }
    let split = matches!(
        kind,
        ScheduleKind::InterleavedZeroBubble | ScheduleKind::ZbvZeroBubble
    );
    let costs: Vec<String> = run
        .traced
        .measured_costs()
        .stage_overrides
        .iter()
        .map(|(stage, c)| {
            if split {
                let (f, i, w) = (c.forward, c.backward_input, c.backward_weight);
                format!("stage {stage} F {f:.1} I {i:.1} W {w:.1}")
            } else {
                format!("stage {stage} F {:.1} B {:.1}", c.forward, c.backward)
            }
        })
        .collect();
    println!(
        "  its action costs (median ms), which the simulation used: {}",
        costs.join("; ")
    );
    // The order each rank runs its compute actions in (stage, kind,
    // microbatch: `3W1` is stage 3's weight backward of microbatch 1).
    let compute = kind.generate(WORKERS, args.stages / WORKERS, args.microbatches)?;
    println!();
    println!("  the schedule, each rank's compute actions in order (stage, kind, microbatch):");
    for line in ferry_schedule::grid(&compute, usize::MAX, 0).lines() {
        println!("  {line}");
    }
    let axis = measured.makespan.max(simulated.makespan);
    let colour = std::io::stdout().is_terminal();
    println!();
    println!("  measured (one column = {:.2} ms; F forward, B backward, I/W input/weight backward, digits = microbatch, . idle):", axis / COLUMNS as f64);
    print!("{}", picture::text(measured, axis, COLUMNS, colour));
    println!("  simulated with the measured costs:");
    print!("{}", picture::text(&simulated, axis, COLUMNS, colour));
    if let Some(path) = &args.trace {
        write(path, &run.traced.chrome_trace())?;
        println!(
            "  wrote the Chrome trace of step {traced} to {} (open it in Perfetto)",
            path.display()
        );
    }
    if let Some(path) = &args.svg {
        let titles = [
            format!(
                "measured: step {traced}, {kind}, {:.2} ms (time in ms)",
                measured.makespan
            ),
            format!(
                "simulated from the measured action costs: {:.2} ms",
                simulated.makespan
            ),
        ];
        let svg = picture::side_by_side(measured, &simulated, [&titles[0], &titles[1]]);
        write(path, &svg)?;
        println!(
            "  wrote the measured and simulated step to {}",
            path.display()
        );
    }
    println!("PIPELINE_FINAL_LOSS={}", run.losses[steps - 1]);
    println!("ONE_PROCESS_FINAL_LOSS={}", one_losses[steps - 1]);
    println!("LOSS_CURVES_MAX_RELATIVE_DIFFERENCE={worst:e}");
    Ok(())
}

/// Columns of the terminal picture's time axis.
const COLUMNS: usize = 100;

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

fn write(path: &Path, text: &str) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
