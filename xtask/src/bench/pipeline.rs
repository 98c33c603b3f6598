//! `cargo xtask bench --only pipeline`: pipeline-parallel training, Ferry
//! (`ferry-pipeline`'s example `pipeline_bench`) against PyTorch 2.13's
//! `torch.distributed.pipelining` over gloo (the peer's `pt_pipeline.py`),
//! run alternately in one bench with the same settings: 8 × (Linear(1024,
//! 1024) + ReLU), batch 64, MSE, SGD, 2 processes × 1 intra-op thread,
//! GPipe, 1F1B, Interleaved1F1B and ZBVZeroBubble at 4 and 8 microbatches,
//! and each side's one-process baseline. Then the table: per row, each
//! side's median and p90 step time, the ratio Ferry / PyTorch with the
//! target, each side's speedup against its own baseline, and
//! Ferry's measured step against its simulation from the costs measured
//! in the same step.
//!
//! A host's speed drifts: each side runs [`RUNS`] times, the sides
//! alternating which goes first, and every number in the table is the
//! median over the runs of that run's number, with the runs' spread; the
//! load average at the start of every run is printed beside it.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::comparison::sides_in_order;
use super::doc::{self, Part};
use super::options::Options;
use super::peers::peer_script;
use super::results::{out_path, remove_stale, write_result};
use crate::bench::table;
use crate::setup::{venv_python, with_libtorch, TORCH_VERSION};
use crate::steps::{cargo, cmd, root, run, Steps};

/// The schedules both sides run, as both name them.
pub(crate) const SCHEDULES: &[&str] = &["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"];
/// The microbatch counts both sides run.
pub(crate) const MICROBATCHES: &[&str] = &["4", "8"];
/// Runs of each side, alternating which goes first, and under `--quick`.
const RUNS: [usize; 2] = [3, 1];
/// Ferry's targets: its step at most this share of PyTorch's.
const TARGET_RATIO: f64 = 0.75;
/// ... and on ZBVZeroBubble.
const TARGET_RATIO_ZBV: f64 = 0.5;
/// ... and Ferry's measured step at most this multiple of its simulation.
const TARGET_SIMULATED: f64 = 1.15;

/// The bench: [`RUNS`] runs of each side (the peer unless `--no-peer`),
/// pooled into `ferry_pipeline.json` and
/// `peer_pipeline.json`, then the table. Under `--table-only`, the table.
pub(crate) fn main(steps: &mut Steps, o: &Options) -> Result<()> {
    let ferry_out = out_path("ferry_pipeline.json");
    let peer_out = out_path("peer_pipeline.json");
    if !o.table_only {
        remove_stale(&ferry_out)?;
        remove_stale(&peer_out)?;
        doc::record_host("pipeline", o)?;
        let script = peer_script(o.no_peer, "pt_pipeline.py");
        let runs = RUNS[usize::from(o.quick)];
        steps.step(
            "build: ferry-pipeline's example pipeline_bench (release, libtorch)",
            || {
                let mut c = cargo(&[
                    "build",
                    "--release",
                    "-p",
                    "ferry-pipeline",
                    "--example",
                    "pipeline_bench",
                ]);
                run(with_libtorch(&mut c))
            },
        )?;
        let (mut ferry_runs, mut peer_runs) = (Vec::new(), Vec::new());
        for i in 1..=runs {
            for ferry_side in sides_in_order(i) {
                if ferry_side {
                    let out = out_path(&format!("ferry_pipeline.{i}.json"));
                    steps.step(&format!("ferry: pipeline_bench (run {i}/{runs})"), || {
                        run_ferry(o, &out)
                    })?;
                    ferry_runs.push(table::read_result(&root().join(&out))?);
                } else if let Some(script) = &script {
                    let out = out_path(&format!("peer_pipeline.{i}.json"));
                    steps.step(
                        &format!(
                            "peer: pt_pipeline.py (torch.distributed.pipelining) (run {i}/{runs})"
                        ),
                        || run_peer(o, script, &out),
                    )?;
                    peer_runs.push(table::read_result(&root().join(&out))?);
                }
            }
        }
        write_result(&ferry_out, &pool(&ferry_runs, Side::Ferry))?;
        if !peer_runs.is_empty() {
            write_result(&peer_out, &pool(&peer_runs, Side::Peer))?;
        }
    }
    steps.step_with("table: pipeline", || {
        let ferry_path = root().join(&ferry_out);
        if o.table_only && !ferry_path.is_file() {
            eprintln!("    no {}: skipping this table", ferry_out.display());
            return Ok("skipped");
        }
        let ferry = table::read_result(&ferry_path)?;
        let peer_path = root().join(&peer_out);
        let peer = if !o.no_peer && peer_path.is_file() {
            Some(table::read_result(&peer_path)?)
        } else {
            None
        };
        let rows = rows(&ferry, peer.as_ref());
        let text = format!(
            "{}\n\n{}\n{}",
            heading(&ferry, peer.as_ref()),
            render(&rows),
            render_runs(&ferry, peer.as_ref())
        );
        println!("\n{text}");
        doc::record(Part::Pipeline, &text);
        let table_out = out_path("pipeline.json");
        let list: Vec<Value> = rows.iter().map(Row::to_json).collect();
        let text = serde_json::to_string_pretty(&list).context("encoding the table")?;
        std::fs::write(root().join(&table_out), text + "\n")
            .with_context(|| format!("writing {}", table_out.display()))?;
        println!(
            "\nwritten: {} (timelines of each row's median step: {})",
            table_out.display(),
            svg_dir().display()
        );
        check_complete(&rows)?;
        Ok("ok")
    })?;
    super::pipeline_small::main(steps, o, &super::pipeline_small::binary())
}

