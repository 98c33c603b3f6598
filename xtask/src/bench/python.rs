//! Ferry from Python: `ferry.rpc` against `torch.distributed.rpc`, both
//! run by the same script (`py_rpc.py --module ...`) on the sizes of
//! `--only rpc` and the paper's Table 1, with the Rust `rpc_sync` measured
//! next to the Python one on the same link, for what Python adds.
//!
//! The `ferry` package the script imports is a release build of ferry-py
//! (the `.venv`'s editable install is the dev build `cargo xtask test`
//! makes): [`build_release`] builds its extension module with cargo, as
//! `maturin develop --release` would, and stages the package under
//! `target/ferry-bench/ferry-py/`, which the Ferry side puts first on
//! `PYTHONPATH`; the `.venv` and the source tree are left as they were.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

use super::comparison::sides_in_order;
use super::doc::{self, Part};
use super::options::Options;
use super::peers::{peer_script, PEERS_DIR};
use super::report::Table;
use super::results::{bench_bin, out_path, release_binary, remove_stale, write_result};
use crate::bench::table::{self, median, Better, Metric, RowSpec};
use crate::setup::{ferry_py_dir, venv_python, with_libtorch};
use crate::steps::{cargo, cmd, root, run, Steps};

/// The table's name: `target/ferry-bench/{ferry_,peer_,}py_rpc.json`.
const NAME: &str = "py_rpc";
/// The script both sides run, in `benches/peers/`.
const SCRIPT: &str = "py_rpc.py";
/// The module each side's script uses.
const FERRY_MODULE: &str = "ferry.rpc";
const PEER_MODULE: &str = "torch.distributed.rpc";
/// The sizes of `--only rpc` under `--quick` (no 400 MB).
const SIZES: &[&str] = &["0", "1KB", "1MB", "4MB", "40MB"];
/// The paper's Table 1 sizes, and under `--quick`.
const TABLE1_SIZES: [&[&str]; 2] = [&["4MB", "40MB", "400MB"], &["4MB", "40MB"]];
/// Seconds of `rpc_sync` calls per size and run, and under `--quick`,
/// the same on all three sides.
const CELL_SECONDS: [&str; 2] = ["3", "1"];
/// Runs of each side, and under `--quick`: the table shows the median over
/// the runs of each run's median, with their min–max.
const RUNS: [usize; 2] = [5, 2];
/// Where the release build of the `ferry` package is staged.
const STAGE_DIR: &str = "target/ferry-bench/ferry-py";

/// Issue 51's targets, as ratios PyTorch / Ferry: the empty call at least
/// 20× faster, 40 MB at least 4×.
fn target(bytes: f64) -> Option<f64> {
    match bytes as u64 {
        0 => Some(20.0),
        b if b == 40 << 20 => Some(4.0),
        _ => None,
    }
}

