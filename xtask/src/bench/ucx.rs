//! `cargo xtask bench --only ucx`: Ferry's `ucx` channel against
//! `ucx_perftest` (`tag_lat`, `tag_bw`; Debian's `ucx-utils`, installed
//! here) for `UCX_TLS` shm and tcp, in the same run: one-way bandwidth at
//! 4 MiB and 64 MiB and the small-message latency (`ferry-transport`'s
//! example `ucx_bench`, which also measures the latency with no spin);
//! then the empty `rpc_sync` round trip (`ferry-benches`' `rpc_latency`,
//! size 0) over the `ucx` transport against Ferry's own `shm` transport:
//! the medians of [`RPC_ROUNDS`] runs of each side, their fastest runs,
//! and the two sides within each of the two thread placements a run can
//! land in ([`placement_split`]).
//!
//! The two sides alternate, [`ROUNDS`] times: the rows show the medians
//! and the range of the per-round ratios. Where `UCX_TLS` names a network
//! transport, Ferry's endpoints ask for UCX's peer-failure handling (UCX
//! 1.13 aborts the process on a failed TCP peer without it) and connect
//! through UCX's connection manager, which keeps zero-copy rendezvous
//! over TCP as the plain `ucx_perftest` has it. `ucx_perftest -e`
//! (failure handling on endpoints from worker addresses, so rendezvous
//! data goes as fragments the receiver copies out) is measured too, and
//! the ratio is given against each.
//! Prints the ratios and writes `target/ferry-bench/ucx.json`.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::doc::{self, Part};
use super::options::Options;
use super::results::{out_path, release_binary, write_result};
use crate::bench::table;
use crate::setup::ensure_debian_package;
use crate::steps::{cargo, run, Steps};

const PERFTEST: &str = "/usr/bin/ucx_perftest";
/// Bandwidth sizes, bytes.
const SIZES: [u64; 2] = [4 << 20, 64 << 20];
/// Ferry's target: its bandwidth at least this share of `ucx_perftest`'s.
const BANDWIDTH_TARGET: f64 = 0.9;
/// Rounds of the comparison, the sides alternating within each: one
/// round's bandwidth ratio over UCX's tcp can move by tens of percent
/// from the next on a busy host, so the median needs more than three.
const ROUNDS: usize = 5;
/// Rounds of the `rpc_sync` comparison (each side's run takes about a
/// second and a half). Each run's median covers about 2,000 calls, a few
/// tens of milliseconds, in which the threads keep one placement on the
/// cores; where the threads outnumber the cores that placement alone can
/// double a run's median, so the ratio needs many runs of each side,
/// and the bench also compares the sides within each placement
/// ([`placement_split`]).
const RPC_ROUNDS: usize = 20;

/// The `ucx_perftest` figures of one test: (50th percentile latency in
/// µs, overall bandwidth in MiB/s) from its `Final:` line (its "MB/s"
/// column divides by 2^20, as `ucx_bench` does).
/// `err_handling`: endpoints with UCX's peer-failure handling (`-e`).
fn perftest(
    tls: &str,
    test: &str,
    size: u64,
    iters: u32,
    port: u16,
    err_handling: bool,
) -> Result<(f64, f64)> {
    let args = |c: &mut Command| {
        c.env("UCX_TLS", tls)
            .args(["-p", &port.to_string()])
            .args(err_handling.then_some("-e"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
    };
    // The server prints this line once it listens (stdbuf makes its piped
    // stdout line-buffered), so the client connects once, when it can.
    let mut server = Command::new("stdbuf");
    server.args(["-oL", PERFTEST]);
    args(&mut server);
    let mut server = server.spawn().context("starting ucx_perftest's server")?;
    // Kept open until the client is done: a server writing to a closed
    // pipe would die of SIGPIPE.
    let mut lines = server
        .stdout
        .take()
        .map(BufReader::new)
        .context("ucx_perftest's server has no stdout")?
        .lines();
    let listening = lines
        .by_ref()
        .map_while(std::result::Result::ok)
        .any(|l| l.starts_with("Waiting for connection"));
    let out = if listening {
        let mut client = Command::new(PERFTEST);
        client.arg("127.0.0.1");
        args(&mut client);
        client.args([
            "-t",
            test,
            "-s",
            &size.to_string(),
            "-n",
            &iters.to_string(),
        ]);
        let o = client.output().context("running ucx_perftest")?;
        o.status
            .success()
            .then(|| String::from_utf8_lossy(&o.stdout).into_owned())
    } else {
        None
    };
    let _ = server.kill();
    let _ = server.wait();
    drop(lines);
    let out = out.with_context(|| format!("ucx_perftest {test} never ran (UCX_TLS={tls})"))?;
    let line = out
        .lines()
        .find(|l| l.starts_with("Final:"))
        .with_context(|| format!("no Final: line in ucx_perftest's output:\n{out}"))?;
    let cols: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|c| c.parse().ok())
        .collect();
    if cols.len() < 8 {
        bail!("unexpected ucx_perftest line {line:?}");
    }
    Ok((cols[1], cols[5]))
}

/// The median of `values` (0 when there are none).
fn median(values: &[f64]) -> f64 {
    table::median(values).unwrap_or(0.0)
}

/// The smallest of `values` (infinity when there are none).
fn min(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::INFINITY, f64::min)
}

