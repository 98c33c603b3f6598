//! PyTorch's own RPC test suites (`rpc_test.py`, `dist_autograd_test.py`,
//! `dist_optimizer_test.py` from the torch in `.venv`) run against
//! `ferry.rpc`: `cargo xtask test` runs the expected passes, and
//! `cargo xtask torch-suites` runs them all.
//!
//! The runner is `crates/ferry-py/tests/torch_suites/run.py`; its lists
//! are checked in beside it: `expected.txt` (the tests that pass; one that
//! fails fails CI) and `skips.txt` (the tests not run, each with its
//! reason).

use std::path::PathBuf;

use anyhow::{bail, Result};

use crate::setup::{ferry_py_dir, venv_python, with_libtorch};
use crate::steps::{cmd, root, run};

/// The runner script.
fn runner() -> PathBuf {
    ferry_py_dir()
        .join("tests")
        .join("torch_suites")
        .join("run.py")
}

/// Which tests a run takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Select {
    /// The expected passes only; any of them failing fails the run.
    Expected,
    /// Every test not skipped: the counts per suite, and the tests that
    /// pass without being listed.
    All {
        /// Rewrite `expected.txt` with the tests that passed.
        update: bool,
    },
}

/// Runs the suites with `.venv`'s python (which has the `ferry` that
/// `setup::install_ferry_py` built) and the selection `select`.
pub(crate) fn run_suites(select: Select) -> Result<()> {
    let py = venv_python();
    let script = runner();
    let mut c = cmd(&py.to_string_lossy(), &[&script.to_string_lossy()]);
    match select {
        Select::Expected => c.args(["--select", "expected"]),
        Select::All { update } => {
            c.args(["--select", "all"]);
            if update {
                c.arg("--update");
            }
            c.arg("--report")
                .arg(root().join("target").join("torch-suites.tsv"))
        }
    };
    c.current_dir(script.parent().unwrap_or(&ferry_py_dir()));
    run(with_libtorch(&mut c))
}

/// `cargo xtask torch-suites [--all [--update]]`.
pub(crate) fn main(args: &[String]) -> Result<()> {
    let mut all = false;
    let mut update = false;
    for a in args {
        match a.as_str() {
            "--all" => all = true,
            "--update" => update = true,
            other => bail!("`cargo xtask torch-suites`: unknown argument `{other}`"),
        }
    }
    if update && !all {
        bail!("`cargo xtask torch-suites --update` needs --all");
    }
    crate::setup::ensure_venv()?;
    crate::setup::ensure_python_test_tools()?;
    crate::setup::install_ferry_py()?;
    run_suites(if all {
        Select::All { update }
    } else {
        Select::Expected
    })
}
