//! The comparison tables a benchmark prints, from its result files.

use std::path::PathBuf;

use anyhow::Result;
use serde_json::Value;

use super::doc::{self, Part};
use super::options::Options;
use super::results::out_path;
use crate::bench::table::{self, RowSpec};
use crate::steps::{root, Steps};

/// A comparison table built from the two result files a side-by-side
/// benchmark left in `target/ferry-bench/`: `ferry_<name>.json` and (if
/// there) `peer_<name>.json`, written as `<name>.json`.
pub(crate) struct Table<'a> {
    pub(crate) name: &'a str,
    /// Its section of `docs/benchmarks.md`.
    pub(crate) part: Part,
    /// The line(s) printed above the table.
    pub(crate) heading: &'a str,
    /// The table's rows, from Ferry's result and the peer's (if there).
    pub(crate) specs: fn(&Value, Option<&Value>) -> Vec<RowSpec>,
}

impl Table<'_> {
    /// `target/ferry-bench/<prefix><name>.json`.
    pub(crate) fn out_path(&self, prefix: &str) -> PathBuf {
        out_path(&format!("{prefix}{}.json", self.name))
    }

    /// The step `table: <name>`: reads both results (the peer's if there),
    /// prints the table, records it for `docs/benchmarks.md` and writes its
    /// JSON. Under `--table-only`, a
    /// missing Ferry result skips the table.
    pub(crate) fn run(&self, steps: &mut Steps, o: &Options) -> Result<()> {
        let (ferry_out, peer_out, table_out) = (
            self.out_path("ferry_"),
            self.out_path("peer_"),
            self.out_path(""),
        );
        steps.step_with(&format!("table: {}", self.name), || {
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
            let rows = table::compare(&ferry, peer.as_ref(), &(self.specs)(&ferry, peer.as_ref()));
            let text = format!("{}\n\n{}", self.heading, table::render(&rows));
            println!("\n{text}");
            record(self.part, self.heading, &rows);
            table::write_json(&root().join(&table_out), &rows)?;
            println!("\nwritten: {}", table_out.display());
            Ok("ok")
        })
    }
}

/// Records a printed table for `docs/benchmarks.md`: its `auth:` rows
/// (what the group's secret costs, measured by the RPC benchmark) form the
/// Authentication section, the others `part`'s.
fn record(part: Part, heading: &str, rows: &[table::Row]) {
    let (auth, rest): (Vec<table::Row>, Vec<table::Row>) = rows
        .iter()
        .cloned()
        .partition(|r| r.case.starts_with("auth: "));
    doc::record(part, &format!("{heading}\n\n{}", table::render(&rest)));
    if !auth.is_empty() {
        doc::record(
            Part::Authentication,
            &format!(
                "{}\n\n{}",
                "Ferry only, in one process over loopback: no secret, records with a MAC, \
                 records sealed (FERRY_AUTH=encrypt); each cost against no secret within a \
                 repetition, median [min–max] over repetitions",
                table::render(&auth)
            ),
        );
    }
}