/// How much slower the slower of the two thread placements must be, at
/// the widest step between consecutive runs, for [`placement_split`] to
/// call the runs two groups (the placements differ by tens of percent,
/// neighbouring runs within one by a few).
const PLACEMENT_STEP: f64 = 1.2;

/// The fewest runs [`placement_split`] puts in either group, so that one
/// or two stray runs at the slow end (a run the host disturbed) do not
/// make a group of their own.
const PLACEMENT_MIN_RUNS: usize = 3;

/// Where `runs` (the run medians of both sides together) split into the
/// two thread placements: the midpoint of the widest step, by ratio,
/// between consecutive sorted runs that leaves at least
/// [`PLACEMENT_MIN_RUNS`] on each side, when that step is at least
/// [`PLACEMENT_STEP`]; `None` when the runs form one group.
fn placement_split(runs: &[f64]) -> Option<f64> {
    let mut sorted = runs.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    (PLACEMENT_MIN_RUNS..=n.saturating_sub(PLACEMENT_MIN_RUNS))
        .map(|i| (sorted[i - 1], sorted[i]))
        .filter(|&(lo, _)| lo > 0.0)
        .max_by(|a, b| (a.1 / a.0).total_cmp(&(b.1 / b.0)))
        .filter(|&(lo, hi)| hi / lo >= PLACEMENT_STEP)
        .map(|(lo, hi)| (lo + hi) / 2.0)
}

/// One placement's row: how many runs of each side landed in it, their
/// medians and the ratio of the medians.
fn placement_row(name: &str, ucx: &[f64], shm: &[f64]) -> String {
    let side = |runs: &[f64]| match table::median(runs) {
        None => "no runs".to_string(),
        Some(m) => format!("{} runs, median {m:.2} us", runs.len()),
    };
    let ratio = match (table::median(ucx), table::median(shm)) {
        (Some(u), Some(s)) => format!("   ucx/shm {:.2}", u / s),
        _ => String::new(),
    };
    format!(
        "  {name}: over ucx {}   over Ferry's shm {}{ratio}",
        side(ucx),
        side(shm)
    )
}

/// `min-max` of `values`, two decimals.
fn range(values: &[f64]) -> String {
    let lo = min(values);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{lo:.2}-{hi:.2}")
}

/// Ferry's `ucx_bench` for `tls`, over `channel` and `transport`.
fn ferry(tls: &str, channel: &str, transport: &str) -> Result<Value> {
    let exe = release_binary("examples/ucx_bench");
    let sizes: Vec<String> = SIZES.iter().map(|s| s.to_string()).collect();
    let o = Command::new(&exe)
        .args(["--tls", tls, "--sizes", &sizes.join(",")])
        .args(["--channel", channel, "--transport", transport])
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", exe.display()))?;
    if !o.status.success() {
        bail!("ucx_bench --tls {tls} failed");
    }
    let text = String::from_utf8_lossy(&o.stdout);
    serde_json::from_str(text.trim()).with_context(|| format!("ucx_bench printed {text:?}"))
}