/// Where Ferry's side writes the measured and simulated timelines.
fn svg_dir() -> PathBuf {
    out_path("pipeline_timelines")
}

/// The arguments both sides share: schedules and microbatch counts.
fn shared_args() -> Vec<&'static str> {
    let mut args = vec!["--schedules"];
    args.extend_from_slice(SCHEDULES);
    args.push("--microbatches");
    args.extend_from_slice(MICROBATCHES);
    args
}

/// The machine's load averages now (1, 5, 15 minutes), if readable.
fn loadavg() -> Value {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let loads: Vec<f64> = text
        .split_whitespace()
        .take(3)
        .filter_map(|x| x.parse().ok())
        .collect();
    if loads.len() == 3 {
        json!(loads)
    } else {
        Value::Null
    }
}

fn run_ferry(o: &Options, out: &Path) -> Result<()> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target"));
    let binary = root().join(target).join("release/examples/pipeline_bench");
    let mut c = cmd(&binary.to_string_lossy(), &shared_args());
    if o.quick {
        c.arg("--quick");
    }
    c.arg("--svg").arg(svg_dir()).arg("--out").arg(out);
    eprintln!("    load average before the run: {}", loadavg());
    run(&mut c)
}

fn run_peer(o: &Options, script: &Path, out: &Path) -> Result<()> {
    let py = venv_python();
    let mut c = cmd(&py.to_string_lossy(), &[]);
    c.arg(script).args(shared_args());
    if o.quick {
        c.arg("--quick");
    }
    c.arg("--out").arg(out);
    eprintln!("    load average before the run: {}", loadavg());
    run(&mut c).context("the peer benchmark failed (`--no-peer` skips it)")
}

/// Whose result a run is: the two write different fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// `pipeline_bench`: the driver times the whole step.
    Ferry,
    /// `pt_pipeline.py`: every rank times its step; the per-step maximum
    /// over the ranks is the step.
    Peer,
}

impl Side {
    /// Where a cell's step statistics are.
    fn step_field(self) -> &'static str {
        match self {
            Side::Ferry => "step_ms",
            Side::Peer => "step_ms_max_of_ranks",
        }
    }
}

/// One number over the runs: the median of the runs' values, the least and
/// the greatest, and every run's value (`null` where a run lacks it).
fn over_runs(values: &[Option<f64>]) -> Value {
    let present: Vec<f64> = values.iter().flatten().copied().collect();
    json!({
        "median": table::median(&present),
        "min": present.iter().copied().reduce(f64::min),
        "max": present.iter().copied().reduce(f64::max),
        "runs": values,
    })
}

