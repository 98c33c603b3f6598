//! `cargo xtask bench [--quick]`: criterion benches, then Ferry and the
//! PyTorch RPC peer side by side (`target/ferry-bench/`): RPC latency
//! (`rpc_latency` / `pt_rpc_latency.py`), the paper's Table 1, tensor vs
//! RRef argument overhead (`rref_overhead` / `pt_rref_overhead.py`), and its
//! Table 2, distributed autograd overhead (`ferry-autograd`'s example
//! `autograd_overhead` / `pt_dist_autograd_overhead.py`); and the lighthouse
//! (`ferry-lighthouse` vs torchft 0.2.0's `torchft_lighthouse`, each its
//! own process, both driven by the peer's `lighthouse_bench.py` through
//! torchft's own client); and pipeline schedules (`ferry-schedule`'s
//! example `schedule_bench` vs `benches/peers/pt_schedule.py`, in
//! [`crate::schedule_bench`]); and pipeline-parallel training
//! (`ferry-pipeline`'s example `pipeline_bench` vs the peer's
//! `pt_pipeline.py`, in [`crate::pipeline_bench`]).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::setup::{ensure_torchft, ensure_venv, venv_python, with_libtorch, TORCHFT_VERSION};
use crate::steps::{cargo, cmd, root, run, Steps};
use crate::table::{self, Better, Metric, RowSpec};

/// Where results go, relative to the repository root.
const OUT_DIR: &str = "target/ferry-bench";
/// Sizes of the RPC latency cells (same labels on both sides).
const RPC_SIZES: &[&str] = &["0", "1KB", "1MB", "4MB", "40MB", "400MB"];
/// [`RPC_SIZES`] under `--quick`.
const RPC_SIZES_QUICK: &[&str] = &["0", "1KB", "1MB", "4MB", "40MB"];
/// The fast-path issue's targets, as ratios PyTorch / Ferry: the empty call
/// at most 1/20 of PyTorch's, 64 empty calls in flight at least 25× the
/// rate, 4 MB at most 1/2, 40 MB and 400 MB at most 1/4.
fn rpc_target(bytes: f64) -> Option<f64> {
    match bytes as u64 {
        0 => Some(20.0),
        b if b == 4 << 20 => Some(2.0),
        b if b == 40 << 20 || b == 400 << 20 => Some(4.0),
        _ => None,
    }
}
const RPC_THROUGHPUT_TARGET: f64 = 25.0;
/// Sizes of the RRef overhead rows (float32; the paper's Table 1).
const RREF_SIZES: &[&str] = &["4MB", "40MB", "400MB"];
/// [`RREF_SIZES`] under `--quick`.
const RREF_SIZES_QUICK: &[&str] = &["4MB", "40MB"];
/// The target for distributed autograd: each of Ferry's overheads
/// (forward, backward, optimizer step) at most 1/4 of PyTorch's, i.e. a
/// ratio (PyTorch / Ferry) of at least 4.
const AUTOGRAD_TARGET: f64 = 4.0;
/// Runs of each side of the autograd comparison, and under `--quick`. On a
/// small machine one run's medians move by tens of percent from the next
/// (page faults on the fresh 4 MB gradients, how the host places the two
/// vCPUs), and an overhead is a small difference of two of them; so each
/// run's overheads are inferred from that run's own columns, and the table
/// shows their median over the runs.
const AUTOGRAD_RUNS: [usize; 2] = [5, 1];
/// `cargo xtask bench --quick` must finish within this many seconds.
const QUICK_BUDGET_S: f64 = 600.0;
/// Replica counts of the lighthouse quorum rows (the 2, 16, 128).
const LIGHTHOUSE_REPLICAS: &[&str] = &["2", "16", "128"];
/// Clients sending heartbeats back to back in the lighthouse bench.
const LIGHTHOUSE_HB_CLIENTS: &str = "8";
/// Shapes (connections × heartbeats in flight on each) of the heartbeat
/// load generator, `lighthouse_load`, run against each lighthouse after the
/// script.
const LIGHTHOUSE_LOAD_SHAPES: &[&str] = &["8x1", "8x16"];
/// `lighthouse_load --seconds`, and under `--quick`.
const LIGHTHOUSE_LOAD_SECONDS: [&str; 2] = ["2", "1"];
/// Runs of the lighthouse script per side, and under `--quick` (each run
/// takes about 6 s; on a small machine one run's numbers move by tens of
/// percent from the next, so the table shows the median).
const LIGHTHOUSE_RUNS: [usize; 2] = [5, 1];
/// The lighthouse script's `--rounds` and `--hb-seconds`, and under `--quick`.
const LIGHTHOUSE_ROUNDS: [&str; 2] = ["5", "3"];
const LIGHTHOUSE_HB_SECONDS: [&str; 2] = ["3", "1"];
/// The options both lighthouse programs run with in the bench (after
/// `--bind 127.0.0.1:0`): those `lighthouse_bench.py --spawn-torchft` would
/// give torchft's in-process `LighthouseServer`.
const LIGHTHOUSE_OPTIONS: &[&str] = &[
    "--min_replicas",
    "1",
    "--join_timeout_ms",
    "50",
    "--quorum_tick_ms",
    "10",
    "--heartbeat_timeout_ms",
    "60000",
];
/// The target for the lighthouse: Ferry at least as fast as
/// torchft's on every row.
const LIGHTHOUSE_TARGET: f64 = 1.0;
/// Bound on one run of `lighthouse_bench.py` (it takes well under a minute).
const LIGHTHOUSE_SCRIPT_TIMEOUT: Duration = Duration::from_secs(300);
/// Bound on a lighthouse program telling the address it listens on
/// (`torchft_lighthouse` imports torch first: about a second).
const LIGHTHOUSE_START_TIMEOUT: Duration = Duration::from_secs(30);

/// The benchmarks `cargo xtask bench` runs (`--only` picks one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bench {
    /// The criterion benches (`ferry-benches`, bench `wire`).
    Criterion,
    /// RPC latency and throughput, Ferry vs PyTorch.
    Rpc,
    /// Tensor vs RRef argument overhead (Table 1), Ferry vs PyTorch.
    Rref,
    /// Distributed autograd overhead (Table 2), Ferry vs PyTorch.
    Autograd,
    /// Lighthouse quorum latency and heartbeat rate, `ferry-lighthouse` vs
    /// torchft 0.2.0's lighthouse, both driven by torchft's own client.
    Lighthouse,
    /// Generating, lowering and simulating pipeline schedules,
    /// `ferry-schedule` vs `torch.distributed.pipelining`
    /// ([`crate::schedule_bench`]).
    Schedule,
    /// Pipeline-parallel training, `ferry-pipeline` vs
    /// `torch.distributed.pipelining` ([`crate::pipeline_bench`]).
    Pipeline,
    /// Ferry's `ucx` channel vs `ucx_perftest`, and `rpc_sync` over the
    /// `ucx` transport vs the `shm` transport ([`crate::ucx_bench`]); only
    /// with `--only ucx` (it builds the `ucx` feature and installs
    /// `ucx-utils`).
    Ucx,
    /// The CUDA channels (`cuda_staged`, `cuda_ipc`) against a local
    /// device-to-device copy (`ferry-transport`'s `cuda_bench` example);
    /// only with `--only cuda`. Prints `SKIPPED: no CUDA device (<reason>)`
    /// on a host without one.
    Cuda,
}

impl Bench {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "criterion" => Some(Bench::Criterion),
            "rpc" => Some(Bench::Rpc),
            "rref" => Some(Bench::Rref),
            "autograd" => Some(Bench::Autograd),
            "lighthouse" => Some(Bench::Lighthouse),
            "schedule" => Some(Bench::Schedule),
            "pipeline" => Some(Bench::Pipeline),
            "ucx" => Some(Bench::Ucx),
            "cuda" => Some(Bench::Cuda),
            _ => None,
        }
    }
}

/// What `--only` accepts, for error texts.
const ONLY_NAMES: &str =
    "criterion, rpc, rref, autograd, lighthouse, schedule, pipeline, ucx, cuda";

/// Command-line options of `cargo xtask bench`.
#[derive(Debug, Default)]
pub(crate) struct Options {
    /// Short settings everywhere (the whole bench in under ten minutes).
    pub(crate) quick: bool,
    /// Skip the criterion benches.
    pub(crate) no_criterion: bool,
    /// Skip the peer (and its `.venv`): Ferry column only.
    pub(crate) no_peer: bool,
    /// Run nothing: rebuild the tables from the JSON results already in
    /// `target/ferry-bench/`.
    pub(crate) table_only: bool,
    /// Run (or tabulate) only this benchmark.
    pub(crate) only: Option<Bench>,
}

impl Options {
    pub(crate) fn parse(args: &[String]) -> Result<Self> {
        let mut o = Options::default();
        let mut args = args.iter();
        while let Some(a) = args.next() {
            match a.as_str() {
                "--quick" => o.quick = true,
                "--no-criterion" => o.no_criterion = true,
                "--no-peer" => o.no_peer = true,
                "--table-only" => o.table_only = true,
                "--only" => {
                    let name = args.next().map(String::as_str).unwrap_or("");
                    o.only = Some(Bench::parse(name).with_context(|| {
                        format!("`--only` takes one of {ONLY_NAMES} (got `{name}`)")
                    })?);
                }
                other => bail!(
                    "unknown option `{other}` for `cargo xtask bench` \
                     (expected --quick, --no-criterion, --no-peer, --table-only, \
                     --only {{{}}})",
                    ONLY_NAMES.replace(", ", "|")
                ),
            }
        }
        Ok(o)
    }

    /// Whether benchmark `b` is selected (all but `ucx` and `cuda` are,
    /// without `--only`).
    fn runs(&self, b: Bench) -> bool {
        match self.only {
            None => !matches!(b, Bench::Ucx | Bench::Cuda),
            Some(only) => only == b,
        }
    }
}

/// The directory of the peer benchmark scripts (read-only), if present:
/// `$FERRY_PEERS_DIR`, else `../shared/peers` next to the repository.
fn peers_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("FERRY_PEERS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("..").join("shared").join("peers"));
    dir.is_dir().then_some(dir)
}

