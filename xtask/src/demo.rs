//! `cargo xtask demo`: the main job. Sets up libtorch (the `.venv`), then
//! builds in release and runs `ferry-autograd`'s `train` example: the
//! paper's Listing 1 trained across 3 local processes with distributed
//! autograd and the `DistributedOptimizer`, then the same run locally.

use anyhow::{Context, Result};

use crate::setup::{ensure_venv, with_libtorch};
use crate::steps::{cargo, run, Steps};

const BUILD: &[&str] = &[
    "build",
    "--release",
    "-p",
    "ferry-autograd",
    "--example",
    "train",
];

/// Sets up, builds, then runs the training example with `args` passed
/// through (e.g. `--steps 1000`).
pub(crate) fn main(args: &[String]) -> Result<()> {
    let mut steps = Steps::default();
    steps.step_with("setup: .venv (torch for libtorch)", ensure_venv)?;
    steps.step("build the training example (release)", || {
        run(with_libtorch(&mut cargo(BUILD))).context("the training example did not build")
    })?;
    steps.step("train Listing 1 across 3 processes", || {
        let mut c = cargo(&[
            "run",
            "--release",
            "-q",
            "-p",
            "ferry-autograd",
            "--example",
            "train",
        ]);
        if !args.is_empty() {
            c.arg("--").args(args);
        }
        run(with_libtorch(&mut c))
    })?;
    steps.summary();
    Ok(())
}