/// A side's result over its runs: for the baseline and every (schedule,
/// microbatches) cell, each number as [`over_runs`] gives it; the speedup
/// against the baseline is each run's own (its baseline median over its
/// cell median), then over the runs. Failed cells are listed with their
/// errors. The load averages of every run are kept.
pub(crate) fn pool(runs: &[Value], side: Side) -> Value {
    let ms = |v: &Value, field: &str, stat: &str| v.pointer(&format!("/{field}/{stat}"))?.as_f64();
    let base = |run: &Value| run.pointer("/baseline/0/step_ms").cloned();
    let baseline = json!({
        "median_ms": over_runs(&runs.iter().map(|r| base(r).and_then(|b| b["median_ms"].as_f64())).collect::<Vec<_>>()),
        "p90_ms": over_runs(&runs.iter().map(|r| base(r).and_then(|b| b["p90_ms"].as_f64())).collect::<Vec<_>>()),
    });
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
            let cells: Vec<Option<&Value>> = runs
                .iter()
                .map(|run| {
                    run["cells"].as_array()?.iter().find(|c| {
                        c["schedule"] == *schedule
                            && c["microbatches"].as_u64() == Some(*mb)
                            && c["status"] == "ok"
                    })
                })
                .collect();
            let each = |f: &dyn Fn(&Value) -> Option<f64>| -> Value {
                over_runs(&cells.iter().map(|c| c.and_then(f)).collect::<Vec<_>>())
            };
            let step = side.step_field();
            let speedups: Vec<Option<f64>> = runs
                .iter()
                .zip(&cells)
                .map(|(run, c)| {
                    let b = base(run)?["median_ms"].as_f64()?;
                    Some(b / ms((*c)?, step, "median_ms")?)
                })
                .collect();
            let errors: Vec<&Value> = runs
                .iter()
                .flat_map(|run| run["cells"].as_array().into_iter().flatten())
                .filter(|c| {
                    c["schedule"] == *schedule
                        && c["microbatches"].as_u64() == Some(*mb)
                        && c["status"] != "ok"
                })
                .map(|c| &c["error"])
                .collect();
            let mut row = json!({
                "schedule": schedule,
                "microbatches": mb,
                "median_ms": each(&|c| ms(c, step, "median_ms")),
                "p90_ms": each(&|c| ms(c, step, "p90_ms")),
                "speedup_vs_baseline": over_runs(&speedups),
                "errors": errors,
            });
            if side == Side::Ferry {
                row["pipeline_step_ms"] = each(&|c| ms(c, "pipeline_step_ms", "median_ms"));
                row["makespan_ms"] = each(&|c| ms(c, "makespan_ms", "median_ms"));
                row["simulated_ms"] = each(&|c| ms(c, "simulated_ms", "median_ms"));
                row["pipeline_step_over_simulated"] =
                    each(&|c| c.pointer("/pipeline_step_over_simulated/median")?.as_f64());
                row["makespan_over_simulated"] =
                    each(&|c| c.pointer("/makespan_over_simulated/median")?.as_f64());
                row["max_abs_param_diff_vs_baseline"] =
                    each(&|c| c["max_abs_param_diff_vs_baseline"].as_f64());
            } else {
                row["rank0_median_ms"] = each(&|c| ms(c, "step_ms_rank0", "median_ms"));
                row["max_abs_param_diff_vs_baseline"] =
                    each(&|c| c["max_abs_param_diff_vs_baseline"].as_f64());
            }
            row
        })
        .collect();
    json!({
        "side": match side { Side::Ferry => "ferry", Side::Peer => "peer" },
        "runs": runs.len(),
        "aggregate": "per number: the median over the runs of each run's value [min–max over the runs]",
        "loadavg_start": runs.iter().map(|r| r.pointer("/host/loadavg_start").cloned().unwrap_or(Value::Null)).collect::<Vec<_>>(),
        "loadavg_end": runs.iter().map(|r| r.pointer("/host/loadavg_end").cloned().unwrap_or(Value::Null)).collect::<Vec<_>>(),
        "baseline_losses": runs.first().and_then(|r| r.pointer("/baseline/0/losses").cloned()),
        "baseline": baseline,
        "rows": rows,
    })
}

