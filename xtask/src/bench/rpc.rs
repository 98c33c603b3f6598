//! RPC latency and throughput: Ferry's `rpc_latency` against PyTorch RPC
//! (TensorPipe), with what the group's secret costs (Ferry only).

use anyhow::Result;
use serde_json::Value;

use super::comparison::Comparison;
use super::doc::Part;
use super::options::Options;
use crate::bench::table::{Better, Metric, RowSpec};
use crate::steps::Steps;

/// Sizes of the RPC latency cells (same labels on both sides).
const RPC_SIZES: &[&str] = &["0", "1KB", "1MB", "4MB", "40MB", "400MB"];
/// [`RPC_SIZES`] under `--quick`.
const RPC_SIZES_QUICK: &[&str] = &["0", "1KB", "1MB", "4MB", "40MB"];
/// Ferry's targets against PyTorch RPC, as ratios PyTorch / Ferry: the empty call
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

/// Ferry's `rpc_latency` binary and the peer's `pt_rpc_latency.py`, then the table.
pub(crate) fn main(steps: &mut Steps, o: &Options) -> Result<()> {
    let sizes = if o.quick { RPC_SIZES_QUICK } else { RPC_SIZES };
    let peer_args = [&["--sizes"][..], sizes].concat();
    let ferry_args = [&["--sizes"][..], sizes].concat();
    Comparison {
        name: "rpc_latency",
        part: Part::Rpc,
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
    .run(steps, o)
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
    use crate::bench::table;
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
}
