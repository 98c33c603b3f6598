//! The lighthouse: `ferry-lighthouse` against torchft's, both driven by
//! torchft's own client (the peer script) and by `lighthouse_load`.

mod server;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Value};

use self::server::{LighthouseProcess, LighthouseProgram};
use super::comparison::sides_in_order;
use super::doc::{self, Part};
use super::options::Options;
use super::peers::peer_script;
use super::process::{last_json_object, log_tail, run_bounded};
use super::report::Table;
use super::results::{median_tree, out_path, release_binary, remove_stale, write_result};
use crate::bench::table::{Better, Metric, RowSpec};
use crate::setup::{ensure_torchft, venv_python, TORCHFT_VERSION};
use crate::steps::{cargo, cmd, root, run, Steps};

/// Replica counts of the lighthouse quorum rows.
const LIGHTHOUSE_REPLICAS: &[&str] = &["2", "16", "128"];
/// Clients sending heartbeats back to back in the lighthouse bench.
const LIGHTHOUSE_HB_CLIENTS: &str = "8";
/// Shapes (connections × heartbeats in flight on each) of the heartbeat
/// load generator, `lighthouse_load`, run against each lighthouse after the
/// script.
const LIGHTHOUSE_LOAD_SHAPES: &[&str] = &["8x1", "8x16"];
/// `lighthouse_load --seconds`, and under `--quick`.
const LIGHTHOUSE_LOAD_SECONDS: [&str; 2] = ["2", "1"];
/// Runs of the lighthouse script per side, and under `--quick` (each run
/// takes about 6 s; one run's numbers can move by tens of percent from
/// the next, so the table shows the median).
const LIGHTHOUSE_RUNS: [usize; 2] = [5, 1];
/// The lighthouse script's `--rounds` and `--hb-seconds`, and under `--quick`.
const LIGHTHOUSE_ROUNDS: [&str; 2] = ["5", "3"];
const LIGHTHOUSE_HB_SECONDS: [&str; 2] = ["3", "1"];
/// Ferry's target for the lighthouse: at least as fast as
/// torchft's on every row.
const LIGHTHOUSE_TARGET: f64 = 1.0;
/// Bound on one run of `lighthouse_bench.py` (it takes well under a minute).
const LIGHTHOUSE_SCRIPT_TIMEOUT: Duration = Duration::from_secs(300);