/// One row of the table.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Row {
    /// `GPipe mb=4`, or `one process (baseline)`.
    pub(crate) case: String,
    pub(crate) ferry_ms: Option<f64>,
    /// The runs' least and greatest median.
    pub(crate) ferry_range: Option<(f64, f64)>,
    pub(crate) ferry_p90_ms: Option<f64>,
    pub(crate) peer_ms: Option<f64>,
    pub(crate) peer_range: Option<(f64, f64)>,
    pub(crate) peer_p90_ms: Option<f64>,
    /// Ferry / PyTorch (medians).
    pub(crate) ratio: Option<f64>,
    /// The most `ratio` may be, on pipeline rows.
    pub(crate) target: Option<f64>,
    pub(crate) ferry_speedup: Option<f64>,
    pub(crate) peer_speedup: Option<f64>,
    /// Ferry's `step` (the pipeline's part of the training step, on the
    /// driver) over its simulation, and the timeline's makespan over it.
    pub(crate) step_over_simulated: Option<f64>,
    pub(crate) makespan_over_simulated: Option<f64>,
    pub(crate) simulated_ms: Option<f64>,
    /// Whether both targets hold (`None` without the numbers to judge).
    pub(crate) ratio_met: Option<bool>,
    pub(crate) simulated_met: Option<bool>,
}

impl Row {
    /// The row as a JSON object (ranges as `[min, max]`).
    fn to_json(&self) -> Value {
        json!({
            "case": self.case,
            "ferry_ms": self.ferry_ms, "ferry_range": self.ferry_range.map(|(a, b)| [a, b]),
            "ferry_p90_ms": self.ferry_p90_ms,
            "peer_ms": self.peer_ms, "peer_range": self.peer_range.map(|(a, b)| [a, b]),
            "peer_p90_ms": self.peer_p90_ms,
            "ratio_ferry_over_peer": self.ratio, "target": self.target, "met": self.ratio_met,
            "ferry_speedup": self.ferry_speedup, "peer_speedup": self.peer_speedup,
            "simulated_ms": self.simulated_ms,
            "step_over_simulated": self.step_over_simulated,
            "makespan_over_simulated": self.makespan_over_simulated,
            "simulated_target": TARGET_SIMULATED, "simulated_met": self.simulated_met,
        })
    }
}

fn get(v: &Value, ptr: &str) -> Option<f64> {
    v.pointer(ptr)?.as_f64()
}

fn range(v: &Value, ptr: &str) -> Option<(f64, f64)> {
    Some((
        get(v, &format!("{ptr}/min"))?,
        get(v, &format!("{ptr}/max"))?,
    ))
}

/// The table's rows: the baseline, then every row of Ferry's pooled result.
pub(crate) fn rows(ferry: &Value, peer: Option<&Value>) -> Vec<Row> {
    let mut rows = vec![Row {
        case: "one process (baseline)".into(),
        ferry_ms: get(ferry, "/baseline/median_ms/median"),
        ferry_range: range(ferry, "/baseline/median_ms"),
        ferry_p90_ms: get(ferry, "/baseline/p90_ms/median"),
        peer_ms: peer.and_then(|p| get(p, "/baseline/median_ms/median")),
        peer_range: peer.and_then(|p| range(p, "/baseline/median_ms")),
        peer_p90_ms: peer.and_then(|p| get(p, "/baseline/p90_ms/median")),
        ratio: None,
        target: None,
        ferry_speedup: None,
        peer_speedup: None,
        step_over_simulated: None,
        makespan_over_simulated: None,
        simulated_ms: None,
        ratio_met: None,
        simulated_met: None,
    }];
    rows[0].ratio = ratio(rows[0].ferry_ms, rows[0].peer_ms);
    for f in ferry["rows"].as_array().into_iter().flatten() {
        let schedule = f["schedule"].as_str().unwrap_or("?");
        let mb = f["microbatches"].as_u64().unwrap_or(0);
        let p = peer.and_then(|p| {
            p["rows"]
                .as_array()?
                .iter()
                .find(|r| r["schedule"] == f["schedule"] && r["microbatches"] == f["microbatches"])
        });
        let target = if schedule == "ZBVZeroBubble" {
            TARGET_RATIO_ZBV
        } else {
            TARGET_RATIO
        };
        let ferry_ms = get(f, "/median_ms/median");
        let peer_ms = p.and_then(|p| get(p, "/median_ms/median"));
        let ratio = ratio(ferry_ms, peer_ms);
        let step_over_simulated = get(f, "/pipeline_step_over_simulated/median");
        rows.push(Row {
            case: format!("{schedule} mb={mb}"),
            ferry_ms,
            ferry_range: range(f, "/median_ms"),
            ferry_p90_ms: get(f, "/p90_ms/median"),
            peer_ms,
            peer_range: p.and_then(|p| range(p, "/median_ms")),
            peer_p90_ms: p.and_then(|p| get(p, "/p90_ms/median")),
            ratio,
            target: Some(target),
            ferry_speedup: get(f, "/speedup_vs_baseline/median"),
            peer_speedup: p.and_then(|p| get(p, "/speedup_vs_baseline/median")),
            step_over_simulated,
            makespan_over_simulated: get(f, "/makespan_over_simulated/median"),
            simulated_ms: get(f, "/simulated_ms/median"),
            ratio_met: ratio.map(|r| r <= target),
            simulated_met: step_over_simulated.map(|r| r <= TARGET_SIMULATED),
        });
    }
    rows
}

