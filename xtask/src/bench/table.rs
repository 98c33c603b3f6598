//! Ferry-vs-peer comparison tables, shared by every side-by-side benchmark
//! (RPC latency, RRef overhead, distributed autograd overhead and the
//! lighthouse).
//!
//! A benchmark run on each side writes one JSON result object. A list of
//! [`RowSpec`]s says which numbers to pull out of both objects and which
//! direction is better; [`compare`] turns them into [`Row`]s whose `ratio` is
//! always "> 1 means Ferry is better". A row may carry a target, the least
//! ratio Ferry should reach ([`RowSpec::with_target`]): the table then gets a
//! `target` column saying whether it holds.

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

/// One row to build: its label, unit, better direction, where its number
/// is and, optionally, where its standard deviation is (shown as `mean±std`)
/// and the least ratio Ferry should reach.
#[derive(Debug, Clone)]
pub(crate) struct RowSpec {
    pub(crate) case: String,
    pub(crate) unit: String,
    pub(crate) better: Better,
    pub(crate) metric: Metric,
    pub(crate) std: Option<Metric>,
    /// Where the low and high ends of its spread are (shown as
    /// `median [lo–hi]`).
    pub(crate) range: Option<(Metric, Metric)>,
    pub(crate) target: Option<f64>,
}

impl RowSpec {
    pub(crate) fn new(case: impl Into<String>, unit: &str, better: Better, metric: Metric) -> Self {
        Self {
            case: case.into(),
            unit: unit.to_string(),
            better,
            metric,
            std: None,
            range: None,
            target: None,
        }
    }

    /// The same row, with the spread of its number from `lo` to `hi`
    /// (e.g. p10 and p90), shown as `median [lo–hi]`.
    pub(crate) fn with_range(mut self, lo: Metric, hi: Metric) -> Self {
        self.range = Some((lo, hi));
        self
    }

    /// The same row, with the standard deviation of its number at `std`.
    pub(crate) fn with_std(mut self, std: Metric) -> Self {
        self.std = Some(std);
        self
    }

