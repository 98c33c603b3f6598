//! `cargo xtask bench --only pipeline`'s small-model rows: Ferry's pipeline
//! runtime against its own simulation when actions are short, as they are
//! on a GPU (0.1 to 0.5 ms), where a slow hand-off between stages shows
//! and longer actions would hide it.
//!
//! The same `pipeline_bench` example as the main rows, with 8 ×
//! (Linear(256, 256) + ReLU) and batch 64, on Interleaved1F1B and
//! ZBVZeroBubble at 4 and 8 microbatches. Per row: the measured `step`
//! over its simulation from the costs measured in the same step (target
//! ≤ [`TARGET_SIMULATED`]), and the hand-off from the send of a value to
//! the start of the action it feeds on an idle receiver (median and p90,
//! µs; target median ≤ [`TARGET_HANDOFF_US`]), with the transit and
//! wake-up medians it splits into. Each number is the median over
//! [`RUNS`] runs, with their spread.
//!
//! Under the table, the host's own floor for such a hand-off, without
//! Ferry (`benches/src/bin/wake_floor.rs`): an eventfd wake-up between two
//! processes with the receiver's core idle, and with it kept awake by a
//! yielding poller. What the hand-off measures above the floor is
//! Ferry's runtime, or the two processes' threads waiting for a core.

use std::path::{Path, PathBuf};

use anyhow::Result;
use serde_json::{json, Value};

use super::doc::{self, Part};
use super::options::Options;
use super::results::{bench_bin, out_path, remove_stale, write_result};
use crate::bench::table;
use crate::steps::{cmd, root, run, Steps};

/// The small model: width and batch (8 layers, as the main rows).
const SHAPE: &[&str] = &["--width", "256", "--batch", "64"];
/// The schedules and microbatch counts of the small rows.
const CELLS: &[&str] = &[
    "--schedules",
    "Interleaved1F1B",
    "ZBVZeroBubble",
    "--microbatches",
    "4",
    "8",
];
/// Runs, and under `--quick`.
const RUNS: [usize; 2] = [3, 1];
/// Ferry's measured step at most this multiple of its simulation.
pub(crate) const TARGET_SIMULATED: f64 = 1.2;
/// The median hand-off to an idle receiver at most this, µs.
pub(crate) const TARGET_HANDOFF_US: f64 = 50.0;

/// Runs the small rows (unless `--table-only`) and prints their table.
/// `binary` is the `pipeline_bench` example the main rows built.
pub(crate) fn main(steps: &mut Steps, o: &Options, binary: &Path) -> Result<()> {
    let pooled_out = out_path("ferry_pipeline_small.json");
    if !o.table_only {
        remove_stale(&pooled_out)?;
        let runs = RUNS[usize::from(o.quick)];
        let mut results = Vec::new();
        for i in 1..=runs {
            let out = out_path(&format!("ferry_pipeline_small.{i}.json"));
            steps.step(
                &format!("ferry: pipeline_bench, small model (run {i}/{runs})"),
                || {
                    let mut c = cmd(&binary.to_string_lossy(), SHAPE);
                    c.args(CELLS).arg("--no-baseline");
                    if o.quick {
                        c.args(["--steps", "10", "--warmup", "2"]);
                    }
                    c.arg("--out").arg(&out);
                    run(&mut c)
                },
            )?;
            results.push(table::read_result(&root().join(&out))?);
        }
        write_result(&pooled_out, &pool(&results))?;
        let floor_out = out_path(FLOOR);
        remove_stale(&floor_out)?;
        steps.step("host: wake_floor (eventfd wake-up, no Ferry)", || {
            let mut c = bench_bin("wake_floor");
            c.arg("--").arg("--out").arg(root().join(&floor_out));
            run(&mut c)
        })?;
    }
    steps.step_with("table: pipeline, small model", || {
        let path = root().join(&pooled_out);
        if o.table_only && !path.is_file() {
            eprintln!("    no {}: skipping this table", pooled_out.display());
            return Ok("skipped");
        }
        let pooled = table::read_result(&path)?;
        let floor = table::read_result(&root().join(out_path(FLOOR))).ok();
        let text = format!(
            "{}\n\n{}{}",
            heading(),
            render(&pooled),
            floor.as_ref().map(render_floor).unwrap_or_default()
        );
        println!("\n{text}");
        doc::record(Part::Pipeline, &text);
        Ok("ok")
    })
}

/// The host's floor, `wake_floor`'s result: `target/ferry-bench/{FLOOR}`.
const FLOOR: &str = "wake_floor.json";

/// The floor's lines under the table.
fn render_floor(floor: &Value) -> String {
    let line = |variant: &str, what: &str| match (
        floor[variant]["median_us"].as_f64(),
        floor[variant]["p10_us"].as_f64(),
        floor[variant]["p90_us"].as_f64(),
    ) {
        (Some(m), Some(lo), Some(hi)) => {
            format!("  {what}: {m:.1} us median [p10 {lo:.1}, p90 {hi:.1}]\n")
        }
        _ => String::new(),
    };
    format!(
        "host floor, without Ferry (wake_floor: an eventfd wake-up between two processes):\n{}{}",
        line("idle", "receiver's core idle"),
        line("busy", "receiver's core kept awake by a yielding poller")
    )
}

