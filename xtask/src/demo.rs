//! `cargo xtask demo`: build in release and run `ferry`'s demo example.

use anyhow::{Context, Result};

use crate::steps::{cargo, run, Steps};

/// Builds the demo in release, then runs it with `args` passed through.
pub(crate) fn main(args: &[String]) -> Result<()> {
    let mut steps = Steps::default();
    steps.step("build demo (release)", || {
        run(&mut cargo(&[
            "build",
            "--release",
            "-p",
            "ferry",
            "--example",
            "demo",
        ]))
        .context("the demo example did not build")
    })?;
    steps.step("run demo", || {
        let mut c = cargo(&["run", "--release", "-p", "ferry", "--example", "demo"]);
        if !args.is_empty() {
            c.arg("--").args(args);
        }
        run(&mut c)
    })?;
    steps.summary();
    Ok(())
}