/// The peer script `name` in `peers`, if both are there; says so when the
/// directory is there but the script is not.
fn peer_script(peers: Option<&Path>, name: &str) -> Option<PathBuf> {
    let script = peers?.join(name);
    if script.is_file() {
        Some(script)
    } else {
        eprintln!(
            "peer script {} not found: skipping its column",
            script.display()
        );
        None
    }
}

/// `target/ferry-bench/<name>`, relative to the repository root (every
/// command runs from there).
pub(crate) fn out_path(name: &str) -> PathBuf {
    Path::new(OUT_DIR).join(name)
}

pub(crate) fn remove_stale(path: &Path) -> Result<()> {
    match std::fs::remove_file(root().join(path)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing stale {}", path.display()))
        }
        _ => Ok(()),
    }
}

pub(crate) fn main(o: &Options) -> Result<()> {
    let t0 = Instant::now();
    let mut steps = Steps::default();
    std::fs::create_dir_all(root().join(OUT_DIR)).context("creating target/ferry-bench")?;

    let peers = if o.no_peer {
        eprintln!("(--no-peer: skipping the peer column)");
        None
    } else {
        let found = peers_dir();
        if found.is_none() {
            eprintln!(
                "peer scripts not found (../shared/peers or $FERRY_PEERS_DIR): \
                 skipping the peer column"
            );
        }
        found
    };
    let side_by_side = o.runs(Bench::Rpc)
        || o.runs(Bench::Rref)
        || o.runs(Bench::Autograd)
        || o.runs(Bench::Lighthouse);
    // Ferry's autograd benchmark links the .venv's libtorch, peer or not.
    // The schedule bench's peer script is in the repository: it needs no peers directory.
    // So does the pipeline bench's Ferry side (ferry-pipeline links libtorch).
    let needs_venv = (peers.is_some() && side_by_side)
        || o.runs(Bench::Autograd)
        || o.runs(Bench::Pipeline)
        || (!o.no_peer && o.runs(Bench::Schedule));
    if needs_venv && !o.table_only {
        steps.step_with("setup: .venv (torch, numpy)", ensure_venv)?;
    }

    if o.table_only {
        eprintln!("(--table-only: tables from the results already in {OUT_DIR})");
    } else if !o.runs(Bench::Criterion) {
        eprintln!("(--only: skipping criterion benches)");
    } else if o.no_criterion {
        eprintln!("(--no-criterion: skipping criterion benches)");
    } else {
        steps.step("criterion: wire", || {
            let mut c = cargo(&["bench", "-p", "ferry-benches", "--bench", "wire"]);
            if o.quick {
                c.args(["--", "--warm-up-time", "1", "--measurement-time", "2"]);
            }
            run(&mut c)
        })?;
    }

    if o.runs(Bench::Rpc) {
        rpc_latency(&mut steps, o, peers.as_deref())?;
    }
    if o.runs(Bench::Rref) {
        rref_overhead(&mut steps, o, peers.as_deref())?;
    }
    if o.runs(Bench::Autograd) {
        autograd_overhead(&mut steps, o, peers.as_deref())?;
    }
    if o.runs(Bench::Lighthouse) {
        lighthouse(&mut steps, o, peers.as_deref())?;
    }
    if o.runs(Bench::Schedule) {
        crate::schedule_bench::main(&mut steps, o)?;
    }
    if o.runs(Bench::Pipeline) {
        crate::pipeline_bench::main(&mut steps, o, peers.as_deref())?;
    }
    if o.runs(Bench::Ucx) && !o.table_only {
        crate::ucx_bench::main(&mut steps)?;
    }
    if o.runs(Bench::Cuda) && !o.table_only {
        steps.step("cuda: channels vs device-to-device copy", || {
            run(&mut cargo(&[
                "run",
                "--release",
                "-p",
                "ferry-transport",
                "--features",
                "cuda",
                "--example",
                "cuda_bench",
            ]))
        })?;
    }

    steps.summary();
    let took = t0.elapsed().as_secs_f64();
    if o.quick && took > QUICK_BUDGET_S {
        eprintln!(
            "warning: `cargo xtask bench --quick` took {took:.0}s, over its {QUICK_BUDGET_S:.0}s budget"
        );
    }
    Ok(())
}

/// Ferry's `rpc_latency` binary and the peer's `pt_rpc_latency.py`, then the table.
fn rpc_latency(steps: &mut Steps, o: &Options, peers: Option<&Path>) -> Result<()> {
    let sizes = if o.quick { RPC_SIZES_QUICK } else { RPC_SIZES };
    let peer_args = [&["--funcs", "identity", "--sizes"][..], sizes].concat();
    let ferry_args = [&["--sizes"][..], sizes].concat();
    Comparison {
        name: "rpc_latency",
        ferry_target: &["-p", "ferry-benches", "--bin", "rpc_latency"],
        libtorch: false,
        ferry_args: &ferry_args,
        peer_script: "pt_rpc_latency.py",
        peer_args: &peer_args,
        heading:
            "Ferry vs PyTorch RPC (TensorPipe), same host, CPU tensors; ratio > 1: Ferry is better",
        specs: rpc_latency_specs,
        repeat: None,
    }
    .run(steps, o, peers)
}

/// Ferry's `rref_overhead` binary and the peer's `pt_rref_overhead.py`
/// (the paper's Table 1: tensor vs RRef argument), then the table.
fn rref_overhead(steps: &mut Steps, o: &Options, peers: Option<&Path>) -> Result<()> {
    let sizes = if o.quick {
        RREF_SIZES_QUICK
    } else {
        RREF_SIZES
    };
    let sizes_args = [&["--sizes"][..], sizes].concat();
    Comparison {
        name: "rref_overhead",
        ferry_target: &["-p", "ferry-benches", "--bin", "rref_overhead"],
        libtorch: false,
        ferry_args: &sizes_args,
        peer_script: "pt_rref_overhead.py",
        peer_args: &sizes_args,
        heading: "Ferry vs PyTorch RPC: tensor vs RRef argument (the paper's Table 1), same host, \
                  CPU float32 tensors\nratio > 1: Ferry is better; an rref-tensor row has a \
                  ratio only when both differences are positive",
        specs: rref_overhead_specs,
        repeat: None,
    }
    .run(steps, o, peers)
}

/// Ferry's `autograd_overhead` example (`ferry-autograd`, built against the
/// `.venv`'s libtorch) and the peer's `pt_dist_autograd_overhead.py` (the
/// paper's Table 2), [`AUTOGRAD_RUNS`] times each, alternating which side
/// goes first; then the table, from each side's medians over its runs
/// ([`autograd_over_runs`]).
fn autograd_overhead(steps: &mut Steps, o: &Options, peers: Option<&Path>) -> Result<()> {
    let runs = AUTOGRAD_RUNS[usize::from(o.quick)];
    let heading = format!(
        "Ferry vs PyTorch RPC: distributed autograd overhead (the paper's Table 2), same \
         host, two Linear(1024, 1024), batch 32, CPU float32; in ms, each side the median \
         over {runs} run(s), alternating which goes first\n\
         columns: the median over the runs of each run's median; overheads: each run's \
         overhead from that run's own medians, then the median over the runs\n\
         norpc-step (Ferry only: the peer has no such column): the same SGD update done \
         locally after a local forward and backward, the step's local reference\n\
         ratio = PyTorch / Ferry (> 1: Ferry is better); an overhead has a ratio only when \
         both are positive\n\
         target ≥4x: Ferry's overhead at most 1/4 of PyTorch's"
    );
    Comparison {
        name: "autograd_overhead",
        ferry_target: &["-p", "ferry-autograd", "--example", "autograd_overhead"],
        libtorch: true,
        ferry_args: &[],
        peer_script: "pt_dist_autograd_overhead.py",
        peer_args: &[],
        heading: &heading,
        specs: autograd_overhead_specs,
        repeat: Some(Repeat {
            runs,
            over_runs: autograd_over_runs,
        }),
    }
    .run(steps, o, peers)
}

