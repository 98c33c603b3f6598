//! `docs/benchmarks.md`, generated: each benchmark's tables exactly as the
//! bench printed them from its result files, under the host they were
//! measured on.
//!
//! A benchmark that runs records the host in
//! `target/ferry-bench/<name>.host.json` ([`record_host`]); its table step
//! records what it prints ([`record`]); at the end [`write`](fn@write) replaces that
//! benchmark's section of the document and keeps the others as they were,
//! so `--only NAME` updates one section and `--table-only` rebuilds every
//! section whose results are in `target/ferry-bench/`.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use super::options::Options;
use super::results::{out_path, write_result};
use crate::setup::TORCH_VERSION;
use crate::steps::{cmd, root};

/// The generated document, relative to the repository root.
pub(crate) const DOC: &str = "docs/benchmarks.md";

/// A section of the document, in the document's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    Rpc,
    /// The `auth:` rows of the RPC table.
    Authentication,
    Rref,
    /// `ferry.rpc` against `torch.distributed.rpc`, both from Python.
    Python,
    Autograd,
    Lighthouse,
    Schedule,
    Pipeline,
    Collective,
    Ucx,
}

impl Part {
    pub(crate) const ALL: [Part; 10] = [
        Part::Rpc,
        Part::Authentication,
        Part::Rref,
        Part::Python,
        Part::Autograd,
        Part::Lighthouse,
        Part::Schedule,
        Part::Pipeline,
        Part::Collective,
        Part::Ucx,
    ];

    /// The section's heading.
    pub(crate) fn title(self) -> &'static str {
        match self {
            Part::Rpc => "RPC latency and throughput",
            Part::Authentication => "Authentication",
            Part::Rref => "Tensor or RRef argument (the PyTorch RPC paper's Table 1)",
            Part::Python => "Ferry from Python",
            Part::Autograd => "Distributed autograd overhead (the paper's Table 2)",
            Part::Lighthouse => "Lighthouse",
            Part::Schedule => "Pipeline schedules",
            Part::Pipeline => "Pipeline-parallel training",
            Part::Collective => "Collectives (allreduce and recovery)",
            Part::Ucx => "UCX",
        }
    }

    /// The `--only` name of the benchmark that measures it (and the stem
    /// of its host record).
    pub(crate) fn bench(self) -> &'static str {
        match self {
            Part::Rpc | Part::Authentication => "rpc",
            Part::Rref => "rref",
            Part::Python => "python",
            Part::Autograd => "autograd",
            Part::Lighthouse => "lighthouse",
            Part::Schedule => "schedule",
            Part::Pipeline => "pipeline",
            Part::Collective => "collective",
            Part::Ucx => "ucx",
        }
    }

    /// What the section is, above its host line.
    fn about(self) -> &'static str {
        match self {
            Part::Rpc => {
                "Ferry's `rpc_latency` against PyTorch RPC (TensorPipe) with \
                `benches/peers/pt_rpc_latency.py`."
            }
            Part::Authentication => {
                "What the group's secret costs: the `auth:` rows of \
                `rpc_latency` (Ferry only; `benches/src/auth_cost.rs`), see \
                [Authentication](reference/authentication.md#cost)."
            }
            Part::Rref => {
                "Ferry's `rref_overhead` against PyTorch RPC with \
                `benches/peers/pt_rref_overhead.py`."
            }
            Part::Python => {
                "`ferry.rpc` (a release build of ferry-py) against \
                `torch.distributed.rpc`, both with `benches/peers/py_rpc.py`, \
                and the Rust `rpc_sync` of `rpc_latency` on the same link."
            }
            Part::Autograd => {
                "`ferry-autograd`'s `autograd_overhead` against PyTorch with \
                `benches/peers/pt_dist_autograd_overhead.py`."
            }
            Part::Lighthouse => {
                "`ferry-lighthouse` against torchft's `torchft_lighthouse`, \
                driven by `benches/peers/lighthouse_bench.py` and `lighthouse_load`."
            }
            Part::Schedule => {
                "`ferry-schedule`'s `schedule_bench` against \
                `torch.distributed.pipelining` with `benches/peers/pt_schedule.py`."
            }
            Part::Pipeline => {
                "`ferry-pipeline`'s `pipeline_bench` against \
                `torch.distributed.pipelining` with `benches/peers/pt_pipeline.py`."
            }
            Part::Collective => {
                "`ferry-ft`'s `collective_bench` example (`ProcessGroup`, \
                `BabyProcessGroup`) against torchft's `ProcessGroupGloo` and \
                `ProcessGroupBabyGloo` with `benches/peers/tf_collective.py`."
            }
            Part::Ucx => {
                "The `ucx` channel and transport against `ucx_perftest`, see \
                [UCX](reference/ucx.md#the-benchmark)."
            }
        }
    }
}

