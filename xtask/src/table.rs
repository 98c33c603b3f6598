//! Ferry-vs-peer comparison tables, shared by every side-by-side benchmark
//! (RPC latency now; RRef, autograd, lighthouse later).
//!
//! A benchmark run on each side writes one JSON result object. A list of
//! [`RowSpec`]s says which numbers to pull out of both objects and which
//! direction is better; [`compare`] turns them into [`Row`]s whose `ratio` is
//! always "> 1 means Ferry is better".

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{json, Value};

/// Which direction of a metric is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Better {
    /// Latency-like: ratio = peer / ferry.
    Lower,
    /// Throughput-like: ratio = ferry / peer.
    Higher,
}

/// Where a number sits in a result object.
#[derive(Debug, Clone)]
pub(crate) enum Metric {
    /// A JSON pointer (RFC 6901), e.g. `/throughput_empty/median_calls_per_s`.
    At(String),
    /// `field` (a JSON pointer relative to the entry) of the first entry of
    /// the list at `list` whose keys equal `matching` (numbers compare by value).
    InList {
        list: String,
        matching: Vec<(String, Value)>,
        field: String,
    },
}

impl Metric {
    /// The number this metric names in `result`, if it is there.
    pub(crate) fn get(&self, result: &Value) -> Option<f64> {
        match self {
            Metric::At(ptr) => result.pointer(ptr)?.as_f64(),
            Metric::InList {
                list,
                matching,
                field,
            } => result
                .pointer(list)?
                .as_array()?
                .iter()
                .find(|entry| {
                    matching
                        .iter()
                        .all(|(k, want)| entry.get(k).is_some_and(|got| same(got, want)))
                })?
                .pointer(field)?
                .as_f64(),
        }
    }
}

fn same(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// One row to build: its label, unit, better direction and where its number is.
#[derive(Debug, Clone)]
pub(crate) struct RowSpec {
    pub(crate) case: String,
    pub(crate) unit: String,
    pub(crate) better: Better,
    pub(crate) metric: Metric,
}

impl RowSpec {
    pub(crate) fn new(case: impl Into<String>, unit: &str, better: Better, metric: Metric) -> Self {
        Self {
            case: case.into(),
            unit: unit.to_string(),
            better,
            metric,
        }
    }
}

/// One row of a comparison table; `None` where a side lacks the number.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Row {
    pub(crate) case: String,
    pub(crate) ferry: Option<f64>,
    pub(crate) peer: Option<f64>,
    pub(crate) unit: String,
    /// > 1 means Ferry is better, whatever the unit.
    pub(crate) ratio: Option<f64>,
}

/// Builds one row per spec from the Ferry result and (if any) the peer result.
pub(crate) fn compare(ferry: &Value, peer: Option<&Value>, specs: &[RowSpec]) -> Vec<Row> {
    specs
        .iter()
        .map(|spec| {
            let f = spec.metric.get(ferry);
            let p = peer.and_then(|p| spec.metric.get(p));
            let ratio = match (f, p, spec.better) {
                (Some(f), Some(p), Better::Lower) if f > 0.0 => Some(p / f),
                (Some(f), Some(p), Better::Higher) if p > 0.0 => Some(f / p),
                _ => None,
            };
            Row {
                case: spec.case.clone(),
                ferry: f,
                peer: p,
                unit: spec.unit.clone(),
                ratio,
            }
        })
        .collect()
}

fn num(v: Option<f64>) -> String {
    match v {
        None => "-".to_string(),
        Some(x) if !x.is_finite() => x.to_string(),
        Some(x) if x.abs() >= 1000.0 => format!("{x:.0}"),
        Some(x) if x.abs() >= 100.0 => format!("{x:.1}"),
        Some(x) if x.abs() >= 1.0 => format!("{x:.3}"),
        Some(x) => format!("{x:.4}"),
    }
}