/// The lighthouse bench: the peer's `lighthouse_bench.py` (torchft 0.2.0's
/// own `LighthouseClient`) run with `--addr` against `ferry-lighthouse`
/// (built in release) and against torchft's own program,
/// `torchft_lighthouse` (installed with torchft in the `.venv`), each
/// started as its own process, fresh for each run, with the same options
/// (`server::LIGHTHOUSE_OPTIONS`) and killed afterwards whatever happens;
/// [`LIGHTHOUSE_RUNS`] times each, alternating which side goes first.
/// After the script, each run also drives the same server process with
/// Ferry's heartbeat load generator, `lighthouse_load`
/// ([`LIGHTHOUSE_LOAD_SHAPES`]). Each side's result is the median over its
/// runs. Then the table. Under `--no-peer` there is no driver: the
/// bench is skipped.
pub(crate) fn main(steps: &mut Steps, o: &Options) -> Result<()> {
    let runs = LIGHTHOUSE_RUNS[usize::from(o.quick)];
    let heading = format!(
        "Ferry vs torchft {TORCHFT_VERSION}: lighthouse (`ferry-lighthouse` vs torchft's \
         `torchft_lighthouse`), same host, same options (min_replicas 1, join timeout 50 ms, \
         tick 10 ms), both driven by torchft {TORCHFT_VERSION}'s LighthouseClient \
         (lighthouse_bench.py --addr), then by one load generator (lighthouse_load: one \
         thread, C connections with K heartbeats in flight on each)\nquorum: all N replicas \
         ask at once, from the last request sent (or the first) until every replica has its \
         answer, median over rounds; each side: median of {runs} run(s), alternating\n\
         heartbeats handled: the server's capacity, from lighthouse_load; torchft's client \
         spends 3-4x the server's CPU per heartbeat, so its row measures the client (no target)\n\
         both servers run as their own process (bound to 127.0.0.1:0), as deployed; the \
         script reaches each through --addr\n\
         ratio > 1: Ferry is better; target ≥1x: Ferry at least as fast on every row"
    );
    let table = Table {
        name: "lighthouse",
        part: Part::Lighthouse,
        heading: &heading,
        specs: lighthouse_specs,
    };
    if !o.table_only {
        let Some(script) = peer_script(o.no_peer, "lighthouse_bench.py") else {
            eprintln!(
                "(the lighthouse bench is driven by the peer's lighthouse_bench.py: skipping it)"
            );
            return Ok(());
        };
        let (ferry_out, peer_out) = (table.out_path("ferry_"), table.out_path("peer_"));
        remove_stale(&ferry_out)?;
        remove_stale(&peer_out)?;
        doc::record_host("lighthouse", o)?;
        // Per-run logs of an earlier, longer run must not pose as this run's.
        for i in 1..=LIGHTHOUSE_RUNS[0] {
            for stem in [
                "lighthouse_ferry_server",
                "lighthouse_ferry_client",
                "lighthouse_peer_server",
                "lighthouse_peer",
            ] {
                remove_stale(&out_path(&format!("{stem}.{i}.log")))?;
            }
        }
        steps.step_with(
            &format!("setup: torchft {TORCHFT_VERSION} in .venv"),
            ensure_torchft,
        )?;
        steps.step(
            "build: ferry-lighthouse and the load generator lighthouse_load (release)",
            || {
                run(&mut cargo(&[
                    "build",
                    "--release",
                    "-p",
                    "ferry-ft",
                    "--bin",
                    "ferry-lighthouse",
                    "-p",
                    "ferry-benches",
                    "--bin",
                    "lighthouse_load",
                ]))
            },
        )?;
        let script_args = lighthouse_script_args(o);
        let ferry_server = LighthouseProgram::Ferry.command_line();
        let peer_server = format!(
            "{} (torchft {TORCHFT_VERSION}), its own process",
            LighthouseProgram::Torchft.command_line()
        );
        let (mut ferry_runs, mut peer_runs) = (Vec::new(), Vec::new());
        for i in 1..=runs {
            for ferry_side in sides_in_order(i) {
                let (program, side, runs_of_side) = if ferry_side {
                    (LighthouseProgram::Ferry, "ferry", &mut ferry_runs)
                } else {
                    (LighthouseProgram::Torchft, "peer", &mut peer_runs)
                };
                steps.step(
                    &format!(
                        "{side}: lighthouse_bench.py, lighthouse_load against {} ({i}/{runs})",
                        program.name()
                    ),
                    || {
                        let lighthouse = LighthouseProcess::start(
                            program,
                            &out_path(&format!("lighthouse_{side}_server.{i}.log")),
                        )?;
                        let args =
                            [&["--addr", lighthouse.url.as_str()][..], &script_args].concat();
                        let log = match program {
                            LighthouseProgram::Ferry => format!("lighthouse_ferry_client.{i}.log"),
                            LighthouseProgram::Torchft => format!("lighthouse_peer.{i}.log"),
                        };
                        let result = run_lighthouse_script(&script, &args, &out_path(&log))
                            .and_then(|mut result| {
                                let load = run_lighthouse_load(&lighthouse.url, o)?;
                                result["load_heartbeats_per_s"] = load["heartbeats_per_s"].clone();
                                Ok(result)
                            });
                        // Stopped on every path (`LighthouseProcess` also kills on drop).
                        let stopped = lighthouse.stop();
                        let result = match program {
                            LighthouseProgram::Ferry => result,
                            LighthouseProgram::Torchft => {
                                result.context("the peer benchmark failed (`--no-peer` skips it)")
                            }
                        };
                        runs_of_side.push(result?);
                        stopped
                    },
                )?;
            }
        }
        let script_args = script_args.join(" ");
        write_result(
            &ferry_out,
            &median_of_runs(ferry_runs, &ferry_server, &script_args),
        )?;
        write_result(
            &peer_out,
            &median_of_runs(peer_runs, &peer_server, &script_args),
        )?;
    }
    table.run(steps, o)
}

/// One side's result over its runs: every number of the first run's
/// `quorum` and `heartbeats_per_s` replaced by its median over the runs
/// ([`median_tree`]), with `lighthouse` (which server), `args` (the
/// script's options) and `runs` (each run's own result) added.
fn median_of_runs(runs: Vec<Value>, server: &str, args: &str) -> Value {
    let all: Vec<&Value> = runs.iter().collect();
    let field = |key: &str| {
        let values: Vec<&Value> = all.iter().filter_map(|run| run.get(key)).collect();
        if values.is_empty() {
            Value::Null
        } else {
            median_tree(&values)
        }
    };
    json!({
        "lighthouse": server,
        "args": args,
        "aggregate": format!("median over {} run(s)", runs.len()),
        "quorum": field("quorum"),
        "heartbeats_per_s": field("heartbeats_per_s"),
        "load_heartbeats_per_s": field("load_heartbeats_per_s"),
        "runs": runs,
    })
}