/// What the table steps of this run printed, by part.
static PRINTED: Mutex<Vec<(Part, String)>> = Mutex::new(Vec::new());

/// Records `text`, as printed, for `part`'s section: the section's new
/// body is everything recorded for it in this run, in order.
pub(crate) fn record(part: Part, text: &str) {
    let text = text.trim_matches('\n');
    let mut printed = PRINTED.lock().unwrap_or_else(|e| e.into_inner());
    match printed.iter_mut().find(|(p, _)| *p == part) {
        Some((_, body)) => {
            body.push_str("\n\n");
            body.push_str(text);
        }
        None => printed.push((part, text.to_string())),
    }
}

/// `target/ferry-bench/<bench>.host.json`.
fn host_path(bench: &str) -> std::path::PathBuf {
    out_path(&format!("{bench}.host.json"))
}

/// Records the host and the settings benchmark `bench` (its `--only` name)
/// runs with now, for the document's host line.
pub(crate) fn record_host(bench: &str, o: &Options) -> Result<()> {
    write_result(&host_path(bench), &host(o))
}

/// This machine and this run, as the host line shows them.
fn host(o: &Options) -> Value {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let cpu = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|(_, v)| v.trim())
        })
        .unwrap_or("unknown CPU")
        .to_string();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_gib = read("/proc/meminfo")
        .lines()
        .find_map(|l| {
            l.strip_prefix("MemTotal:")?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map(|kb| (kb / (1 << 20) as f64).round());
    let load: Vec<f64> = read("/proc/loadavg")
        .split_whitespace()
        .take(3)
        .filter_map(|x| x.parse().ok())
        .collect();
    let commit = cmd("git", &["rev-parse", "--short", "HEAD"])
        .current_dir(root())
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string());
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    json!({
        "cpu": cpu,
        "cpus": cpus,
        "memory_gib": mem_gib,
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
        "load_average": load,
        "date_utc": utc(secs),
        "commit": commit,
        "quick": o.quick,
        "no_peer": o.no_peer,
        "torch": TORCH_VERSION,
    })
}

/// `YYYY-MM-DD HH:MM` in UTC for `secs` since the Unix epoch (Howard
/// Hinnant's `civil_from_days`).
fn utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let (hh, mm) = ((secs % 86_400) / 3600, (secs % 3600) / 60);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {hh:02}:{mm:02}")
}

/// The host line of a section, from a host record.
fn host_line(host: &Value) -> String {
    let s = |k: &str| host[k].as_str().unwrap_or("?").to_string();
    let mem = host["memory_gib"]
        .as_f64()
        .map_or(String::new(), |g| format!(", {g} GiB"));
    let load = host["load_average"]
        .get(0)
        .and_then(Value::as_f64)
        .map_or(String::new(), |l| {
            format!(", load average {l:.2} at the start")
        });
    let commit = host["commit"]
        .as_str()
        .map_or(String::new(), |c| format!(" at `{c}`"));
    let mut how = String::from("`cargo xtask bench");
    if host["quick"].as_bool() == Some(true) {
        how.push_str(" --quick");
    }
    if host["no_peer"].as_bool() == Some(true) {
        how.push_str(" --no-peer");
    }
    how.push('`');
    format!(
        "Host: {}, {} CPUs{mem}, Linux {}; {} UTC{commit}, {how}{load}; PyTorch {}.",
        s("cpu"),
        host["cpus"],
        s("kernel"),
        s("date_utc"),
        s("torch"),
    )
}

/// A generated section: heading, what it is, the host line and the text
/// as printed.
fn section(part: Part, host: Option<&Value>, text: &str) -> String {
    let host = host.map_or("Host: not recorded.".to_string(), host_line);
    format!(
        "## {}\n\n{} `cargo xtask bench --only {}`.\n{host}\n\n```text\n{text}\n```\n",
        part.title(),
        part.about(),
        part.bench(),
    )
}

/// The sections of a markdown document by their `## ` heading (the text
/// from the heading line to the next, fences respected).
fn sections(doc: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    let mut fence = false;
    for line in doc.lines() {
        if line.starts_with("```") {
            fence = !fence;
        }
        if !fence && line.starts_with("## ") {
            out.push((line[3..].trim().to_string(), String::new()));
        }
        if let Some((_, text)) = out.last_mut() {
            text.push_str(line);
            text.push('\n');
        }
    }
    out
}