/// The lighthouse bench: the peer's `lighthouse_bench.py` (torchft 0.2.0's
/// own `LighthouseClient`) run with `--addr` against `ferry-lighthouse`
/// (built in release) and against torchft's own program,
/// `torchft_lighthouse` (installed with torchft in the `.venv`), each
/// started as its own process, fresh for each run, with the same options
/// ([`LIGHTHOUSE_OPTIONS`]) and killed afterwards whatever happens;
/// [`LIGHTHOUSE_RUNS`] times each, alternating which side goes first.
/// After the script, each run also drives the same server process with
/// Ferry's heartbeat load generator, `lighthouse_load`
/// ([`LIGHTHOUSE_LOAD_SHAPES`]). Each side's result is the median over its
/// runs. Then the table. Without the script (no peers directory, or
/// `--no-peer`) there is no driver: the bench is skipped.
fn lighthouse(steps: &mut Steps, o: &Options, peers: Option<&Path>) -> Result<()> {
    let runs = LIGHTHOUSE_RUNS[usize::from(o.quick)];
    let heading = format!(
        "Ferry vs torchft {TORCHFT_VERSION}: lighthouse (`ferry-lighthouse` vs torchft's \
         `torchft_lighthouse`), same host, same options (min_replicas 1, join timeout 50 ms, \
         tick 10 ms), both driven by torchft {TORCHFT_VERSION}'s LighthouseClient \
         (lighthouse_bench.py --addr), then by one load generator (lighthouse_load: one \
         thread, C connections with K heartbeats in flight on each)\nquorum: all N replicas \
         ask at once, from the last request sent (or the first) until every replica has its \
         answer, median over rounds; each side: median of {runs} run(s), alternating\n\
         heartbeats handled: the server's capacity, from lighthouse_load; torchft's client \
         spends 3-4x the server's CPU per heartbeat, so its row measures the client (no target)\n\
         both servers run as their own process (bound to 127.0.0.1:0), as deployed; the \
         script reaches each through --addr\n\
         ratio > 1: Ferry is better; target ≥1x: Ferry at least as fast on every row"
    );
    let table = Table {
        name: "lighthouse",
        heading: &heading,
        specs: lighthouse_specs,
    };
    if !o.table_only {
        let Some(script) = peer_script(peers, "lighthouse_bench.py") else {
            eprintln!(
                "(the lighthouse bench is driven by the peer's lighthouse_bench.py: skipping it)"
            );
            return Ok(());
        };
        let (ferry_out, peer_out) = (table.out_path("ferry_"), table.out_path("peer_"));
        remove_stale(&ferry_out)?;
        remove_stale(&peer_out)?;
        // Per-run logs of an earlier, longer run must not pose as this run's.
        for i in 1..=LIGHTHOUSE_RUNS[0] {
            for stem in [
                "lighthouse_ferry_server",
                "lighthouse_ferry_client",
                "lighthouse_peer_server",
                "lighthouse_peer",
            ] {
                remove_stale(&out_path(&format!("{stem}.{i}.log")))?;
            }
        }
        steps.step_with(
            &format!("setup: torchft {TORCHFT_VERSION} in .venv"),
            ensure_torchft,
        )?;
        steps.step(
            "build: ferry-lighthouse and the load generator lighthouse_load (release)",
            || {
                run(&mut cargo(&[
                    "build",
                    "--release",
                    "-p",
                    "ferry-ft",
                    "--bin",
                    "ferry-lighthouse",
                    "-p",
                    "ferry-benches",
                    "--bin",
                    "lighthouse_load",
                ]))
            },
        )?;
        let script_args = lighthouse_script_args(o);
        let ferry_server = LighthouseProgram::Ferry.command_line();
        let peer_server = format!(
            "{} (torchft {TORCHFT_VERSION}), its own process",
            LighthouseProgram::Torchft.command_line()
        );
        let (mut ferry_runs, mut peer_runs) = (Vec::new(), Vec::new());
        for i in 1..=runs {
            for ferry_side in sides_in_order(i) {
                let (program, side, runs_of_side) = if ferry_side {
                    (LighthouseProgram::Ferry, "ferry", &mut ferry_runs)
                } else {
                    (LighthouseProgram::Torchft, "peer", &mut peer_runs)
                };
                steps.step(
                    &format!(
                        "{side}: lighthouse_bench.py, lighthouse_load against {} ({i}/{runs})",
                        program.name()
                    ),
                    || {
                        let lighthouse = LighthouseProcess::start(
                            program,
                            &out_path(&format!("lighthouse_{side}_server.{i}.log")),
                        )?;
                        let args =
                            [&["--addr", lighthouse.url.as_str()][..], &script_args].concat();
                        let log = match program {
                            LighthouseProgram::Ferry => format!("lighthouse_ferry_client.{i}.log"),
                            LighthouseProgram::Torchft => format!("lighthouse_peer.{i}.log"),
                        };
                        let result = run_lighthouse_script(&script, &args, &out_path(&log))
                            .and_then(|mut result| {
                                let load = run_lighthouse_load(&lighthouse.url, o)?;
                                result["load_heartbeats_per_s"] = load["heartbeats_per_s"].clone();
                                Ok(result)
                            });
                        // Stopped on every path (`LighthouseProcess` also kills on drop).
                        let stopped = lighthouse.stop();
                        let result = match program {
                            LighthouseProgram::Ferry => result,
                            LighthouseProgram::Torchft => {
                                result.context("the peer benchmark failed (`--no-peer` skips it)")
                            }
                        };
                        runs_of_side.push(result?);
                        stopped
                    },
                )?;
            }
        }
        let script_args = script_args.join(" ");
        write_result(
            &ferry_out,
            &median_of_runs(ferry_runs, &ferry_server, &script_args),
        )?;
        write_result(
            &peer_out,
            &median_of_runs(peer_runs, &peer_server, &script_args),
        )?;
    }
    table.run(steps, o)
}

/// One side's result over its runs: every number of the first run's
/// `quorum` and `heartbeats_per_s` replaced by its median over the runs
/// ([`median_tree`]), with `lighthouse` (which server), `args` (the
/// script's options) and `runs` (each run's own result) added.
fn median_of_runs(runs: Vec<Value>, server: &str, args: &str) -> Value {
    let all: Vec<&Value> = runs.iter().collect();
    let field = |key: &str| {
        let values: Vec<&Value> = all.iter().filter_map(|run| run.get(key)).collect();
        if values.is_empty() {
            Value::Null
        } else {
            median_tree(&values)
        }
    };
    json!({
        "lighthouse": server,
        "args": args,
        "aggregate": format!("median over {} run(s)", runs.len()),
        "quorum": field("quorum"),
        "heartbeats_per_s": field("heartbeats_per_s"),
        "load_heartbeats_per_s": field("load_heartbeats_per_s"),
        "runs": runs,
    })
}

/// The element-wise median of `values` (at least one): numbers give their
/// median (the first one where all are equal, keeping integers integers),
/// objects recurse on the first one's keys, anything else is the first.
fn median_tree(values: &[&Value]) -> Value {
    let first = values[0];
    if let Some(fields) = first.as_object() {
        let merged = fields
            .keys()
            .map(|key| {
                let at: Vec<&Value> = values.iter().filter_map(|v| v.get(key)).collect();
                (key.clone(), median_tree(&at))
            })
            .collect();
        return Value::Object(merged);
    }
    if values.iter().all(|v| *v == first) {
        return first.clone();
    }
    let mut numbers: Vec<f64> = values.iter().filter_map(|v| v.as_f64()).collect();
    if numbers.len() != values.len() {
        return first.clone();
    }
    numbers.sort_by(f64::total_cmp);
    let mid = numbers.len() / 2;
    let median = if numbers.len() % 2 == 1 {
        numbers[mid]
    } else {
        (numbers[mid - 1] + numbers[mid]) / 2.0
    };
    json!(median)
}

/// Writes one result object as pretty JSON to `out` (repository-relative).
pub(crate) fn write_result(out: &Path, result: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(result).context("encoding the result")?;
    std::fs::write(root().join(out), text + "\n")
        .with_context(|| format!("writing {}", out.display()))
}

/// The arguments both runs of `lighthouse_bench.py` share.
fn lighthouse_script_args(o: &Options) -> Vec<&'static str> {
    let k = usize::from(o.quick);
    let mut args = vec!["--replicas"];
    args.extend_from_slice(LIGHTHOUSE_REPLICAS);
    args.extend([
        "--rounds",
        LIGHTHOUSE_ROUNDS[k],
        "--hb-clients",
        LIGHTHOUSE_HB_CLIENTS,
        "--hb-seconds",
        LIGHTHOUSE_HB_SECONDS[k],
    ]);
    args
}

/// Where cargo puts the release build of binary `name`
/// (`$CARGO_TARGET_DIR`, else `target/`, under the repository root).
pub(crate) fn release_binary(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target"));
    root().join(target).join("release").join(name)
}

/// A lighthouse program the bench starts: Ferry's or torchft's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LighthouseProgram {
    /// `ferry-lighthouse`, the release build.
    Ferry,
    /// `torchft_lighthouse`, the program torchft installs in the `.venv`
    /// (torchft's Rust lighthouse behind a Python entry point).
    Torchft,
}

impl LighthouseProgram {
    fn name(self) -> &'static str {
        match self {
            LighthouseProgram::Ferry => "ferry-lighthouse",
            LighthouseProgram::Torchft => "torchft_lighthouse",
        }
    }

    fn binary(self) -> PathBuf {
        match self {
            LighthouseProgram::Ferry => release_binary("ferry-lighthouse"),
            LighthouseProgram::Torchft => venv_python().with_file_name("torchft_lighthouse"),
        }
    }

    /// The arguments it runs with: [`LIGHTHOUSE_BIND`], then
    /// [`LIGHTHOUSE_OPTIONS`] (torchft's spellings, which both accept).
    fn args() -> Vec<&'static str> {
        [&["--bind", LIGHTHOUSE_BIND][..], LIGHTHOUSE_OPTIONS].concat()
    }

    /// How the result files name the server.
    fn command_line(self) -> String {
        format!("{} {}", self.name(), Self::args().join(" "))
    }

    /// The URL to reach it at, from one line of its output, if that line
    /// tells where it listens: `ferry-lighthouse` prints
    /// `ferry-lighthouse listening on http://ADDR` as its first line of
    /// stdout; `torchft_lighthouse` logs `... Lighthouse listening on:
    /// http://HOSTNAME:PORT` to stderr, with the machine's host name in
    /// place of the address it bound, so the URL is 127.0.0.1 and that port.
    fn parse_address(self, line: &str) -> Option<String> {
        match self {
            LighthouseProgram::Ferry => {
                let url = line.trim().strip_prefix("ferry-lighthouse listening on ")?;
                (url.starts_with("http://") && url.len() > "http://".len()).then(|| url.to_string())
            }
            LighthouseProgram::Torchft => {
                let (_, url) = line.split_once("Lighthouse listening on: ")?;
                let (_, port) = url.trim().strip_prefix("http://")?.rsplit_once(':')?;
                let port: u16 = port.parse().ok()?;
                (port != 0).then(|| format!("http://127.0.0.1:{port}"))
            }
        }
    }
}

/// Where both lighthouse programs listen in the bench (a free port).
const LIGHTHOUSE_BIND: &str = "127.0.0.1:0";

/// A running lighthouse program on 127.0.0.1 (port 0), its stderr (its
/// log) going to a file, killed when dropped.
struct LighthouseProcess {
    program: LighthouseProgram,
    child: Child,
    /// `http://127.0.0.1:PORT`.
    url: String,
}

