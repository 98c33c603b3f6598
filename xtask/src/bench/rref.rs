//! The PyTorch RPC paper's Table 1: a tensor passed by value or by RRef,
//! Ferry's `rref_overhead` against PyTorch RPC.

use anyhow::Result;
use serde_json::Value;

use super::comparison::Comparison;
use super::doc::Part;
use super::options::Options;
use crate::bench::table::{Better, Metric, RowSpec};
use crate::steps::Steps;

/// Sizes of the RRef overhead rows (float32; the paper's Table 1).
const RREF_SIZES: &[&str] = &["4MB", "40MB", "400MB"];
/// [`RREF_SIZES`] under `--quick`.
const RREF_SIZES_QUICK: &[&str] = &["4MB", "40MB"];

/// Ferry's `rref_overhead` binary and the peer's `pt_rref_overhead.py`
/// (the paper's Table 1: tensor vs RRef argument), then the table.
pub(crate) fn main(steps: &mut Steps, o: &Options) -> Result<()> {
    let sizes = if o.quick {
        RREF_SIZES_QUICK
    } else {
        RREF_SIZES
    };
    let sizes_args = [&["--sizes"][..], sizes].concat();
    Comparison {
        name: "rref_overhead",
        part: Part::Rref,
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
    .run(steps, o)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::table;
    use serde_json::json;

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
}