const INTRO: &str = "# Benchmarks

The current figures of each benchmark, side by side with its peer, on the
host named in each section. This file is generated by `cargo xtask bench`
from the results in `target/ferry-bench/` (`cargo xtask bench
--table-only` rebuilds it from them): each section is a benchmark's
tables exactly as the bench printed them. A ratio above 1 means Ferry is
better. How each benchmark measures is in its heading lines, in the peer
scripts' headers (`benches/peers/`) and in the reference pages; `cargo
xtask bench --only cuda` and the criterion benches print to the terminal
only.
";

/// The document: [`INTRO`], then every part in order: the text printed in
/// this run, else the section `old` has under the same heading, else a
/// line saying how to fill it.
fn render(old: &str, printed: &[(Part, String)], hosts: &dyn Fn(Part) -> Option<Value>) -> String {
    let old = sections(old);
    let mut doc = String::from(INTRO);
    for part in Part::ALL {
        doc.push('\n');
        if let Some((_, text)) = printed.iter().find(|(p, _)| *p == part) {
            doc.push_str(&section(part, hosts(part).as_ref(), text));
        } else if let Some((_, text)) = old.iter().find(|(title, _)| title == part.title()) {
            doc.push_str(text.trim_end_matches('\n'));
            doc.push('\n');
        } else {
            doc.push_str(&format!(
                "## {}\n\nNot measured yet: `cargo xtask bench --only {}` fills this section.\n",
                part.title(),
                part.bench()
            ));
        }
    }
    doc
}

/// Rewrites [`DOC`] with what this run's table steps printed (nothing to
/// do if they printed nothing).
pub(crate) fn write() -> Result<()> {
    let printed = PRINTED.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if printed.is_empty() {
        return Ok(());
    }
    let path = root().join(DOC);
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    let hosts = |part: Part| super::table::read_result(&root().join(host_path(part.bench()))).ok();
    let doc = render(&old, &printed, &hosts);
    std::fs::write(&path, doc).with_context(|| format!("writing {DOC}"))?;
    let parts: Vec<&str> = printed.iter().map(|(p, _)| p.title()).collect();
    eprintln!("\nwritten: {DOC} ({})", parts.join("; "));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_utc_calendar_days() {
        assert_eq!(utc(0), "1970-01-01 00:00");
        assert_eq!(utc(951_782_400 + 3_661), "2000-02-29 01:01");
        assert_eq!(utc(1_795_953_600), "2026-11-29 12:00");
    }

    #[test]
    fn a_run_replaces_its_sections_and_keeps_the_others() {
        let old = "# Benchmarks\n\nold intro\n\n## Authentication\n\nhand-written\n\n\
                   ```text\n## not a heading\n```\n\n## Lighthouse\n\nold lighthouse\n";
        let host = json!({"cpu": "Some CPU", "cpus": 2, "memory_gib": 8.0, "kernel": "6.1",
                          "load_average": [0.5, 0.4, 0.3], "date_utc": "2026-11-29 10:00",
                          "commit": "abc1234", "quick": true, "no_peer": false, "torch": "2.13.0"});
        let hosts = |p: Part| (p == Part::Lighthouse).then(|| host.clone());
        let doc = render(old, &[(Part::Lighthouse, "table\nrows".into())], &hosts);
        let titles: Vec<String> = sections(&doc).into_iter().map(|(t, _)| t).collect();
        let want: Vec<&str> = Part::ALL.iter().map(|p| p.title()).collect();
        assert_eq!(titles, want);
        assert!(doc.starts_with(INTRO), "{doc}");
        // Kept verbatim, fenced heading-like lines included.
        assert!(
            doc.contains("## Authentication\n\nhand-written\n\n```text\n## not a heading\n```\n")
        );
        assert!(!doc.contains("old lighthouse"));
        assert!(doc.contains(
            "Host: Some CPU, 2 CPUs, 8 GiB, Linux 6.1; 2026-11-29 10:00 UTC at `abc1234`, \
             `cargo xtask bench --quick`, load average 0.50 at the start; PyTorch 2.13.0.\n\n\
             ```text\ntable\nrows\n```\n"
        ));
        assert!(doc.contains("## UCX\n\nNot measured yet: `cargo xtask bench --only ucx`"));
        // Generating again from the result changes nothing.
        assert_eq!(render(&doc, &[], &|_| None), doc);
    }
}