impl LighthouseProcess {
    /// Starts `program` with [`LighthouseProgram::args`], its output (both
    /// streams) going to `log` (relative to the repository root), and waits
    /// for the address it tells: on stdout for `ferry-lighthouse`, in its
    /// log on stderr for `torchft_lighthouse`.
    fn start(program: LighthouseProgram, log: &Path) -> Result<Self> {
        let name = program.name();
        let binary = program.binary();
        let log_file = std::fs::File::create(root().join(log))
            .with_context(|| format!("creating {}", log.display()))?;
        let args = LighthouseProgram::args();
        let mut c = Command::new(&binary);
        c.current_dir(root())
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        eprintln!(
            "    $ {} {}  (log: {})",
            binary.display(),
            args.join(" "),
            log.display()
        );
        let mut child = c
            .spawn()
            .with_context(|| format!("could not start {}", binary.display()))?;
        // One thread per stream copies its lines to the log and sends the
        // address once a complete line tells it. When both streams end (the
        // program exited) the channel disconnects.
        let (tx, rx) = mpsc::channel();
        let streams: [Box<dyn Read + Send>; 2] = [
            Box::new(
                child
                    .stdout
                    .take()
                    .with_context(|| format!("{name}'s stdout"))?,
            ),
            Box::new(
                child
                    .stderr
                    .take()
                    .with_context(|| format!("{name}'s stderr"))?,
            ),
        ];
        for stream in streams {
            let tx = tx.clone();
            let mut log_file = log_file.try_clone().context("the lighthouse log")?;
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    let _ = writeln!(log_file, "{line}");
                    if let Some(url) = program.parse_address(&line) {
                        let _ = tx.send(url);
                    }
                }
            });
        }
        drop(tx);
        let url = match rx.recv_timeout(LIGHTHOUSE_START_TIMEOUT) {
            Ok(url) => url,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "{name} told no address within {LIGHTHOUSE_START_TIMEOUT:?} (log: {}){}",
                    log.display(),
                    log_tail(log)
                )
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = child.wait().context("waiting for the lighthouse")?;
                bail!(
                    "{name} exited before listening ({status}; log: {}){}",
                    log.display(),
                    log_tail(log)
                )
            }
        };
        eprintln!("    {name} listening on {url}");
        Ok(LighthouseProcess {
            program,
            child,
            url,
        })
    }

    /// Kills it, saying so if it had already exited (it should run until killed).
    fn stop(mut self) -> Result<()> {
        let name = self.program.name();
        if let Ok(Some(status)) = self.child.try_wait() {
            bail!("{name} exited during the bench ({status})");
        }
        self.child
            .kill()
            .with_context(|| format!("killing {name}"))
            .and_then(|()| {
                self.child
                    .wait()
                    .with_context(|| format!("waiting for {name}"))
            })?;
        Ok(())
    }
}

impl Drop for LighthouseProcess {
    fn drop(&mut self) {
        // Already reaped after `stop`: then both calls fail harmlessly.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `lighthouse_bench.py` with `args` in the `.venv` (its log, stderr,
/// going to `log`), bounded by [`LIGHTHOUSE_SCRIPT_TIMEOUT`], and returns
/// the JSON object it prints.
fn run_lighthouse_script(script: &Path, args: &[&str], log: &Path) -> Result<Value> {
    let log_file = std::fs::File::create(root().join(log))
        .with_context(|| format!("creating {}", log.display()))?;
    let py = venv_python();
    let mut c = cmd(&py.to_string_lossy(), &[]);
    c.arg(script)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log_file);
    eprintln!(
        "    $ {} {} {}  (log: {})",
        py.display(),
        script.display(),
        args.join(" "),
        log.display()
    );
    let stdout = run_bounded(&mut c, LIGHTHOUSE_SCRIPT_TIMEOUT).map_err(|e| {
        anyhow::anyhow!(
            "lighthouse_bench.py failed: {e:#} (log: {}){}",
            log.display(),
            log_tail(log)
        )
    })?;
    let result = last_json_object(&stdout).with_context(|| {
        format!(
            "lighthouse_bench.py printed no JSON object (stdout: {stdout:?}; log: {})",
            log.display()
        )
    })?;
    eprintln!("    {}", stdout.trim());
    Ok(result)
}

/// Runs the heartbeat load generator (`lighthouse_load`, release build)
/// against the lighthouse at `url` with [`LIGHTHOUSE_LOAD_SHAPES`],
/// bounded by [`LIGHTHOUSE_SCRIPT_TIMEOUT`], and returns the JSON object it
/// prints.
fn run_lighthouse_load(url: &str, o: &Options) -> Result<Value> {
    let seconds = LIGHTHOUSE_LOAD_SECONDS[usize::from(o.quick)];
    let mut args = vec!["--addr", url, "--seconds", seconds, "--shapes"];
    args.extend_from_slice(LIGHTHOUSE_LOAD_SHAPES);
    let binary = release_binary("lighthouse_load");
    eprintln!("    $ {} {}", binary.display(), args.join(" "));
    let mut c = cmd(&binary.to_string_lossy(), &args);
    c.stdin(Stdio::null()).stdout(Stdio::piped());
    let stdout = run_bounded(&mut c, LIGHTHOUSE_SCRIPT_TIMEOUT)
        .map_err(|e| anyhow::anyhow!("lighthouse_load failed: {e:#}"))?;
    let result = serde_json::from_str::<Value>(stdout.trim())
        .ok()
        .filter(Value::is_object)
        .with_context(|| format!("lighthouse_load printed no JSON object (stdout: {stdout:?})"))?;
    eprintln!("    {result}");
    Ok(result)
}

/// The last lines of the log at `log` (repository-relative), to quote in
/// an error; empty if there is nothing to read.
fn log_tail(log: &Path) -> String {
    const LINES: usize = 15;
    let text = std::fs::read_to_string(root().join(log)).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = &lines[lines.len().saturating_sub(LINES)..];
    if tail.is_empty() {
        String::new()
    } else {
        format!(", its last lines:\n{}", tail.join("\n"))
    }
}

/// Runs `c` (stdout piped) to its end and returns its stdout; kills it
/// after `limit`. Fails if it does not exit with success.
fn run_bounded(c: &mut Command, limit: Duration) -> Result<String> {
    let mut child = c.spawn().context("could not start the command")?;
    let mut stdout = child.stdout.take().context("the command's stdout")?;
    // Its stdout ends when it exits: the reader's message is the wait.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = tx.send(stdout.read_to_string(&mut text).map(|_| text));
    });
    let text = match rx.recv_timeout(limit) {
        Ok(text) => text.context("reading the command's stdout")?,
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            bail!("still running after {limit:?}: killed");
        }
    };
    let status = child.wait().context("waiting for the command")?;
    if !status.success() {
        bail!("exited with {status}");
    }
    Ok(text)
}

/// The last line of `text` that is a JSON object.
fn last_json_object(text: &str) -> Option<Value> {
    text.lines()
        .rev()
        .filter_map(|line| serde_json::from_str::<Value>(line.trim()).ok())
        .find(Value::is_object)
}

/// Row specs for the lighthouse table: the quorum latency after the last
/// request for each replica count found on either side (ascending), then
/// heartbeats handled per second under each load generator shape
/// ([`LIGHTHOUSE_LOAD_SHAPES`]), all with [`LIGHTHOUSE_TARGET`]; then,
/// without a target, heartbeats per second from torchft's own client (which
/// spends three to four times the server's CPU per heartbeat, so on a small
/// machine it measures the client) and the span from the first quorum
/// request to the last answer.
pub(crate) fn lighthouse_specs(ferry: &Value, peer: Option<&Value>) -> Vec<RowSpec> {
    let mut counts: Vec<u64> = Vec::new();
    for result in std::iter::once(ferry).chain(peer) {
        let quorum = result.get("quorum").and_then(Value::as_object);
        for n in quorum.into_iter().flat_map(|q| q.keys()) {
            if let Ok(n) = n.parse::<u64>() {
                if !counts.contains(&n) {
                    counts.push(n);
                }
            }
        }
    }
    counts.sort_unstable();
    let quorum = |n: u64, field: &str| Metric::At(format!("/quorum/{n}/{field}"));
    let mut specs: Vec<RowSpec> = counts
        .iter()
        .map(|&n| {
            RowSpec::new(
                format!("quorum, {n} replicas: after last request, median"),
                "ms",
                Better::Lower,
                quorum(n, "after_last_request_ms_median"),
            )
            .with_target(LIGHTHOUSE_TARGET)
        })
        .collect();
    specs.extend(LIGHTHOUSE_LOAD_SHAPES.iter().map(|shape| {
        let (connections, in_flight) = shape.split_once('x').unwrap_or((shape, "1"));
        RowSpec::new(
            format!(
                "heartbeats handled, {connections} connections x {in_flight} in flight \
                 (lighthouse_load)"
            ),
            "hb/s",
            Better::Higher,
            Metric::At(format!("/load_heartbeats_per_s/{shape}")),
        )
        .with_target(LIGHTHOUSE_TARGET)
    }));
    specs.push(RowSpec::new(
        format!(
            "heartbeats, torchft's client, {LIGHTHOUSE_HB_CLIENTS} threads back to back \
             (client-bound)"
        ),
        "hb/s",
        Better::Higher,
        Metric::At("/heartbeats_per_s".into()),
    ));
    specs.extend(counts.iter().map(|&n| {
        RowSpec::new(
            format!("quorum, {n} replicas: first request to all answered, median"),
            "ms",
            Better::Lower,
            quorum(n, "first_to_all_done_ms_median"),
        )
    }));
    specs
}

/// One side-by-side benchmark: Ferry's binary and the peer's script, run
/// with the same settings, then their comparison table.
struct Comparison<'a> {
    /// The table's name and the stem of the result files in
    /// `target/ferry-bench/`: `ferry_<name>.json`, `peer_<name>.json` and
    /// the table's `<name>.json`.
    name: &'a str,
    /// Cargo's package and target selection for Ferry's side, as given to
    /// `cargo run --release` (e.g. `-p ferry-benches --bin rpc_latency`).
    ferry_target: &'a [&'a str],
    /// Whether Ferry's side links libtorch: it then builds and runs against
    /// the `.venv`'s PyTorch ([`with_libtorch`]).
    libtorch: bool,
    /// Arguments of Ferry's binary, after `--quick` and before `--out`.
    ferry_args: &'a [&'a str],
    /// The peer script's file name in the peers directory.
    peer_script: &'a str,
    /// Arguments of the peer script, before `--quick` and `--out`.
    peer_args: &'a [&'a str],
    /// The line(s) printed above the table.
    heading: &'a str,
    /// The table's rows, from Ferry's result and the peer's (if there).
    specs: fn(&Value, Option<&Value>) -> Vec<RowSpec>,
    /// Runs each side more than once; without it, once, and a side's
    /// result is that run's.
    repeat: Option<Repeat>,
}