fn ratio(ferry: Option<f64>, peer: Option<f64>) -> Option<f64> {
    match (ferry, peer) {
        (Some(f), Some(p)) if f > 0.0 && p > 0.0 => Some(f / p),
        _ => None,
    }
}

fn num(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:.1}"))
}

fn with_range(v: Option<f64>, r: Option<(f64, f64)>) -> String {
    match (v, r) {
        (Some(_), Some((lo, hi))) => format!("{} [{}–{}]", num(v), num(Some(lo)), num(Some(hi))),
        _ => num(v),
    }
}

fn times(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:.2}x"))
}

fn verdict(limit: Option<f64>, met: Option<bool>) -> String {
    match (limit, met) {
        (Some(l), Some(true)) => format!("≤{l} met"),
        (Some(l), Some(false)) => format!("≤{l} MISSED"),
        (Some(l), None) => format!("≤{l} ?"),
        (None, _) => String::new(),
    }
}

/// The rows as an aligned text table.
pub(crate) fn render(rows: &[Row]) -> String {
    let header = [
        "row",
        "Ferry ms",
        "p90",
        "PyTorch ms",
        "p90",
        "Ferry/PT",
        "target",
        "speedup F",
        "speedup PT",
        "sim ms",
        "step/sim",
        "timeline/sim",
        "target",
    ];
    let mut cells: Vec<Vec<String>> = vec![header.map(String::from).into()];
    for r in rows {
        cells.push(vec![
            r.case.clone(),
            with_range(r.ferry_ms, r.ferry_range),
            num(r.ferry_p90_ms),
            with_range(r.peer_ms, r.peer_range),
            num(r.peer_p90_ms),
            times(r.ratio),
            verdict(r.target, r.ratio_met),
            times(r.ferry_speedup),
            times(r.peer_speedup),
            num(r.simulated_ms),
            times(r.step_over_simulated),
            times(r.makespan_over_simulated),
            verdict(
                r.step_over_simulated.map(|_| TARGET_SIMULATED),
                r.simulated_met,
            ),
        ]);
    }
    aligned(&cells)
}