/// The steps: the release build, then [`RUNS`] runs of each side
/// alternating which goes first (Ferry's: the script with `ferry.rpc`
/// and, next to it, the Rust `rpc_latency --latency-only`), then the table.
pub(crate) fn main(steps: &mut Steps, o: &Options) -> Result<()> {
    let quick = usize::from(o.quick);
    if !o.table_only {
        let ferry_out = out_path(&format!("ferry_{NAME}.json"));
        let peer_out = out_path(&format!("peer_{NAME}.json"));
        remove_stale(&ferry_out)?;
        remove_stale(&peer_out)?;
        doc::record_host(Part::Python.bench(), o)?;
        steps.step("build: ferry-py (release), staged", build_release)?;
        let script = root().join(PEERS_DIR).join(SCRIPT);
        let peer = peer_script(o.no_peer, SCRIPT);
        let runs = RUNS[quick];
        let (run_py, run_rust, run_pt) = (
            out_path(&format!("ferry_{NAME}.run.json")),
            out_path(&format!("ferry_{NAME}.rust.run.json")),
            out_path(&format!("peer_{NAME}.run.json")),
        );
        let (mut py, mut rust, mut pt) = (Vec::new(), Vec::new(), Vec::new());
        for i in 1..=runs {
            let of = format!(" (run {i}/{runs})");
            for ferry_side in sides_in_order(i) {
                if ferry_side {
                    // The Rust figure right next to the Python one, on
                    // the side away from the peer's run.
                    let rust_first = i % 2 == 0;
                    for rust_now in [rust_first, !rust_first] {
                        if rust_now {
                            steps
                                .step(&format!("ferry: rpc_latency --latency-only{of}"), || {
                                    run_rust_side(o, &run_rust)
                                })?;
                            rust.push(read_run(&run_rust)?);
                        } else {
                            steps.step(
                                &format!("ferry: {SCRIPT} --module {FERRY_MODULE}{of}"),
                                || run_script(o, &script, FERRY_MODULE, &run_py),
                            )?;
                            py.push(read_run(&run_py)?);
                        }
                    }
                } else if let Some(peer) = &peer {
                    steps.step(
                        &format!("peer: {SCRIPT} --module {PEER_MODULE}{of}"),
                        || run_script(o, peer, PEER_MODULE, &run_pt),
                    )?;
                    pt.push(read_run(&run_pt)?);
                }
            }
        }
        write_result(&ferry_out, &over_runs(&py, Some(&rust)))?;
        if !pt.is_empty() {
            write_result(&peer_out, &over_runs(&pt, None))?;
        }
    }
    let heading = heading(o);
    Table {
        name: NAME,
        part: Part::Python,
        heading: &heading,
        specs,
    }
    .run(steps, o)
}

/// One run's result, with the load average when it ended.
fn read_run(out: &Path) -> Result<Value> {
    let mut v = table::read_result(&root().join(out))?;
    v["load_1min_after"] = json!(load_1min());
    Ok(v)
}

/// The 1-minute load average now (`NaN` where it cannot be read).
fn load_1min() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Builds ferry-py's extension module in release (`cargo build --release
/// -p ferry-py --features extension-module`, against the `.venv`'s torch,
/// as maturin builds it) and stages the package: `STAGE_DIR/ferry/` holds
/// links to the Python sources and `_ferry.so`, a link to the build.
fn build_release() -> Result<()> {
    let mut c = cargo(&[
        "build",
        "--release",
        "-p",
        "ferry-py",
        "--lib",
        "--features",
        "extension-module",
    ]);
    run(with_libtorch(&mut c)).context("building ferry-py in release")?;
    let lib = release_binary("libferry_py.so");
    if !lib.is_file() {
        bail!("the release build left no {}", lib.display());
    }
    stage(
        &ferry_py_dir().join("python").join("ferry"),
        &lib,
        &root().join(STAGE_DIR),
    )
}

/// Stages the package `src` (the `ferry` sources) with the extension
/// module `lib` as `<dir>/ferry`: a link to each entry of `src` but its
/// own extension modules and caches, and `_ferry.so` linking to `lib`.
fn stage(src: &Path, lib: &Path, dir: &Path) -> Result<()> {
    let pkg = dir.join("ferry");
    if pkg.exists() {
        std::fs::remove_dir_all(&pkg).with_context(|| format!("removing {}", pkg.display()))?;
    }
    std::fs::create_dir_all(&pkg).with_context(|| format!("creating {}", pkg.display()))?;
    let entries = std::fs::read_dir(src).with_context(|| format!("reading {}", src.display()))?;
    for entry in entries {
        let name = entry?.file_name();
        let text = name.to_string_lossy();
        if (text.starts_with("_ferry.") && text.ends_with(".so")) || text == "__pycache__" {
            continue;
        }
        std::os::unix::fs::symlink(src.join(&name), pkg.join(&name))
            .with_context(|| format!("linking {text} into {}", pkg.display()))?;
    }
    std::os::unix::fs::symlink(lib, pkg.join("_ferry.so"))
        .with_context(|| format!("linking {} into {}", lib.display(), pkg.display()))
}

