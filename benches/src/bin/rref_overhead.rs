//! Ferry's side of Table 1 of the PyTorch RPC paper: the overhead of passing
//! a tensor by RRef instead of by value. Same protocol and JSON schema as
//! `benches/peers/pt_rref_overhead.py`, so `cargo xtask bench` can put both
//! in one table.
//!
//! Two processes on 127.0.0.1; rank 0 = caller `worker0` (owns the tensor),
//! rank 1 = callee `worker1`. Per size, float32:
//!
//! - Tensor: `IDENTITY.rpc_sync("worker1", t)`, which returns `t`;
//! - RRef: `rref = RRef::new(t.clone())` on the caller (untimed; the clone
//!   shares the storage), then `IDENTITY_RREF.rpc_sync("worker1", rref)`
//!   (timed), where the callee fetches the value from its owner (the caller)
//!   with `to_here` and returns it; then the RRef is dropped.
//!
//! After `--warmup` calls of each variant, the two are interleaved in blocks
//! of `--block` calls until each has `--reps` timings (`--reps-large` for
//! sizes of at least 400MB). Per variant: mean, std (sample), median, p10,
//! p90, min, max in ms; per size the RRef-minus-tensor differences.
//!
//! Usage: `rref_overhead [--quick] [--sizes 4MB 40MB 400MB] [--reps N]
//! [--reps-large N] [--warmup N] [--block N] [--out PATH]`
//! (`--quick`: 20 reps, 5 for large sizes, warm-up 2, sizes 4MB 40MB;
//! explicit options win over it).

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use clap::Parser;
use ferry::{Function, Functions, RRef, RawTensor};
use ferry_benches::{
    size_arg, size_label, stats_ms, test_tensor, two_workers, write_result, Std, IDENTITY,
};
use serde_json::{json, Value};

/// Timeout of every call and of `to_here` (a 400MB round trip is slow on a
/// busy host; a stuck call should still end the run eventually).
const TIMEOUT: Duration = Duration::from_secs(600);
/// Sizes at or above this use `reps_large` (like the peer's `--large-threshold`).
const LARGE_THRESHOLD: u64 = 400 << 20;
const CALLEE: &str = "worker1";

struct Config {
    quick: bool,
    sizes: Vec<u64>,
    reps: usize,
    reps_large: usize,
    warmup: usize,
    block: usize,
    out: Option<String>,
}

/// Ferry's side of the paper's Table 1 (`pt_rref_overhead.py`).
#[derive(Debug, Parser)]
#[command(name = "rref_overhead")]
struct Args {
    /// Fewer repetitions and no 400 MB cell: a smoke run.
    #[arg(long)]
    quick: bool,
    /// Tensor sizes (bytes, or with a B/KB/MB/GB suffix) [default: 4MB 40MB
    /// 400MB; 4MB 40MB with --quick].
    #[arg(long, num_args = 1.., value_parser = size_arg)]
    sizes: Option<Vec<u64>>,
    /// Timed calls per cell below 400 MB [default: 100; 20 with --quick].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    reps: Option<u64>,
    /// Timed calls per cell from 400 MB [default: 30; 5 with --quick].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    reps_large: Option<u64>,
    /// Untimed calls before each cell [default: 3; 2 with --quick].
    #[arg(long)]
    warmup: Option<u64>,
    /// Calls per alternation block between the two sides.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    block: u64,
    /// Where to write the JSON result (stdout when absent).
    #[arg(long, value_name = "PATH")]
    out: Option<String>,
}

fn config() -> Config {
    let args = Args::parse();
    let quick = args.quick;
    let count = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    Config {
        quick,
        sizes: args.sizes.unwrap_or_else(|| {
            if quick {
                vec![4 << 20, 40 << 20]
            } else {
                vec![4 << 20, 40 << 20, 400 << 20]
            }
        }),
        reps: args.reps.map_or(if quick { 20 } else { 100 }, count),
        reps_large: args.reps_large.map_or(if quick { 5 } else { 30 }, count),
        warmup: args.warmup.map_or(if quick { 2 } else { 3 }, count),
        block: count(args.block),
        out: args.out,
    }
}

fn call_tensor(t: &RawTensor) -> Result<f64> {
    let s = Instant::now();
    let r = IDENTITY.rpc_sync(CALLEE, t.clone())?;
    let e = s.elapsed().as_secs_f64();
    ensure!(
        r.numel() == t.numel(),
        "identity returned {} elements",
        r.numel()
    );
    Ok(e)
}