/// `cells` (the first row the header) as columns joined by ` | `, the
/// first column left-aligned, the others right-aligned, a rule under the
/// header.
fn aligned(cells: &[Vec<String>]) -> String {
    let mut width = vec![0usize; cells[0].len()];
    for row in cells {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for (i, row) in cells.iter().enumerate() {
        let line: Vec<String> = row
            .iter()
            .zip(&width)
            .enumerate()
            .map(|(j, (c, &w))| {
                if j == 0 {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect();
        out.push_str(line.join(" | ").trim_end());
        out.push('\n');
        if i == 0 {
            let rule: Vec<String> = width.iter().map(|w| "-".repeat(*w)).collect();
            out.push_str(&rule.join("-|-"));
            out.push('\n');
        }
    }
    out
}

/// Every run's own median step time per row, each side's run with the
/// load average (1 min) at its start, so the spread can be read against
/// what else the host was doing.
pub(crate) fn render_runs(ferry: &Value, peer: Option<&Value>) -> String {
    let runs = |v: &Value| v["runs"].as_u64().unwrap_or(0) as usize;
    let n = runs(ferry).max(peer.map_or(0, runs));
    let load = |v: Option<&Value>, i: usize| -> String {
        v.and_then(|v| v.pointer(&format!("/loadavg_start/{i}/0"))?.as_f64())
            .map_or("-".into(), |l| format!("{l:.2}"))
    };
    let mut header = vec!["row (median ms per run)".to_string()];
    for i in 0..n {
        header.push(format!("F{} (load {})", i + 1, load(Some(ferry), i)));
        header.push(format!("PT{} (load {})", i + 1, load(peer, i)));
    }
    let run_value = |v: Option<&Value>, ptr: &str, i: usize| -> String {
        num(v.and_then(|v| get(v, &format!("{ptr}/runs/{i}"))))
    };
    let mut cells = vec![header];
    let mut line = vec!["one process (baseline)".to_string()];
    for i in 0..n {
        line.push(run_value(Some(ferry), "/baseline/median_ms", i));
        line.push(run_value(peer, "/baseline/median_ms", i));
    }
    cells.push(line);
    for f in ferry["rows"].as_array().into_iter().flatten() {
        let p = peer.and_then(|p| {
            p["rows"]
                .as_array()?
                .iter()
                .find(|r| r["schedule"] == f["schedule"] && r["microbatches"] == f["microbatches"])
        });
        let mut line = vec![format!(
            "{} mb={}",
            f["schedule"].as_str().unwrap_or("?"),
            f["microbatches"]
        )];
        for i in 0..n {
            line.push(run_value(Some(f), "/median_ms", i));
            line.push(run_value(p, "/median_ms", i));
        }
        cells.push(line);
    }
    aligned(&cells)
}

/// The lines above the table.
fn heading(ferry: &Value, peer: Option<&Value>) -> String {
    let same_data = match (
        ferry["baseline_losses"].as_array(),
        peer.and_then(|p| p["baseline_losses"].as_array()),
    ) {
        (Some(f), Some(p)) if f.len() == p.len() && !f.is_empty() => {
            let diff = f
                .iter()
                .zip(p)
                .filter_map(|(a, b)| Some((a.as_f64()? - b.as_f64()?).abs()))
                .fold(0.0, f64::max);
            format!(
                "both baselines' losses agree to {diff:.1e} over {} steps (same init and data)",
                f.len()
            )
        }
        _ => "baseline losses not compared (a side has none)".into(),
    };
    format!(
        "Ferry (ferry-pipeline) vs PyTorch {TORCH_VERSION} (torch.distributed.pipelining, gloo): \
         8 x (Linear(1024,1024) + ReLU), batch 64, MSE (mean, scale_grads), SGD; 2 processes x 1 \
         intra-op thread on one host; 1 stage per rank for GPipe/1F1B, 2 per rank for \
         Interleaved1F1B (loop) and ZBVZeroBubble (V)\n\
         step = zero_grad + step + optimizer step (Ferry: on the driver; PyTorch: the per-step \
         max over its ranks); baseline: one process, 1 thread, full batch\n\
         each number: the median over {} Ferry and {} PyTorch run(s) (alternating) of that run's \
         median [min–max of the runs' medians]; p90: the median of the runs' p90\n\
         Ferry/PT: Ferry's median over PyTorch's (target ≤{TARGET_RATIO}, ≤{TARGET_RATIO_ZBV} on \
         ZBVZeroBubble); speedup: the side's own baseline over its step\n\
         sim ms: the duration-aware simulation of the schedule with the per-action costs \
         measured in the same step (median per stage and action kind, free links); step/sim: \
         Ferry's `step` (on the driver, without zero_grad and optimizer step) over it (target \
         ≤{TARGET_SIMULATED}); timeline/sim: first action start to last action end over it\n\
         {same_data}",
        ferry["runs"],
        peer.map_or(json!(0), |p| p["runs"].clone()),
    )
}

/// Fails unless `rows` has every (schedule, microbatches) of the bench.
pub(crate) fn check_complete(rows: &[Row]) -> Result<()> {
    let mut missing = Vec::new();
    for s in SCHEDULES {
        for m in MICROBATCHES {
            let case = format!("{s} mb={m}");
            if !rows.iter().any(|r| r.case == case && r.ferry_ms.is_some()) {
                missing.push(case);
            }
        }
    }
    if !missing.is_empty() {
        bail!("Ferry has no time for: {}", missing.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One run of a side, as the programs write it: the baseline median,
    /// then per cell (schedule, microbatches, median, p90).
    fn run(side: Side, base: f64, cells: &[(&str, u64, f64, f64)]) -> Value {
        let field = side.step_field();
        let cells: Vec<Value> = cells
            .iter()
            .map(|&(s, m, med, p90)| {
                let mut c = json!({"schedule": s, "microbatches": m, "status": "ok",
                    "max_abs_param_diff_vs_baseline": 1e-6});
                c[field] = json!({"median_ms": med, "p90_ms": p90});
                if side == Side::Ferry {
                    c["pipeline_step_ms"] = json!({"median_ms": med - 2.0});
                    c["simulated_ms"] = json!({"median_ms": med - 4.0});
                    c["pipeline_step_over_simulated"] =
                        json!({"median": (med - 2.0) / (med - 4.0)});
                    c["makespan_over_simulated"] = json!({"median": 1.01});
                }
                c
            })
            .collect();
        json!({"baseline": [{"step_ms": {"median_ms": base, "p90_ms": base + 1.0},
                             "losses": [1.0, 0.5]}],
               "cells": cells, "host": {"loadavg_start": [0.5, 0.4, 0.3]}})
    }

    #[test]
    fn runs_pool_to_the_median_of_their_medians_with_the_spread() {
        let runs = [
            run(Side::Ferry, 50.0, &[("GPipe", 4, 40.0, 45.0)]),
            run(Side::Ferry, 60.0, &[("GPipe", 4, 30.0, 35.0)]),
            run(Side::Ferry, 55.0, &[("GPipe", 4, 50.0, 60.0)]),
        ];
        let pooled = pool(&runs, Side::Ferry);
        let row = &pooled["rows"][0];
        assert_eq!(row["median_ms"]["median"], json!(40.0));
        assert_eq!(
            (
                row["median_ms"]["min"].as_f64(),
                row["median_ms"]["max"].as_f64()
            ),
            (Some(30.0), Some(50.0))
        );
        assert_eq!(row["p90_ms"]["median"], json!(45.0));
        // Each run's speedup is its own baseline over its own step.
        assert_eq!(row["speedup_vs_baseline"]["runs"], json!([1.25, 2.0, 1.1]));
        assert_eq!(row["speedup_vs_baseline"]["median"], json!(1.25));
        assert_eq!(pooled["baseline"]["median_ms"]["median"], json!(55.0));
        assert_eq!(pooled["loadavg_start"][2], json!([0.5, 0.4, 0.3]));
    }

    #[test]
    fn a_failed_cell_leaves_a_gap_and_its_error() {
        let mut bad = run(Side::Ferry, 50.0, &[]);
        bad["cells"] = json!([{"schedule": "GPipe", "microbatches": 4, "status": "failed",
                                "error": "boom"}]);
        let runs = [run(Side::Ferry, 50.0, &[("GPipe", 4, 40.0, 45.0)]), bad];
        let pooled = pool(&runs, Side::Ferry);
        let row = &pooled["rows"][0];
        assert_eq!(row["median_ms"]["runs"], json!([40.0, null]));
        assert_eq!(row["median_ms"]["median"], json!(40.0));
        assert_eq!(row["errors"], json!(["boom"]));
    }

    #[test]
    fn the_table_judges_both_targets() {
        let ferry = pool(
            &[run(
                Side::Ferry,
                56.0,
                &[("GPipe", 4, 50.0, 55.0), ("ZBVZeroBubble", 4, 90.0, 99.0)],
            )],
            Side::Ferry,
        );
        let peer = pool(
            &[run(
                Side::Peer,
                56.0,
                &[("GPipe", 4, 72.0, 80.0), ("ZBVZeroBubble", 4, 171.0, 180.0)],
            )],
            Side::Peer,
        );
        let rows = rows(&ferry, Some(&peer));
        assert_eq!(rows[0].case, "one process (baseline)");
        assert_eq!(rows[0].ratio, Some(1.0));
        let gpipe = &rows[1];
        assert_eq!((gpipe.ferry_ms, gpipe.peer_ms), (Some(50.0), Some(72.0)));
        assert_eq!(gpipe.ratio_met, Some(true));
        assert_eq!(gpipe.simulated_met, Some(true)); // 48 / 46
        let zbv = &rows[2];
        // 90 / 171 > 0.5.
        assert_eq!((zbv.target, zbv.ratio_met), (Some(0.5), Some(false)));
        let text = render(&rows);
        assert!(text.contains("≤0.5 MISSED"), "{text}");
        assert!(text.contains("≤0.75 met"), "{text}");
        let runs = render_runs(&ferry, Some(&peer));
        assert!(runs.contains("F1 (load 0.50)"), "{runs}");
        assert!(heading(&ferry, Some(&peer)).contains("agree to 0.0e0"));
        // Without the peer: Ferry's columns only, nothing judged on the ratio.
        let alone = super::rows(&ferry, None);
        assert_eq!((alone[1].ratio, alone[1].ratio_met), (None, None));
        assert!(check_complete(&alone).is_err());
    }
}