/// How a [`Comparison`] repeats its sides.
struct Repeat {
    /// How many times each side runs ([`sides_in_order`]).
    runs: usize,
    /// A side's result over its runs (each run's own result, in order).
    over_runs: fn(Vec<Value>) -> Value,
}

/// Which side goes first in run `run` (from 1), then the other: `true` is
/// Ferry's. They alternate, so that a drift in the machine's speed does not
/// always favour the same side.
pub(crate) fn sides_in_order(run: usize) -> [bool; 2] {
    let ferry_first = run % 2 == 1;
    [ferry_first, !ferry_first]
}

impl Comparison<'_> {
    /// The steps `ferry: <name>`, `peer: <script> (PyTorch RPC)` (where the
    /// script is there) and `table: <name>`; under `--table-only`, only
    /// the table.
    fn run(&self, steps: &mut Steps, o: &Options, peers: Option<&Path>) -> Result<()> {
        if !o.table_only {
            let ferry_out = self.out_path("ferry_");
            let peer_out = self.out_path("peer_");
            // Files left from an earlier run must not pose as this run's.
            remove_stale(&ferry_out)?;
            remove_stale(&peer_out)?;
            let script = peer_script(peers, self.peer_script);
            let runs = self.repeat.as_ref().map_or(1, |r| r.runs);
            // Each run's result (when repeating), read before the next run
            // overwrites it.
            let read = |out: &Path| -> Result<Option<Value>> {
                self.repeat
                    .as_ref()
                    .map(|_| table::read_result(&root().join(out)))
                    .transpose()
            };
            let (mut ferry_runs, mut peer_runs) = (Vec::new(), Vec::new());
            for i in 1..=runs {
                let of = if self.repeat.is_some() {
                    format!(" (run {i}/{runs})")
                } else {
                    String::new()
                };
                for ferry_side in sides_in_order(i) {
                    if ferry_side {
                        steps.step(&format!("ferry: {}{of}", self.name), || {
                            self.run_ferry(o, &ferry_out)
                        })?;
                        ferry_runs.extend(read(&ferry_out)?);
                    } else if let Some(script) = &script {
                        let name = format!("peer: {} (PyTorch RPC){of}", self.peer_script);
                        steps.step(&name, || self.run_peer(o, script, &peer_out))?;
                        peer_runs.extend(read(&peer_out)?);
                    }
                }
            }
            if let Some(repeat) = &self.repeat {
                for (runs, out) in [(ferry_runs, &ferry_out), (peer_runs, &peer_out)] {
                    if !runs.is_empty() {
                        write_result(out, &(repeat.over_runs)(runs))?;
                    }
                }
            }
        }

        self.table(steps, o)
    }

    /// One run of Ferry's side, its result written to `out`.
    fn run_ferry(&self, o: &Options, out: &Path) -> Result<()> {
        let mut c = cargo(&["run", "--release"]);
        c.args(self.ferry_target).arg("--");
        if self.libtorch {
            with_libtorch(&mut c);
        }
        if o.quick {
            c.arg("--quick");
        }
        c.args(self.ferry_args);
        c.arg("--out").arg(out);
        run(&mut c)
    }

    /// One run of the peer's `script`, its result written to `out`.
    fn run_peer(&self, o: &Options, script: &Path, out: &Path) -> Result<()> {
        let py = venv_python();
        let mut c = cmd(&py.to_string_lossy(), &[]);
        c.arg(script).args(self.peer_args);
        if o.quick {
            c.arg("--quick");
        }
        c.arg("--out").arg(out);
        run(&mut c).context("the peer benchmark failed (`--no-peer` skips it)")
    }

    /// `target/ferry-bench/<prefix><name>.json`.
    fn out_path(&self, prefix: &str) -> PathBuf {
        out_path(&format!("{prefix}{}.json", self.name))
    }

    /// The step `table: <name>` ([`Table::run`]).
    fn table(&self, steps: &mut Steps, o: &Options) -> Result<()> {
        Table {
            name: self.name,
            heading: self.heading,
            specs: self.specs,
        }
        .run(steps, o)
    }
}

/// A comparison table built from the two result files a side-by-side
/// benchmark left in `target/ferry-bench/`: `ferry_<name>.json` and (if
/// there) `peer_<name>.json`, written as `<name>.json`.
struct Table<'a> {
    name: &'a str,
    /// The line(s) printed above the table.
    heading: &'a str,
    /// The table's rows, from Ferry's result and the peer's (if there).
    specs: fn(&Value, Option<&Value>) -> Vec<RowSpec>,
}

impl Table<'_> {
    /// `target/ferry-bench/<prefix><name>.json`.
    fn out_path(&self, prefix: &str) -> PathBuf {
        out_path(&format!("{prefix}{}.json", self.name))
    }

    /// The step `table: <name>`: reads both results (the peer's if there),
    /// prints the table and writes its JSON. Under `--table-only`, a
    /// missing Ferry result skips the table.
    fn run(&self, steps: &mut Steps, o: &Options) -> Result<()> {
        let (ferry_out, peer_out, table_out) = (
            self.out_path("ferry_"),
            self.out_path("peer_"),
            self.out_path(""),
        );
        steps.step_with(&format!("table: {}", self.name), || {
            let ferry_path = root().join(&ferry_out);
            if o.table_only && !ferry_path.is_file() {
                eprintln!("    no {}: skipping this table", ferry_out.display());
                return Ok("skipped");
            }
            let ferry = table::read_result(&ferry_path)?;
            let peer_path = root().join(&peer_out);
            let peer = if !o.no_peer && peer_path.is_file() {
                Some(table::read_result(&peer_path)?)
            } else {
                None
            };
            let rows = table::compare(&ferry, peer.as_ref(), &(self.specs)(&ferry, peer.as_ref()));
            println!("\n{}\n", self.heading);
            print!("{}", table::render(&rows));
            table::write_json(&root().join(&table_out), &rows)?;
            println!("\nwritten: {}", table_out.display());
            Ok("ok")
        })
    }
}

/// Row specs for the RRef overhead table: per size found on either side
/// (Ferry's order first, matched by bytes), the tensor and RRef medians and
/// their difference, then both means with their standard deviations and
/// the difference of the means.
pub(crate) fn rref_overhead_specs(ferry: &Value, peer: Option<&Value>) -> Vec<RowSpec> {
    let mut sizes: Vec<(String, Value)> = Vec::new(); // (size label, bytes)
    for result in std::iter::once(ferry).chain(peer) {
        let list = result.get("rows").and_then(Value::as_array);
        for row in list.into_iter().flatten() {
            let size = row.get("size").and_then(Value::as_str).unwrap_or("?");
            let bytes = row.get("bytes").cloned().unwrap_or(Value::Null);
            if !sizes.iter().any(|(_, b)| b.as_f64() == bytes.as_f64()) {
                sizes.push((size.to_string(), bytes));
            }
        }
    }
    let mut specs = Vec::new();
    for (size, bytes) in sizes {
        let field = |f: &str| Metric::InList {
            list: "/rows".into(),
            matching: vec![("bytes".into(), bytes.clone())],
            field: f.into(),
        };
        let row = |case: &str, f: &str| {
            RowSpec::new(format!("{size} {case}"), "ms", Better::Lower, field(f))
        };
        specs.push(row("tensor median", "/tensor/median_ms"));
        specs.push(row("rref median", "/rref/median_ms"));
        specs.push(row("rref-tensor median", "/rref_minus_tensor_median_ms"));
        specs.push(row("tensor mean±std", "/tensor/mean_ms").with_std(field("/tensor/std_ms")));
        specs.push(row("rref mean±std", "/rref/mean_ms").with_std(field("/rref/std_ms")));
        specs.push(row("rref-tensor mean", "/rref_minus_tensor_mean_ms"));
    }
    specs
}

/// The overheads of one autograd run (a result of either side), each
/// inferred from that run's own column medians as the paper does: RPC
/// forward (nograd-fwd − norpc-fwd), distributed autograd forward
/// (grad-fwd − nograd-fwd), backward as the peer reports it (grad-bwd −
/// norpc-bwd) and as the paper infers it (also minus the RPC forward
/// overhead), and the optimizer step over its local reference
/// (dist-optim-step − norpc-step, Ferry's only). `null` where a column is
/// missing.
fn autograd_inferred(run: &Value) -> Value {
    let median = |col: &str| {
        run.pointer(&format!("/columns/{col}/median_ms"))
            .and_then(Value::as_f64)
    };
    let sum = |terms: &[(f64, &str)]| -> Value {
        terms
            .iter()
            .map(|&(k, col)| median(col).map(|m| k * m))
            .sum::<Option<f64>>()
            .map_or(Value::Null, |v| json!(v))
    };
    json!({
        "rpc_fwd_ms": sum(&[(1.0, "nograd-fwd"), (-1.0, "norpc-fwd")]),
        "fwd_ms": sum(&[(1.0, "grad-fwd"), (-1.0, "nograd-fwd")]),
        "bwd_ms": sum(&[(1.0, "grad-bwd"), (-1.0, "norpc-bwd")]),
        "bwd_paper_ms": sum(&[
            (1.0, "grad-bwd"),
            (-1.0, "norpc-bwd"),
            (-1.0, "nograd-fwd"),
            (1.0, "norpc-fwd"),
        ]),
        "step_over_local_ms": sum(&[(1.0, "dist-optim-step"), (-1.0, "norpc-step")]),
    })
}

