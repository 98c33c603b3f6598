//! Collectives: Ferry's in-process `ProcessGroup` and its Baby group (the
//! collective in a killable child) against torchft 0.2.0's
//! `ProcessGroupGloo` and `ProcessGroupBabyGloo`: allreduce time and
//! recovery from a child killed mid-allreduce.

use anyhow::Result;
use serde_json::Value;

use super::comparison::{Comparison, Repeat};
use super::doc::Part;
use super::options::Options;
use super::results::median_tree;
use crate::bench::table::{Better, Metric, RowSpec};
use crate::setup::{ensure_torchft, TORCHFT_VERSION};
use crate::steps::{cargo, run, Steps};

/// Float32 buffer sizes of the allreduce rows (the 1, 16, 64 MB).
const COLLECTIVE_SIZES: &[&str] = &["1MB", "16MB", "64MB"];
/// Runs of each side, and under `--quick`.
const COLLECTIVE_RUNS: [usize; 2] = [3, 1];
/// Ferry's Baby group against torchft's Baby Gloo: at least as fast.
const BABY_TARGET: f64 = 1.0;

/// Ferry's `collective_bench` example (with the `ferry-ft-baby` child,
/// both release) and the peer's `tf_collective.py` (torchft's own process
/// groups from the `.venv`), alternating, [`COLLECTIVE_RUNS`] times each;
/// each side's result is the element-wise median over its runs. Then the
/// table.
pub(crate) fn main(steps: &mut Steps, o: &Options) -> Result<()> {
    let runs = COLLECTIVE_RUNS[usize::from(o.quick)];
    if !o.table_only {
        if !o.no_peer {
            steps.step_with(
                &format!("setup: torchft {TORCHFT_VERSION} in .venv"),
                ensure_torchft,
            )?;
        }
        // `cargo run` below builds the example; the child is a binary of
        // its own, next to it.
        steps.step("build: ferry-ft-baby (release)", || {
            run(&mut cargo(&[
                "build",
                "--release",
                "-p",
                "ferry-ft",
                "--bin",
                "ferry-ft-baby",
            ]))
        })?;
    }
    let sizes_args = [&["--sizes"][..], COLLECTIVE_SIZES].concat();
    let [full, quick] = COLLECTIVE_RUNS;
    let heading = format!(
        "Ferry vs torchft {TORCHFT_VERSION}: allreduce (Sum) of float32 buffers, 2 replica \
         groups on one host (one process each), Ferry's ProcessGroup and BabyProcessGroup \
         (collective_bench) vs torchft's ProcessGroupGloo and ProcessGroupBabyGloo \
         (tf_collective.py)\nin-process / Gloo, Baby / Baby Gloo: one allreduce on rank 0, \
         median [p10–p90] over rounds; baby/in-process: each side's Baby median over its \
         in-process median (Ferry's target ≤1.1 at 64MB)\nrecovery: rank 0 SIGKILLs its \
         child mid-allreduce (16MB); from the kill until both replica groups have seen the \
         failure, configured the next quorum (fresh children) and allreduced again; \
         detect: from the kill to the failure seen on rank 0\neach side: median over \
         {full} runs ({quick} with --quick: see the host line), alternating\nratio > 1: \
         Ferry is better; target ≥1x: Ferry's Baby group at least as fast as torchft's \
         Baby Gloo"
    );
    Comparison {
        name: "collective",
        part: Part::Collective,
        ferry_target: &["-p", "ferry-ft", "--example", "collective_bench"],
        libtorch: false,
        ferry_args: &sizes_args,
        peer_script: "tf_collective.py",
        peer_args: &sizes_args,
        heading: &heading,
        specs: collective_specs,
        repeat: Some(Repeat { runs, over_runs }),
    }
    .run(steps, o)
}

/// A side's result over its runs: the element-wise median, each size's
/// row over the runs' rows of the same size (by `bytes`).
fn over_runs(runs: Vec<Value>) -> Value {
    let mut merged = median_tree(&runs.iter().collect::<Vec<_>>());
    let first = runs[0].get("rows").and_then(Value::as_array);
    let rows: Vec<Value> = first
        .into_iter()
        .flatten()
        .map(|row| {
            let same: Vec<&Value> = runs
                .iter()
                .filter_map(|r| r.get("rows")?.as_array())
                .filter_map(|rows| rows.iter().find(|r| r.get("bytes") == row.get("bytes")))
                .collect();
            median_tree(&same)
        })
        .collect();
    if let Some(slot) = merged.get_mut("rows") {
        *slot = Value::Array(rows);
    }
    merged
}