/// The arguments both runs of `lighthouse_bench.py` share.
fn lighthouse_script_args(o: &Options) -> Vec<&'static str> {
    let k = usize::from(o.quick);
    let mut args = vec!["--replicas"];
    args.extend_from_slice(LIGHTHOUSE_REPLICAS);
    args.extend([
        "--rounds",
        LIGHTHOUSE_ROUNDS[k],
        "--hb-clients",
        LIGHTHOUSE_HB_CLIENTS,
        "--hb-seconds",
        LIGHTHOUSE_HB_SECONDS[k],
    ]);
    args
}

/// Runs `lighthouse_bench.py` with `args` in the `.venv` (its log, stderr,
/// going to `log`), bounded by [`LIGHTHOUSE_SCRIPT_TIMEOUT`], and returns
/// the JSON object it prints.
fn run_lighthouse_script(script: &Path, args: &[&str], log: &Path) -> Result<Value> {
    let log_file = std::fs::File::create(root().join(log))
        .with_context(|| format!("creating {}", log.display()))?;
    let py = venv_python();
    let mut c = cmd(&py.to_string_lossy(), &[]);
    c.arg(script)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log_file);
    eprintln!(
        "    $ {} {} {}  (log: {})",
        py.display(),
        script.display(),
        args.join(" "),
        log.display()
    );
    let stdout = run_bounded(&mut c, LIGHTHOUSE_SCRIPT_TIMEOUT).map_err(|e| {
        anyhow::anyhow!(
            "lighthouse_bench.py failed: {e:#} (log: {}){}",
            log.display(),
            log_tail(log)
        )
    })?;
    let result = last_json_object(&stdout).with_context(|| {
        format!(
            "lighthouse_bench.py printed no JSON object (stdout: {stdout:?}; log: {})",
            log.display()
        )
    })?;
    eprintln!("    {}", stdout.trim());
    Ok(result)
}

/// Runs the heartbeat load generator (`lighthouse_load`, release build)
/// against the lighthouse at `url` with [`LIGHTHOUSE_LOAD_SHAPES`],
/// bounded by [`LIGHTHOUSE_SCRIPT_TIMEOUT`], and returns the JSON object it
/// prints.
fn run_lighthouse_load(url: &str, o: &Options) -> Result<Value> {
    let seconds = LIGHTHOUSE_LOAD_SECONDS[usize::from(o.quick)];
    let mut args = vec!["--addr", url, "--seconds", seconds, "--shapes"];
    args.extend_from_slice(LIGHTHOUSE_LOAD_SHAPES);
    let binary = release_binary("lighthouse_load");
    eprintln!("    $ {} {}", binary.display(), args.join(" "));
    let mut c = cmd(&binary.to_string_lossy(), &args);
    c.stdin(Stdio::null()).stdout(Stdio::piped());
    let stdout = run_bounded(&mut c, LIGHTHOUSE_SCRIPT_TIMEOUT)
        .map_err(|e| anyhow::anyhow!("lighthouse_load failed: {e:#}"))?;
    let result = serde_json::from_str::<Value>(stdout.trim())
        .ok()
        .filter(Value::is_object)
        .with_context(|| format!("lighthouse_load printed no JSON object (stdout: {stdout:?})"))?;
    eprintln!("    {result}");
    Ok(result)
}

