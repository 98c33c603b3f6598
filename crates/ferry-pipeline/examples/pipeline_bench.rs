//! Ferry's side of the pipeline benchmark: the same model, data, schedules
//! and timing as `benches/peers/pt_pipeline.py` (PyTorch's
//! `torch.distributed.pipelining` over gloo), so `cargo xtask bench --only
//! pipeline` can put both in one table.
//!
//! Model: 8 blocks of `Linear(1024, 1024)` + ReLU, PyTorch's initialisation
//! under seed 0 then Kaiming-normal weights and zero biases; batch 64 split
//! into `--microbatches` microbatches; `MSELoss` (mean) per microbatch with
//! `scale_grads`; SGD (lr 0.05) per stage ([`model`] has the exact recipe).
//! Two processes on 127.0.0.1, launched by this program itself
//! (`ferry::launch::local`), each with `--threads` libtorch intra-op
//! threads (1). Rank 0 (`worker0`) is the driver and owns stages too.
//!
//! Cells, as the peer lays them out:
//! - GPipe, 1F1B: one stage per rank (4 blocks each), stages on workers 0, 1;
//! - Interleaved1F1B, LoopedBFS, InterleavedZeroBubble: two stages per rank
//!   (2 blocks each), loop placement (workers 0, 1, 0, 1);
//! - ZBVZeroBubble, DualPipeV: two stages per rank, V placement (0, 1, 1, 0);
//!
//! each at every `--microbatches` value. A training step is timed on the
//! driver: `zero_grad` + `step` + `optimizer_step` (the peer's step, whose
//! `dist.barrier` before it is implicit here: the driver's calls finish on
//! every rank before the next). The first `--warmup` steps are not in the
//! statistics. Every step is traced: its measured timeline gives the
//! per-action costs of that step (median per stage and kind), and the
//! duration-aware simulation of the schedule with those costs and free
//! links gives what the step would take with no runtime overhead.
//!
//! Baseline: the same model and data in one process without pipelining
//! (full-batch forward, MSELoss, backward, SGD) with `--threads` threads,
//! on the driver before the cells (the other worker idle).
//!
//! Reported per cell (JSON, the peer's field names where they match):
//! `step_ms` (zero_grad + step + optimizer_step), `pipeline_step_ms`
//! (`step` alone), `makespan_ms` (first action's start to last action's
//! end, from the timeline), `simulated_ms`, the per-step ratios
//! `step_over_simulated` and `makespan_over_simulated`, losses, the
//! largest parameter difference from the baseline after the same steps,
//! and the measured costs of the median step.
//!
//! Usage: `pipeline_bench [--quick] [--schedules NAME…] [--microbatches M…]
//! [--steps N] [--warmup N] [--layers L] [--width W] [--batch B] [--lr LR]
//! [--threads T] [--no-baseline] [--svg DIR] [--out PATH]`; `--quick`: 10
//! timed steps after 2 warm-up steps, GPipe, 1F1B, Interleaved1F1B and
//! ZBVZeroBubble (as the peer's `--quick`). By hand:
//! `cargo run --release -p ferry-pipeline --example pipeline_bench -- --quick`.

#[path = "pipeline_bench/model.rs"]
mod model;
#[path = "pipeline_bench/stats.rs"]
mod stats;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use ferry_autograd::OptimizerKind;
use ferry_pipeline::{HandOffSummary, HostCores, Pipeline, Timeline};
use ferry_rpc::{Function, Functions, RpcOptions};
use ferry_schedule::ScheduleKind;
use serde_json::{json, Value};

use model::{Shape, StageArgs};
use stats::stats_ms;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Set by the launcher for its workers: where rank 0 writes its result.
const PART_ENV: &str = "FERRY_PIPELINE_BENCH_PART";

/// Every schedule, as the peer names them.
const SCHEDULES: &[(&str, ScheduleKind)] = &[
    ("GPipe", ScheduleKind::GPipe),
    ("1F1B", ScheduleKind::OneFOneB),
    ("Interleaved1F1B", ScheduleKind::Interleaved1F1B),
    ("LoopedBFS", ScheduleKind::LoopedBfs),
    ("InterleavedZeroBubble", ScheduleKind::InterleavedZeroBubble),
    ("ZBVZeroBubble", ScheduleKind::ZbvZeroBubble),
    ("DualPipeV", ScheduleKind::DualPipeV),
];
/// The peer's `--quick` schedules.
const QUICK_SCHEDULES: &[&str] = &["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"];