/// The script's arguments shared by both sides, then `--quick`.
fn script_args(o: &Options) -> Vec<&'static str> {
    let quick = usize::from(o.quick);
    let mut args = vec!["--sizes"];
    args.extend(SIZES);
    args.push("--table1-sizes");
    args.extend(TABLE1_SIZES[quick]);
    args.extend(["--cell-seconds", CELL_SECONDS[quick]]);
    if o.quick {
        args.push("--quick");
    }
    args
}

/// One run of `script` with `module`, its result written to `out`; the
/// Ferry side finds the staged release build first on `PYTHONPATH`.
fn run_script(o: &Options, script: &Path, module: &str, out: &Path) -> Result<()> {
    let py = venv_python();
    let mut c = cmd(&py.to_string_lossy(), &[]);
    c.arg(script)
        .args(["--module", module])
        .args(script_args(o));
    c.arg("--out").arg(out);
    if module == FERRY_MODULE {
        let mut path = std::ffi::OsString::from(root().join(STAGE_DIR));
        if let Some(p) = std::env::var_os("PYTHONPATH") {
            path.push(":");
            path.push(p);
        }
        c.env("PYTHONPATH", path);
    }
    run(&mut c).with_context(|| format!("{SCRIPT} --module {module} failed"))
}

/// One run of the Rust `rpc_latency --latency-only` on the same sizes
/// and cell length, its result written to `out`.
fn run_rust_side(o: &Options, out: &Path) -> Result<()> {
    let quick = usize::from(o.quick);
    let mut c = bench_bin("rpc_latency");
    c.arg("--").arg("--latency-only");
    if o.quick {
        c.arg("--quick");
    }
    c.arg("--sizes").args(SIZES);
    c.args(["--cell-seconds", CELL_SECONDS[quick]]);
    c.arg("--out").arg(out);
    run(&mut c)
}

/// `{median, min, max, runs}` of one number over the runs (`null` if
/// no run has it).
fn spread(values: Vec<f64>) -> Value {
    let Some(m) = median(&values) else {
        return Value::Null;
    };
    let finite = values.iter().copied().filter(|v| v.is_finite());
    let min = finite.clone().fold(f64::INFINITY, f64::min);
    let max = finite.fold(f64::NEG_INFINITY, f64::max);
    json!({"median": m, "min": min, "max": max, "runs": values})
}

/// The entry of `list` (at `ptr` in a run's result) with these `bytes`.
fn entry<'a>(run: &'a Value, ptr: &str, bytes: &Value) -> Option<&'a Value> {
    run.pointer(ptr)?
        .as_array()?
        .iter()
        .find(|e| e.get("bytes").and_then(Value::as_f64) == bytes.as_f64())
}

/// The number at `field` of the entry of each run with these `bytes`.
fn over(runs: &[Value], list: &str, bytes: &Value, field: &str) -> Value {
    spread(
        runs.iter()
            .filter_map(|r| entry(r, list, bytes)?.pointer(field)?.as_f64())
            .collect(),
    )
}

/// The sizes (label, bytes) of `list` in the first run.
fn sizes_of(runs: &[Value], list: &str) -> Vec<(Value, Value)> {
    let first = runs
        .first()
        .and_then(|r| r.pointer(list))
        .and_then(Value::as_array);
    first
        .into_iter()
        .flatten()
        .map(|e| (e["size"].clone(), e["bytes"].clone()))
        .collect()
}

