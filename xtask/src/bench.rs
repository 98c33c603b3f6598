//! `cargo xtask bench [--quick]`: criterion benches, then Ferry and the
//! PyTorch RPC peer side by side (`target/ferry-bench/`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::setup::{ensure_venv, venv_python};
use crate::steps::{cargo, cmd, root, run, Steps};
use crate::table::{self, Better, Metric, RowSpec};

/// Where results go, relative to the repository root.
const OUT_DIR: &str = "target/ferry-bench";
/// Sizes of the RPC latency cells (same labels on both sides).
const RPC_SIZES: &[&str] = &["0", "1KB", "1MB", "4MB"];
/// `cargo xtask bench --quick` must finish within this many seconds.
const QUICK_BUDGET_S: f64 = 600.0;

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
}

impl Options {
    pub(crate) fn parse(args: &[String]) -> Result<Self> {
        let mut o = Options::default();
        for a in args {
            match a.as_str() {
                "--quick" => o.quick = true,
                "--no-criterion" => o.no_criterion = true,
                "--no-peer" => o.no_peer = true,
                "--table-only" => o.table_only = true,
                other => bail!(
                    "unknown option `{other}` for `cargo xtask bench` \
                     (expected --quick, --no-criterion, --no-peer, --table-only)"
                ),
            }
        }
        Ok(o)
    }
}

/// The directory of the peer benchmark scripts (read-only), if present:
/// `$FERRY_PEERS_DIR`, else `../shared/peers` next to the repository.
fn peers_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("FERRY_PEERS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("..").join("shared").join("peers"));
    dir.join("pt_rpc_latency.py").is_file().then_some(dir)
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
                "peer scripts not found (../shared/peers/pt_rpc_latency.py or $FERRY_PEERS_DIR): \
                 skipping the peer column"
            );
        }
        found
    };
    if peers.is_some() && !o.table_only {
        steps.step_with("setup: .venv (torch, numpy)", ensure_venv)?;
    }

    if o.table_only {
        eprintln!("(--table-only: tables from the results already in {OUT_DIR})");
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

    rpc_latency(&mut steps, o, peers.as_deref())?;

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
    let ferry_out = out_path("ferry_rpc_latency.json");
    let peer_out = out_path("peer_rpc_latency.json");
    let table_out = out_path("rpc_latency.json");

    if !o.table_only {
        // A peer file left from an earlier run must not pose as this run's.
        remove_stale(&peer_out)?;
        run_rpc_latency(steps, o, peers, &ferry_out, &peer_out)?;
    }

    steps.step("table: rpc_latency", || {
        let ferry = table::read_result(&root().join(&ferry_out))?;
        let peer_path = root().join(&peer_out);
        let peer = if !o.no_peer && peer_path.is_file() {
            Some(table::read_result(&peer_path)?)
        } else {
            None
        };
        let rows = table::compare(&ferry, peer.as_ref(), &rpc_latency_specs(&ferry, peer.as_ref()));
        println!("\nFerry vs PyTorch RPC (TensorPipe), same host, CPU tensors; ratio > 1: Ferry is better\n");
        print!("{}", table::render(&rows));
        table::write_json(&root().join(&table_out), &rows)?;
        println!("\nwritten: {}", table_out.display());
        Ok(())
    })
}

fn run_rpc_latency(
    steps: &mut Steps,
    o: &Options,
    peers: Option<&Path>,
    ferry_out: &Path,
    peer_out: &Path,
) -> Result<()> {
    steps.step("ferry: rpc_latency", || {
        remove_stale(ferry_out)?;
        let mut c = cargo(&[
            "run",
            "--release",
            "-p",
            "ferry-benches",
            "--bin",
            "rpc_latency",
            "--",
        ]);
        if o.quick {
            c.arg("--quick");
        }
        c.arg("--out").arg(ferry_out);
        run(&mut c)
    })?;

    if let Some(dir) = peers {
        steps.step("peer: pt_rpc_latency.py (PyTorch RPC)", || {
            let script = dir.join("pt_rpc_latency.py");
            let py = venv_python();
            let mut c = cmd(&py.to_string_lossy(), &[]);
            c.arg(&script).args(["--funcs", "identity", "--sizes"]);
            c.args(RPC_SIZES);
            if o.quick {
                c.arg("--quick");
            }
            c.arg("--out").arg(peer_out);
            run(&mut c).context("the peer benchmark failed (`--no-peer` skips it)")
        })?;
    }
    Ok(())
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
    fn options_parse() {
        let o = Options::parse(&["--quick".into()]).expect("valid");
        assert!(o.quick && !o.no_peer && !o.no_criterion);
        assert!(Options::parse(&["--slow".into()]).is_err());
    }
}
