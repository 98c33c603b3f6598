//! Ferry's side of `cargo xtask bench --only schedule`: how long it takes
//! to generate a pipeline schedule for every rank, lower it
//! ([`add_send_recv`]) and simulate it ([`simulate_unit_steps`]), the same
//! work `benches/peers/pt_schedule.py` times in PyTorch.
//!
//! For each schedule (Interleaved1F1B in the loop placement, ZBVZeroBubble
//! in the V, both with 2 stages per rank) and each shape (ranks ×
//! microbatches), one repetition is: [`ScheduleKind::generate`] for all
//! ranks and the stage-to-rank placement (`generate`), [`add_send_recv`]
//! (`lower`), [`simulate_unit_steps`] (`simulate`), each phase timed on its
//! own. Repetitions run until the row has at least `--min-reps` of them and
//! `--min-seconds` of work (at most `--max-reps`). Per row: every sample
//! (seconds, so runs can be pooled), their statistics in ms, the simulated
//! step count and the number of lowered actions (the xtask checks both
//! equal PyTorch's), and ns per lowered action. Per schedule: the exponent
//! of a least-squares fit of time against ranks × microbatches over the
//! shapes measured (1 means time grows linearly with the work).
//!
//! Usage (clap; `--help` lists the options): `schedule_bench [--quick] [--shapes 8x32 16x64 ...] [--min-reps N]
//! [--max-reps N] [--min-seconds S] [--schedules NAME ...] [--out PATH]` (`--quick`: fewer
//! repetitions; explicit options win over it). Writes the JSON result to
//! `--out`, or prints it without one.

use std::error::Error;
use std::time::Instant;

use ferry_schedule::{add_send_recv, simulate_unit_steps, ScheduleKind};
use serde_json::{json, Value};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// Stages per rank of both schedules.
const STAGES_PER_RANK: usize = 2;
/// The schedules measured, with the names both sides use.
const SCHEDULES: [(&str, ScheduleKind); 2] = [
    ("Interleaved1F1B", ScheduleKind::Interleaved1F1B),
    ("ZBVZeroBubble", ScheduleKind::ZbvZeroBubble),
];
/// Shapes (ranks, microbatches): the three PyTorch also runs, and two more
/// for how Ferry's time grows.
const SHAPES: [(usize, usize); 5] = [(8, 32), (16, 64), (32, 128), (64, 256), (128, 512)];

/// Times generating, lowering and simulating pipeline schedules (Ferry's
/// side of `cargo xtask bench --only schedule`).
#[derive(clap::Parser)]
#[command(name = "schedule_bench")]
struct Args {
    /// Fewer repetitions (explicit options win over it).
    #[arg(long)]
    quick: bool,
    /// Shapes to measure, as RANKSxMICROBATCHES (default: 8x32 16x64 32x128 64x256 128x512).
    #[arg(long, num_args = 1.., value_parser = parse_shape)]
    shapes: Option<Vec<(usize, usize)>>,
    /// Least repetitions per row (default 20, 5 with --quick).
    #[arg(long)]
    min_reps: Option<usize>,
    /// Most repetitions per row (default 1000, 50 with --quick).
    #[arg(long)]
    max_reps: Option<usize>,
    /// Least seconds of work per row (default 1, 0.2 with --quick).
    #[arg(long)]
    min_seconds: Option<f64>,
    /// Where to write the JSON result (printed without it).
    #[arg(long)]
    out: Option<String>,
    /// Schedules to measure, by name (default: Interleaved1F1B ZBVZeroBubble).
    #[arg(long, num_args = 1.., value_parser = parse_schedule)]
    schedules: Option<Vec<String>>,
}

struct Config {
    schedules: Vec<(&'static str, ScheduleKind)>,
    shapes: Vec<(usize, usize)>,
    min_reps: usize,
    max_reps: usize,
    min_seconds: f64,
    out: Option<String>,
}

fn parse_shape(text: &str) -> std::result::Result<(usize, usize), String> {
    let bad = || format!("a shape is RANKSxMICROBATCHES, e.g. 8x32 (got `{text}`)");
    let (ranks, micro) = text.split_once('x').ok_or_else(bad)?;
    Ok((
        ranks.parse().map_err(|_| bad())?,
        micro.parse().map_err(|_| bad())?,
    ))
}

fn parse_schedule(text: &str) -> std::result::Result<String, String> {
    match SCHEDULES.iter().find(|(name, _)| *name == text) {
        Some((name, _)) => Ok(name.to_string()),
        None => Err(format!(
            "unknown schedule `{text}` (known: {})",
            SCHEDULES.map(|(name, _)| name).join(", ")
        )),
    }
}

fn config() -> Config {
    let args = <Args as clap::Parser>::parse();
    let quick = args.quick;
    let min_reps: usize = args.min_reps.unwrap_or(if quick { 5 } else { 20 });
    let schedules = match &args.schedules {
        Some(names) => SCHEDULES
            .into_iter()
            .filter(|(name, _)| names.iter().any(|n| n == name))
            .collect(),
        None => SCHEDULES.to_vec(),
    };
    Config {
        schedules,
        shapes: args.shapes.unwrap_or_else(|| SHAPES.to_vec()),
        min_reps: min_reps.max(1),
        max_reps: args
            .max_reps
            .unwrap_or(if quick { 50 } else { 1000 })
            .max(min_reps),
        min_seconds: args.min_seconds.unwrap_or(if quick { 0.2 } else { 1.0 }),
        out: args.out,
    }
}

/// The three phases of one repetition, in seconds, with the step count
/// and the number of lowered actions.
struct Rep {
    generate: f64,
    lower: f64,
    simulate: f64,
    steps: usize,
    actions: usize,
}

fn one_rep(kind: ScheduleKind, ranks: usize, micro: usize) -> Result<Rep> {
    let t0 = Instant::now();
    let compute = kind.generate(ranks, STAGES_PER_RANK, micro)?;
    let stage_to_rank = kind
        .placement()
        .stage_to_rank(ranks * STAGES_PER_RANK, ranks)?;
    let t1 = Instant::now();
    let lowered = add_send_recv(&compute, &stage_to_rank)?;
    let t2 = Instant::now();
    let timeline = simulate_unit_steps(&lowered, &stage_to_rank)?;
    let t3 = Instant::now();
    let actions = lowered.ranks.iter().flatten().flatten().count();
    Ok(Rep {
        generate: (t1 - t0).as_secs_f64(),
        lower: (t2 - t1).as_secs_f64(),
        simulate: (t3 - t2).as_secs_f64(),
        steps: timeline.steps(),
        actions,
    })
}

/// The `p` quantile of sorted `values`, interpolating linearly between
/// the two nearest ranks (as the peers' `pct`).
fn pct(sorted: &[f64], p: f64) -> f64 {
    let idx = p * (sorted.len() - 1) as f64;
    let lo = idx.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] * (1.0 - (idx - lo as f64)) + sorted[hi] * (idx - lo as f64)
}

