//! `cargo xtask bench [--quick]`: the criterion benches, then each of
//! Ferry's benchmarks side by side with its peer (`target/ferry-bench/`).
//!
//! One module per benchmark family: [`rpc`] (RPC latency against PyTorch
//! RPC), [`rref`] (the PyTorch RPC paper's Table 1), [`python`] (both from
//! Python: `ferry.rpc` against `torch.distributed.rpc`), [`autograd`] (its
//! Table 2), [`lighthouse`] (against torchft's), [`schedule`] (pipeline
//! schedules against `torch.distributed.pipelining`), [`pipeline`]
//! (pipeline-parallel training against it), [`collective`] (allreduce and
//! recovery against torchft's process groups) and [`ucx`] (the `ucx` channel
//! against `ucx_perftest`). The machinery they share: [`options`] (the
//! command line), [`peers`] (the peer scripts), [`comparison`] (Ferry's
//! binary and the peer's script run alternately), [`process`] (a bounded
//! run of a program), [`results`] (result files and medians over runs),
//! [`table`] (Ferry-vs-peer rows and their ratios), [`report`] (the
//! tables printed from the result files) and [`doc`] (`docs/benchmarks.md`,
//! generated from what the tables printed).

mod autograd;
mod collective;
mod comparison;
mod doc;
mod lighthouse;
mod options;
mod peers;
mod pipeline;
mod pipeline_small;
mod process;
mod python;
mod report;
mod results;
mod rpc;
mod rref;
mod schedule;
pub(crate) mod table;
mod ucx;

use std::time::Instant;

use anyhow::{Context, Result};

use self::options::Bench;
pub(crate) use self::options::Options;
use self::results::OUT_DIR;
use crate::setup::ensure_venv;
use crate::steps::{cargo, root, run, Steps};

/// `cargo xtask bench --quick` must finish within this many seconds.
const QUICK_BUDGET_S: f64 = 600.0;

pub(crate) fn main(o: &Options) -> Result<()> {
    let t0 = Instant::now();
    let mut steps = Steps::default();
    std::fs::create_dir_all(root().join(OUT_DIR)).context("creating target/ferry-bench")?;

    if o.no_peer {
        eprintln!("(--no-peer: skipping the peer column)");
    }
    let side_by_side = o.runs(Bench::Rpc)
        || o.runs(Bench::Rref)
        || o.runs(Bench::Autograd)
        || o.runs(Bench::Lighthouse)
        || o.runs(Bench::Collective);
    // The peer scripts run in the .venv; Ferry's autograd and pipeline
    // benchmarks link its libtorch, peer or not.
    // Both sides of the Python benchmark are Python.
    let needs_venv = (!o.no_peer && (side_by_side || o.runs(Bench::Schedule)))
        || o.runs(Bench::Python)
        || o.runs(Bench::Autograd)
        || o.runs(Bench::Pipeline);
    if needs_venv && !o.table_only {
        steps.step_with("setup: .venv (torch, numpy)", ensure_venv)?;
    }

    if o.table_only {
        eprintln!("(--table-only: tables from the results already in {OUT_DIR})");
    } else if !o.runs(Bench::Criterion) {
        eprintln!("(--only: skipping criterion benches)");
    } else if o.no_criterion {
        eprintln!("(--no-criterion: skipping criterion benches)");
    } else {
        steps.step("criterion: wire", || {
            let mut c = cargo(&["bench", "-p", "ferry-benches", "--bench", "wire"]);
            if o.quick {
                c.args(["--", "--warm-up-time", "1", "--measurement-time", "2"]);
            }
            run(&mut c)
        })?;
    }

    if o.runs(Bench::Rpc) {
        rpc::main(&mut steps, o)?;
    }
    if o.runs(Bench::Rref) {
        rref::main(&mut steps, o)?;
    }
    if o.runs(Bench::Python) {
        python::main(&mut steps, o)?;
    }
    if o.runs(Bench::Autograd) {
        autograd::main(&mut steps, o)?;
    }
    if o.runs(Bench::Lighthouse) {
        lighthouse::main(&mut steps, o)?;
    }
    if o.runs(Bench::Schedule) {
        schedule::main(&mut steps, o)?;
    }
    if o.runs(Bench::Pipeline) {
        pipeline::main(&mut steps, o)?;
    }
    if o.runs(Bench::Collective) {
        collective::main(&mut steps, o)?;
    }
    // `--table-only` alone also rebuilds the UCX table, from its last run.
    if o.runs(Bench::Ucx) || (o.table_only && o.only.is_none()) {
        if o.table_only {
            ucx::table(&mut steps)?;
        } else {
            ucx::main(&mut steps, o)?;
        }
    }
    if o.runs(Bench::Cuda) && !o.table_only {
        steps.step("cuda: channels vs device-to-device copy", || {
            run(&mut cargo(&[
                "run",
                "--release",
                "-p",
                "ferry-transport",
                "--features",
                "cuda",
                "--example",
                "cuda_bench",
            ]))
        })?;
    }

    doc::write()?;
    steps.summary();
    let took = t0.elapsed().as_secs_f64();
    if o.quick && took > QUICK_BUDGET_S {
        eprintln!(
            "warning: `cargo xtask bench --quick` took {took:.0}s, over its {QUICK_BUDGET_S:.0}s budget"
        );
    }
    Ok(())
}
