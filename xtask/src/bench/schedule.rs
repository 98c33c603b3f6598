//! `cargo xtask bench --only schedule`: generating, lowering and simulating
//! pipeline schedules, Ferry (`ferry-schedule`'s example `schedule_bench`)
//! against PyTorch 2.13's `torch.distributed.pipelining`
//! (`benches/peers/pt_schedule.py`, in this repository), run alternately
//! in one bench; then the table, after checking that both sides simulated
//! the same schedules (equal step and lowered-action counts on every row).

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::comparison::sides_in_order;
use super::doc::{self, Part};
use super::options::Options;
use super::peers::PEERS_DIR;
use super::results::{out_path, remove_stale, write_result};
use crate::bench::table::{self, Better, Metric, RowSpec};
use crate::setup::{venv_python, TORCH_VERSION};
use crate::steps::{cargo, cmd, root, run, Steps};

/// Shapes (ranks x microbatches) both sides run.
pub(crate) const SHAPES: &[&str] = &["8x32", "32x128", "64x256"];
/// Shapes only Ferry runs, for how its time grows.
pub(crate) const FERRY_ONLY_SHAPES: &[&str] = &["16x64", "128x512"];
/// The schedules, as both sides name them.
pub(crate) const SCHEDULES: &[&str] = &["Interleaved1F1B", "ZBVZeroBubble"];
/// Ferry's target: at least 300x faster on every row.
pub(crate) const TARGET: f64 = 300.0;
/// Runs of each side, alternating which goes first, and under `--quick`.
const RUNS: [usize; 2] = [3, 1];
/// The phases each side times (one repetition is all three).
const PHASES: &[&str] = &["total", "generate", "lower", "simulate"];

/// The bench: [`RUNS`] runs of each side (the peer unless `--no-peer`),
/// pooled into `ferry_schedule.json` and `peer_schedule.json`, then the
/// count check and the tables. Under `--table-only`, only the last two.
pub(crate) fn main(steps: &mut Steps, o: &Options) -> Result<()> {
    let ferry_out = out_path("ferry_schedule.json");
    let peer_out = out_path("peer_schedule.json");
    if !o.table_only {
        remove_stale(&ferry_out)?;
        remove_stale(&peer_out)?;
        doc::record_host("schedule", o)?;
        let runs = RUNS[usize::from(o.quick)];
        steps.step(
            "build: ferry-schedule's example schedule_bench (release)",
            || {
                run(&mut cargo(&[
                    "build",
                    "--release",
                    "-p",
                    "ferry-schedule",
                    "--example",
                    "schedule_bench",
                ]))
            },
        )?;
        let (mut ferry_runs, mut peer_runs) = (Vec::new(), Vec::new());
        for i in 1..=runs {
            for ferry_side in sides_in_order(i) {
                if ferry_side {
                    let out = out_path(&format!("ferry_schedule.{i}.json"));
                    steps.step(&format!("ferry: schedule_bench (run {i}/{runs})"), || {
                        run_ferry(o, &out)
                    })?;
                    ferry_runs.push(table::read_result(&root().join(&out))?);
                } else if !o.no_peer {
                    let out = out_path(&format!("peer_schedule.{i}.json"));
                    steps.step(
                        &format!(
                            "peer: pt_schedule.py (torch.distributed.pipelining) (run {i}/{runs})"
                        ),
                        || run_peer(o, &out),
                    )?;
                    peer_runs.push(table::read_result(&root().join(&out))?);
                }
            }
        }
        write_result(&ferry_out, &pool_runs(&ferry_runs, Spread::P10P90)?)?;
        if !peer_runs.is_empty() {
            write_result(&peer_out, &pool_runs(&peer_runs, Spread::MinMax)?)?;
        }
    }
    tables(steps, o, &ferry_out, &peer_out)
}

fn run_ferry(o: &Options, out: &Path) -> Result<()> {
    let mut c = cargo(&[
        "run",
        "--release",
        "-p",
        "ferry-schedule",
        "--example",
        "schedule_bench",
        "--",
    ]);
    if o.quick {
        c.arg("--quick");
    }
    c.arg("--shapes").args(all_shapes()).arg("--out").arg(out);
    run(&mut c)
}