/// Statistics of `secs` in ms, and the samples themselves in seconds.
fn stats(secs: &[f64]) -> Value {
    let mut ms: Vec<f64> = secs.iter().map(|s| s * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let n = ms.len();
    json!({
        "n": n, "median_ms": pct(&ms, 0.5), "p10_ms": pct(&ms, 0.1), "p90_ms": pct(&ms, 0.9),
        "min_ms": ms[0], "max_ms": ms[n - 1], "mean_ms": ms.iter().sum::<f64>() / n as f64,
        "samples_s": secs,
    })
}

fn row(name: &str, kind: ScheduleKind, ranks: usize, micro: usize, c: &Config) -> Result<Value> {
    // One untimed repetition: warms the allocator and gives the counts.
    let first = one_rep(kind, ranks, micro)?;
    let (mut generate, mut lower, mut simulate, mut total) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let start = Instant::now();
    while total.len() < c.max_reps
        && (total.len() < c.min_reps || start.elapsed().as_secs_f64() < c.min_seconds)
    {
        let rep = one_rep(kind, ranks, micro)?;
        if (rep.steps, rep.actions) != (first.steps, first.actions) {
            return Err(format!("{name} {ranks}x{micro}: repetitions disagree").into());
        }
        generate.push(rep.generate);
        lower.push(rep.lower);
        simulate.push(rep.simulate);
        total.push(rep.generate + rep.lower + rep.simulate);
    }
    let median_total = stats(&total)["median_ms"].as_f64().unwrap_or(f64::NAN);
    let result = json!({
        "schedule": name, "ranks": ranks, "microbatches": micro,
        "stages_per_rank": STAGES_PER_RANK, "shape": format!("{ranks}x{micro}"),
        "steps": first.steps, "actions": first.actions, "reps": total.len(),
        "total": stats(&total), "generate": stats(&generate), "lower": stats(&lower),
        "simulate": stats(&simulate),
        "ns_per_action": median_total * 1e6 / first.actions as f64,
    });
    eprintln!(
        "{name:>16} {ranks:>4}x{micro:<5} steps {:>6} actions {:>8} reps {:>4}  median {:>9.3} ms \
         (generate {:.3}, lower {:.3}, simulate {:.3})",
        first.steps,
        first.actions,
        total.len(),
        median_total,
        result["generate"]["median_ms"].as_f64().unwrap_or(f64::NAN),
        result["lower"]["median_ms"].as_f64().unwrap_or(f64::NAN),
        result["simulate"]["median_ms"].as_f64().unwrap_or(f64::NAN),
    );
    Ok(result)
}

/// The slope of the least-squares line through (ln x, ln y): time ∝
/// (ranks × microbatches)^slope. `None` with fewer than two distinct x.
fn exponent(points: &[(f64, f64)]) -> Option<f64> {
    let logs: Vec<(f64, f64)> = points.iter().map(|(x, y)| (x.ln(), y.ln())).collect();
    let n = logs.len() as f64;
    let mx = logs.iter().map(|p| p.0).sum::<f64>() / n;
    let my = logs.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = logs.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = logs.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

fn main() -> Result<()> {
    let c = config();
    let mut rows = Vec::new();
    let mut growth = serde_json::Map::new();
    for &(name, kind) in &c.schedules {
        let mut points = Vec::new();
        for &(ranks, micro) in &c.shapes {
            let r = row(name, kind, ranks, micro, &c)?;
            let median = r["total"]["median_ms"].as_f64().unwrap_or(f64::NAN);
            points.push(((ranks * micro) as f64, median));
            rows.push(r);
        }
        let fit = exponent(&points);
        eprintln!(
            "{name}: time grows as (ranks x microbatches)^{}",
            fit.map_or("?".into(), |e| format!("{e:.2}"))
        );
        growth.insert(
            name.to_string(),
            json!({"exponent_vs_ranks_x_microbatches": fit}),
        );
    }
    let result = json!({
        "bench": "ferry_schedule",
        "what": "generate (all ranks) + add_send_recv + simulate_unit_steps",
        "config": {"min_reps": c.min_reps, "max_reps": c.max_reps, "min_seconds": c.min_seconds},
        "rows": rows,
        "growth": growth,
    });
    let text = serde_json::to_string(&result)?;
    match &c.out {
        Some(out) => {
            std::fs::write(out, format!("{text}\n")).map_err(|e| format!("writing {out}: {e}"))?
        }
        None => println!("{text}"),
    }
    Ok(())
}
