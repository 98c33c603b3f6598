//! Helpers shared by Ferry's side-by-side benchmark binaries (`rpc_latency`,
//! `rref_overhead`, and for its JSON output `lighthouse_load`): the
//! `4MB`-style size arguments and labels of the peer scripts, the float32
//! tensor both send, the peers' summary statistics, the two-process set-up,
//! and writing a result as JSON.
//!
//! The statistics follow the peer scripts in `benches/peers/` so that
//! `cargo xtask bench` can put both sides in one table.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use ferry::launch::{self, Role};
use ferry::{Function, Functions, RawTensor, RpcOptions};
use serde_json::{json, Value};

mod auth_cost;
pub use auth_cost::auth_cost;

/// Parses a size argument: bytes, with an optional case-insensitive `B`,
/// `KB`, `MB` or `GB` suffix (binary multiples, so `1KB` is 1024), and a
/// fractional count allowed with a suffix (`1.5MB`).
pub fn parse_size(s: &str) -> Result<u64> {
    let u = s.trim().to_uppercase();
    for (suffix, mult) in [
        ("KB", 1u64 << 10),
        ("MB", 1 << 20),
        ("GB", 1 << 30),
        ("B", 1),
    ] {
        if let Some(n) = u.strip_suffix(suffix) {
            return Ok((n.parse::<f64>()? * mult as f64) as u64);
        }
    }
    Ok(u.parse()?)
}

/// [`parse_size`] as a clap value parser (`value_parser = size_arg`).
pub fn size_arg(text: &str) -> std::result::Result<u64, String> {
    parse_size(text).map_err(|e| format!("{text:?} is not a size (bytes, or B/KB/MB/GB): {e}"))
}

/// The label of a size of `n` bytes, as the peer scripts write it: the
/// largest of `GB`, `MB`, `KB` that divides it evenly, else bytes (`0B`,
/// `1KB`, `4MB`, `1000B`).
pub fn size_label(n: u64) -> String {
    if n == 0 {
        return "0B".into();
    }
    for (suffix, mult) in [("GB", 1u64 << 30), ("MB", 1 << 20), ("KB", 1 << 10)] {
        if n % mult == 0 {
            return format!("{}{suffix}", n / mult);
        }
    }
    format!("{n}B")
}

/// The tensor both benchmarks send: one-dimensional float32 with `numel`
/// elements, element `i` being `(i % 1000) * 0.001` (the peers send random
/// values of the same size; the values do not matter to the timings).
pub fn test_tensor(numel: usize) -> Result<RawTensor> {
    let data: Vec<f32> = (0..numel).map(|i| (i % 1000) as f32 * 0.001).collect();
    Ok(RawTensor::from_slice(&data, &[numel as i64])?)
}

/// The `p`-quantile (`0.0..=1.0`) of the non-empty, ascending `sorted`,
/// interpolating linearly between the two nearest ranks (the peers' `pct`).
///
/// # Panics
///
/// If `sorted` is empty.
pub fn pct(sorted: &[f64], p: f64) -> f64 {
    let idx = p * (sorted.len() - 1) as f64;
    let lo = idx.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] * (1.0 - (idx - lo as f64)) + sorted[hi] * (idx - lo as f64)
}

/// Which standard deviation [`stats_ms`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Std {
    /// Divides by `n` (`statistics.pstdev`, as `pt_rpc_latency.py` uses).
    Population,
    /// Divides by `n - 1`, and is 0 for a single sample
    /// (`statistics.stdev`, as `pt_rref_overhead.py` uses).
    Sample,
}