/// A side's result over its runs: each number as its [`spread`] over the
/// runs' values; for Ferry's side, with the Rust `rpc_sync` runs `rust`
/// (the i-th next to the i-th Python run), also Python's overhead: per
/// run, the Python median minus the Rust one, in µs, and their ratio.
fn over_runs(runs: &[Value], rust: Option<&[Value]>) -> Value {
    let cells: Vec<Value> = sizes_of(runs, "/cells")
        .into_iter()
        .map(|(size, bytes)| {
            json!({
                "size": size, "bytes": bytes,
                "rpc_sync_median_ms": over(runs, "/cells", &bytes, "/rpc_sync/median_ms"),
                "rpc_sync_p90_ms": over(runs, "/cells", &bytes, "/rpc_sync/p90_ms"),
                "async10_per_call_ms": over(runs, "/cells", &bytes, "/async10_per_call_ms_median"),
            })
        })
        .collect();
    let rows: Vec<Value> = sizes_of(runs, "/rows")
        .into_iter()
        .map(|(size, bytes)| {
            json!({
                "size": size, "bytes": bytes,
                "tensor_median_ms": over(runs, "/rows", &bytes, "/tensor/median_ms"),
                "rref_median_ms": over(runs, "/rows", &bytes, "/rref/median_ms"),
                "rref_minus_tensor_median_ms":
                    over(runs, "/rows", &bytes, "/rref_minus_tensor_median_ms"),
            })
        })
        .collect();
    let mut out = Map::new();
    out.insert(
        "module".into(),
        runs.first().map_or(Value::Null, |r| r["module"].clone()),
    );
    out.insert(
        "compiled".into(),
        runs.first().map_or(Value::Null, |r| r["compiled"].clone()),
    );
    out.insert("runs".into(), json!(runs.len()));
    let loads = runs
        .iter()
        .filter_map(|r| r["load_1min_after"].as_f64())
        .collect();
    out.insert("load_1min_after".into(), spread(loads));
    out.insert("cells".into(), json!(cells));
    out.insert("rows".into(), json!(rows));
    if let Some(rust) = rust {
        let mut overhead = Vec::new();
        let mut rust_cells = Vec::new();
        for (size, bytes) in sizes_of(runs, "/cells") {
            let pairs: Vec<(f64, f64)> = runs
                .iter()
                .zip(rust)
                .filter_map(|(p, r)| {
                    let at = |run| {
                        entry(run, "/cells", &bytes)?
                            .pointer("/rpc_sync/median_ms")?
                            .as_f64()
                    };
                    Some((at(p)?, at(r)?))
                })
                .collect();
            rust_cells.push(json!({
                "size": size, "bytes": bytes,
                "rpc_sync_median_ms": over(rust, "/cells", &bytes, "/rpc_sync/median_ms"),
            }));
            overhead.push(json!({
                "size": size, "bytes": bytes,
                "us": spread(pairs.iter().map(|(p, r)| (p - r) * 1e3).collect()),
                "ratio": spread(pairs.iter().filter(|(_, r)| *r > 0.0).map(|(p, r)| p / r).collect()),
            }));
        }
        out.insert(
            "rust".into(),
            json!({"link": rust.first().map_or(Value::Null, |r| r["link"].clone()),
                   "cells": rust_cells}),
        );
        out.insert("python_overhead".into(), json!(overhead));
    }
    Value::Object(out)
}

