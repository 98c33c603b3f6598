//! A side-by-side benchmark: Ferry's binary and the peer's script run with
//! the same settings, alternating, then their table.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

use super::doc::{self, Part};
use super::options::Options;
use super::peers::peer_script;
use super::report::Table;
use super::results::{out_path, remove_stale, write_result};
use crate::bench::table::{self, RowSpec};
use crate::setup::{venv_python, with_libtorch};
use crate::steps::{cargo, cmd, root, run, Steps};

/// One side-by-side benchmark: Ferry's binary and the peer's script, run
/// with the same settings, then their comparison table.
pub(crate) struct Comparison<'a> {
    /// The table's name and the stem of the result files in
    /// `target/ferry-bench/`: `ferry_<name>.json`, `peer_<name>.json` and
    /// the table's `<name>.json`.
    pub(crate) name: &'a str,
    /// Its section of `docs/benchmarks.md`.
    pub(crate) part: Part,
    /// Cargo's package and target selection for Ferry's side, as given to
    /// `cargo run --release` (e.g. `-p ferry-benches --bin rpc_latency`).
    pub(crate) ferry_target: &'a [&'a str],
    /// Whether Ferry's side links libtorch: it then builds and runs against
    /// the `.venv`'s PyTorch ([`with_libtorch`]).
    pub(crate) libtorch: bool,
    /// Arguments of Ferry's binary, after `--quick` and before `--out`.
    pub(crate) ferry_args: &'a [&'a str],
    /// The peer script's file name in `benches/peers/`.
    pub(crate) peer_script: &'a str,
    /// Arguments of the peer script, before `--quick` and `--out`.
    pub(crate) peer_args: &'a [&'a str],
    /// The line(s) printed above the table.
    pub(crate) heading: &'a str,
    /// The table's rows, from Ferry's result and the peer's (if there).
    pub(crate) specs: fn(&Value, Option<&Value>) -> Vec<RowSpec>,
    /// Runs each side more than once; without it, once, and a side's
    /// result is that run's.
    pub(crate) repeat: Option<Repeat>,
}

/// How a [`Comparison`] repeats its sides.
pub(crate) struct Repeat {
    /// How many times each side runs ([`sides_in_order`]).
    pub(crate) runs: usize,
    /// A side's result over its runs (each run's own result, in order).
    pub(crate) over_runs: fn(Vec<Value>) -> Value,
}

/// Which side goes first in run `run` (from 1), then the other: `true` is
/// Ferry's. They alternate, so that a drift in the machine's speed does not
/// always favour the same side.
pub(crate) fn sides_in_order(run: usize) -> [bool; 2] {
    let ferry_first = run % 2 == 1;
    [ferry_first, !ferry_first]
}

impl Comparison<'_> {
    /// The steps `ferry: <name>`, `peer: <script>` (where the
    /// script is there) and `table: <name>`; under `--table-only`, only
    /// the table.
    pub(crate) fn run(&self, steps: &mut Steps, o: &Options) -> Result<()> {
        if !o.table_only {
            let ferry_out = self.out_path("ferry_");
            let peer_out = self.out_path("peer_");
            // Files left from an earlier run must not pose as this run's.
            remove_stale(&ferry_out)?;
            remove_stale(&peer_out)?;
            doc::record_host(self.part.bench(), o)?;
            let script = peer_script(o.no_peer, self.peer_script);
            let runs = self.repeat.as_ref().map_or(1, |r| r.runs);
            // Each run's result (when repeating), read before the next run
            // overwrites it.
            let read = |out: &Path| -> Result<Option<Value>> {
                self.repeat
                    .as_ref()
                    .map(|_| table::read_result(&root().join(out)))
                    .transpose()
            };
            let (mut ferry_runs, mut peer_runs) = (Vec::new(), Vec::new());
            for i in 1..=runs {
                let of = if self.repeat.is_some() {
                    format!(" (run {i}/{runs})")
                } else {
                    String::new()
                };
                for ferry_side in sides_in_order(i) {
                    if ferry_side {
                        steps.step(&format!("ferry: {}{of}", self.name), || {
                            self.run_ferry(o, &ferry_out)
                        })?;
                        ferry_runs.extend(read(&ferry_out)?);
                    } else if let Some(script) = &script {
                        let name = format!("peer: {}{of}", self.peer_script);
                        steps.step(&name, || self.run_peer(o, script, &peer_out))?;
                        peer_runs.extend(read(&peer_out)?);
                    }
                }
            }
            if let Some(repeat) = &self.repeat {
                for (runs, out) in [(ferry_runs, &ferry_out), (peer_runs, &peer_out)] {
                    if !runs.is_empty() {
                        write_result(out, &(repeat.over_runs)(runs))?;
                    }
                }
            }
        }

        self.table(steps, o)
    }

    /// One run of Ferry's side, its result written to `out`.
    pub(crate) fn run_ferry(&self, o: &Options, out: &Path) -> Result<()> {
        let mut c = cargo(&["run", "--release"]);
        c.args(self.ferry_target).arg("--");
        if self.libtorch {
            with_libtorch(&mut c);
        }
        if o.quick {
            c.arg("--quick");
        }
        c.args(self.ferry_args);
        c.arg("--out").arg(out);
        run(&mut c)
    }

    /// One run of the peer's `script`, its result written to `out`.
    pub(crate) fn run_peer(&self, o: &Options, script: &Path, out: &Path) -> Result<()> {
        let py = venv_python();
        let mut c = cmd(&py.to_string_lossy(), &[]);
        c.arg(script).args(self.peer_args);
        if o.quick {
            c.arg("--quick");
        }
        c.arg("--out").arg(out);
        run(&mut c).context("the peer benchmark failed (`--no-peer` skips it)")
    }

    /// `target/ferry-bench/<prefix><name>.json`.
    pub(crate) fn out_path(&self, prefix: &str) -> PathBuf {
        out_path(&format!("{prefix}{}.json", self.name))
    }

    /// The step `table: <name>` ([`Table::run`]).
    pub(crate) fn table(&self, steps: &mut Steps, o: &Options) -> Result<()> {
        Table {
            name: self.name,
            part: self.part,
            heading: self.heading,
            specs: self.specs,
        }
        .run(steps, o)
    }
}