fn run_peer(o: &Options, out: &Path) -> Result<()> {
    let py = venv_python();
    let mut c = cmd(&py.to_string_lossy(), &[]);
    c.arg(Path::new(PEERS_DIR).join("pt_schedule.py"));
    if o.quick {
        c.arg("--quick");
    }
    // One repetition at least per run: the 64x256 rows take seconds each,
    // so they get one per run (three in all); the others repeat for
    // the script's --min-seconds.
    c.args(["--min-reps", "1", "--shapes"])
        .args(SHAPES)
        .arg("--out")
        .arg(out);
    run(&mut c).context("the peer benchmark failed (`--no-peer` skips it)")
}

/// Ferry's shapes: [`SHAPES`] and [`FERRY_ONLY_SHAPES`], by size.
fn all_shapes() -> Vec<&'static str> {
    let mut shapes: Vec<&str> = SHAPES.iter().chain(FERRY_ONLY_SHAPES).copied().collect();
    shapes.sort_by_key(|s| shape_size(s));
    shapes
}

/// ranks x microbatches of a `RxM` shape (0 if it is not one).
fn shape_size(shape: &str) -> usize {
    shape
        .split_once('x')
        .and_then(|(r, m)| Some(r.parse::<usize>().ok()? * m.parse::<usize>().ok()?))
        .unwrap_or(0)
}

/// Which ends a pooled row's `lo_ms` and `hi_ms` are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Spread {
    /// The 10th and 90th percentiles (Ferry: many repetitions).
    P10P90,
    /// The least and the greatest (PyTorch: a few repetitions of seconds).
    MinMax,
}

/// The `p` quantile of sorted `values`, interpolating linearly.
fn pct(sorted: &[f64], p: f64) -> f64 {
    let idx = p * (sorted.len() - 1) as f64;
    let lo = idx.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] * (1.0 - (idx - lo as f64)) + sorted[hi] * (idx - lo as f64)
}

/// Statistics (ms) of samples in seconds, with `lo_ms` and `hi_ms` as `spread` says.
fn stats(secs: &[f64], spread: Spread) -> Value {
    let mut ms: Vec<f64> = secs.iter().map(|s| s * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let n = ms.len();
    let (lo, hi) = match spread {
        Spread::P10P90 => (pct(&ms, 0.1), pct(&ms, 0.9)),
        Spread::MinMax => (ms[0], ms[n - 1]),
    };
    json!({
        "n": n, "median_ms": pct(&ms, 0.5), "lo_ms": lo, "hi_ms": hi,
        "p10_ms": pct(&ms, 0.1), "p90_ms": pct(&ms, 0.9), "min_ms": ms[0], "max_ms": ms[n - 1],
    })
}

/// One side's runs pooled: per (schedule, shape), every phase's samples of
/// every run together, their statistics ([`stats`]), the step and action
/// counts (which must agree between runs), and for the full constructor
/// (`construct`, `construct_total`; the peer's only) the same.
pub(crate) fn pool_runs(runs: &[Value], spread: Spread) -> Result<Value> {
    let mut rows: Vec<Value> = Vec::new();
    for run in runs {
        for r in run["rows"].as_array().context("a result without rows")? {
            let key = (r["schedule"].clone(), r["shape"].clone());
            let i = match rows
                .iter()
                .position(|p| (p["schedule"].clone(), p["shape"].clone()) == key)
            {
                Some(i) => i,
                None => {
                    let mut first = json!({});
                    for field in [
                        "schedule",
                        "shape",
                        "ranks",
                        "microbatches",
                        "stages_per_rank",
                    ] {
                        first[field] = r[field].clone();
                    }
                    first["steps"] = r["steps"].clone();
                    first["actions"] = r["actions"].clone();
                    first["samples_s"] = json!({});
                    rows.push(first);
                    rows.len() - 1
                }
            };
            let pooled = &mut rows[i];
            for count in ["steps", "actions"] {
                if pooled[count] != r[count] {
                    bail!(
                        "{} {}: {count} differ between runs ({} and {})",
                        key.0,
                        key.1,
                        pooled[count],
                        r[count]
                    );
                }
            }
            for phase in PHASES.iter().chain(&["construct", "construct_total"]) {
                let Some(samples) = r[*phase]["samples_s"].as_array() else {
                    continue;
                };
                let list = pooled["samples_s"][*phase]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                pooled["samples_s"][*phase] = json!([list, samples.clone()].concat());
            }
        }
    }
    for row in &mut rows {
        let samples = row["samples_s"].as_object().cloned().unwrap_or_default();
        for (phase, list) in samples {
            let secs: Vec<f64> = list
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_f64)
                .collect();
            if !secs.is_empty() {
                row[phase.as_str()] = stats(&secs, spread);
            }
        }
        let total = row["total"]["median_ms"].as_f64();
        let actions = row["actions"].as_f64();
        if let (Some(total), Some(actions)) = (total, actions) {
            row["ns_per_action"] = json!(total * 1e6 / actions);
        }
    }
    Ok(json!({
        "spread": match spread { Spread::P10P90 => "p10-p90", Spread::MinMax => "min-max" },
        "runs": runs.len(),
        "rows": rows,
        "first_run": runs.first().map(|r| json!({"what": r["what"], "torch": r["torch"],
            "config": r["config"]})),
    }))
}