/// The fields of a cell pooled over the runs, as JSON pointers.
const FIELDS: &[(&str, &str)] = &[
    ("step_ms", "/pipeline_step_ms/median_ms"),
    ("simulated_ms", "/simulated_ms/median_ms"),
    (
        "step_over_simulated",
        "/pipeline_step_over_simulated/median",
    ),
    ("makespan_over_simulated", "/makespan_over_simulated/median"),
    ("handoff_median_us", "/handoff/median_us"),
    ("handoff_p90_us", "/handoff/p90_us"),
    ("transit_median_us", "/handoff/transit_median_us"),
    ("wake_median_us", "/handoff/wake_median_us"),
    ("waiting_median_us", "/handoff_waiting/median_us"),
];

/// Every cell's fields over the runs: median, least, greatest and each
/// run's value; and each run's largest action cost, ms.
pub(crate) fn pool(runs: &[Value]) -> Value {
    let mut keys: Vec<(String, u64)> = Vec::new();
    for run in runs {
        for c in run["cells"].as_array().into_iter().flatten() {
            let key = (
                c["schedule"].as_str().unwrap_or("?").to_string(),
                c["microbatches"].as_u64().unwrap_or(0),
            );
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
    }
    let rows: Vec<Value> = keys
        .iter()
        .map(|(schedule, mb)| {
            let cells: Vec<Option<&Value>> =
                runs.iter()
                    .map(|r| {
                        r["cells"].as_array()?.iter().find(|c| {
                            c["schedule"] == schedule.as_str() && c["microbatches"] == *mb
                        })
                    })
                    .collect();
            let mut row = json!({"schedule": schedule, "microbatches": mb});
            for (name, ptr) in FIELDS {
                let values: Vec<Option<f64>> = cells
                    .iter()
                    .map(|c| c.and_then(|c| c.pointer(ptr)?.as_f64()))
                    .collect();
                let present: Vec<f64> = values.iter().flatten().copied().collect();
                row[*name] = json!({
                    "median": table::median(&present),
                    "min": present.iter().copied().reduce(f64::min),
                    "max": present.iter().copied().reduce(f64::max),
                    "runs": values,
                });
            }
            let costs: Vec<f64> = cells
                .iter()
                .flatten()
                .flat_map(|c| {
                    c["costs_ms_of_median_step"]
                        .as_object()
                        .into_iter()
                        .flat_map(|stages| stages.values())
                        .flat_map(|s| ["F", "B", "I", "W"].map(|k| s[k].as_f64()))
                        .flatten()
                })
                .collect();
            row["action_ms"] = json!({
                "min": costs.iter().copied().reduce(f64::min),
                "max": costs.iter().copied().reduce(f64::max),
            });
            row
        })
        .collect();
    let host = &runs.first().unwrap_or(&Value::Null)["host"];
    json!({
        "bench": "ferry_pipeline_small",
        "shape": SHAPE,
        "rows": rows,
        "cores": host["cores"],
        "cpu_count": host["cpu_count"],
    })
}

fn heading() -> String {
    format!(
        "Pipeline, small model (8 x Linear(256, 256) + ReLU, batch 64; Ferry alone): \
         measured step / simulated (target <= {TARGET_SIMULATED}) and the hand-off to an idle \
         receiver (median target <= {TARGET_HANDOFF_US} us; an idle receiver asked before the \
         value came; \"waiting at send\": the median over those whose receiver already waited \
         when it was sent), medians over the runs [spread]"
    )
}

fn cell(row: &Value, field: &str, digits: usize) -> String {
    let v = |stat: &str| row[field][stat].as_f64();
    match (v("median"), v("min"), v("max")) {
        (Some(m), Some(lo), Some(hi)) => {
            format!("{m:.digits$} [{lo:.digits$}-{hi:.digits$}]")
        }
        _ => "-".into(),
    }
}

fn verdict(value: Option<f64>, limit: f64) -> &'static str {
    match value {
        Some(v) if v <= limit => "met",
        Some(_) => "MISSED",
        None => "?",
    }
}

