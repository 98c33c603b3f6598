//! Ferry's side of the PyTorch RPC latency comparison: the same cells as
//! `benches/peers/pt_rpc_latency.py` (identity on float32 tensors, two
//! processes on 127.0.0.1), written as JSON in the same schema so
//! `cargo xtask bench` can put both in one table.
//!
//! rank 0 = caller, rank 1 = callee. Per size: `rpc_sync` round-trip latency
//! after warm-up (median/p10/p90/mean), the paper's 10 × `rpc_async` protocol,
//! and empty-call throughput with 64 calls in flight; then what the group's
//! secret costs (`auth`: connection set-up and a round trip on an
//! established connection, with and without it).
//!
//! Usage: `rpc_latency [--quick] [--sizes 0 1KB 1MB 4MB] [--out PATH]`;
//! `--latency-only` (with `--cell-seconds`) measures the cells alone, the
//! Rust figure `cargo xtask bench --only python` sets Python's against.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use ferry::{DType, RawTensor};
use ferry_benches::{
    memory, pct, size_arg, size_label, stats_ms, test_tensor, two_workers, write_result, Std,
    IDENTITY, RSS_PEAK, RSS_RESET,
};
use serde_json::{json, Value};

/// Ferry's side of the PyTorch RPC latency comparison (`pt_rpc_latency.py`).
#[derive(Debug, Parser)]
#[command(name = "rpc_latency")]
struct Args {
    /// Short cells (1 s instead of 10 s, fewer repetitions): a smoke run.
    #[arg(long)]
    quick: bool,
    /// Tensor sizes to measure (bytes, or with a B/KB/MB/GB suffix).
    #[arg(long, num_args = 1.., value_parser = size_arg, default_values = ["0", "1KB", "1MB", "4MB"])]
    sizes: Vec<u64>,
    /// Where to write the JSON result (stdout when absent).
    #[arg(long, value_name = "PATH")]
    out: Option<String>,
    /// Only what authentication costs (no secret, MAC, encrypt), in this
    /// process: `{"auth": ...}`.
    #[arg(long)]
    auth_only: bool,
    /// Only the cells (`rpc_sync` and async10 per size): no throughput,
    /// authentication or peak-RSS measurement.
    #[arg(long)]
    latency_only: bool,
    /// Seconds of `rpc_sync` calls per cell (after `--quick`'s).
    #[arg(long, value_name = "SECONDS")]
    cell_seconds: Option<f64>,
}

struct Config {
    quick: bool,
    sizes: Vec<u64>,
    cell_seconds: f64,
    min_reps: usize,
    max_reps: usize,
    warmup: usize,
    async_max_reps: usize,
    inflight: usize,
    tput_seconds: f64,
    tput_runs: usize,
    latency_only: bool,
    out: Option<String>,
}

fn config() -> Config {
    let args = Args::parse();
    let mut c = Config {
        quick: args.quick,
        sizes: args.sizes,
        cell_seconds: 10.0,
        min_reps: 5,
        max_reps: 2000,
        warmup: 20,
        async_max_reps: 200,
        inflight: 64,
        tput_seconds: 5.0,
        tput_runs: 3,
        latency_only: args.latency_only,
        out: args.out,
    };
    if args.quick {
        c.cell_seconds = 1.0;
        c.min_reps = 3;
        c.warmup = 5;
        c.tput_seconds = 1.0;
        c.tput_runs = 1;
    }
    if let Some(seconds) = args.cell_seconds {
        c.cell_seconds = seconds;
    }
    c
}

const CALLEE: u32 = 1;

fn measure_sync(t: &RawTensor, c: &Config) -> Result<Vec<f64>> {
    let start = Instant::now();
    let mut n = 0;
    while n < c.warmup || start.elapsed() < Duration::from_millis(300) {
        let s = Instant::now();
        IDENTITY.rpc_sync(CALLEE, t.clone())?;
        n += 1;
        if s.elapsed() > Duration::from_millis(500) && n >= 2 {
            break;
        }
    }
    let mut lats = Vec::new();
    let start = Instant::now();
    while lats.len() < c.max_reps
        && (lats.len() < c.min_reps || start.elapsed().as_secs_f64() < c.cell_seconds)
    {
        let s = Instant::now();
        let r = IDENTITY.rpc_sync(CALLEE, t.clone())?;
        lats.push(s.elapsed().as_secs_f64());
        drop(r);
    }
    Ok(lats)
}

fn measure_async10(t: &RawTensor, c: &Config, est_single: f64) -> Result<Vec<f64>> {
    let est = 10.0 * est_single;
    let reps = ((c.cell_seconds / est.max(1e-9)) as usize).clamp(3, c.async_max_reps);
    let ten = || -> Result<()> {
        let futures: Vec<_> = (0..10)
            .map(|_| IDENTITY.rpc_async(CALLEE, t.clone()))
            .collect();
        for f in futures {
            f.wait()?;
        }
        Ok(())
    };
    if est < 1.0 {
        ten()?;
    }
    let mut totals = Vec::with_capacity(reps);
    for _ in 0..reps {
        let s = Instant::now();
        ten()?;
        totals.push(s.elapsed().as_secs_f64());
    }
    Ok(totals)
}

