//! `cargo xtask bench [--quick]`: criterion benches, then Ferry and the
//! PyTorch RPC peer side by side (`target/ferry-bench/`): RPC latency
//! (`rpc_latency` / `pt_rpc_latency.py`), the paper's Table 1, tensor vs
//! RRef argument overhead (`rref_overhead` / `pt_rref_overhead.py`), and its
//! Table 2, distributed autograd overhead (`ferry-autograd`'s example
//! `autograd_overhead` / `pt_dist_autograd_overhead.py`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::setup::{ensure_venv, venv_python, with_libtorch};
use crate::steps::{cargo, cmd, root, run, Steps};
use crate::table::{self, Better, Metric, RowSpec};

/// Where results go, relative to the repository root.
const OUT_DIR: &str = "target/ferry-bench";
/// Sizes of the RPC latency cells (same labels on both sides).
const RPC_SIZES: &[&str] = &["0", "1KB", "1MB", "4MB"];
/// Sizes of the RRef overhead rows (float32; the paper's Table 1).
const RREF_SIZES: &[&str] = &["4MB", "40MB", "400MB"];
/// [`RREF_SIZES`] under `--quick`.
const RREF_SIZES_QUICK: &[&str] = &["4MB", "40MB"];
/// The target for distributed autograd: each of Ferry's overheads
/// (forward, backward, optimizer step) at most 1/4 of PyTorch's, i.e. a
/// ratio (PyTorch / Ferry) of at least 4.
const AUTOGRAD_TARGET: f64 = 4.0;
/// `cargo xtask bench --quick` must finish within this many seconds.
const QUICK_BUDGET_S: f64 = 600.0;

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
}

impl Bench {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "criterion" => Some(Bench::Criterion),
            "rpc" => Some(Bench::Rpc),
            "rref" => Some(Bench::Rref),
            "autograd" => Some(Bench::Autograd),
            _ => None,
        }
    }
}