/// The benchmark's settings (the peer's arguments, same spellings).
#[derive(Debug, Clone, Parser)]
#[command(name = "pipeline_bench")]
struct Config {
    /// Schedules to run (default: all seven; with --quick: GPipe 1F1B
    /// Interleaved1F1B ZBVZeroBubble).
    #[arg(long, num_args = 1.., value_parser = schedule_name)]
    schedules: Option<Vec<String>>,
    /// Microbatch counts to run each schedule with.
    #[arg(long, num_args = 1.., default_values_t = [4, 8])]
    microbatches: Vec<usize>,
    /// Timed training steps per cell (after --warmup).
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Untimed steps before them.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Blocks in the model.
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Width of every linear layer.
    #[arg(long, default_value_t = 1024)]
    width: i64,
    /// Rows per batch.
    #[arg(long, default_value_t = 64)]
    batch: i64,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
    /// libtorch intra-op threads per process (and in the baseline).
    #[arg(long, default_value_t = 1)]
    threads: i32,
    /// How long (µs) the workers' `shm` readers and waiting callers poll
    /// before they sleep (`ChannelConfig::spin`; default: `FERRY_SPIN_US`,
    /// else Ferry's 50). A short spin leaves more of a small host's cores
    /// to the compute threads, and costs a wake-up per late message.
    #[arg(long)]
    spin_us: Option<u64>,
    /// How long (µs) a rank waiting for an input polls before it sleeps
    /// (`PipelineBuilder::wait_spin`; default: Ferry's 3000).
    #[arg(long)]
    wait_spin_us: Option<u64>,
    /// Whether the host has a core for every busy thread
    /// (`PipelineBuilder::host_cores`; default: each rank finds out).
    #[arg(long, value_enum)]
    host_cores: Option<Cores>,
    /// Skip the one-process baseline.
    #[arg(long)]
    no_baseline: bool,
    /// RPC timeout (and pipeline step limit) in seconds.
    #[arg(long, default_value_t = 120.0)]
    rpc_timeout: f64,
    /// The peer's quick run: 10 timed steps, 2 warm-up steps.
    #[arg(long)]
    quick: bool,
    /// Write the measured and simulated timelines of each cell's median
    /// step as SVG files into this directory.
    #[arg(long, value_name = "DIR")]
    svg: Option<PathBuf>,
    /// Where to write the JSON result (stdout when absent).
    #[arg(long, value_name = "PATH")]
    out: Option<PathBuf>,
}

/// `--host-cores`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Cores {
    /// `HostCores::Scarce`.
    Scarce,
    /// `HostCores::Spare`.
    Spare,
}

/// clap's parser for a schedule name.
fn schedule_name(text: &str) -> std::result::Result<String, String> {
    if SCHEDULES.iter().any(|(name, _)| *name == text) {
        Ok(text.to_string())
    } else {
        let names: Vec<&str> = SCHEDULES.iter().map(|(n, _)| *n).collect();
        Err(format!(
            "unknown schedule {text:?} (one of {})",
            names.join(", ")
        ))
    }
}

impl Config {
    /// `--host-cores`, else what the ranks find: `HostCores::of` this
    /// host's CPUs, the 2 workers and `--threads`.
    fn cores(&self) -> HostCores {
        match self.host_cores {
            Some(Cores::Scarce) => HostCores::Scarce,
            Some(Cores::Spare) => HostCores::Spare,
            None => HostCores::of(
                std::thread::available_parallelism().map_or(1, usize::from),
                2,
                usize::try_from(self.threads).unwrap_or(1),
            ),
        }
    }

    /// `--wait-spin-us`, else the pipeline's default.
    fn wait_spin(&self) -> Duration {
        self.wait_spin_us
            .map_or(ferry_pipeline::DEFAULT_WAIT_SPIN, Duration::from_micros)
    }