/// The table's heading, with the runs, the link and the load average
/// from the results (when there).
fn heading(o: &Options) -> String {
    let read = |prefix: &str| {
        table::read_result(&root().join(out_path(&format!("{prefix}{NAME}.json")))).ok()
    };
    let (ferry, peer) = (read("ferry_"), read("peer_"));
    let runs = ferry
        .as_ref()
        .and_then(|f| f["runs"].as_u64())
        .unwrap_or(RUNS[usize::from(o.quick)] as u64);
    let link = ferry
        .as_ref()
        .and_then(|f| {
            f.pointer("/rust/link/transport")?
                .as_str()
                .map(str::to_string)
        })
        .unwrap_or_else(|| "?".into());
    let load = |side: &Option<Value>| -> String {
        let at = |k: &str| {
            side.as_ref()?
                .pointer(&format!("/load_1min_after/{k}"))?
                .as_f64()
        };
        match (at("min"), at("max")) {
            (Some(lo), Some(hi)) => format!("{lo:.1}–{hi:.1}"),
            _ => "-".into(),
        }
    };
    format!(
        "Ferry from Python: ferry.rpc vs torch.distributed.rpc (TensorPipe), the same script \
         (benches/peers/{SCRIPT} --module ...), same host, CPU float32 tensors, ferry-py built \
         in release, its workers after ferry.rpc.retain_freed_memory() (opt-in)\n\
         each side {runs} runs, alternating which goes first; a cell: the median over the runs \
         of each run's median [min–max over the runs]; load average (1 min) after the runs: \
         ferry {}, peer {}\n\
         Rust rpc_sync: rpc_latency --latency-only run next to each ferry.rpc run, same sizes \
         and settings, link {link}; Python overhead: per run, ferry.rpc's median minus the \
         Rust one (and their ratio)\n\
         ratio > 1: Ferry is better; targets: the empty call ≥20x, 40MB ≥4x",
        load(&ferry),
        load(&peer),
    )
}