    /// The same row, with a target: Ferry should reach at least ratio
    /// `min_ratio` (for a latency, Ferry's number at most `1 / min_ratio`
    /// of the peer's).
    pub(crate) fn with_target(mut self, min_ratio: f64) -> Self {
        self.target = Some(min_ratio);
        self
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
    /// Standard deviations of `ferry` and `peer`, for rows whose spec names one.
    pub(crate) ferry_std: Option<f64>,
    pub(crate) peer_std: Option<f64>,
    /// Whether the spec names a standard deviation (the JSON then has
    /// `ferry_std` and `peer_std`, `null` where missing).
    pub(crate) has_std: bool,
    /// The spreads (low, high) of `ferry` and `peer`, for rows whose spec
    /// names one.
    pub(crate) ferry_range: Option<(f64, f64)>,
    pub(crate) peer_range: Option<(f64, f64)>,
    /// Whether the spec names a spread (the JSON then has `ferry_lo`,
    /// `ferry_hi`, `peer_lo` and `peer_hi`, `null` where missing).
    pub(crate) has_range: bool,
    /// The spec's target (least ratio), if any.
    pub(crate) target: Option<f64>,
    /// Whether the target holds; `None` without a target or without a
    /// positive peer number to hold it against.
    pub(crate) met: Option<bool>,
}

/// Builds one row per spec from the Ferry result and (if any) the peer result.
///
/// A ratio needs both numbers positive: a difference (e.g. an overhead
/// that can come out negative) has no meaningful ratio otherwise. A target
/// is judged on the numbers themselves (for a latency: Ferry's ≤ the
/// peer's / target), so a Ferry overhead at or below zero meets it; it needs
/// the peer's number positive.
pub(crate) fn compare(ferry: &Value, peer: Option<&Value>, specs: &[RowSpec]) -> Vec<Row> {
    specs
        .iter()
        .map(|spec| {
            let f = spec.metric.get(ferry);
            let p = peer.and_then(|p| spec.metric.get(p));
            let ratio = match (f, p, spec.better) {
                (Some(f), Some(p), _) if f <= 0.0 || p <= 0.0 => None,
                (Some(f), Some(p), Better::Lower) => Some(p / f),
                (Some(f), Some(p), Better::Higher) => Some(f / p),
                _ => None,
            };
            let std = |side: Option<&Value>| spec.std.as_ref()?.get(side?);
            let range = |side: Option<&Value>| {
                let (lo, hi) = spec.range.as_ref()?;
                let side = side?;
                Some((lo.get(side)?, hi.get(side)?))
            };
            let met = match (spec.target, f, p, spec.better) {
                (Some(t), Some(f), Some(p), Better::Lower) if p > 0.0 => Some(f * t <= p),
                (Some(t), Some(f), Some(p), Better::Higher) if p > 0.0 => Some(f >= t * p),
                _ => None,
            };
            Row {
                case: spec.case.clone(),
                ferry: f,
                peer: p,
                unit: spec.unit.clone(),
                ratio,
                ferry_std: std(Some(ferry)),
                peer_std: std(peer),
                has_std: spec.std.is_some(),
                ferry_range: range(Some(ferry)),
                peer_range: range(peer),
                has_range: spec.range.is_some(),
                target: spec.target,
                met,
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

/// A number with its standard deviation, if any: `12.345±0.4567`.
fn num_std(v: Option<f64>, std: Option<f64>) -> String {
    match (v, std) {
        (Some(_), Some(_)) => format!("{}±{}", num(v), num(std)),
        _ => num(v),
    }
}

/// A number with its spread, if any: `12.35 [11.00–14.00]`.
fn num_range(v: Option<f64>, range: Option<(f64, f64)>) -> String {
    match (v, range) {
        (Some(_), Some((lo, hi))) => format!("{} [{}–{}]", num(v), num(Some(lo)), num(Some(hi))),
        _ => num(v),
    }
}

/// A row's number cell: with its spread, its standard deviation, or alone.
fn cell(v: Option<f64>, std: Option<f64>, range: Option<(f64, f64)>) -> String {
    if range.is_some() {
        num_range(v, range)
    } else {
        num_std(v, std)
    }
}

/// A row's target cell: `≥4x met`, `≥4x MISSED`, `≥4x ?` (not judged),
/// empty without a target.
fn target_cell(r: &Row) -> String {
    let Some(t) = r.target else {
        return String::new();
    };
    let verdict = match r.met {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "?",
    };
    format!("≥{t}x {verdict}")
}

/// The rows as one aligned text table: case | ferry | peer | unit | ratio,
/// and a last column `target` when any row has one (numbers with a
/// standard deviation read `mean±std`, numbers with a spread
/// `median [lo–hi]`).
pub(crate) fn render(rows: &[Row]) -> String {
    let targets = rows.iter().any(|r| r.target.is_some());
    let mut header: Vec<String> = ["case", "ferry", "peer", "unit", "ratio"]
        .map(String::from)
        .into();
    if targets {
        header.push("target".into());
    }
    let mut cells: Vec<Vec<String>> = vec![header];
    for r in rows {
        let mut row = vec![
            r.case.clone(),
            cell(r.ferry, r.ferry_std, r.ferry_range),
            cell(r.peer, r.peer_std, r.peer_range),
            r.unit.clone(),
            r.ratio.map_or("-".to_string(), |x| format!("{x:.2}x")),
        ];
        if targets {
            row.push(target_cell(r));
        }
        cells.push(row);
    }
    let mut width = vec![0usize; cells[0].len()];
    for row in &cells {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    // Text columns align left, numbers right.
    let left = [true, false, false, true, false, true];
    let mut out = String::new();
    for (i, row) in cells.iter().enumerate() {
        let line = row
            .iter()
            .zip(&width)
            .zip(left)
            .map(|((c, &w), left)| {
                if left {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect::<Vec<_>>()
            .join(" | ");
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
/// key order, one row per line; missing numbers are `null`), followed by
/// `ferry_std` and `peer_std` in rows whose spec names a standard deviation,
/// by `ferry_lo`, `ferry_hi`, `peer_lo` and `peer_hi` in rows whose spec
/// names a spread, and by `target` and `met` in rows with a target.
pub(crate) fn to_json(rows: &[Row]) -> String {
    let field = |v: Value| v.to_string();
    let lines: Vec<String> = rows
        .iter()
        .map(|r| {
            let std = if r.has_std {
                format!(
                    ", \"ferry_std\": {}, \"peer_std\": {}",
                    field(json!(r.ferry_std)),
                    field(json!(r.peer_std)),
                )
            } else {
                String::new()
            };
            let range = if r.has_range {
                let end = |range: Option<(f64, f64)>, hi: bool| {
                    field(json!(range.map(|(l, h)| if hi { h } else { l })))
                };
                format!(
                    ", \"ferry_lo\": {}, \"ferry_hi\": {}, \"peer_lo\": {}, \"peer_hi\": {}",
                    end(r.ferry_range, false),
                    end(r.ferry_range, true),
                    end(r.peer_range, false),
                    end(r.peer_range, true),
                )
            } else {
                String::new()
            };
            let target = match r.target {
                Some(t) => format!(
                    ", \"target\": {}, \"met\": {}",
                    field(json!(t)),
                    field(json!(r.met))
                ),
                None => String::new(),
            };
            format!(
                "  {{\"case\": {}, \"ferry\": {}, \"peer\": {}, \"unit\": {}, \"ratio\": {}{std}{range}{target}}}",
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

/// The median of `values` (`None` if empty).
pub(crate) fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    })
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
    fn std_and_differences() {
        let std_spec = RowSpec::new("mean", "ms", Better::Lower, Metric::At("/m".into()))
            .with_std(Metric::At("/s".into()));
        let diff_spec = RowSpec::new("diff", "ms", Better::Lower, Metric::At("/d".into()));
        let ferry = json!({"m": 2.0, "s": 0.5, "d": -0.25});
        let peer = json!({"m": 4.0, "d": 1.0});
        let rows = compare(&ferry, Some(&peer), &[std_spec, diff_spec]);
        assert_eq!(rows[0].ratio, Some(2.0));
        assert_eq!((rows[0].ferry_std, rows[0].peer_std), (Some(0.5), None));
        // A negative difference has no ratio.
        assert_eq!(rows[1].ratio, None);
        let text = render(&rows);
        assert!(text.contains("2.000±0.5000"), "{text}");
        let text = to_json(&rows);
        assert!(
            text.contains(r#""ratio": 2.0, "ferry_std": 0.5, "peer_std": null}"#),
            "{text}"
        );
        assert!(text.contains(r#""ratio": null}"#), "{text}");
        let js: Value = serde_json::from_str(&text).expect("valid JSON");
        assert!(js[1].get("ferry_std").is_none());
    }

    #[test]
    fn missing_peer_gives_empty_peer_column() {
        let ferry = json!({"tput": 1.0});
        let rows = compare(&ferry, None, &specs());
        assert!(rows.iter().all(|r| r.peer.is_none() && r.ratio.is_none()));
        assert_eq!(rows[1].ferry, Some(1.0));
    }

    #[test]
    fn differences_and_targets() {
        let diff = Metric::At("/a_minus_b".into());
        let spec = |case: &str, m: Metric| RowSpec::new(case, "ms", Better::Lower, m);
        let specs = [
            spec("a", Metric::At("/a".into())).with_target(4.0),
            spec("a-b", diff.clone()).with_target(4.0),
            spec("plain", diff),
            spec("missing", Metric::At("/nope".into())).with_target(4.0),
        ];
        let ferry = json!({"a": 1.0, "a_minus_b": -0.5});
        let peer = json!({"a": 5.0, "a_minus_b": 1.0});
        let rows = compare(&ferry, Some(&peer), &specs);
        // 1.0 <= 5.0 / 4: met.
        assert_eq!((rows[0].ratio, rows[0].met), (Some(5.0), Some(true)));
        // Ferry's difference is negative: no ratio, but the target holds.
        assert_eq!((rows[1].ferry, rows[1].peer), (Some(-0.5), Some(1.0)));
        assert_eq!((rows[1].ratio, rows[1].met), (None, Some(true)));
        assert_eq!((rows[2].target, rows[2].met), (None, None));
        assert_eq!((rows[3].ferry, rows[3].met), (None, None));
        let missed = compare(&json!({"a": 2.0}), Some(&peer), &specs[..1]);
        assert_eq!((missed[0].ratio, missed[0].met), (Some(2.5), Some(false)));
        let text = render(&rows);
        assert!(
            text.lines().next().is_some_and(|h| h.ends_with("| target")),
            "{text}"
        );
        assert!(text.contains("≥4x met") && text.contains("≥4x ?"), "{text}");
        assert!(render(&missed).contains("≥4x MISSED"));
        let text = to_json(&rows);
        assert!(
            text.contains(r#""ratio": 5.0, "target": 4.0, "met": true}"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#""case": "plain", "ferry": -0.5, "peer": 1.0, "unit": "ms", "ratio": null}"#
            ),
            "{text}"
        );
        let js: Value = serde_json::from_str(&text).expect("valid JSON");
        assert_eq!(js[3]["met"], Value::Null);
        // Tables without targets keep their five columns.
        assert!(!render(&rows[2..3]).contains("target"));
    }

    #[test]
    fn spreads_show_as_a_range() {
        let m = |p: &str| Metric::At(p.into());
        let spec = RowSpec::new("t", "ms", Better::Lower, m("/median"))
            .with_range(m("/lo"), m("/hi"))
            .with_target(300.0);
        let ferry = json!({"median": 0.5, "lo": 0.25, "hi": 1.0});
        let peer = json!({"median": 100.0, "lo": 90.0, "hi": 110.0});
        let rows = compare(&ferry, Some(&peer), std::slice::from_ref(&spec));
        assert_eq!(rows[0].ferry_range, Some((0.25, 1.0)));
        assert_eq!(rows[0].peer_range, Some((90.0, 110.0)));
        assert_eq!((rows[0].ratio, rows[0].met), (Some(200.0), Some(false)));
        let text = render(&rows);
        assert!(text.contains("0.5000 [0.2500–1.000]"), "{text}");
        assert!(text.contains("100.0 [90.000–110.0]"), "{text}");
        assert!(text.contains("≥300x MISSED"), "{text}");
        let text = to_json(&rows);
        assert!(
            text.contains(
                r#""ferry_lo": 0.25, "ferry_hi": 1.0, "peer_lo": 90.0, "peer_hi": 110.0, "target": 300.0"#
            ),
            "{text}"
        );
        // Without the peer, its ends are null.
        let alone = to_json(&compare(&ferry, None, &[spec]));
        assert!(
            alone.contains(r#""peer_lo": null, "peer_hi": null"#),
            "{alone}"
        );
    }
}