    fn parse_checked() -> Result<Config> {
        let mut c = Config::parse();
        if c.quick {
            (c.steps, c.warmup) = (10, 2);
        }
        if c.schedules.is_none() {
            let names: &[&str] = if c.quick {
                QUICK_SCHEDULES
            } else {
                &SCHEDULES.iter().map(|(n, _)| *n).collect::<Vec<_>>()
            };
            c.schedules = Some(names.iter().map(|n| n.to_string()).collect());
        }
        if c.layers == 0 || c.layers % 4 != 0 {
            return Err(format!(
                "--layers must be a positive multiple of 4 (2 ranks x 2 stages), not {}",
                c.layers
            )
            .into());
        }
        if let Some(&m) = c
            .microbatches
            .iter()
            .find(|&&m| m == 0 || c.batch % m as i64 != 0)
        {
            return Err(format!("--batch {} does not split into {m} microbatches", c.batch).into());
        }
        if c.steps == 0 || c.threads < 1 || c.width < 1 {
            return Err("--steps, --threads and --width must be at least 1".into());
        }
        Ok(c)
    }

    fn shape(&self) -> Shape {
        Shape {
            layers: self.layers,
            width: self.width,
        }
    }
}

/// The machine's load averages (1, 5, 15 minutes), if readable.
fn loadavg() -> Option<[f64; 3]> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut it = text.split_whitespace().map(|x| x.parse::<f64>().ok());
    Some([it.next()??, it.next()??, it.next()??])
}

// ------------------------------------------------------------------ baseline

/// The one-process baseline: per-step times and losses, and the final
/// parameters.
fn baseline(c: &Config) -> Result<(Value, Vec<tch::Tensor>)> {
    let teacher = model::teacher(c.width);
    let mut model = model::Baseline::new(c.shape(), c.lr)?;
    let (mut times, mut losses) = (Vec::new(), Vec::new());
    for k in 0..c.warmup + c.steps {
        let (x, y) = model::batch(k as i64, c.batch, c.width, &teacher);
        let t0 = Instant::now();
        let loss = model.step(&x, &y)?;
        let dt = t0.elapsed().as_secs_f64();
        losses.push(loss);
        if k >= c.warmup {
            times.push(dt);
        }
    }
    let result = json!({
        "threads": tch::get_num_threads(),
        "step_ms": stats_ms(&times),
        "times_s": times,
        "losses": losses,
        "final_loss": losses.last(),
    });
    Ok((result, model.parameters()))
}

// ------------------------------------------------------------------ cells

/// Stages per rank and the worker of every stage, as the peer places them.
fn placement(kind: ScheduleKind) -> (usize, Vec<u32>) {
    match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB => (1, vec![0, 1]),
        ScheduleKind::ZbvZeroBubble | ScheduleKind::DualPipeV => (2, vec![0, 1, 1, 0]),
        _ => (2, vec![0, 1, 0, 1]),
    }
}

/// What one traced step measured.
struct StepSample {
    /// zero_grad + step + optimizer_step, s.
    total: f64,
    /// `step` alone, s.
    step: f64,
    timeline: Timeline,
    /// The simulated makespan with this step's costs, ms.
    simulated_ms: f64,
    loss: f64,
}

