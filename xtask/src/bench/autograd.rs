//! The PyTorch RPC paper's Table 2: distributed autograd overhead,
//! `ferry-autograd`'s `autograd_overhead` against PyTorch RPC.

use anyhow::Result;
use serde_json::{json, Value};

use super::comparison::{Comparison, Repeat};
use super::doc::Part;
use super::options::Options;
use super::results::median_tree;
use crate::bench::table::{Better, Metric, RowSpec};
use crate::steps::Steps;

/// Ferry's target for distributed autograd: each of its overheads
/// (forward, backward, optimizer step) at most 1/4 of PyTorch's, i.e. a
/// ratio (PyTorch / Ferry) of at least 4.
const AUTOGRAD_TARGET: f64 = 4.0;
/// Runs of each side of the autograd comparison, and under `--quick`. One
/// run's medians can move by tens of percent from the next (page faults
/// on the fresh 4 MB gradients, where the threads land on the cores), and
/// an overhead is a small difference of two of them; so each
/// run's overheads are inferred from that run's own columns, and the table
/// shows their median over the runs.
const AUTOGRAD_RUNS: [usize; 2] = [5, 1];

/// Ferry's `autograd_overhead` example (`ferry-autograd`, built against the
/// `.venv`'s libtorch) and the peer's `pt_dist_autograd_overhead.py` (the
/// paper's Table 2), [`AUTOGRAD_RUNS`] times each, alternating which side
/// goes first; then the table, from each side's medians over its runs
/// ([`autograd_over_runs`]).
pub(crate) fn main(steps: &mut Steps, o: &Options) -> Result<()> {
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
        part: Part::Autograd,
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
    .run(steps, o)
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
/// inferred overheads ([`autograd_inferred`]). The three figures with a
/// target carry [`AUTOGRAD_TARGET`]: the optimizer step and the
/// forward and backward overheads as the peer defines them. The paper's
/// backward overhead (the peer's minus the RPC forward overhead) is shown
/// without one: the target's backward figure is the peer's definition.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::table;
    use serde_json::json;

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
}