fn measure_tput(c: &Config) -> Result<Value> {
    let empty = RawTensor::zeros(DType::F32, &[0])?;
    let call = || IDENTITY.rpc_async(CALLEE, empty.clone());
    let warm: Vec<_> = (0..c.inflight).map(|_| call()).collect();
    for f in warm {
        f.wait()?;
    }
    let mut runs = Vec::new();
    for _ in 0..c.tput_runs {
        let mut q = VecDeque::with_capacity(c.inflight);
        let mut done = 0u64;
        let start = Instant::now();
        while start.elapsed().as_secs_f64() < c.tput_seconds {
            while q.len() < c.inflight {
                q.push_back(call());
            }
            q.pop_front().context("queue")?.wait()?;
            done += 1;
        }
        while let Some(f) = q.pop_front() {
            f.wait()?;
            done += 1;
        }
        runs.push(done as f64 / start.elapsed().as_secs_f64());
    }
    let mut sorted = runs.clone();
    sorted.sort_by(f64::total_cmp);
    Ok(json!({
        "inflight": c.inflight, "seconds_per_run": c.tput_seconds, "runs_calls_per_s": runs,
        "median_calls_per_s": pct(&sorted, 0.5), "p10_calls_per_s": pct(&sorted, 0.1),
        "p90_calls_per_s": pct(&sorted, 0.9),
    }))
}

fn caller(c: &Config) -> Result<Value> {
    let mut cells = Vec::new();
    for &bytes in &c.sizes {
        let numel = (bytes / 4) as usize;
        let t = test_tensor(numel)?;
        let label = size_label(bytes);
        eprintln!("[ferry] identity {label} ...");
        let cell_start = Instant::now();
        let lats = measure_sync(&t, c)?;
        let sync = stats_ms(&lats, Std::Population);
        let median_s = sync["median_ms"].as_f64().unwrap_or(0.0) / 1e3;
        let mut cell = json!({
            "func": "identity", "size": label, "bytes": bytes, "numel": numel, "rpc_sync": sync,
        });
        if bytes >= 1 << 20 {
            let best = lats.iter().copied().fold(f64::INFINITY, f64::min);
            cell["eff_bandwidth_GBps_median"] = json!(2.0 * bytes as f64 / median_s / 1e9);
            cell["eff_bandwidth_GBps_best"] = json!(2.0 * bytes as f64 / best / 1e9);
        }
        let totals = measure_async10(&t, c, median_s)?;
        let a10 = stats_ms(&totals, Std::Population);
        cell["async10_per_call_ms_median"] = json!(a10["median_ms"].as_f64().unwrap_or(0.0) / 10.0);
        cell["async10_total"] = a10;
        cell["cell_wall_s"] = json!(cell_start.elapsed().as_secs_f64());
        eprintln!(
            "    rpc_sync median {:.4} ms (n={})",
            median_s * 1e3,
            lats.len()
        );
        cells.push(cell);
    }
    // The link the calls went over (a transport that could not be used
    // falls back to another: the figures say which one they measured).
    let link = ferry::rpc::agent()?.link_info(CALLEE)?.map(|l| {
        json!({
            "transport": l.transport,
            "outgoing": l.outgoing.iter().map(|c| c.channel.clone()).collect::<Vec<_>>(),
            "ucx_fallback": l.ucx_fallback.map(|f| f.to_string()),
        })
    });
    eprintln!("[ferry] link: {}", link.clone().unwrap_or(Value::Null));
    if c.latency_only {
        return Ok(json!({
            "bench": "ferry_rpc_latency",
            "config": {"quick": c.quick, "sizes": c.sizes, "cell_seconds": c.cell_seconds},
            "cells": cells,
            "link": link,
        }));
    }
    eprintln!("[ferry] throughput ...");
    let tput = measure_tput(c)?;
    eprintln!("[ferry] authentication cost ...");
    let auth = ferry_benches::auth_cost(c.quick)?;
    let peak_rss = match c.sizes.iter().copied().max() {
        Some(bytes) if bytes >= 100 << 20 => measure_peak_rss(bytes)?,
        _ => Value::Null,
    };
    Ok(json!({
        "bench": "ferry_rpc_latency",
        "config": {
            "quick": c.quick, "sizes": c.sizes, "cell_seconds": c.cell_seconds,
            "inflight": c.inflight, "tput_seconds": c.tput_seconds, "tput_runs": c.tput_runs,
        },
        "cells": cells,
        "link": link,
        "throughput_empty": tput,
        "peak_rss": peak_rss,
        "auth": auth,
    }))
}

/// How much one round trip of a `bytes` tensor raises each side's peak
/// resident memory: both sides give their pooled buffers back and reset
/// their peak mark, then one call runs. The bound is one tensor size plus a
/// constant (no hidden staging copies).
fn measure_peak_rss(bytes: u64) -> Result<Value> {
    eprintln!("[ferry] peak RSS, {} ...", size_label(bytes));
    let t = test_tensor((bytes / 4) as usize)?;
    IDENTITY.rpc_sync(CALLEE, t.clone())?;
    let callee_before = RSS_RESET.rpc_sync(CALLEE, ())?;
    let caller_before = memory::reset_peak();
    let r = IDENTITY.rpc_sync(CALLEE, t.clone())?;
    let caller_peak = memory::peak();
    let callee_peak = RSS_PEAK.rpc_sync(CALLEE, ())?;
    drop(r);
    let rise = |peak: u64, before: u64| peak.saturating_sub(before) as f64;
    Ok(json!({
        "tensor_bytes": bytes,
        "caller_before_bytes": caller_before, "caller_peak_bytes": caller_peak,
        "callee_before_bytes": callee_before, "callee_peak_bytes": callee_peak,
        "caller_rise_tensors": rise(caller_peak, caller_before) / bytes as f64,
        "callee_rise_tensors": rise(callee_peak, callee_before) / bytes as f64,
    }))
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.auth_only {
        let auth = ferry_benches::auth_cost(args.quick)?;
        return write_result(&json!({ "auth": auth }), args.out.as_deref());
    }
    let c = config();
    let result = two_workers(Duration::from_secs(900), |_| {}, || caller(&c))?;
    if let Some(value) = result {
        write_result(&value, c.out.as_deref())?;
    }
    Ok(())
}
