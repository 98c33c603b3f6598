//! Where the bench's files go and how results are written and pooled:
//! `target/ferry-bench/`, the release binaries, JSON results, medians
//! over runs.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use crate::steps::root;

/// Where results go, relative to the repository root.
pub(crate) const OUT_DIR: &str = "target/ferry-bench";

/// `cargo run --release -p ferry-benches --bin NAME`: one of
/// `benches/src/bin/`, built if needed; its own arguments follow a `--`.
pub(crate) fn bench_bin(name: &str) -> std::process::Command {
    crate::steps::cargo(&["run", "--release", "-p", "ferry-benches", "--bin", name])
}

/// `target/ferry-bench/<name>`, relative to the repository root (every
/// command runs from there).
pub(crate) fn out_path(name: &str) -> PathBuf {
    Path::new(OUT_DIR).join(name)
}

pub(crate) fn remove_stale(path: &Path) -> Result<()> {
    match std::fs::remove_file(root().join(path)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing stale {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// The element-wise median of `values` (at least one): numbers give their
/// median (the first one where all are equal, keeping integers integers),
/// objects recurse on the first one's keys, anything else is the first.
pub(crate) fn median_tree(values: &[&Value]) -> Value {
    let first = values[0];
    if let Some(fields) = first.as_object() {
        let merged = fields
            .keys()
            .map(|key| {
                let at: Vec<&Value> = values.iter().filter_map(|v| v.get(key)).collect();
                (key.clone(), median_tree(&at))
            })
            .collect();
        return Value::Object(merged);
    }
    if values.iter().all(|v| *v == first) {
        return first.clone();
    }
    let mut numbers: Vec<f64> = values.iter().filter_map(|v| v.as_f64()).collect();
    if numbers.len() != values.len() {
        return first.clone();
    }
    numbers.sort_by(f64::total_cmp);
    let mid = numbers.len() / 2;
    let median = if numbers.len() % 2 == 1 {
        numbers[mid]
    } else {
        (numbers[mid - 1] + numbers[mid]) / 2.0
    };
    json!(median)
}

/// Writes one result object as pretty JSON to `out` (repository-relative).
pub(crate) fn write_result(out: &Path, result: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(result).context("encoding the result")?;
    std::fs::write(root().join(out), text + "\n")
        .with_context(|| format!("writing {}", out.display()))
}

/// Where cargo puts the release build of binary `name`
/// (`$CARGO_TARGET_DIR`, else `target/`, under the repository root).
pub(crate) fn release_binary(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target"));
    root().join(target).join("release").join(name)
}