/// The median empty `rpc_sync` round trip in µs over `transport`.
fn rpc_sync(transport: &str, tls: Option<&str>) -> Result<f64> {
    let exe = release_binary("rpc_latency");
    let out = out_path(&format!("ucx_rpc_{transport}.json"));
    let mut c = Command::new(&exe);
    c.args(["--quick", "--sizes", "0", "--out"])
        .arg(&out)
        .env("FERRY_TRANSPORTS", transport);
    if let Some(tls) = tls {
        c.env("FERRY_UCX_TLS", tls);
    }
    run(&mut c)?;
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out)?)?;
    let used = &v["link"]["transport"];
    if used.as_str() != Some(transport) {
        bail!(
            "rpc_latency asked for transport {transport} but ran over {used} (link: {})",
            v["link"]
        );
    }
    v["cells"][0]["rpc_sync"]["median_ms"]
        .as_f64()
        .map(|ms| ms * 1e3)
        .context("no rpc_sync median in rpc_latency's result")
}

/// The line above the benchmark's rows.
const HEADING: &str = "Ferry's ucx channel vs ucx_perftest (same run, this host):";

/// Runs the UCX benchmark.
pub(crate) fn main(steps: &mut Steps, o: &Options) -> Result<()> {
    steps.step_with("setup: ucx-utils (Debian)", || {
        ensure_debian_package("ucx-utils", PERFTEST)
    })?;
    if !Path::new(PERFTEST).exists() {
        eprintln!("(UCX benchmark skipped: {PERFTEST} is missing)");
        return Ok(());
    }
    steps.step("build: ucx_bench, rpc_latency (feature ucx)", || {
        run(&mut cargo(&[
            "build",
            "--release",
            "-p",
            "ferry-transport",
            "--features",
            "ucx",
            "--example",
            "ucx_bench",
        ]))?;
        run(&mut cargo(&[
            "build",
            "--release",
            "-p",
            "ferry-benches",
            "--features",
            "ucx",
            "--bin",
            "rpc_latency",
        ]))
    })?;
    doc::record_host("ucx", o)?;
    let mut rows = Vec::new();
    let mut result = json!({});
    for (i, tls) in ["shm", "tcp"].into_iter().enumerate() {
        // Ferry's endpoints ask for peer-failure handling exactly where
        // UCX_TLS names a network transport (see the module's doc).
        let with_e = tls != "shm";
        let mut rounds = Vec::new();
        steps.step(
            &format!("ucx_perftest and Ferry, UCX_TLS={tls}, {ROUNDS} rounds alternating"),
            || {
                for round in 0..ROUNDS {
                    let port = 13_500 + 100 * i as u16 + 10 * round as u16;
                    let (lat, _) = perftest(tls, "tag_lat", 8, 20_000, port, false)?;
                    let mut bw = json!({});
                    let mut bw_e = json!({});
                    for (j, size) in SIZES.into_iter().enumerate() {
                        let iters = (4u64 << 30).div_ceil(size).clamp(16, 1000) as u32;
                        let port = port + 1 + 2 * j as u16;
                        let (_, mib_s) = perftest(tls, "tag_bw", size, iters, port, false)?;
                        bw[size.to_string()] = json!(mib_s);
                        if with_e {
                            let (_, mib_s) = perftest(tls, "tag_bw", size, iters, port + 1, true)?;
                            bw_e[size.to_string()] = json!(mib_s);
                        }
                    }
                    let mut peer = json!({"latency_us": lat, "bandwidth_mib_s": bw});
                    if with_e {
                        peer["bandwidth_mib_s_err_handling"] = bw_e;
                    }
                    rounds.push(json!({"ucx_perftest": peer, "ferry": ferry(tls, "ucx", "ucx")?}));
                }
                Ok(())
            },
        )?;
        let get = |r: &Value, side: &str, field: &str, key: &str| {
            r[side][field][key].as_f64().unwrap_or(0.0)
        };
        for size in SIZES {
            let key = size.to_string();
            let f: Vec<f64> = rounds
                .iter()
                .map(|r| get(r, "ferry", "bandwidth_mib_s", &key))
                .collect();
            let mut peers = vec![("ucx_perftest", "bandwidth_mib_s")];
            if with_e {
                peers.push(("ucx_perftest -e", "bandwidth_mib_s_err_handling"));
            }
            for (name, field) in peers {
                let p: Vec<f64> = rounds
                    .iter()
                    .map(|r| get(r, "ucx_perftest", field, &key))
                    .collect();
                let per_round: Vec<f64> = f.iter().zip(&p).map(|(f, p)| f / p).collect();
                let (fv, pv) = (median(&f), median(&p));
                let ratio = fv / pv;
                rows.push(format!(
                    "{tls:>4}  bandwidth {:>3} MiB   Ferry {fv:>9.1} MiB/s   {name:<15} {pv:>9.1} MiB/s   ratio {ratio:.2} (rounds {}; target >= {BANDWIDTH_TARGET}) {}",
                    size >> 20,
                    range(&per_round),
                    if ratio >= BANDWIDTH_TARGET { "met" } else { "MISSED" }
                ));
            }
        }
        let lat = |side: &str, field: &str| {
            median(
                &rounds
                    .iter()
                    .map(|r| r[side][field].as_f64().unwrap_or(0.0))
                    .collect::<Vec<_>>(),
            )
        };
        let (fl, fl0, pl) = (
            lat("ferry", "latency_us"),
            lat("ferry", "latency_us_no_spin"),
            lat("ucx_perftest", "latency_us"),
        );
        rows.push(format!(
            "{tls:>4}  one-way latency 8 B  Ferry {fl:.2} us (no spin {fl0:.2} us)   ucx_perftest {pl:.2} us   Ferry/UCX {:.2}",
            fl / pl
        ));
        // Ferry's medians stand for the same-host comparison below; every
        // round is kept.
        let mut ferry_bw = json!({});
        for size in SIZES {
            let key = size.to_string();
            ferry_bw[&key] = json!(median(
                &rounds
                    .iter()
                    .map(|r| get(r, "ferry", "bandwidth_mib_s", &key))
                    .collect::<Vec<_>>()
            ));
        }
        result[tls] = json!({
            "ferry": {"bandwidth_mib_s": ferry_bw, "latency_us": fl, "latency_us_no_spin": fl0},
            "rounds": rounds,
        });
    }
    // One host: the same measurement over Ferry's own same-host channels,
    // which sets the `ucx` channel's priority below or above them.
    let mut same_host = json!({});
    steps.step("same host: cma and shm channels (shm transport)", || {
        for ch in ["cma", "shm"] {
            same_host[ch] = ferry("shm", ch, "shm")?;
        }
        Ok(())
    })?;
    for size in SIZES {
        let key = size.to_string();
        let get = |v: &Value| v["bandwidth_mib_s"][&key].as_f64().unwrap_or(0.0);
        let u = get(&result["shm"]["ferry"]);
        let (c, m) = (get(&same_host["cma"]), get(&same_host["shm"]));
        rows.push(format!(
            "same host, {:>3} MiB: ucx (UCX shm) {u:.1} MiB/s, cma {c:.1} MiB/s, shm {m:.1} MiB/s: {} wins",
            size >> 20,
            [("ucx", u), ("cma", c), ("shm", m)]
                .iter()
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .map_or("none", |w| w.0)
        ));
    }
    let lat = |v: &Value| v["latency_us"].as_f64().unwrap_or(0.0);
    rows.push(format!(
        "same host, one-way 8 B: ucx {:.2} us, cma {:.2} us, shm {:.2} us (each over its transport)",
        lat(&result["shm"]["ferry"]),
        lat(&same_host["cma"]),
        lat(&same_host["shm"])
    ));
    result["same_host"] = same_host;
    let mut ucx_runs = Vec::new();
    let mut shm_runs = Vec::new();
    steps.step(
        &format!(
            "rpc_sync (empty): transport ucx (shm) vs Ferry's shm, {RPC_ROUNDS} rounds alternating"
        ),
        || {
            for _ in 0..RPC_ROUNDS {
                ucx_runs.push(rpc_sync("ucx", Some("shm"))?);
                shm_runs.push(rpc_sync("shm", None)?);
            }
            Ok(())
        },
    )?;
    let (ucx_us, shm_us) = (median(&ucx_runs), median(&shm_runs));
    let per_round: Vec<f64> = ucx_runs.iter().zip(&shm_runs).map(|(u, s)| u / s).collect();
    rows.push(format!(
        "empty rpc_sync round trip   over ucx (UCX shm) {ucx_us:.2} us   over Ferry's shm {shm_us:.2} us   ucx/shm {:.2} (rounds {}; target <= 1) {}",
        ucx_us / shm_us,
        range(&per_round),
        if ucx_us <= shm_us { "met" } else { "MISSED" }
    ));
    // A run's median depends on where its threads landed (see
    // RPC_ROUNDS); the fastest run of each side compares the two in the
    // best placement either got.
    let (ucx_best, shm_best) = (min(&ucx_runs), min(&shm_runs));
    rows.push(format!(
        "empty rpc_sync, fastest run of each   over ucx (UCX shm) {ucx_best:.2} us   over Ferry's shm {shm_best:.2} us   ucx/shm {:.2}",
        ucx_best / shm_best
    ));
    // Each run keeps one of two placements: compare the sides within
    // each, with how many runs of each side landed there.
    let pooled: Vec<f64> = ucx_runs.iter().chain(&shm_runs).copied().collect();
    let split = placement_split(&pooled);
    match split {
        Some(at) => {
            let in_placement = |runs: &[f64], fast: bool| -> Vec<f64> {
                runs.iter().copied().filter(|&r| (r < at) == fast).collect()
            };
            rows.push(format!(
                "empty rpc_sync by thread placement (the runs split at {at:.1} us):"
            ));
            for (name, fast) in [("fast placement", true), ("slow placement", false)] {
                rows.push(placement_row(
                    name,
                    &in_placement(&ucx_runs, fast),
                    &in_placement(&shm_runs, fast),
                ));
            }
        }
        None => rows.push("empty rpc_sync: the runs form one group (no placement split)".into()),
    }
    result["rpc_sync_us"] = json!({
        "ucx_shm": ucx_us,
        "ferry_shm": shm_us,
        "fastest": {"ucx_shm": ucx_best, "ferry_shm": shm_best},
        "placement_split_us": split,
        "rounds": {"ucx_shm": ucx_runs, "ferry_shm": shm_runs},
    });
    result["summary"] = json!(rows);
    write_result(&out_path("ucx.json"), &result)?;
    print_summary(&rows);
    Ok(())
}