/// Fails, naming every row that differs, unless both sides report the
/// same step count and the same number of lowered actions for every
/// (schedule, shape) they both ran; returns how many rows were compared.
pub(crate) fn check_counts(ferry: &Value, peer: &Value) -> Result<usize> {
    let rows = |v: &Value| v["rows"].as_array().cloned().unwrap_or_default();
    let mut compared = 0;
    let mut wrong = Vec::new();
    for p in rows(peer) {
        let Some(f) = rows(ferry)
            .into_iter()
            .find(|f| f["schedule"] == p["schedule"] && f["shape"] == p["shape"])
        else {
            continue;
        };
        compared += 1;
        for count in ["steps", "actions"] {
            if f[count] != p[count] {
                wrong.push(format!(
                    "{} {}: Ferry {count} {} but PyTorch {}",
                    p["schedule"].as_str().unwrap_or("?"),
                    p["shape"].as_str().unwrap_or("?"),
                    f[count],
                    p[count]
                ));
            }
        }
    }
    if !wrong.is_empty() {
        bail!(
            "Ferry and PyTorch did not compute the same schedules, so the times are not \
             comparable:\n  {}",
            wrong.join("\n  ")
        );
    }
    Ok(compared)
}

/// A metric of the row for (`schedule`, `shape`).
fn at(schedule: &str, shape: &str, field: &str) -> Metric {
    Metric::InList {
        list: "/rows".into(),
        matching: vec![
            ("schedule".into(), json!(schedule)),
            ("shape".into(), json!(shape)),
        ],
        field: field.into(),
    }
}

/// One timed row: the median of `phase` with its spread.
fn timed(case: String, schedule: &str, shape: &str, phase: &str) -> RowSpec {
    RowSpec::new(
        case,
        "ms",
        Better::Lower,
        at(schedule, shape, &format!("/{phase}/median_ms")),
    )
    .with_range(
        at(schedule, shape, &format!("/{phase}/lo_ms")),
        at(schedule, shape, &format!("/{phase}/hi_ms")),
    )
}

/// The main table: per schedule and shape both sides ran, the whole work
/// (generate + lower + simulate) with [`TARGET`]; then the same against
/// PyTorch's side as users call it (the full constructor, with its
/// own lowering, + `_add_send_recv` + `_simulate_comms_compute`), also with
/// the target.
pub(crate) fn main_specs(_ferry: &Value, _peer: Option<&Value>) -> Vec<RowSpec> {
    let mut specs = Vec::new();
    for schedule in SCHEDULES {
        for shape in SHAPES {
            specs.push(
                timed(format!("{schedule} {shape}"), schedule, shape, "total").with_target(TARGET),
            );
        }
    }
    for schedule in SCHEDULES {
        for shape in SHAPES {
            // Ferry's column is its total (see [`ferry_view`]); PyTorch's,
            // constructor + lower + simulate.
            specs.push(
                timed(
                    format!("{schedule} {shape}, PyTorch via its constructor"),
                    schedule,
                    shape,
                    "construct_total",
                )
                .with_target(TARGET),
            );
        }
    }
    specs
}