/// Row specs: per size (Ferry's order, then sizes only the peer has), the
/// in-process and Baby allreduce medians with their p10–p90 spread and
/// the Baby/in-process ratio; then recovery and its detection.
pub(crate) fn collective_specs(ferry: &Value, peer: Option<&Value>) -> Vec<RowSpec> {
    let mut sizes: Vec<(String, Value)> = Vec::new();
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
        let timed = |case: &str, kind: &str| {
            RowSpec::new(
                format!("{size} {case}"),
                "ms",
                Better::Lower,
                field(&format!("/{kind}/median_ms")),
            )
            .with_range(
                field(&format!("/{kind}/p10_ms")),
                field(&format!("/{kind}/p90_ms")),
            )
        };
        specs.push(timed("in-process / Gloo", "pg"));
        specs.push(timed("Baby / Baby Gloo", "baby").with_target(BABY_TARGET));
        specs.push(RowSpec::new(
            format!("{size} baby/in-process"),
            "x",
            Better::Lower,
            field("/baby_over_pg"),
        ));
    }
    let at = |p: &str| Metric::At(p.into());
    specs.push(
        RowSpec::new(
            "recovery (child killed)",
            "ms",
            Better::Lower,
            at("/recovery/median_ms"),
        )
        .with_range(at("/recovery/p10_ms"), at("/recovery/p90_ms")),
    );
    specs.push(RowSpec::new(
        "recovery: failure detected",
        "ms",
        Better::Lower,
        at("/recovery_detect/median_ms"),
    ));
    specs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::table;
    use serde_json::json;

    #[test]
    fn collective_rows_from_both_schemas() {
        let stats = |median: f64| {
            json!({"n": 5, "median_ms": median, "p10_ms": median * 0.9, "p90_ms": median * 1.1,
                   "mean_ms": median, "std_ms": 0.0, "min_ms": median, "max_ms": median})
        };
        let side = |pg: f64, baby: f64, recovery: f64| {
            json!({"rows": [{"size": "64MB", "bytes": 67108864, "pg": stats(pg),
                             "baby": stats(baby), "baby_over_pg": baby / pg}],
                   "recovery": stats(recovery), "recovery_detect": stats(recovery / 10.0)})
        };
        let ferry = side(100.0, 105.0, 40.0);
        let peer = side(120.0, 140.0, 4000.0);
        let specs = collective_specs(&ferry, Some(&peer));
        let rows = table::compare(&ferry, Some(&peer), &specs);
        let cases: Vec<&str> = rows.iter().map(|r| r.case.as_str()).collect();
        assert_eq!(
            cases,
            [
                "64MB in-process / Gloo",
                "64MB Baby / Baby Gloo",
                "64MB baby/in-process",
                "recovery (child killed)",
                "recovery: failure detected",
            ]
        );
        assert_eq!(rows[0].ratio, Some(1.2));
        assert_eq!(rows[1].met, Some(true));
        assert_eq!(rows[0].ferry_range, Some((90.0, 110.00000000000001)));
        assert_eq!(rows[3].ratio, Some(100.0));
        // Over runs: each size's row is the median of that size's rows.
        let runs = vec![
            side(100.0, 105.0, 40.0),
            side(300.0, 90.0, 50.0),
            side(110.0, 100.0, 45.0),
        ];
        let merged = over_runs(runs);
        assert_eq!(merged["rows"][0]["pg"]["median_ms"], json!(110.0));
        assert_eq!(merged["rows"][0]["baby"]["median_ms"], json!(100.0));
        assert_eq!(merged["recovery"]["median_ms"], json!(45.0));
        // Ferry alone: rows without a ratio.
        let rows = table::compare(&ferry, None, &collective_specs(&ferry, None));
        assert!(rows.iter().all(|r| r.ratio.is_none() && r.ferry.is_some()));
    }
}