/// Row specs for the lighthouse table: the quorum latency after the last
/// request for each replica count found on either side (ascending), then
/// heartbeats handled per second under each load generator shape
/// ([`LIGHTHOUSE_LOAD_SHAPES`]), all with [`LIGHTHOUSE_TARGET`]; then,
/// without a target, heartbeats per second from torchft's own client (which
/// spends three to four times the server's CPU per heartbeat, so on a small
/// machine it measures the client) and the span from the first quorum
/// request to the last answer.
pub(crate) fn lighthouse_specs(ferry: &Value, peer: Option<&Value>) -> Vec<RowSpec> {
    let mut counts: Vec<u64> = Vec::new();
    for result in std::iter::once(ferry).chain(peer) {
        let quorum = result.get("quorum").and_then(Value::as_object);
        for n in quorum.into_iter().flat_map(|q| q.keys()) {
            if let Ok(n) = n.parse::<u64>() {
                if !counts.contains(&n) {
                    counts.push(n);
                }
            }
        }
    }
    counts.sort_unstable();
    let quorum = |n: u64, field: &str| Metric::At(format!("/quorum/{n}/{field}"));
    let mut specs: Vec<RowSpec> = counts
        .iter()
        .map(|&n| {
            RowSpec::new(
                format!("quorum, {n} replicas: after last request, median"),
                "ms",
                Better::Lower,
                quorum(n, "after_last_request_ms_median"),
            )
            .with_target(LIGHTHOUSE_TARGET)
        })
        .collect();
    specs.extend(LIGHTHOUSE_LOAD_SHAPES.iter().map(|shape| {
        let (connections, in_flight) = shape.split_once('x').unwrap_or((shape, "1"));
        RowSpec::new(
            format!(
                "heartbeats handled, {connections} connections x {in_flight} in flight \
                 (lighthouse_load)"
            ),
            "hb/s",
            Better::Higher,
            Metric::At(format!("/load_heartbeats_per_s/{shape}")),
        )
        .with_target(LIGHTHOUSE_TARGET)
    }));
    specs.push(RowSpec::new(
        format!(
            "heartbeats, torchft's client, {LIGHTHOUSE_HB_CLIENTS} threads back to back \
             (client-bound)"
        ),
        "hb/s",
        Better::Higher,
        Metric::At("/heartbeats_per_s".into()),
    ));
    specs.extend(counts.iter().map(|&n| {
        RowSpec::new(
            format!("quorum, {n} replicas: first request to all answered, median"),
            "ms",
            Better::Lower,
            quorum(n, "first_to_all_done_ms_median"),
        )
    }));
    specs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::table;
    use serde_json::json;

    #[test]
    fn lighthouse_rows_follow_the_script_schema() {
        // As lighthouse_bench.py prints it (keys are strings, in run order).
        let result = |lat: [f64; 3], hb: f64| {
            json!({"addr": "http://127.0.0.1:1", "quorum": {
                "2": {"after_last_request_ms_median": lat[0], "first_to_all_done_ms_median": 2.0 * lat[0], "rounds": 5},
                "16": {"after_last_request_ms_median": lat[1], "first_to_all_done_ms_median": 2.0 * lat[1], "rounds": 5},
                "128": {"after_last_request_ms_median": lat[2], "first_to_all_done_ms_median": 2.0 * lat[2], "rounds": 5}},
                "heartbeats_per_s": hb,
                "load_heartbeats_per_s": {"8x1": 3.0 * hb, "8x16": 5.0 * hb}})
        };
        let ferry = result([0.5, 1.0, 8.0], 20000.0);
        let peer = result([1.0, 1.0, 4.0], 10000.0);
        let specs = lighthouse_specs(&ferry, Some(&peer));
        let rows = table::compare(&ferry, Some(&peer), &specs);
        let cases: Vec<&str> = rows.iter().map(|r| r.case.as_str()).collect();
        assert_eq!(
            cases,
            [
                "quorum, 2 replicas: after last request, median",
                "quorum, 16 replicas: after last request, median",
                "quorum, 128 replicas: after last request, median",
                "heartbeats handled, 8 connections x 1 in flight (lighthouse_load)",
                "heartbeats handled, 8 connections x 16 in flight (lighthouse_load)",
                "heartbeats, torchft's client, 8 threads back to back (client-bound)",
                "quorum, 2 replicas: first request to all answered, median",
                "quorum, 16 replicas: first request to all answered, median",
                "quorum, 128 replicas: first request to all answered, median",
            ]
        );
        let got = |i: usize| (rows[i].ferry, rows[i].peer, rows[i].ratio, rows[i].met);
        assert_eq!(got(0), (Some(0.5), Some(1.0), Some(2.0), Some(true)));
        // Equal is at least as fast.
        assert_eq!(got(1), (Some(1.0), Some(1.0), Some(1.0), Some(true)));
        assert_eq!(got(2), (Some(8.0), Some(4.0), Some(0.5), Some(false)));
        assert_eq!(
            got(3),
            (Some(60000.0), Some(30000.0), Some(2.0), Some(true))
        );
        assert_eq!(
            got(4),
            (Some(100000.0), Some(50000.0), Some(2.0), Some(true))
        );
        // torchft's own client sets its rate: shown, without a target.
        assert_eq!(got(5), (Some(20000.0), Some(10000.0), Some(2.0), None));
        assert!(rows[3..6].iter().all(|r| r.unit == "hb/s"));
        assert_eq!(got(8), (Some(16.0), Some(8.0), Some(0.5), None));
        assert_eq!(rows.iter().filter(|r| r.target == Some(1.0)).count(), 5);
        // Ferry's result alone still gives every row.
        let alone = table::compare(&ferry, None, &lighthouse_specs(&ferry, None));
        assert_eq!(alone.len(), 9);
        assert!(alone.iter().all(|r| r.ferry.is_some() && r.met.is_none()));
    }

    #[test]
    fn lighthouse_runs_reduce_to_medians() {
        let run = |lat: f64, hb: f64, addr: &str| {
            json!({"addr": addr, "quorum": {"2": {"after_last_request_ms_median": lat,
                   "first_to_all_done_ms_median": 2.0 * lat, "rounds": 5}},
                   "heartbeats_per_s": hb})
        };
        let runs = vec![
            run(0.3, 100.0, "a"),
            run(0.1, 300.0, "b"),
            run(0.2, 200.0, "c"),
        ];
        let result = median_of_runs(runs.clone(), "server", "--rounds 5");
        assert_eq!(result["quorum"]["2"]["after_last_request_ms_median"], 0.2);
        assert_eq!(result["quorum"]["2"]["first_to_all_done_ms_median"], 0.4);
        // Equal integers stay integers.
        assert_eq!(result["quorum"]["2"]["rounds"], json!(5));
        assert_eq!(result["heartbeats_per_s"], 200.0);
        assert_eq!(result["runs"], json!(runs));
        assert_eq!(
            (result["lighthouse"].as_str(), result["args"].as_str()),
            (Some("server"), Some("--rounds 5"))
        );
        // Two runs: the mean of the two; one run: itself.
        let two = median_of_runs(runs[..2].to_vec(), "s", "");
        assert_eq!(two["heartbeats_per_s"], 200.0);
        let one = median_of_runs(runs[..1].to_vec(), "s", "");
        assert_eq!(one["quorum"], runs[0]["quorum"]);
        // The table reads the medians.
        let rows = table::compare(&result, Some(&one), &lighthouse_specs(&result, Some(&one)));
        assert_eq!((rows[0].ferry, rows[0].peer), (Some(0.2), Some(0.3)));
    }

    #[test]
    fn lighthouse_script_plumbing() {
        let (ferry, torchft) = (LighthouseProgram::Ferry, LighthouseProgram::Torchft);
        assert_eq!(
            ferry.parse_address("ferry-lighthouse listening on http://127.0.0.1:41234\n"),
            Some("http://127.0.0.1:41234".to_string())
        );
        assert_eq!(ferry.parse_address("listening on http://x:1"), None);
        assert_eq!(
            ferry.parse_address("ferry-lighthouse listening on http://"),
            None
        );
        assert_eq!(ferry.parse_address(""), None);
        // torchft_lighthouse's log line names the host, not the bound address.
        assert_eq!(
            torchft.parse_address(
                "2026-11-21T03:49:32.054 [INFO] [torchft::lighthouse] - \
                 Lighthouse listening on: http://vm:41101"
            ),
            Some("http://127.0.0.1:41101".to_string())
        );
        assert_eq!(
            torchft.parse_address("[INFO] - Quorum status: New quorum not ready"),
            None
        );
        assert_eq!(
            torchft.parse_address("Lighthouse listening on: http://vm:0"),
            None
        );
        assert_eq!(
            torchft.parse_address("Lighthouse listening on: http://vm"),
            None
        );
        assert!(torchft.binary().ends_with(".venv/bin/torchft_lighthouse"));

        let text = "noise\n{\"quorum\": {}, \"heartbeats_per_s\": 1.0}\n[1]\nmore noise\n";
        assert_eq!(
            last_json_object(text),
            Some(json!({"quorum": {}, "heartbeats_per_s": 1.0}))
        );
        assert_eq!(last_json_object("no json\n[1, 2]\n"), None);

        let full = lighthouse_script_args(&Options::default()).join(" ");
        assert_eq!(
            full,
            "--replicas 2 16 128 --rounds 5 --hb-clients 8 --hb-seconds 3"
        );
        let quick = Options {
            quick: true,
            ..Options::default()
        };
        assert!(lighthouse_script_args(&quick)
            .join(" ")
            .ends_with("--rounds 3 --hb-clients 8 --hb-seconds 1"));
        // Both programs get what the script would give torchft's in-process server.
        assert_eq!(
            ferry.command_line(),
            "ferry-lighthouse --bind 127.0.0.1:0 --min_replicas 1 --join_timeout_ms 50 \
             --quorum_tick_ms 10 --heartbeat_timeout_ms 60000"
        );
        assert_eq!(
            torchft.command_line(),
            "torchft_lighthouse --bind 127.0.0.1:0 --min_replicas 1 --join_timeout_ms 50 \
             --quorum_tick_ms 10 --heartbeat_timeout_ms 60000"
        );
    }
}