/// The rows as one aligned text table: case | ferry | peer | unit | ratio.
pub(crate) fn render(rows: &[Row]) -> String {
    let header = ["case", "ferry", "peer", "unit", "ratio"].map(String::from);
    let mut cells: Vec<[String; 5]> = vec![header];
    for r in rows {
        cells.push([
            r.case.clone(),
            num(r.ferry),
            num(r.peer),
            r.unit.clone(),
            r.ratio.map_or("-".to_string(), |x| format!("{x:.2}x")),
        ]);
    }
    let mut width = [0usize; 5];
    for row in &cells {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for (i, row) in cells.iter().enumerate() {
        let line = format!(
            "{:<w0$} | {:>w1$} | {:>w2$} | {:<w3$} | {:>w4$}",
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            w0 = width[0],
            w1 = width[1],
            w2 = width[2],
            w3 = width[3],
            w4 = width[4],
        );
        out.push_str(line.trim_end());
        out.push('\n');
        if i == 0 {
            let rule: Vec<String> = width.iter().map(|w| "-".repeat(*w)).collect();
            out.push_str(&rule.join("-|-"));
            out.push('\n');
        }
    }
    out
}

/// The rows as a JSON list of `{case, ferry, peer, unit, ratio}` (in that
/// key order, one row per line; missing numbers are `null`).
pub(crate) fn to_json(rows: &[Row]) -> String {
    let field = |v: Value| v.to_string();
    let lines: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "  {{\"case\": {}, \"ferry\": {}, \"peer\": {}, \"unit\": {}, \"ratio\": {}}}",
                field(json!(r.case)),
                field(json!(r.ferry)),
                field(json!(r.peer)),
                field(json!(r.unit)),
                field(json!(r.ratio)),
            )
        })
        .collect();
    if lines.is_empty() {
        "[]\n".to_string()
    } else {
        format!("[\n{}\n]\n", lines.join(",\n"))
    }
}

/// Writes [`to_json`] of the rows to `path`, creating its directory.
pub(crate) fn write_json(path: &Path, rows: &[Row]) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, to_json(rows)).with_context(|| format!("writing {}", path.display()))
}

/// Reads one JSON result object.
pub(crate) fn read_result(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs() -> Vec<RowSpec> {
        vec![
            RowSpec::new(
                "lat",
                "ms",
                Better::Lower,
                Metric::InList {
                    list: "/cells".into(),
                    matching: vec![
                        ("func".into(), json!("identity")),
                        ("bytes".into(), json!(1024)),
                    ],
                    field: "/rpc_sync/median_ms".into(),
                },
            ),
            RowSpec::new(
                "tput",
                "calls/s",
                Better::Higher,
                Metric::At("/tput".into()),
            ),
            RowSpec::new("absent", "ms", Better::Lower, Metric::At("/nope".into())),
        ]
    }

    #[test]
    fn ratio_above_one_means_ferry_is_better() {
        let ferry = json!({"cells": [{"func": "identity", "bytes": 1024, "rpc_sync": {"median_ms": 0.5}}], "tput": 40000});
        let peer = json!({"cells": [{"func": "identity", "bytes": 1024.0, "rpc_sync": {"median_ms": 1.0}}], "tput": 20000});
        let rows = compare(&ferry, Some(&peer), &specs());
        assert_eq!(rows[0].ratio, Some(2.0));
        assert_eq!(rows[1].ratio, Some(2.0));
        assert_eq!(rows[2].ferry, None);
        assert_eq!(rows[2].ratio, None);
        let text = render(&rows);
        assert!(text.starts_with("case "), "{text}");
        assert_eq!(text.lines().count(), 2 + rows.len());
        let text = to_json(&rows);
        assert!(
            text.contains(
                r#"{"case": "lat", "ferry": 0.5, "peer": 1.0, "unit": "ms", "ratio": 2.0}"#
            ),
            "{text}"
        );
        let js: Value = serde_json::from_str(&text).expect("valid JSON");
        assert_eq!(js[1]["unit"], "calls/s");
        assert_eq!(js[2]["peer"], Value::Null);
    }

    #[test]
    fn missing_peer_gives_empty_peer_column() {
        let ferry = json!({"tput": 1.0});
        let rows = compare(&ferry, None, &specs());
        assert!(rows.iter().all(|r| r.peer.is_none() && r.ratio.is_none()));
        assert_eq!(rows[1].ferry, Some(1.0));
    }
}