/// What `--only` accepts, for error texts.
const ONLY_NAMES: &str = "criterion, rpc, rref, autograd";

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

    /// Whether benchmark `b` is selected (all are, without `--only`).
    fn runs(&self, b: Bench) -> bool {
        self.only.is_none_or(|only| only == b)
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
fn out_path(name: &str) -> PathBuf {
    Path::new(OUT_DIR).join(name)
}

fn remove_stale(path: &Path) -> Result<()> {
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
    let side_by_side = o.runs(Bench::Rpc) || o.runs(Bench::Rref) || o.runs(Bench::Autograd);
    // Ferry's autograd benchmark links the .venv's libtorch, peer or not.
    let needs_venv = (peers.is_some() && side_by_side) || o.runs(Bench::Autograd);
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
    let peer_args = [&["--funcs", "identity", "--sizes"][..], RPC_SIZES].concat();
    Comparison {
        name: "rpc_latency",
        ferry_target: &["-p", "ferry-benches", "--bin", "rpc_latency"],
        libtorch: false,
        ferry_args: &[],
        peer_script: "pt_rpc_latency.py",
        peer_args: &peer_args,
        heading:
            "Ferry vs PyTorch RPC (TensorPipe), same host, CPU tensors; ratio > 1: Ferry is better",
        specs: rpc_latency_specs,
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
    }
    .run(steps, o, peers)
}

/// Ferry's `autograd_overhead` example (`ferry-autograd`, built against the
/// `.venv`'s libtorch) and the peer's `pt_dist_autograd_overhead.py` (the
/// paper's Table 2), then the table.
fn autograd_overhead(steps: &mut Steps, o: &Options, peers: Option<&Path>) -> Result<()> {
    Comparison {
        name: "autograd_overhead",
        ferry_target: &["-p", "ferry-autograd", "--example", "autograd_overhead"],
        libtorch: true,
        ferry_args: &[],
        peer_script: "pt_dist_autograd_overhead.py",
        peer_args: &[],
        heading: "Ferry vs PyTorch RPC: distributed autograd overhead (the paper's Table 2), same \
                  host, two Linear(1024, 1024), batch 32, CPU float32; medians in ms\n\
                  ratio = PyTorch / Ferry (> 1: Ferry is better); overheads are differences of \
                  the medians and have a ratio only when both are positive\n\
                  target ≥4x: Ferry's overhead at most 1/4 of PyTorch's",
        specs: autograd_overhead_specs,
    }
    .run(steps, o, peers)
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
}

impl Comparison<'_> {
    /// The steps `ferry: <name>`, `peer: <script> (PyTorch RPC)` (where the
    /// script is there) and `table: <name>`; under `--table-only`, only
    /// the table.
    fn run(&self, steps: &mut Steps, o: &Options, peers: Option<&Path>) -> Result<()> {
        if !o.table_only {
            let ferry_out = self.out_path("ferry_");
            let peer_out = self.out_path("peer_");
            // A peer file left from an earlier run must not pose as this run's.
            remove_stale(&peer_out)?;
            steps.step(&format!("ferry: {}", self.name), || {
                remove_stale(&ferry_out)?;
                let mut c = cargo(&["run", "--release"]);
                c.args(self.ferry_target).arg("--");
                if self.libtorch {
                    with_libtorch(&mut c);
                }
                if o.quick {
                    c.arg("--quick");
                }
                c.args(self.ferry_args);
                c.arg("--out").arg(&ferry_out);
                run(&mut c)
            })?;
            if let Some(script) = peer_script(peers, self.peer_script) {
                let name = format!("peer: {} (PyTorch RPC)", self.peer_script);
                steps.step(&name, || {
                    let py = venv_python();
                    let mut c = cmd(&py.to_string_lossy(), &[]);
                    c.arg(&script).args(self.peer_args);
                    if o.quick {
                        c.arg("--quick");
                    }
                    c.arg("--out").arg(&peer_out);
                    run(&mut c).context("the peer benchmark failed (`--no-peer` skips it)")
                })?;
            }
        }

        self.table(steps, o)
    }

    /// `target/ferry-bench/<prefix><name>.json`.
    fn out_path(&self, prefix: &str) -> PathBuf {
        out_path(&format!("{prefix}{}.json", self.name))
    }

    /// The step `table: <name>`: reads both results (the peer's if there),
    /// prints the table and writes its JSON. Under `--table-only`, a
    /// missing Ferry result skips the table.
    fn table(&self, steps: &mut Steps, o: &Options) -> Result<()> {
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

/// Row specs for the distributed autograd table (the paper's Table 2): the
/// median of each column, then the overheads inferred from those medians on
/// each side: RPC forward (nograd-fwd − norpc-fwd), distributed autograd
/// forward (grad-fwd − nograd-fwd), distributed autograd backward as the
/// peer reports it (grad-bwd − norpc-bwd) and as the paper infers it (also
/// minus the RPC forward overhead). The optimizer step and the three
/// autograd overheads carry [`AUTOGRAD_TARGET`].
pub(crate) fn autograd_overhead_specs(_ferry: &Value, _peer: Option<&Value>) -> Vec<RowSpec> {
    let median = |col: &str| Metric::At(format!("/columns/{col}/median_ms"));
    let combination = |terms: &[(f64, &str)]| {
        Metric::Sum(terms.iter().map(|&(k, col)| (k, median(col))).collect())
    };
    let row = |case: &str, metric: Metric| RowSpec::new(case, "ms", Better::Lower, metric);
    let mut specs: Vec<RowSpec> = [
        "norpc-fwd",
        "nograd-fwd",
        "grad-fwd",
        "norpc-bwd",
        "grad-bwd",
    ]
    .iter()
    .map(|col| row(&format!("{col} median"), median(col)))
    .collect();
    specs.push(
        row("dist-optim-step median", median("dist-optim-step")).with_target(AUTOGRAD_TARGET),
    );
    specs.push(row(
        "rpc fwd overhead (nograd-fwd - norpc-fwd)",
        combination(&[(1.0, "nograd-fwd"), (-1.0, "norpc-fwd")]),
    ));
    specs.push(
        row(
            "dist autograd fwd overhead (grad-fwd - nograd-fwd)",
            combination(&[(1.0, "grad-fwd"), (-1.0, "nograd-fwd")]),
        )
        .with_target(AUTOGRAD_TARGET),
    );
    specs.push(
        row(
            "dist autograd bwd overhead (grad-bwd - norpc-bwd)",
            combination(&[(1.0, "grad-bwd"), (-1.0, "norpc-bwd")]),
        )
        .with_target(AUTOGRAD_TARGET),
    );
    specs.push(
        row(
            "dist autograd bwd overhead, paper (also - rpc fwd overhead)",
            combination(&[
                (1.0, "grad-bwd"),
                (-1.0, "norpc-bwd"),
                (-1.0, "nograd-fwd"),
                (1.0, "norpc-fwd"),
            ]),
        )
        .with_target(AUTOGRAD_TARGET),
    );
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
        specs.push(RowSpec::new(
            format!("{func} {size} rpc_sync median"),
            "ms",
            Better::Lower,
            field("/rpc_sync/median_ms"),
        ));
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
    specs.push(RowSpec::new(
        format!("empty calls/s, {inflight} in flight"),
        "calls/s",
        Better::Higher,
        Metric::At("/throughput_empty/median_calls_per_s".into()),
    ));
    specs
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
        let result = |m: [f64; 6]| {
            json!({"columns": {
                "norpc-fwd": col(m[0]), "nograd-fwd": col(m[1]), "grad-fwd": col(m[2]),
                "norpc-bwd": col(m[3]), "grad-bwd": col(m[4]), "dist-optim-step": col(m[5]),
            }})
        };
        let ferry = result([1.0, 1.25, 1.375, 2.0, 2.5, 0.25]);
        let peer = result([1.0, 2.0, 3.0, 2.0, 6.0, 0.5]);
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
                "dist-optim-step median",
                "rpc fwd overhead (nograd-fwd - norpc-fwd)",
                "dist autograd fwd overhead (grad-fwd - nograd-fwd)",
                "dist autograd bwd overhead (grad-bwd - norpc-bwd)",
                "dist autograd bwd overhead, paper (also - rpc fwd overhead)",
            ]
        );
        let got = |i: usize| (rows[i].ferry, rows[i].peer, rows[i].ratio, rows[i].met);
        assert_eq!(got(2), (Some(1.375), Some(3.0), Some(3.0 / 1.375), None));
        assert_eq!(got(5), (Some(0.25), Some(0.5), Some(2.0), Some(false)));
        assert_eq!(got(6), (Some(0.25), Some(1.0), Some(4.0), None));
        assert_eq!(got(7), (Some(0.125), Some(1.0), Some(8.0), Some(true)));
        assert_eq!(got(8), (Some(0.5), Some(4.0), Some(8.0), Some(true)));
        // 2.5 - 2 - 0.25 = 0.25 against 6 - 2 - 1 = 3.
        assert_eq!(got(9), (Some(0.25), Some(3.0), Some(12.0), Some(true)));
        assert_eq!(rows.iter().filter(|r| r.target == Some(4.0)).count(), 4);
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
            format!("{err}").contains("--only {criterion|rpc|rref|autograd}"),
            "{err}"
        );
        let o = Options::parse(&["--only".into(), "autograd".into()]).expect("valid");
        assert!(o.runs(Bench::Autograd) && !o.runs(Bench::Rref) && !o.runs(Bench::Criterion));
        assert!(Options::default().runs(Bench::Autograd));
    }
}