/// One side's autograd result over its runs (at least one): every column
/// statistic and every inferred overhead ([`autograd_inferred`], paired
/// within a run) replaced by its median over the runs ([`median_tree`]),
/// with the first run's `config` and each run's own result under `runs`.
fn autograd_over_runs(runs: Vec<Value>) -> Value {
    let per_run: Vec<Value> = runs
        .iter()
        .map(|r| json!({"columns": r["columns"].clone(), "inferred": autograd_inferred(r)}))
        .collect();
    let all: Vec<&Value> = per_run.iter().collect();
    let mut result = median_tree(&all);
    result["aggregate"] = json!(format!("median over {} run(s)", runs.len()));
    result["config"] = runs[0]["config"].clone();
    result["runs"] = json!(runs);
    result
}

/// Row specs for the distributed autograd table (the paper's Table 2),
/// from [`autograd_over_runs`] results: the median of each column, then the
/// inferred overheads ([`autograd_inferred`]). The three figures the issue
/// sets a target for carry [`AUTOGRAD_TARGET`]: the optimizer step and the
/// forward and backward overheads as the peer defines them. The paper's
/// backward overhead (the peer's minus the RPC forward overhead) is shown
/// without one: the backward figure is the peer's definition.
pub(crate) fn autograd_overhead_specs(_ferry: &Value, _peer: Option<&Value>) -> Vec<RowSpec> {
    let row = |case: &str, ptr: String| RowSpec::new(case, "ms", Better::Lower, Metric::At(ptr));
    let column = |col: &str| {
        row(
            &format!("{col} median"),
            format!("/columns/{col}/median_ms"),
        )
    };
    let inferred = |case: &str, key: &str| row(case, format!("/inferred/{key}"));
    let mut specs: Vec<RowSpec> = [
        "norpc-fwd",
        "nograd-fwd",
        "grad-fwd",
        "norpc-bwd",
        "grad-bwd",
        "norpc-step",
    ]
    .into_iter()
    .map(column)
    .collect();
    specs.push(column("dist-optim-step").with_target(AUTOGRAD_TARGET));
    specs.push(inferred(
        "rpc fwd overhead (nograd-fwd - norpc-fwd)",
        "rpc_fwd_ms",
    ));
    specs.push(
        inferred(
            "dist autograd fwd overhead (grad-fwd - nograd-fwd)",
            "fwd_ms",
        )
        .with_target(AUTOGRAD_TARGET),
    );
    specs.push(
        inferred(
            "dist autograd bwd overhead (grad-bwd - norpc-bwd)",
            "bwd_ms",
        )
        .with_target(AUTOGRAD_TARGET),
    );
    specs.push(inferred(
        "dist autograd bwd overhead, paper (also - rpc fwd overhead)",
        "bwd_paper_ms",
    ));
    specs.push(inferred(
        "dist optimizer step over local (dist-optim-step - norpc-step)",
        "step_over_local_ms",
    ));
    specs
}