fn cell(
    c: &Config,
    name: &str,
    kind: ScheduleKind,
    microbatches: usize,
    base: Option<&(Value, Vec<tch::Tensor>)>,
) -> Result<Value> {
    let (per_rank, workers) = placement(kind);
    let n_stages = workers.len();
    let per_stage = c.layers / n_stages;
    let mut builder = Pipeline::builder();
    for (stage, &worker) in workers.iter().enumerate() {
        let args = StageArgs {
            shape: c.shape(),
            first: stage * per_stage,
            count: per_stage,
        };
        builder = builder.stage(worker, model::BLOCKS, args);
    }
    let mut builder = builder
        .schedule(kind)
        .microbatches(microbatches)
        .loss(model::MSE)
        .optimizer(OptimizerKind::sgd(c.lr))
        .timeout(Duration::from_secs_f64(c.rpc_timeout))
        .wait_spin(c.wait_spin());
    if c.host_cores.is_some() {
        builder = builder.host_cores(c.cores());
    }
    let mut pipeline = builder
        // The peer's outputs stay on its last rank; so do Ferry's.
        .return_outputs(false)
        .build()?;
    pipeline.set_trace(true);
    let stage_to_rank = pipeline.stage_to_rank().to_vec();
    let teacher = model::teacher(c.width);
    let mut samples = Vec::new();
    let mut first_step_ms = 0.0;
    for k in 0..c.warmup + c.steps {
        let (x, y) = model::batch(k as i64, c.batch, c.width, &teacher);
        let t0 = Instant::now();
        pipeline.zero_grad()?;
        let t1 = Instant::now();
        let out = pipeline.step(&x, &y)?;
        let t2 = Instant::now();
        pipeline.optimizer_step()?;
        let total = t0.elapsed().as_secs_f64();
        let step = (t2 - t1).as_secs_f64();
        if k == 0 {
            first_step_ms = total * 1e3;
        }
        let timeline = out.timeline.ok_or("the step returned no timeline")?;
        let simulated_ms = timeline.simulated(&stage_to_rank)?.makespan;
        let loss = out.losses.iter().sum::<f64>() / out.losses.len() as f64;
        samples.push(StepSample {
            total,
            step,
            timeline,
            simulated_ms,
            loss,
        });
    }
    let losses: Vec<f64> = samples.iter().map(|s| s.loss).collect();
    let timed = &samples[c.warmup..];
    let totals: Vec<f64> = timed.iter().map(|s| s.total).collect();
    let steps: Vec<f64> = timed.iter().map(|s| s.step).collect();
    let makespans: Vec<f64> = timed
        .iter()
        .map(|s| s.timeline.makespan_ms() / 1e3)
        .collect();
    let simulated: Vec<f64> = timed.iter().map(|s| s.simulated_ms / 1e3).collect();
    let ratio = |f: &dyn Fn(&StepSample) -> f64| -> Value {
        let r: Vec<f64> = timed.iter().map(|s| f(s) / s.simulated_ms).collect();
        stats::stats(&r)
    };
    // The step whose total is the median: its costs and pictures.
    let mut order: Vec<usize> = (0..timed.len()).collect();
    order.sort_by(|&a, &b| timed[a].total.total_cmp(&timed[b].total));
    let median = &timed[order[order.len() / 2]];
    let handoffs = HandOffSummary::of(timed.iter().flat_map(|s| s.timeline.handoffs()));
    let waiting = HandOffSummary::of_waiting(timed.iter().flat_map(|s| s.timeline.handoffs()));
    let costs = median.timeline.measured_costs();
    let costs: Value = costs
        .stage_overrides
        .iter()
        .map(|(stage, s)| {
            (
                stage.to_string(),
                json!({"F": s.forward, "B": s.backward, "I": s.backward_input,
                       "W": s.backward_weight}),
            )
        })
        .collect::<serde_json::Map<String, Value>>()
        .into();
    if let Some(dir) = &c.svg {
        std::fs::create_dir_all(dir)?;
        let stem = format!("{name}_{microbatches}");
        std::fs::write(
            dir.join(format!("{stem}_measured.svg")),
            median.timeline.svg(),
        )?;
        let sim = median.timeline.simulated(&stage_to_rank)?;
        std::fs::write(
            dir.join(format!("{stem}_simulated.svg")),
            ferry_schedule::svg_timed(&sim),
        )?;
        std::fs::write(
            dir.join(format!("{stem}_measured.trace.json")),
            median.timeline.chrome_trace(),
        )?;
    }
    let mut result = json!({
        "schedule": name,
        "microbatches": microbatches,
        "status": "ok",
        "stages_per_rank": per_rank,
        "num_stages": n_stages,
        "stage_workers": workers,
        "microbatch_size": c.batch / microbatches as i64,
        "first_step_ms": first_step_ms,
        "step_ms": stats_ms(&totals),
        "pipeline_step_ms": stats_ms(&steps),
        "makespan_ms": stats_ms(&makespans),
        "simulated_ms": stats_ms(&simulated),
        "step_over_simulated": ratio(&|s| s.total * 1e3),
        "pipeline_step_over_simulated": ratio(&|s| s.step * 1e3),
        "makespan_over_simulated": ratio(&|s| s.timeline.makespan_ms()),
        "bubble_measured": median.timeline.bubble(),
        "handoff": handoffs.map(handoff_json),
        "handoff_waiting": waiting.map(handoff_json),
        "costs_ms_of_median_step": costs,
        "times_s": totals,
        "losses": losses,
        "final_loss": losses.last(),
    });
    if let Some((base, base_params)) = base {
        let params: Vec<tch::Tensor> = pipeline.parameters()?.into_iter().flatten().collect();
        if params.len() != base_params.len() {
            return Err(format!(
                "the pipeline has {} parameters, the baseline {}",
                params.len(),
                base_params.len()
            )
            .into());
        }
        let diff = params
            .iter()
            .zip(base_params)
            .map(|(a, b)| (a - b).abs().max().double_value(&[]))
            .fold(0.0, f64::max);
        let base_losses: Vec<f64> = base["losses"]
            .as_array()
            .map(|l| l.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default();
        let loss_diff = losses
            .iter()
            .zip(&base_losses)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        result["max_abs_param_diff_vs_baseline"] = json!(diff);
        result["max_abs_loss_diff_vs_baseline"] = json!(loss_diff);
        let base_median = base["step_ms"]["median_ms"].as_f64().unwrap_or(f64::NAN);
        let median = result["step_ms"]["median_ms"].as_f64().unwrap_or(f64::NAN);
        result["speedup_vs_baseline_same_threads"] = json!(base_median / median);
    }
    Ok(result)
}

/// The driver (rank 0): the baseline, then every cell.
fn driver(c: &Config) -> Result<Value> {
    let load_start = loadavg();
    let base = if c.no_baseline {
        None
    } else {
        eprintln!("[ferry pipeline] baseline ({} thread(s)) ...", c.threads);
        let base = baseline(c)?;
        eprintln!(
            "    baseline median {:.1} ms, final loss {:.6}",
            base.0["step_ms"]["median_ms"].as_f64().unwrap_or(f64::NAN),
            base.0["final_loss"].as_f64().unwrap_or(f64::NAN)
        );
        Some(base)
    };
    let mut cells = Vec::new();
    for name in c.schedules.iter().flatten() {
        let kind = SCHEDULES
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, k)| *k)
            .ok_or_else(|| format!("unknown schedule {name}"))?;
        for &m in &c.microbatches {
            eprintln!("[ferry pipeline] {name} mb={m} ...");
            let t0 = Instant::now();
            let mut result = match cell(c, name, kind, m, base.as_ref()) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("    FAILED: {e}");
                    json!({"schedule": name, "microbatches": m, "status": "failed",
                           "error": e.to_string()})
                }
            };
            result["wall_s"] = json!(t0.elapsed().as_secs_f64());
            if result["status"] == "ok" {
                eprintln!(
                    "    median {:.1} ms (step {:.1}, timeline {:.1}, simulated {:.1}), \
                     final loss {:.6}, max|dparam| {:.2e}",
                    result["step_ms"]["median_ms"].as_f64().unwrap_or(f64::NAN),
                    result["pipeline_step_ms"]["median_ms"]
                        .as_f64()
                        .unwrap_or(f64::NAN),
                    result["makespan_ms"]["median_ms"]
                        .as_f64()
                        .unwrap_or(f64::NAN),
                    result["simulated_ms"]["median_ms"]
                        .as_f64()
                        .unwrap_or(f64::NAN),
                    result["final_loss"].as_f64().unwrap_or(f64::NAN),
                    result["max_abs_param_diff_vs_baseline"]
                        .as_f64()
                        .unwrap_or(f64::NAN),
                );
            }
            cells.push(result);
        }
    }
    let failures: Vec<Value> = cells
        .iter()
        .filter(|c| c["status"] != "ok")
        .map(|c| {
            json!({"schedule": c["schedule"], "microbatches": c["microbatches"],
                        "error": c["error"]})
        })
        .collect();
    Ok(json!({
        "baseline": base.map(|b| vec![b.0]).unwrap_or_default(),
        "cells": cells,
        "failures": failures,
        "threads": tch::get_num_threads(),
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
    }))
}