/// The phase table: per schedule and shape, each phase on both sides (no
/// target); then Ferry's growth: every shape's total and ns per lowered
/// action, and the exponent of the fit of time against ranks x microbatches.
pub(crate) fn phase_specs(_ferry: &Value, _peer: Option<&Value>) -> Vec<RowSpec> {
    let mut specs = Vec::new();
    for schedule in SCHEDULES {
        for shape in SHAPES {
            for phase in ["generate", "lower", "simulate"] {
                specs.push(timed(
                    format!("{schedule} {shape} {phase}"),
                    schedule,
                    shape,
                    phase,
                ));
            }
        }
    }
    for schedule in SCHEDULES {
        for shape in all_shapes() {
            specs.push(timed(
                format!("{schedule} {shape} total (Ferry's growth)"),
                schedule,
                shape,
                "total",
            ));
            specs.push(RowSpec::new(
                format!("{schedule} {shape} per lowered action"),
                "ns",
                Better::Lower,
                at(schedule, shape, "/ns_per_action"),
            ));
        }
        specs.push(RowSpec::new(
            format!("{schedule}: time ~ (ranks x microbatches)^k, fitted k"),
            "",
            Better::Lower,
            Metric::At(format!("/growth/{schedule}")),
        ));
    }
    specs
}

/// Ferry's growth exponent per schedule: the slope of the least-squares
/// line through (ln(ranks x microbatches), ln(median total)) over every
/// shape Ferry ran, added to its pooled result under `growth`.
pub(crate) fn add_growth(ferry: &mut Value) {
    let rows = ferry["rows"].as_array().cloned().unwrap_or_default();
    let mut growth = serde_json::Map::new();
    for schedule in SCHEDULES {
        let points: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r["schedule"] == *schedule)
            .filter_map(|r| {
                let size = r["ranks"].as_f64()? * r["microbatches"].as_f64()?;
                let t = r["total"]["median_ms"].as_f64()?;
                (size > 0.0 && t > 0.0).then(|| (size.ln(), t.ln()))
            })
            .collect();
        let n = points.len() as f64;
        let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
        let my = points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
        let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        if sxx > 0.0 {
            growth.insert(schedule.to_string(), json!(sxy / sxx));
        }
    }
    ferry["growth"] = Value::Object(growth);
}

/// Ferry's pooled result as the tables read it: with its growth
/// ([`add_growth`]) and, on every row, `construct_total` equal to its `total`
/// (Ferry's work has no constructor beside it: generating is its
/// constructor), so the constructor rows set it against PyTorch's.
pub(crate) fn ferry_view(mut ferry: Value) -> Value {
    add_growth(&mut ferry);
    if let Some(rows) = ferry["rows"].as_array_mut() {
        for row in rows {
            row["construct_total"] = row["total"].clone();
        }
    }
    ferry
}