/// Row specs for the RPC latency table: three rows per (func, size) cell
/// found on either side (Ferry's order first), then empty-call throughput.
pub(crate) fn rpc_latency_specs(ferry: &Value, peer: Option<&Value>) -> Vec<RowSpec> {
    let mut cells: Vec<(String, String, Value)> = Vec::new(); // (func, size label, bytes)
    for result in std::iter::once(ferry).chain(peer) {
        let list = result.get("cells").and_then(Value::as_array);
        for cell in list.into_iter().flatten() {
            let func = cell.get("func").and_then(Value::as_str).unwrap_or("?");
            let size = cell.get("size").and_then(Value::as_str).unwrap_or("?");
            let bytes = cell.get("bytes").cloned().unwrap_or(Value::Null);
            let seen = cells
                .iter()
                .any(|(f, _, b)| f == func && b.as_f64() == bytes.as_f64());
            if !seen {
                cells.push((func.to_string(), size.to_string(), bytes));
            }
        }
    }
    let mut specs = Vec::new();
    for (func, size, bytes) in cells {
        let field = |f: &str| Metric::InList {
            list: "/cells".into(),
            matching: vec![
                ("func".into(), Value::from(func.clone())),
                ("bytes".into(), bytes.clone()),
            ],
            field: f.into(),
        };
        let median = RowSpec::new(
            format!("{func} {size} rpc_sync median"),
            "ms",
            Better::Lower,
            field("/rpc_sync/median_ms"),
        );
        specs.push(match bytes.as_f64().and_then(rpc_target) {
            Some(t) => median.with_target(t),
            None => median,
        });
        specs.push(RowSpec::new(
            format!("{func} {size} rpc_sync p90"),
            "ms",
            Better::Lower,
            field("/rpc_sync/p90_ms"),
        ));
        specs.push(RowSpec::new(
            format!("{func} {size} async10 per call"),
            "ms",
            Better::Lower,
            field("/async10_per_call_ms_median"),
        ));
    }
    let inflight = std::iter::once(ferry)
        .chain(peer)
        .find_map(|r| {
            r.pointer("/throughput_empty/inflight")
                .and_then(Value::as_u64)
        })
        .unwrap_or(64);
    specs.push(
        RowSpec::new(
            format!("empty calls/s, {inflight} in flight"),
            "calls/s",
            Better::Higher,
            Metric::At("/throughput_empty/median_calls_per_s".into()),
        )
        .with_target(RPC_THROUGHPUT_TARGET),
    );
    // Ferry only: what the group's secret costs, side by side: no secret,
    // records with a MAC, records sealed with an AEAD (FERRY_AUTH=encrypt).
    if ferry.pointer("/auth").is_some() {
        let sides = [
            ("no secret", "none"),
            ("MAC", "mac"),
            ("encrypt", "encrypt"),
        ];
        for (what, ptr, unit, better) in [
            ("connection set-up", "setup/median_ms", "ms", Better::Lower),
            (
                "empty round trip",
                "round_trip/median_ms",
                "ms",
                Better::Lower,
            ),
            (
                "empty calls/s, 64 in flight",
                "throughput/calls_per_s",
                "calls/s",
                Better::Higher,
            ),
            (
                "4MB round trip over mpt",
                "mpt/4MB/median_ms",
                "ms",
                Better::Lower,
            ),
            (
                "40MB round trip over mpt",
                "mpt/40MB/median_ms",
                "ms",
                Better::Lower,
            ),
        ] {
            for (label, key) in sides {
                specs.push(RowSpec::new(
                    format!("auth: {what}, {label}"),
                    unit,
                    better,
                    Metric::At(format!("/auth/{key}/{ptr}")),
                ));
            }
        }
        // The cost of each protection within a repetition, median
        // [min–max] over repetitions.
        for (label, key) in &sides[1..] {
            for (what, ratio, unit) in [
                (
                    "added per empty round trip (MAC target <= 1 us)",
                    "round_trip_added_us",
                    "us",
                ),
                (
                    "64-in-flight throughput / no secret",
                    "throughput_ratio",
                    "x",
                ),
                (
                    "4MB over mpt, time / no secret (MAC target <= 1.15)",
                    "mpt_4MB",
                    "x",
                ),
                (
                    "40MB over mpt, time / no secret (MAC target <= 1.15)",
                    "mpt_40MB",
                    "x",
                ),
            ] {
                let at = |f: &str| Metric::At(format!("/auth/ratios/{key}/{ratio}/{f}"));
                specs.push(
                    RowSpec::new(
                        format!("auth: {label}, {what}"),
                        unit,
                        Better::Lower,
                        at("median"),
                    )
                    .with_range(at("min"), at("max")),
                );
            }
        }
    }
    // Ferry only: how much one round trip of the largest tensor raised each
    // side's peak resident memory, in tensor sizes (bound: 1 + a constant).
    for side in ["caller", "callee"] {
        if ferry
            .pointer(&format!("/peak_rss/{side}_rise_tensors"))
            .is_some()
        {
            specs.push(RowSpec::new(
                format!("peak RSS rise, {side}, one round trip (tensor sizes)"),
                "x",
                Better::Lower,
                Metric::At(format!("/peak_rss/{side}_rise_tensors")),
            ));
        }
    }
    specs
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn auth_rows_show_each_protection_and_its_cost() {
        let side = |m: f64| {
            json!({"setup": {"median_ms": m}, "round_trip": {"median_ms": m / 100.0},
                   "throughput": {"calls_per_s": 1000.0 / m},
                   "mpt": {"4MB": {"median_ms": m * 10.0}, "40MB": {"median_ms": m * 100.0}}})
        };
        let cost = |r: f64| json!({"median": r, "min": r - 0.1, "max": r + 0.1});
        let ratios = |r: f64| {
            json!({"round_trip_added_us": cost(r), "throughput_ratio": cost(r),
                   "mpt_4MB": cost(r), "mpt_40MB": cost(r)})
        };
        let ferry = json!({"cells": [], "auth": {"none": side(0.2), "mac": side(0.3),
            "encrypt": side(0.4), "ratios": {"mac": ratios(1.1), "encrypt": ratios(1.3)}}});
        let specs = rpc_latency_specs(&ferry, None);
        let rows = table::compare(&ferry, None, &specs);
        let auth: Vec<(&str, Option<f64>)> = rows
            .iter()
            .filter(|r| {
                r.case.starts_with("auth: connection set-up")
                    || r.case.contains("40MB over mpt, time")
            })
            .map(|r| (r.case.as_str(), r.ferry))
            .collect();
        assert_eq!(
            auth,
            [
                ("auth: connection set-up, no secret", Some(0.2)),
                ("auth: connection set-up, MAC", Some(0.3)),
                ("auth: connection set-up, encrypt", Some(0.4)),
                (
                    "auth: MAC, 40MB over mpt, time / no secret (MAC target <= 1.15)",
                    Some(1.1)
                ),
                (
                    "auth: encrypt, 40MB over mpt, time / no secret (MAC target <= 1.15)",
                    Some(1.3)
                ),
            ]
        );
        let rows_of = |prefix: &str| rows.iter().filter(|r| r.case.starts_with(prefix)).count();
        assert_eq!(rows_of("auth: "), 5 * 3 + 2 * 4);
    }

    #[test]
    fn rpc_rows_follow_the_peer_schema() {
        let ferry = json!({
            "cells": [{"func": "identity", "size": "1KB", "bytes": 1024,
                       "rpc_sync": {"median_ms": 0.1, "p10_ms": 0.09, "p90_ms": 0.2, "mean_ms": 0.12},
                       "async10_per_call_ms_median": 0.05}],
            "throughput_empty": {"inflight": 64, "median_calls_per_s": 50000.0}
        });
        let peer = json!({
            "cells": [{"func": "identity", "size": "1KB", "bytes": 1024,
                       "rpc_sync": {"median_ms": 0.3, "p90_ms": 0.4}},
                      {"func": "identity", "size": "4MB", "bytes": 4194304,
                       "rpc_sync": {"median_ms": 2.0, "p90_ms": 3.0}}],
            "throughput_empty": {"inflight": 64, "median_calls_per_s": 10000.0}
        });
        let specs = rpc_latency_specs(&ferry, Some(&peer));
        let rows = table::compare(&ferry, Some(&peer), &specs);
        let cases: Vec<&str> = rows.iter().map(|r| r.case.as_str()).collect();
        assert_eq!(
            cases,
            [
                "identity 1KB rpc_sync median",
                "identity 1KB rpc_sync p90",
                "identity 1KB async10 per call",
                "identity 4MB rpc_sync median",
                "identity 4MB rpc_sync p90",
                "identity 4MB async10 per call",
                "empty calls/s, 64 in flight",
            ]
        );
        let ratio = |i: usize| rows[i].ratio.map(|r| (r * 1000.0).round() / 1000.0);
        assert_eq!(ratio(0), Some(3.0));
        assert_eq!(ratio(1), Some(2.0));
        assert_eq!(rows[2].peer, None);
        assert_eq!(rows[3].ferry, None);
        assert_eq!(ratio(6), Some(5.0));
        assert_eq!(rows[6].unit, "calls/s");
    }

    #[test]
    fn rref_rows_follow_the_peer_schema() {
        let stats = |median: f64, mean: f64, std: f64| {
            json!({"n": 20, "mean_ms": mean, "std_ms": std, "median_ms": median,
                   "p10_ms": median, "p90_ms": median, "min_ms": median, "max_ms": median})
        };
        let ferry = json!({
            "bench": "ferry_rref_overhead",
            "rows": [{"size": "4MB", "bytes": 4194304, "reps": 20,
                      "tensor": stats(1.0, 1.5, 0.5), "rref": stats(1.25, 2.0, 0.25),
                      "rref_minus_tensor_mean_ms": 0.5, "rref_minus_tensor_median_ms": 0.25,
                      "rref_over_tensor_mean_ratio": 1.333, "wall_s": 0.1}]
        });
        let peer = json!({
            "bench": "pt_rref_overhead",
            "rows": [{"size": "4MB", "bytes": 4194304.0, "reps": 20,
                      "tensor": stats(2.0, 3.0, 1.0), "rref": stats(3.0, 4.0, 1.0),
                      "rref_minus_tensor_mean_ms": 1.0, "rref_minus_tensor_median_ms": 1.0,
                      "rref_over_tensor_mean_ratio": 1.333, "wall_s": 0.2},
                     {"size": "40MB", "bytes": 41943040, "reps": 20,
                      "tensor": stats(20.0, 21.0, 2.0), "rref": stats(19.0, 20.0, 2.0),
                      "rref_minus_tensor_mean_ms": -1.0, "rref_minus_tensor_median_ms": -1.0,
                      "rref_over_tensor_mean_ratio": 0.95, "wall_s": 1.0}]
        });
        let specs = rref_overhead_specs(&ferry, Some(&peer));
        let rows = table::compare(&ferry, Some(&peer), &specs);
        let cases: Vec<&str> = rows.iter().map(|r| r.case.as_str()).collect();
        assert_eq!(
            cases,
            [
                "4MB tensor median",
                "4MB rref median",
                "4MB rref-tensor median",
                "4MB tensor mean±std",
                "4MB rref mean±std",
                "4MB rref-tensor mean",
                "40MB tensor median",
                "40MB rref median",
                "40MB rref-tensor median",
                "40MB tensor mean±std",
                "40MB rref mean±std",
                "40MB rref-tensor mean",
            ]
        );
        assert!(rows.iter().all(|r| r.unit == "ms"));
        assert_eq!(rows[0].ratio, Some(2.0));
        assert_eq!(rows[1].ratio, Some(2.4));
        assert_eq!(rows[2].ratio, Some(4.0));
        assert_eq!((rows[3].ferry, rows[3].ferry_std), (Some(1.5), Some(0.5)));
        assert_eq!((rows[3].peer, rows[3].peer_std), (Some(3.0), Some(1.0)));
        assert_eq!(rows[3].ratio, Some(2.0));
        assert_eq!(rows[5].ratio, Some(2.0));
        assert!(!rows[0].has_std && rows[4].has_std);
        // Only the peer has 40MB; its negative overhead has no ratio.
        assert_eq!((rows[6].ferry, rows[6].peer), (None, Some(20.0)));
        assert_eq!((rows[8].peer, rows[8].ratio), (Some(-1.0), None));
    }

    #[test]
    fn autograd_rows_follow_the_peer_schema() {
        let col = |median: f64| json!({"n": 40, "mean_ms": median, "median_ms": median});
        // The peer's schema; Ferry's adds norpc-step.
        let result = |m: [f64; 6], local_step: Option<f64>| {
            let mut r = json!({"config": {"reps": 40}, "columns": {
                "norpc-fwd": col(m[0]), "nograd-fwd": col(m[1]), "grad-fwd": col(m[2]),
                "norpc-bwd": col(m[3]), "grad-bwd": col(m[4]), "dist-optim-step": col(m[5]),
            }});
            if let Some(s) = local_step {
                r["columns"]["norpc-step"] = col(s);
            }
            r
        };
        let ferry = autograd_over_runs(vec![result(
            [1.0, 1.25, 1.375, 2.0, 2.5, 0.25],
            Some(0.125),
        )]);
        let peer = autograd_over_runs(vec![result([1.0, 2.0, 3.0, 2.0, 6.0, 0.5], None)]);
        let specs = autograd_overhead_specs(&ferry, Some(&peer));
        let rows = table::compare(&ferry, Some(&peer), &specs);
        let cases: Vec<&str> = rows.iter().map(|r| r.case.as_str()).collect();
        assert_eq!(
            cases,
            [
                "norpc-fwd median",
                "nograd-fwd median",
                "grad-fwd median",
                "norpc-bwd median",
                "grad-bwd median",
                "norpc-step median",
                "dist-optim-step median",
                "rpc fwd overhead (nograd-fwd - norpc-fwd)",
                "dist autograd fwd overhead (grad-fwd - nograd-fwd)",
                "dist autograd bwd overhead (grad-bwd - norpc-bwd)",
                "dist autograd bwd overhead, paper (also - rpc fwd overhead)",
                "dist optimizer step over local (dist-optim-step - norpc-step)",
            ]
        );
        let got = |i: usize| (rows[i].ferry, rows[i].peer, rows[i].ratio, rows[i].met);
        assert_eq!(got(2), (Some(1.375), Some(3.0), Some(3.0 / 1.375), None));
        assert_eq!(got(5), (Some(0.125), None, None, None));
        assert_eq!(got(6), (Some(0.25), Some(0.5), Some(2.0), Some(false)));
        assert_eq!(got(7), (Some(0.25), Some(1.0), Some(4.0), None));
        assert_eq!(got(8), (Some(0.125), Some(1.0), Some(8.0), Some(true)));
        assert_eq!(got(9), (Some(0.5), Some(4.0), Some(8.0), Some(true)));
        // 2.5 - 2 - 0.25 = 0.25 against 6 - 2 - 1 = 3.
        assert_eq!(got(10), (Some(0.25), Some(3.0), Some(12.0), None));
        assert_eq!(got(11), (Some(0.125), None, None, None));
        assert_eq!(rows.iter().filter(|r| r.target == Some(4.0)).count(), 3);
    }

    #[test]
    fn autograd_overheads_are_paired_within_a_run_then_the_median_over_runs() {
        let col = |median: f64| json!({"median_ms": median});
        let run = |nograd: f64, grad: f64| {
            json!({"config": {"reps": 300}, "columns": {
                "norpc-fwd": col(1.0), "nograd-fwd": col(nograd), "grad-fwd": col(grad),
            }})
        };
        // Forward overheads 0.5, 0.0 and 0.25 by run. The difference of the
        // column medians (2.0 - 2.0) would be 0; the paired median is 0.25.
        let runs = vec![run(1.0, 1.5), run(2.0, 2.0), run(3.0, 3.25)];
        let r = autograd_over_runs(runs.clone());
        assert_eq!(r["inferred"]["fwd_ms"], json!(0.25));
        assert_eq!(r["columns"]["nograd-fwd"]["median_ms"], json!(2.0));
        assert_eq!(r["columns"]["grad-fwd"]["median_ms"], json!(2.0));
        assert_eq!(r["columns"]["norpc-fwd"]["median_ms"], json!(1.0));
        // Missing columns stay missing, not zero.
        assert_eq!(r["inferred"]["bwd_ms"], Value::Null);
        assert_eq!(r["aggregate"], json!("median over 3 run(s)"));
        assert_eq!(r["config"], json!({"reps": 300}));
        assert_eq!(r["runs"], json!(runs));
    }

    #[test]
    fn options_parse() {
        let o = Options::parse(&["--quick".into()]).expect("valid");
        assert!(o.quick && !o.no_peer && !o.no_criterion && o.only.is_none());
        assert!(o.runs(Bench::Rpc) && o.runs(Bench::Rref) && o.runs(Bench::Criterion));
        assert!(Options::parse(&["--slow".into()]).is_err());
        let o = Options::parse(&["--only".into(), "rref".into(), "--quick".into()]).expect("valid");
        assert_eq!(o.only, Some(Bench::Rref));
        assert!(o.quick && o.runs(Bench::Rref) && !o.runs(Bench::Rpc));
        let err = Options::parse(&["--only".into(), "wire".into()]).expect_err("unknown name");
        assert!(
            format!("{err:#}").contains("criterion, rpc, rref"),
            "{err:#}"
        );
        assert!(Options::parse(&["--only".into()]).is_err());
        let err = Options::parse(&["--slow".into()]).expect_err("unknown option");
        assert!(
            format!("{err}").contains(
                "--only {criterion|rpc|rref|autograd|lighthouse|schedule|pipeline|ucx|cuda}"
            ),
            "{err}"
        );
        let o = Options::parse(&["--only".into(), "autograd".into()]).expect("valid");
        assert!(o.runs(Bench::Autograd) && !o.runs(Bench::Rref) && !o.runs(Bench::Criterion));
        assert!(Options::default().runs(Bench::Autograd));
        // `ucx` runs only when asked for.
        assert!(!Options::default().runs(Bench::Ucx));
        let o = Options::parse(&["--only".into(), "ucx".into()]).expect("valid");
        assert!(o.runs(Bench::Ucx) && !o.runs(Bench::Rpc));
        assert!(!Options::default().runs(Bench::Cuda));
        let o = Options::parse(&["--only".into(), "cuda".into()]).expect("valid");
        assert!(o.runs(Bench::Cuda) && !o.runs(Bench::Ucx));
        let o = Options::parse(&["--only".into(), "lighthouse".into()]).expect("valid");
        assert!(o.runs(Bench::Lighthouse) && !o.runs(Bench::Autograd) && !o.runs(Bench::Rpc));
        assert!(Options::default().runs(Bench::Lighthouse));
        let o = Options::parse(&["--only".into(), "schedule".into(), "--no-peer".into()])
            .expect("valid");
        assert_eq!(o.only, Some(Bench::Schedule));
        assert!(o.no_peer && o.runs(Bench::Schedule));
        assert!(!o.runs(Bench::Lighthouse) && !o.runs(Bench::Criterion) && !o.runs(Bench::Rpc));
        let o = Options::parse(&["--table-only".into(), "--only".into(), "schedule".into()])
            .expect("valid");
        assert!(o.table_only && o.runs(Bench::Schedule) && !o.runs(Bench::Autograd));
        assert!(Options::default().runs(Bench::Schedule));
        let o =
            Options::parse(&["--only".into(), "pipeline".into(), "--quick".into()]).expect("valid");
        assert!(o.quick && o.runs(Bench::Pipeline) && !o.runs(Bench::Schedule));
        assert!(Options::default().runs(Bench::Pipeline));
        let err = Options::parse(&["--only".into(), "schedules".into()]).expect_err("unknown");
        assert!(
            format!("{err:#}").contains("lighthouse, schedule"),
            "{err:#}"
        );
    }

    #[test]
    fn lighthouse_rows_follow_the_script_schema() {
        // As lighthouse_bench.py prints it (keys are strings, in run order).
        let result = |lat: [f64; 3], hb: f64| {
            json!({"addr": "http://127.0.0.1:1", "quorum": {
                "2": {"after_last_request_ms_median": lat[0], "first_to_all_done_ms_median": 2.0 * lat[0], "rounds": 5},
                "16": {"after_last_request_ms_median": lat[1], "first_to_all_done_ms_median": 2.0 * lat[1], "rounds": 5},
                "128": {"after_last_request_ms_median": lat[2], "first_to_all_done_ms_median": 2.0 * lat[2], "rounds": 5}},
                "heartbeats_per_s": hb,
                "load_heartbeats_per_s": {"8x1": 3.0 * hb, "8x16": 5.0 * hb}})
        };
        let ferry = result([0.5, 1.0, 8.0], 20000.0);
        let peer = result([1.0, 1.0, 4.0], 10000.0);
        let specs = lighthouse_specs(&ferry, Some(&peer));
        let rows = table::compare(&ferry, Some(&peer), &specs);
        let cases: Vec<&str> = rows.iter().map(|r| r.case.as_str()).collect();
        assert_eq!(
            cases,
            [
                "quorum, 2 replicas: after last request, median",
                "quorum, 16 replicas: after last request, median",
                "quorum, 128 replicas: after last request, median",
                "heartbeats handled, 8 connections x 1 in flight (lighthouse_load)",
                "heartbeats handled, 8 connections x 16 in flight (lighthouse_load)",
                "heartbeats, torchft's client, 8 threads back to back (client-bound)",
                "quorum, 2 replicas: first request to all answered, median",
                "quorum, 16 replicas: first request to all answered, median",
                "quorum, 128 replicas: first request to all answered, median",
            ]
        );
        let got = |i: usize| (rows[i].ferry, rows[i].peer, rows[i].ratio, rows[i].met);
        assert_eq!(got(0), (Some(0.5), Some(1.0), Some(2.0), Some(true)));
        // Equal is at least as fast.
        assert_eq!(got(1), (Some(1.0), Some(1.0), Some(1.0), Some(true)));
        assert_eq!(got(2), (Some(8.0), Some(4.0), Some(0.5), Some(false)));
        assert_eq!(
            got(3),
            (Some(60000.0), Some(30000.0), Some(2.0), Some(true))
        );
        assert_eq!(
            got(4),
            (Some(100000.0), Some(50000.0), Some(2.0), Some(true))
        );
        // torchft's own client sets its rate: shown, without a target.
        assert_eq!(got(5), (Some(20000.0), Some(10000.0), Some(2.0), None));
        assert!(rows[3..6].iter().all(|r| r.unit == "hb/s"));
        assert_eq!(got(8), (Some(16.0), Some(8.0), Some(0.5), None));
        assert_eq!(rows.iter().filter(|r| r.target == Some(1.0)).count(), 5);
        // Ferry's result alone still gives every row.
        let alone = table::compare(&ferry, None, &lighthouse_specs(&ferry, None));
        assert_eq!(alone.len(), 9);
        assert!(alone.iter().all(|r| r.ferry.is_some() && r.met.is_none()));
    }

    #[test]
    fn lighthouse_runs_reduce_to_medians() {
        let run = |lat: f64, hb: f64, addr: &str| {
            json!({"addr": addr, "quorum": {"2": {"after_last_request_ms_median": lat,
                   "first_to_all_done_ms_median": 2.0 * lat, "rounds": 5}},
                   "heartbeats_per_s": hb})
        };
        let runs = vec![
            run(0.3, 100.0, "a"),
            run(0.1, 300.0, "b"),
            run(0.2, 200.0, "c"),
        ];
        let result = median_of_runs(runs.clone(), "server", "--rounds 5");
        assert_eq!(result["quorum"]["2"]["after_last_request_ms_median"], 0.2);
        assert_eq!(result["quorum"]["2"]["first_to_all_done_ms_median"], 0.4);
        // Equal integers stay integers.
        assert_eq!(result["quorum"]["2"]["rounds"], json!(5));
        assert_eq!(result["heartbeats_per_s"], 200.0);
        assert_eq!(result["runs"], json!(runs));
        assert_eq!(
            (result["lighthouse"].as_str(), result["args"].as_str()),
            (Some("server"), Some("--rounds 5"))
        );
        // Two runs: the mean of the two; one run: itself.
        let two = median_of_runs(runs[..2].to_vec(), "s", "");
        assert_eq!(two["heartbeats_per_s"], 200.0);
        let one = median_of_runs(runs[..1].to_vec(), "s", "");
        assert_eq!(one["quorum"], runs[0]["quorum"]);
        // The table reads the medians.
        let rows = table::compare(&result, Some(&one), &lighthouse_specs(&result, Some(&one)));
        assert_eq!((rows[0].ferry, rows[0].peer), (Some(0.2), Some(0.3)));
    }

    #[test]
    fn lighthouse_script_plumbing() {
        let (ferry, torchft) = (LighthouseProgram::Ferry, LighthouseProgram::Torchft);
        assert_eq!(
            ferry.parse_address("ferry-lighthouse listening on http://127.0.0.1:41234\n"),
            Some("http://127.0.0.1:41234".to_string())
        );
        assert_eq!(ferry.parse_address("listening on http://x:1"), None);
        assert_eq!(
            ferry.parse_address("ferry-lighthouse listening on http://"),
            None
        );
        assert_eq!(ferry.parse_address(""), None);
        // torchft_lighthouse's log line names the host, not the bound address.
        assert_eq!(
            torchft.parse_address(
                "2026-11-21T03:49:32.054 [INFO] [torchft::lighthouse] - \
                 Lighthouse listening on: http://vm:41101"
            ),
            Some("http://127.0.0.1:41101".to_string())
        );
        assert_eq!(
            torchft.parse_address("[INFO] - Quorum status: New quorum not ready"),
            None
        );
        assert_eq!(
            torchft.parse_address("Lighthouse listening on: http://vm:0"),
            None
        );
        assert_eq!(
            torchft.parse_address("Lighthouse listening on: http://vm"),
            None
        );
        assert!(torchft.binary().ends_with(".venv/bin/torchft_lighthouse"));

        let text = "noise\n{\"quorum\": {}, \"heartbeats_per_s\": 1.0}\n[1]\nmore noise\n";
        assert_eq!(
            last_json_object(text),
            Some(json!({"quorum": {}, "heartbeats_per_s": 1.0}))
        );
        assert_eq!(last_json_object("no json\n[1, 2]\n"), None);

        let full = lighthouse_script_args(&Options::default()).join(" ");
        assert_eq!(
            full,
            "--replicas 2 16 128 --rounds 5 --hb-clients 8 --hb-seconds 3"
        );
        let quick = Options {
            quick: true,
            ..Options::default()
        };
        assert!(lighthouse_script_args(&quick)
            .join(" ")
            .ends_with("--rounds 3 --hb-clients 8 --hb-seconds 1"));
        // Both programs get what the script would give torchft's in-process server.
        assert_eq!(
            ferry.command_line(),
            "ferry-lighthouse --bind 127.0.0.1:0 --min_replicas 1 --join_timeout_ms 50 \
             --quorum_tick_ms 10 --heartbeat_timeout_ms 60000"
        );
        assert_eq!(
            torchft.command_line(),
            "torchft_lighthouse --bind 127.0.0.1:0 --min_replicas 1 --join_timeout_ms 50 \
             --quorum_tick_ms 10 --heartbeat_timeout_ms 60000"
        );
    }
}