// ------------------------------------------------------------------ processes

/// The driver tells the other worker that it is done with it (the other
/// worker serves the pipeline until then, however long the bench takes).
const DONE: Function<(), ()> = Function::new("pipeline_bench.done");
/// The longest the other worker waits for [`DONE`] (the whole bench takes
/// minutes; this only bounds a driver that died).
const SERVE_LIMIT: Duration = Duration::from_secs(2 * 3600);

/// One worker: `--threads` intra-op threads, RPC with the pipeline layer;
/// rank 0 drives (writing the result to `part`) and then tells rank 1 it
/// is done; rank 1 serves until then. Then both shut down.
fn worker(rank: u32, c: &Config, part: &Path) -> Result<()> {
    tch::set_num_threads(c.threads);
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let mut functions = Functions::new();
    functions.add(DONE, move |()| {
        let _ = done_tx.send(());
    });
    let mut options = RpcOptions::from_env(format!("worker{rank}"))?
        .rpc_timeout(Duration::from_secs_f64(c.rpc_timeout))
        .functions(functions);
    if let Some(us) = c.spin_us {
        options.channel_config.spin = Duration::from_micros(us);
    }
    let spin_us = options.channel_config.spin.as_micros() as u64;
    // Freed tensors are reused, not faulted in again, in the pipeline's
    // workers and in the baseline alike.
    ferry_pipeline::retain_freed_memory()?;
    ferry_pipeline::install(&mut options, model::stages());
    // The agent with the pipeline layer alone, as the process's.
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    let result = if rank == 0 {
        let result = driver(c).and_then(|mut r| {
            r["spin_us"] = json!(spin_us);
            Ok(std::fs::write(part, serde_json::to_vec(&r)?)?)
        });
        let told = DONE.rpc_sync("worker1", ());
        result.and(Ok(told?))
    } else {
        done_rx
            .recv_timeout(SERVE_LIMIT)
            .map_err(|_| format!("worker0 did not finish the bench within {SERVE_LIMIT:?}").into())
    };
    ferry_rpc::shutdown()?;
    result
}