fn tables(steps: &mut Steps, o: &Options, ferry_out: &Path, peer_out: &Path) -> Result<()> {
    steps.step_with("table: schedule", || {
        let ferry_path = root().join(ferry_out);
        if o.table_only && !ferry_path.is_file() {
            eprintln!("    no {}: skipping this table", ferry_out.display());
            return Ok("skipped");
        }
        let ferry = ferry_view(table::read_result(&ferry_path)?);
        let peer_path = root().join(peer_out);
        let peer = if !o.no_peer && peer_path.is_file() {
            Some(table::read_result(&peer_path)?)
        } else {
            None
        };
        if let Some(peer) = &peer {
            let n = check_counts(&ferry, peer)?;
            eprintln!(
                "    both sides simulated the same schedules: equal step and lowered-action \
                 counts on {n} rows"
            );
        }
        let heading = format!(
            "Ferry vs PyTorch {TORCH_VERSION} (torch.distributed.pipelining): generate a pipeline \
             schedule for every rank, lower it (SEND/RECV) and simulate it in unit steps; 2 stages \
             per rank (Interleaved1F1B: loop placement, ZBVZeroBubble: V), RxM = ranks x \
             microbatches; same host, one thread each\n\
             Ferry: median [p10–p90] over its repetitions; PyTorch: median [min–max]; each pooled \
             over {} alternating run(s)\n\
             PyTorch: pipeline_order (the constructor with its own lowering skipped) + \
             _add_send_recv + _simulate_comms_compute, the same work as Ferry's; \"via its \
             constructor\": the full constructor (which also adds UNSHARD/RESHARD, REDUCE_GRAD \
             and SEND/RECV for its runtime) + _add_send_recv + _simulate_comms_compute, \
             PyTorch's side as users call it\n\
             ratio = PyTorch / Ferry; target ≥{TARGET}x on every row",
            ferry["runs"]
        );
        let rows = table::compare(&ferry, peer.as_ref(), &main_specs(&ferry, peer.as_ref()));
        let main_out = out_path("schedule.json");
        table::write_json(&root().join(&main_out), &rows)?;
        let phases_heading = format!(
            "per phase (ratio = PyTorch / Ferry, no target), and Ferry's growth with ranks x \
             microbatches (also {}; ns per lowered action = median total / actions after \
             add_send_recv)",
            FERRY_ONLY_SHAPES.join(", ")
        );
        let phases = table::compare(&ferry, peer.as_ref(), &phase_specs(&ferry, peer.as_ref()));
        let text = format!(
            "{heading}\n\n{}\n{phases_heading}\n\n{}",
            table::render(&rows),
            table::render(&phases)
        );
        println!("\n{text}");
        doc::record(Part::Schedule, &text);
        let phases_out = out_path("schedule_phases.json");
        table::write_json(&root().join(&phases_out), &phases)?;
        println!(
            "\nwritten: {}, {}",
            main_out.display(),
            phases_out.display()
        );
        Ok("ok")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One side's run as the scripts write it: per row, samples in seconds.
    fn run(rows: &[(&str, &str, u64, u64, &[f64])]) -> Value {
        let rows: Vec<Value> = rows
            .iter()
            .map(|&(schedule, shape, steps, actions, total)| {
                let (r, m) = shape.split_once('x').expect("RxM");
                let samples =
                    |k: f64| json!({"samples_s": total.iter().map(|t| t * k).collect::<Vec<_>>()});
                json!({"schedule": schedule, "shape": shape, "ranks": r.parse::<u64>().unwrap(),
                       "microbatches": m.parse::<u64>().unwrap(), "stages_per_rank": 2,
                       "steps": steps, "actions": actions, "total": samples(1.0),
                       "generate": samples(0.25), "lower": samples(0.25), "simulate": samples(0.5)})
            })
            .collect();
        json!({"what": "test", "rows": rows})
    }

    #[test]
    fn runs_pool_their_samples() {
        let a = run(&[("ZBVZeroBubble", "8x32", 557, 3328, &[0.001, 0.003])]);
        let b = run(&[("ZBVZeroBubble", "8x32", 557, 3328, &[0.002])]);
        let pooled = pool_runs(&[a.clone(), b.clone()], Spread::MinMax).expect("pools");
        let row = &pooled["rows"][0];
        assert_eq!(row["total"]["n"], json!(3));
        assert_eq!(row["total"]["median_ms"], json!(2.0));
        assert_eq!(
            (
                row["total"]["lo_ms"].as_f64(),
                row["total"]["hi_ms"].as_f64()
            ),
            (Some(1.0), Some(3.0))
        );
        assert_eq!(row["simulate"]["median_ms"], json!(1.0));
        assert_eq!(row["ns_per_action"].as_f64(), Some(2.0 * 1e6 / 3328.0));
        assert_eq!(
            (pooled["runs"].as_u64(), pooled["spread"].as_str()),
            (Some(2), Some("min-max"))
        );
        // p10-p90 interpolates.
        let pooled = pool_runs(&[a.clone(), b], Spread::P10P90).expect("pools");
        let lo = pooled["rows"][0]["total"]["lo_ms"].as_f64().expect("lo");
        assert!((lo - 1.2).abs() < 1e-9, "{lo}");
        // Runs that disagree on a count are refused.
        let c = run(&[("ZBVZeroBubble", "8x32", 558, 3328, &[0.002])]);
        let err = pool_runs(&[a, c], Spread::P10P90).expect_err("differing steps");
        assert!(
            format!("{err}").contains("steps differ between runs"),
            "{err}"
        );
    }

    #[test]
    fn counts_must_agree_between_the_sides() {
        let ferry = run(&[
            ("Interleaved1F1B", "8x32", 863, 2944, &[0.0001]),
            ("Interleaved1F1B", "16x64", 2775, 12032, &[0.0004]),
        ]);
        let peer = run(&[("Interleaved1F1B", "8x32", 863, 2944, &[0.05])]);
        assert_eq!(check_counts(&ferry, &peer).expect("equal"), 1);
        let wrong = run(&[("Interleaved1F1B", "8x32", 862, 2945, &[0.05])]);
        let err = check_counts(&ferry, &wrong).expect_err("different schedules");
        let text = format!("{err}");
        assert!(
            text.contains("Interleaved1F1B 8x32: Ferry steps 863 but PyTorch 862"),
            "{text}"
        );
        assert!(
            text.contains("Ferry actions 2944 but PyTorch 2945"),
            "{text}"
        );
    }

    #[test]
    fn tables_compare_like_with_like_and_mark_the_target() {
        let ferry = run(&[(
            "Interleaved1F1B",
            "8x32",
            863,
            2944,
            &[0.0001, 0.0002, 0.0003],
        )]);
        let mut peer = run(&[("Interleaved1F1B", "8x32", 863, 2944, &[0.05])]);
        peer["rows"][0]["construct_total"] = json!({"samples_s": [0.08]});
        let ferry = ferry_view(pool_runs(&[ferry], Spread::P10P90).expect("pools"));
        let peer = pool_runs(&[peer], Spread::MinMax).expect("pools");
        let rows = table::compare(&ferry, Some(&peer), &main_specs(&ferry, Some(&peer)));
        let find = |case: &str| rows.iter().find(|r| r.case == case).expect(case);
        let total = find("Interleaved1F1B 8x32");
        assert_eq!((total.ferry, total.peer), (Some(0.2), Some(50.0)));
        assert_eq!((total.ratio, total.met), (Some(250.0), Some(false)));
        let ctor = find("Interleaved1F1B 8x32, PyTorch via its constructor");
        assert_eq!(
            (ctor.ferry, ctor.peer, ctor.met),
            (Some(0.2), Some(80.0), Some(true))
        );
        assert!(table::render(&rows).contains("≥300x MISSED"));
        // Rows without a PyTorch side are not judged.
        assert_eq!(find("ZBVZeroBubble 64x256").met, None);
        let phases = table::compare(&ferry, Some(&peer), &phase_specs(&ferry, Some(&peer)));
        let sim = phases
            .iter()
            .find(|r| r.case == "Interleaved1F1B 8x32 simulate")
            .expect("row");
        assert_eq!(sim.ratio, Some(250.0));
        assert!(phases.iter().all(|r| r.target.is_none()));
    }

    #[test]
    fn growth_is_the_log_log_slope() {
        let mut ferry = run(&[
            ("ZBVZeroBubble", "8x32", 1, 1, &[0.001]),
            ("ZBVZeroBubble", "16x64", 1, 1, &[0.004]),
            ("ZBVZeroBubble", "32x128", 1, 1, &[0.016]),
        ]);
        ferry = pool_runs(&[ferry], Spread::P10P90).expect("pools");
        add_growth(&mut ferry);
        let k = ferry["growth"]["ZBVZeroBubble"].as_f64().expect("fitted");
        assert!((k - 1.0).abs() < 1e-9, "{k}");
        assert!(ferry["growth"].get("Interleaved1F1B").is_none());
        assert_eq!(
            all_shapes(),
            ["8x32", "16x64", "32x128", "64x256", "128x512"]
        );
    }
}