/// Under `--table-only`: the rows of the last run, from `ucx.json`.
pub(crate) fn table(steps: &mut Steps) -> Result<()> {
    steps.step_with("table: ucx", || {
        let path = crate::steps::root().join(out_path("ucx.json"));
        if !path.is_file() {
            eprintln!("    no {}: skipping this table", path.display());
            return Ok("skipped");
        }
        let result = table::read_result(&path)?;
        let rows: Vec<String> = result["summary"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r.as_str().map(String::from))
            .collect();
        print_summary(&rows);
        Ok("ok")
    })
}

/// Prints the benchmark's rows and records them for `docs/benchmarks.md`.
fn print_summary(rows: &[String]) {
    let text = std::iter::once(HEADING.to_string())
        .chain(rows.iter().map(|r| format!("  {r}")))
        .collect::<Vec<_>>()
        .join("\n");
    println!("\n{text}");
    doc::record(Part::Ucx, &text);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_in_two_placements_split_at_the_widest_step() {
        let runs = [11.2, 9.8, 18.5, 11.4, 21.1, 16.6, 12.1, 23.8];
        let at = placement_split(&runs).expect("two groups");
        assert!((at - (12.1 + 16.6) / 2.0).abs() < 1e-9, "{at}");
    }

    #[test]
    fn a_stray_slow_run_does_not_make_a_group() {
        let runs = [11.2, 9.8, 18.5, 11.4, 21.1, 16.6, 12.1, 19.0, 41.3];
        let at = placement_split(&runs).expect("two groups");
        assert!((at - (12.1 + 16.6) / 2.0).abs() < 1e-9, "{at}");
    }

    #[test]
    fn runs_in_one_placement_do_not_split() {
        assert_eq!(placement_split(&[11.0, 11.5, 12.0, 12.9, 13.4]), None);
        assert_eq!(placement_split(&[11.0]), None);
        assert_eq!(placement_split(&[]), None);
    }

    #[test]
    fn a_placement_row_names_a_side_without_runs() {
        let row = placement_row("slow placement", &[20.0, 22.0], &[]);
        assert!(row.contains("over ucx 2 runs, median 21.00 us"), "{row}");
        assert!(row.contains("over Ferry's shm no runs"), "{row}");
        assert!(!row.contains("ucx/shm"), "{row}");
    }
}