/// Summary statistics of the durations `secs` (seconds), in milliseconds,
/// in the peers' schema: `n`, `mean_ms`, `std_ms` (of kind `std`),
/// `median_ms`, `p10_ms`, `p90_ms`, `min_ms`, `max_ms`.
///
/// # Panics
///
/// If `secs` is empty.
pub fn stats_ms(secs: &[f64], std: Std) -> Value {
    let mut ms: Vec<f64> = secs.iter().map(|s| s * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let n = ms.len();
    let mean = ms.iter().sum::<f64>() / n as f64;
    let spread = |divisor: usize| {
        (ms.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / divisor as f64).sqrt()
    };
    let std = match std {
        Std::Population => spread(n),
        Std::Sample if n > 1 => spread(n - 1),
        Std::Sample => 0.0,
    };
    json!({
        "n": n, "mean_ms": mean, "std_ms": std, "median_ms": pct(&ms, 0.5),
        "p10_ms": pct(&ms, 0.1), "p90_ms": pct(&ms, 0.9), "min_ms": ms[0], "max_ms": ms[n - 1],
    })
}

/// Returns its tensor; answered on the callee's runtime.
pub const IDENTITY: Function<RawTensor, RawTensor> = Function::new("identity");
/// Resets the callee's peak-RSS counter and returns the current RSS.
pub const RSS_RESET: Function<(), u64> = Function::new("rss_reset");
/// The callee's peak RSS since the last reset.
pub const RSS_PEAK: Function<(), u64> = Function::new("rss_peak");

/// Runs a benchmark between two processes on this host: `worker0` (rank 0,
/// the caller) and `worker1` (rank 1, the callee), launched by
/// [`launch::local`].
///
/// Both workers register `identity` (returns its tensor) and then whatever
/// `register` adds, start RPC with `timeout` for every call, and shut it
/// down once rank 0 has run `caller`. `identity` answers on the callee's
/// runtime like TensorPipe's agent answers on its thread pool: a cheap
/// function needs no extra thread hop.
///
/// Returns `caller`'s result on rank 0, and `None` on rank 1 and in the
/// launching process (once both workers have exited successfully).
pub fn two_workers(
    timeout: Duration,
    register: impl FnOnce(&mut Functions),
    caller: impl FnOnce() -> Result<Value>,
) -> Result<Option<Value>> {
    let rank = match launch::local(2)? {
        Role::Worker { rank, .. } => rank,
        Role::Launcher => return Ok(None),
    };
    let mut functions = Functions::new();
    functions.add(
        IDENTITY,
        |t| async move { Ok::<_, std::convert::Infallible>(t) },
    );
    functions.add(RSS_RESET, |()| memory::reset_peak());
    functions.add(RSS_PEAK, |()| memory::peak());
    register(&mut functions);
    ferry::init_rpc(
        RpcOptions::from_env(format!("worker{rank}"))?
            .functions(functions)
            .rpc_timeout(timeout),
    )?;
    let result = if rank == 0 { Some(caller()) } else { None };
    ferry::shutdown()?;
    result.transpose()
}

/// Resident-memory readings of this process, for the peak-RSS bound.
pub mod memory {
    /// Gives the receive pool's kept buffers back and resets the kernel's
    /// peak-RSS mark (`VmHWM`) to the current resident size; returns it.
    pub fn reset_peak() -> u64 {
        ferry::transport::BufferPool::global().trim();
        // "5" resets the peak resident set size (Linux 4.0+).
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        status_bytes("VmRSS:")
    }

    /// The peak resident set size since the last [`reset_peak`], in bytes.
    pub fn peak() -> u64 {
        status_bytes("VmHWM:")
    }

    fn status_bytes(key: &str) -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines().find_map(|l| {
                    l.strip_prefix(key)
                        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                })
            })
            .map_or(0, |kb| kb * 1024)
    }
}

/// Writes `value` as pretty-printed JSON to the file `out` (creating its
/// directory), or to stdout without one.
pub fn write_result(value: &Value, out: Option<&str>) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    match out {
        Some(path) => {
            if let Some(dir) = Path::new(path).parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(path, &text)?;
        }
        None => println!("{text}"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_label_like_the_peers() {
        assert_eq!(parse_size("0").unwrap(), 0);
        assert_eq!(parse_size("1000B").unwrap(), 1000);
        assert_eq!(parse_size(" 1kb ").unwrap(), 1 << 10);
        assert_eq!(parse_size("1.5MB").unwrap(), 3 << 19);
        assert_eq!(parse_size("2GB").unwrap(), 2 << 30);
        assert!(parse_size("MB").is_err());
        assert!(parse_size("four").is_err());
        for (bytes, label) in [
            (0, "0B"),
            (1000, "1000B"),
            (1 << 10, "1KB"),
            (4 << 20, "4MB"),
            (400 << 20, "400MB"),
            (1 << 30, "1GB"),
            (3 << 19, "1536KB"),
        ] {
            assert_eq!(size_label(bytes), label);
            assert_eq!(parse_size(label).unwrap(), bytes);
        }
    }

    #[test]
    fn percentiles_interpolate() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(pct(&v, 0.0), 1.0);
        assert_eq!(pct(&v, 0.5), 3.0);
        assert_eq!(pct(&v, 1.0), 5.0);
        assert!((pct(&v, 0.1) - 1.4).abs() < 1e-12);
        assert!((pct(&[1.0, 2.0], 0.5) - 1.5).abs() < 1e-12);
        assert_eq!(pct(&[7.0], 0.9), 7.0);
    }

    #[test]
    fn stats_follow_the_peer_schema() {
        let secs = [0.004, 0.001, 0.003, 0.002];
        let pop = stats_ms(&secs, Std::Population);
        let sample = stats_ms(&secs, Std::Sample);
        let get = |v: &Value, k: &str| v[k].as_f64().unwrap();
        assert_eq!(pop["n"], 4);
        assert!((get(&pop, "mean_ms") - 2.5).abs() < 1e-12);
        assert!((get(&pop, "median_ms") - 2.5).abs() < 1e-12);
        assert!((get(&pop, "min_ms") - 1.0).abs() < 1e-12);
        assert!((get(&pop, "max_ms") - 4.0).abs() < 1e-12);
        assert!((get(&pop, "std_ms") - 1.25f64.sqrt()).abs() < 1e-12);
        assert!((get(&sample, "std_ms") - (5.0f64 / 3.0).sqrt()).abs() < 1e-12);
        let keys = |v: &Value| {
            let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
            k.sort();
            k
        };
        assert_eq!(keys(&pop), keys(&sample));
        assert_eq!(
            keys(&pop),
            [
                "max_ms",
                "mean_ms",
                "median_ms",
                "min_ms",
                "n",
                "p10_ms",
                "p90_ms",
                "std_ms"
            ]
        );
        // One sample: no spread either way.
        assert_eq!(get(&stats_ms(&[0.5], Std::Sample), "std_ms"), 0.0);
        assert_eq!(get(&stats_ms(&[0.5], Std::Population), "std_ms"), 0.0);
    }

    #[test]
    fn test_tensor_has_the_requested_length() {
        assert_eq!(test_tensor(0).unwrap().numel(), 0);
        assert_eq!(test_tensor(1000).unwrap().numel(), 1000);
    }
}
