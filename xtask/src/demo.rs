//! `cargo xtask demo`: the main job. Sets up libtorch (the `.venv`), then
//! builds in release and runs two examples:
//!
//! 1. `ferry-autograd`'s `train`: the paper's Listing 1 trained across 3
//!    local processes with distributed autograd and the
//!    `DistributedOptimizer`, then the same run locally;
//! 2. `ferry-pipeline`'s `train_pipeline`: a model of 4 stages trained on
//!    2 worker processes with the Interleaved1F1B schedule (`--schedule
//!    zbv` on the example runs the V-shaped zero-bubble one),
//!    then in one process; it prints the loss curves, the step times and
//!    the speedup, and one measured step beside the simulator's prediction
//!    for the same action costs, in the terminal and as an SVG
//!    (`target/demo/pipeline-step.svg`, with its Chrome trace beside it).

use anyhow::{Context, Result};

use crate::setup::{ensure_venv, with_libtorch};
use crate::steps::{cargo, root, run, Steps};

/// The examples the demo runs: (package, example).
const LISTING_1: (&str, &str) = ("ferry-autograd", "train");
const PIPELINE: (&str, &str) = ("ferry-pipeline", "train_pipeline");

/// `cargo build --release -p PACKAGE --example EXAMPLE`, or `run -q`.
fn example(
    verb: &'static str,
    (package, name): (&'static str, &'static str),
) -> std::process::Command {
    let mut args = vec![verb, "--release"];
    if verb == "run" {
        args.push("-q");
    }
    args.extend(["-p", package, "--example", name]);
    cargo(&args)
}

/// Sets up, builds, then runs the two examples; `args` go to the first
/// (e.g. `--steps 1000`).
pub(crate) fn main(args: &[String]) -> Result<()> {
    let mut steps = Steps::default();
    steps.step_with("setup: .venv (torch for libtorch)", ensure_venv)?;
    steps.step("build the examples (release)", || {
        for ex in [LISTING_1, PIPELINE] {
            run(with_libtorch(&mut example("build", ex)))
                .with_context(|| format!("the {} example did not build", ex.1))?;
        }
        Ok(())
    })?;
    steps.step("train Listing 1 across 3 processes", || {
        let mut c = example("run", LISTING_1);
        if !args.is_empty() {
            c.arg("--").args(args);
        }
        run(with_libtorch(&mut c))
    })?;
    steps.step(
        "train a pipelined model on 2 processes (Interleaved1F1B)",
        || {
            let dir = root().join("target").join("demo");
            let mut c = example("run", PIPELINE);
            c.args(["--", "--schedule", "interleaved", "--trace"])
                .arg(dir.join("pipeline-step.json"))
                .arg("--svg")
                .arg(dir.join("pipeline-step.svg"));
            run(with_libtorch(&mut c))
        },
    )?;
    steps.summary();
    Ok(())
}