/// The small rows as an aligned text table.
pub(crate) fn render(pooled: &Value) -> String {
    let mut lines = vec![[
        "row".to_string(),
        "actions ms".into(),
        "step ms".into(),
        "simulated ms".into(),
        "step/sim".into(),
        "".into(),
        "hand-off us (median)".into(),
        "p90".into(),
        "transit".into(),
        "wake".into(),
        "".into(),
        "waiting at send".into(),
    ]];
    for row in pooled["rows"].as_array().into_iter().flatten() {
        let actions = match (
            row["action_ms"]["min"].as_f64(),
            row["action_ms"]["max"].as_f64(),
        ) {
            (Some(lo), Some(hi)) => format!("{lo:.2}-{hi:.2}"),
            _ => "-".into(),
        };
        lines.push([
            format!(
                "{} mb={}",
                row["schedule"].as_str().unwrap_or("?"),
                row["microbatches"]
            ),
            actions,
            cell(row, "step_ms", 2),
            cell(row, "simulated_ms", 2),
            cell(row, "step_over_simulated", 2),
            verdict(
                row["step_over_simulated"]["median"].as_f64(),
                TARGET_SIMULATED,
            )
            .into(),
            cell(row, "handoff_median_us", 0),
            cell(row, "handoff_p90_us", 0),
            cell(row, "transit_median_us", 0),
            cell(row, "wake_median_us", 0),
            verdict(
                row["handoff_median_us"]["median"].as_f64(),
                TARGET_HANDOFF_US,
            )
            .into(),
            cell(row, "waiting_median_us", 0),
        ]);
    }
    let mut width = [0usize; 12];
    for l in &lines {
        for (w, c) in width.iter_mut().zip(l) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut text = String::new();
    for l in &lines {
        let cells: Vec<String> = l
            .iter()
            .zip(&width)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        text.push_str(cells.join("  ").trim_end());
        text.push('\n');
    }
    text.push_str(&cores_line(pooled));
    text
}

/// What the ranks' readers did, by the host's cores
/// (`ferry_pipeline::HostCores`): a line under the table.
fn cores_line(pooled: &Value) -> String {
    let cpus = pooled["cpu_count"].as_u64().unwrap_or(0);
    match pooled["cores"].as_str() {
        Some("Spare") => format!(
            "host cores: Spare ({cpus} CPUs for 2 workers' compute threads, waiting ranks and \
             ring readers): readers poll while a rank awaits its input\n"
        ),
        Some("Scarce") => format!(
            "host cores: Scarce ({cpus} CPUs for 2 workers' compute threads, waiting ranks and \
             ring readers): readers sleep 5 us after a message, and a woken one waits for a \
             core behind the compute\n"
        ),
        _ => String::new(),
    }
}

/// Where `pipeline_bench` is, as the main rows built it.
pub(crate) fn binary() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target"));
    root().join(target).join("release/examples/pipeline_bench")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(schedule: &str, mb: u64, ratio: f64, handoff: f64) -> Value {
        json!({
            "schedule": schedule, "microbatches": mb,
            "pipeline_step_ms": {"median_ms": 3.0}, "simulated_ms": {"median_ms": 2.5},
            "pipeline_step_over_simulated": {"median": ratio},
            "makespan_over_simulated": {"median": ratio - 0.05},
            "handoff": {"median_us": handoff, "p90_us": handoff * 2.0,
                        "transit_median_us": handoff / 2.0, "wake_median_us": 5.0},
            "handoff_waiting": {"median_us": handoff / 4.0},
            "costs_ms_of_median_step": {"0": {"F": 0.1, "B": 0.4, "I": 0.2, "W": 0.2}},
        })
    }

    #[test]
    fn the_floor_prints_both_variants_and_nothing_without_figures() {
        let floor = json!({
            "idle": {"median_us": 33.04, "p10_us": 24.5, "p90_us": 35.3},
            "busy": {"median_us": 4.1, "p10_us": 3.7, "p90_us": 4.7},
        });
        let text = render_floor(&floor);
        assert!(text.contains("receiver's core idle: 33.0 us median [p10 24.5, p90 35.3]"));
        assert!(text.contains("yielding poller: 4.1 us median [p10 3.7, p90 4.7]"));
        let partial = render_floor(&json!({"idle": {"median_us": 30.0}}));
        assert_eq!(partial.lines().count(), 1, "{partial}");
    }

    #[test]
    fn runs_pool_to_medians_and_the_table_judges_both_targets() {
        let runs = [
            json!({"cells": [cell("ZBVZeroBubble", 4, 1.1, 40.0)]}),
            json!({"cells": [cell("ZBVZeroBubble", 4, 1.3, 60.0)]}),
            json!({"cells": [cell("ZBVZeroBubble", 4, 1.15, 45.0)]}),
        ];
        let pooled = pool(&runs);
        let row = &pooled["rows"][0];
        assert_eq!(row["step_over_simulated"]["median"], 1.15);
        assert_eq!(row["handoff_median_us"]["median"], 45.0);
        assert_eq!(row["handoff_median_us"]["max"], 60.0);
        assert_eq!(row["action_ms"]["max"], 0.4);
        assert_eq!(row["waiting_median_us"]["median"], 11.25);
        let text = render(&pooled);
        let line = text.lines().nth(1).expect("a row");
        assert!(line.starts_with("ZBVZeroBubble mb=4"), "{text}");
        assert_eq!(line.matches("met").count(), 2, "{text}");
        // No host record in these runs: no line on the cores.
        assert!(!text.contains("host cores"), "{text}");
        let runs = [json!({"host": {"cores": "Scarce", "cpu_count": 2}, "cells": []})];
        let text = render(&pool(&runs));
        assert!(text.contains("host cores: Scarce (2 CPUs for"), "{text}");
    }

    #[test]
    fn a_missed_target_says_so() {
        let pooled = pool(&[json!({"cells": [cell("Interleaved1F1B", 8, 1.5, 80.0)]})]);
        let text = render(&pooled);
        assert_eq!(text.matches("MISSED").count(), 2, "{text}");
    }
}