/// Where rank 0 writes its result for the launcher: next to `--out`, or
/// in the temporary directory.
fn part_path(c: &Config) -> Result<PathBuf> {
    Ok(match &c.out {
        Some(out) => {
            if let Some(dir) = out.parent() {
                std::fs::create_dir_all(dir)?;
            }
            PathBuf::from(format!("{}.part", out.display()))
        }
        None => std::env::temp_dir().join(format!(
            "ferry_pipeline_bench.{}.json.part",
            std::process::id()
        )),
    })
}

fn main() -> Result<()> {
    let c = Config::parse_checked()?;
    let t0 = Instant::now();
    if std::env::var_os("RANK").is_none() {
        // The launcher: the workers inherit where rank 0 writes its part.
        let part = part_path(&c)?;
        let _ = std::fs::remove_file(&part);
        std::env::set_var(PART_ENV, &part);
    }
    let part = PathBuf::from(std::env::var_os(PART_ENV).ok_or(format!("{PART_ENV} is not set"))?);
    // Ranks 0 and 1 are copies of this executable (ferry's local launcher).
    if let ferry::launch::Role::Worker { rank, .. } = ferry::launch::local(2)? {
        return worker(rank, &c, &part);
    }
    let result: Value = serde_json::from_slice(&std::fs::read(&part)?)?;
    std::fs::remove_file(&part)?;
    let n_params = c.layers as i64 * (c.width * c.width + c.width);
    let value = json!({
        "bench": "ferry_pipeline",
        "versions": {
            "ferry": env!("CARGO_PKG_VERSION"),
            "platform": format!("{}-{}", std::env::consts::OS, std::env::consts::ARCH),
        },
        "config": {
            "schedules": c.schedules, "microbatches": c.microbatches, "steps": c.steps,
            "warmup": c.warmup, "layers": c.layers, "width": c.width, "batch": c.batch,
            "lr": c.lr, "threads": c.threads, "spin_us": result["spin_us"],
            "wait_spin_us": c.wait_spin().as_micros() as u64,
            "host_cores": c.host_cores.map(|h| format!("{h:?}")), "quick": c.quick, "rpc_timeout": c.rpc_timeout,
        },
        "host": {
            "cpu_count": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "cores": format!("{:?}", c.cores()),
            "loadavg_start": result["loadavg_start"],
            "loadavg_end": result["loadavg_end"],
        },
        "model": {
            "blocks": format!("{} x (Linear({w},{w}) + ReLU)", c.layers, w = c.width),
            "params": n_params, "batch": c.batch,
            "loss": "MSELoss(mean) per microbatch, scale_grads=true",
            "optimizer": format!("SGD(lr={}) per stage, after the step", c.lr),
            "timed": "zero_grad + step + optimizer_step on the driver (rank 0)",
        },
        "baseline": result["baseline"],
        "cells": result["cells"],
        "failures": result["failures"],
        "elapsed_s": t0.elapsed().as_secs_f64(),
    });
    let text = serde_json::to_string_pretty(&value)?;
    match &c.out {
        Some(out) => std::fs::write(out, &text)?,
        None => println!("{text}"),
    }
    Ok(())
}

/// A hand-off summary as the bench's JSON writes it.
fn handoff_json(h: HandOffSummary) -> Value {
    json!({
        "count": h.count,
        "median_us": h.median_us,
        "p90_us": h.p90_us,
        "transit_median_us": h.transit_median_us,
        "wake_median_us": h.wake_median_us,
    })
}