/// The table's rows: per size, `rpc_sync` (median, p90) and async10 per
/// call; per Table 1 size, the tensor and RRef medians and their
/// difference; then, Ferry's only, the Rust `rpc_sync` and Python's
/// overhead over it.
fn specs(ferry: &Value, peer: Option<&Value>) -> Vec<RowSpec> {
    let sizes = |list: &str| {
        let mut seen: Vec<(String, Value)> = Vec::new();
        for side in std::iter::once(ferry).chain(peer) {
            for e in side
                .pointer(list)
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let bytes = e["bytes"].clone();
                if !seen.iter().any(|(_, b)| b.as_f64() == bytes.as_f64()) {
                    seen.push((e["size"].as_str().unwrap_or("?").to_string(), bytes));
                }
            }
        }
        seen
    };
    let spread_row = |case: String, unit: &str, list: &str, bytes: &Value, field: &str| {
        let at = |k: &str| Metric::InList {
            list: list.into(),
            matching: vec![("bytes".into(), bytes.clone())],
            field: format!("/{field}/{k}"),
        };
        RowSpec::new(case, unit, Better::Lower, at("median")).with_range(at("min"), at("max"))
    };
    let mut specs = Vec::new();
    for (size, bytes) in sizes("/cells") {
        let row = spread_row(
            format!("{size} rpc_sync median"),
            "ms",
            "/cells",
            &bytes,
            "rpc_sync_median_ms",
        );
        specs.push(match bytes.as_f64().and_then(target) {
            Some(t) => row.with_target(t),
            None => row,
        });
        specs.push(spread_row(
            format!("{size} rpc_sync p90"),
            "ms",
            "/cells",
            &bytes,
            "rpc_sync_p90_ms",
        ));
        specs.push(spread_row(
            format!("{size} async10 per call"),
            "ms",
            "/cells",
            &bytes,
            "async10_per_call_ms",
        ));
    }
    for (size, bytes) in sizes("/rows") {
        for (case, field) in [
            ("tensor", "tensor_median_ms"),
            ("rref", "rref_median_ms"),
            ("rref-tensor", "rref_minus_tensor_median_ms"),
        ] {
            specs.push(spread_row(
                format!("Table 1 {size} {case} median"),
                "ms",
                "/rows",
                &bytes,
                field,
            ));
        }
    }
    for (size, bytes) in sizes("/rust/cells") {
        specs.push(spread_row(
            format!("{size} Rust rpc_sync median (Ferry only)"),
            "ms",
            "/rust/cells",
            &bytes,
            "rpc_sync_median_ms",
        ));
        specs.push(spread_row(
            format!("{size} Python overhead: ferry.rpc - Rust"),
            "us",
            "/python_overhead",
            &bytes,
            "us",
        ));
        specs.push(spread_row(
            format!("{size} Python overhead: ferry.rpc / Rust"),
            "x",
            "/python_overhead",
            &bytes,
            "ratio",
        ));
    }
    specs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(module: &str, medians: &[(u64, f64)], load: f64) -> Value {
        let cells: Vec<Value> = medians
            .iter()
            .map(|&(bytes, m)| {
                json!({"func": "identity", "size": format!("{bytes}B"), "bytes": bytes,
                       "rpc_sync": {"median_ms": m, "p90_ms": 2.0 * m},
                       "async10_per_call_ms_median": m / 2.0})
            })
            .collect();
        let rows = vec![json!({"size": "4MB", "bytes": 4u64 << 20,
            "tensor": {"median_ms": 1.0}, "rref": {"median_ms": 1.5},
            "rref_minus_tensor_median_ms": 0.5})];
        json!({"module": module, "compiled": "x.so", "cells": cells, "rows": rows,
               "link": {"transport": "shm"}, "load_1min_after": load})
    }

    #[test]
    fn the_table_pools_runs_and_sets_python_against_rust() {
        let py = [
            run("ferry.rpc", &[(0, 0.02)], 1.0),
            run("ferry.rpc", &[(0, 0.03)], 3.0),
        ];
        let rust = [run("", &[(0, 0.01)], 1.0), run("", &[(0, 0.02)], 2.0)];
        let pt = [
            run("torch", &[(0, 0.5)], 2.0),
            run("torch", &[(0, 0.7)], 2.0),
        ];
        let ferry = over_runs(&py, Some(&rust));
        let peer = over_runs(&pt, None);
        assert_eq!(ferry["load_1min_after"]["max"], json!(3.0));
        let rows = table::compare(&ferry, Some(&peer), &specs(&ferry, Some(&peer)));
        let get = |case: &str| {
            rows.iter()
                .find(|r| r.case == case)
                .unwrap_or_else(|| panic!("{case}"))
        };
        let empty = get("0B rpc_sync median");
        assert_eq!(empty.ferry, Some(0.025));
        assert_eq!(empty.ferry_range, Some((0.02, 0.03)));
        assert_eq!(empty.peer, Some(0.6));
        assert_eq!(empty.target, Some(20.0));
        assert_eq!(empty.met, Some(true));
        let overhead = get("0B Python overhead: ferry.rpc - Rust");
        let us = overhead.ferry.map(|x| (x * 1e6).round() / 1e6);
        assert_eq!((us, overhead.peer), (Some(10.0), None));
        assert_eq!(
            get("0B Python overhead: ferry.rpc / Rust").ferry,
            Some(1.75)
        );
        assert_eq!(
            get("0B Rust rpc_sync median (Ferry only)").ferry,
            Some(0.015)
        );
        assert_eq!(get("Table 1 4MB rref-tensor median").peer, Some(0.5));
        assert!(!rows.iter().any(|r| r.case.starts_with("4MB rpc_sync")));
    }

    #[test]
    fn the_stage_links_the_sources_and_the_release_module() {
        let tmp = root().join("target").join("tmp").join("xtask-python-stage");
        let _ = std::fs::remove_dir_all(&tmp);
        let src = tmp.join("src");
        std::fs::create_dir_all(src.join("rpc")).expect("src");
        for f in ["api", "_ferry.cpython-311-x86_64-linux-gnu.so"] {
            std::fs::write(src.join(f), "").expect("file");
        }
        let lib = tmp.join("libferry_py.so");
        std::fs::write(&lib, "release").expect("lib");
        for _ in 0..2 {
            stage(&src, &lib, &tmp.join("stage")).expect("staged");
        }
        let pkg = tmp.join("stage").join("ferry");
        let mut names: Vec<String> = std::fs::read_dir(&pkg)
            .expect("pkg")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["_ferry.so", "api", "rpc"]);
        assert_eq!(
            std::fs::read_to_string(pkg.join("_ferry.so")).expect("read"),
            "release"
        );
        let _ = std::fs::remove_dir_all(&tmp);
    }
}
