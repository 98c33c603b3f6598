//! Step-time statistics, computed as the peer's `stats_ms` computes them.

use serde_json::{json, Value};

/// The `p`-quantile of the ascending, non-empty `sorted`, interpolating
/// linearly (the peer's `pct`).
pub(crate) fn pct(sorted: &[f64], p: f64) -> f64 {
    let idx = p * (sorted.len() - 1) as f64;
    let lo = idx.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] * (1.0 - (idx - lo as f64)) + sorted[hi] * (idx - lo as f64)
}

/// n, median, p10, p90, mean, min and max of `values` (no unit).
pub(crate) fn stats(values: &[f64]) -> Value {
    if values.is_empty() {
        return Value::Null;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    json!({
        "n": n, "median": pct(&v, 0.5), "p10": pct(&v, 0.1), "p90": pct(&v, 0.9),
        "mean": v.iter().sum::<f64>() / n as f64, "min": v[0], "max": v[n - 1],
    })
}

/// The peer's `stats_ms` of durations in seconds: n, median, p10, p90,
/// mean, min and max in ms.
pub(crate) fn stats_ms(secs: &[f64]) -> Value {
    if secs.is_empty() {
        return Value::Null;
    }
    let mut ms: Vec<f64> = secs.iter().map(|s| s * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let n = ms.len();
    json!({
        "n": n, "median_ms": pct(&ms, 0.5), "p10_ms": pct(&ms, 0.1), "p90_ms": pct(&ms, 0.9),
        "mean_ms": ms.iter().sum::<f64>() / n as f64, "min_ms": ms[0], "max_ms": ms[n - 1],
    })
}