fn call_rref(t: &RawTensor) -> Result<f64> {
    // Owned by the caller; creation is local and not timed. The clone shares
    // the tensor's storage: no bytes are copied.
    let rref = RRef::new(t.clone())?;
    let s = Instant::now();
    // By value (an `Arc` clone): the callee's signature names `RRef<RawTensor>`.
    let r = IDENTITY_RREF.rpc_sync(CALLEE, rref.clone())?;
    let e = s.elapsed().as_secs_f64();
    ensure!(
        r.numel() == t.numel(),
        "identity_rref returned {} elements",
        r.numel()
    );
    drop(rref);
    Ok(e)
}

fn mean_median(v: &Value) -> (f64, f64) {
    let get = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    (get("mean_ms"), get("median_ms"))
}

fn caller(c: &Config) -> Result<Value> {
    let mut rows = Vec::new();
    for &bytes in &c.sizes {
        let reps = if bytes < LARGE_THRESHOLD {
            c.reps
        } else {
            c.reps_large
        };
        let numel = (bytes / 4) as usize;
        let t = test_tensor(numel)?;
        let label = size_label(bytes);
        eprintln!("[ferry rref] {label}: warm-up");
        for _ in 0..c.warmup {
            call_tensor(&t)?;
            call_rref(&t)?;
        }
        let (mut tensor, mut rref) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
        let c0 = Instant::now();
        while rref.len() < reps {
            let k = c.block.min(reps - rref.len());
            for _ in 0..k {
                tensor.push(call_tensor(&t)?);
            }
            for _ in 0..k {
                rref.push(call_rref(&t)?);
            }
        }
        // The peer's `stats_ms`: the std is the sample one (`statistics.stdev`).
        let (tensor, rref) = (stats_ms(&tensor, Std::Sample), stats_ms(&rref, Std::Sample));
        let (t_mean, t_median) = mean_median(&tensor);
        let (r_mean, r_median) = mean_median(&rref);
        eprintln!(
            "    tensor {t_mean:.2}±{:.2} ms  rref {r_mean:.2}±{:.2} ms",
            tensor["std_ms"].as_f64().unwrap_or(f64::NAN),
            rref["std_ms"].as_f64().unwrap_or(f64::NAN),
        );
        rows.push(json!({
            "size": label, "bytes": bytes, "reps": reps, "tensor": tensor, "rref": rref,
            "rref_minus_tensor_mean_ms": r_mean - t_mean,
            "rref_minus_tensor_median_ms": r_median - t_median,
            "rref_over_tensor_mean_ratio": r_mean / t_mean,
            "wall_s": c0.elapsed().as_secs_f64(),
        }));
    }
    Ok(json!({ "rows": rows }))
}

/// Fetches the RRef's tensor from its owner and returns it.
const IDENTITY_RREF: Function<RRef<RawTensor>, RawTensor> = Function::new("identity_rref");

fn main() -> Result<()> {
    let c = config();
    let t0 = Instant::now();
    // `identity_rref` answers on the callee's runtime like `identity`, and
    // awaits the fetch from the owner instead of blocking a thread on it.
    let register = |functions: &mut Functions| {
        functions.add(IDENTITY_RREF, |rref: RRef<RawTensor>| async move {
            rref.timeout(TIMEOUT).to_here_async().await
        });
    };
    let result = two_workers(TIMEOUT, register, || caller(&c))?;
    if let Some(mut result) = result {
        let mut value = json!({
            "bench": "ferry_rref_overhead",
            "versions": {
                "ferry": env!("CARGO_PKG_VERSION"),
                "platform": format!("{}-{}", std::env::consts::OS, std::env::consts::ARCH),
            },
            "config": {
                "quick": c.quick, "sizes": c.sizes.iter().map(|&b| size_label(b)).collect::<Vec<_>>(),
                "sizes_bytes": c.sizes, "reps": c.reps, "reps_large": c.reps_large,
                "large_threshold": LARGE_THRESHOLD, "warmup": c.warmup, "block": c.block,
            },
        });
        value["rows"] = result["rows"].take();
        value["elapsed_s"] = json!(t0.elapsed().as_secs_f64());
        write_result(&value, c.out.as_deref())?;
    }
    Ok(())
}
