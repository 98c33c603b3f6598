//! Ferry's task runner: `cargo xtask <command>`.
//!
//! - `cargo xtask demo [ARGS…]`: build in release and run `ferry-autograd`'s
//!   `train` example (Listing 1 across 3 processes, then locally), then
//!   `ferry-pipeline`'s `train_pipeline` (4 stages on 2 processes, Interleaved1F1B,
//!   then in one process; a measured step beside its simulation);
//! - `cargo xtask test`: everything CI runs (fmt, clippy, tests, doctests,
//!   fuzz harness check, cargo-deny), installing the tools it needs;
//! - `cargo xtask torch-suites [--all [--update]]`: PyTorch's RPC test
//!   suites against `ferry.rpc` ([`torch_suites`]);
//! - `cargo xtask gpu-bundle`: the GPU check as prebuilt binaries and a
//!   script, for a machine with a GPU and no Rust toolchain;
//! - `cargo xtask bench [--quick]`: criterion benches and the side-by-side
//!   tables against the PyTorch RPC peer (RPC latency, RRef overhead,
//!   distributed autograd overhead), against torchft's lighthouse, and
//!   pipeline schedules and pipeline-parallel training against
//!   `torch.distributed.pipelining`.
//!
//! Each module has one job: [`steps`] runs commands and times them,
//! [`setup`] installs tools, [`test`](mod@test), [`demo`] and
//! [`bench`](mod@bench) are the commands (`bench` has a module per
//! benchmark family). Repository
//! checks ("tidy") are unit tests in `tidy.rs`: `cargo test -p xtask`.

mod bench;
mod demo;
mod gpu_bundle;
mod setup;
mod steps;
mod test;
#[cfg(test)]
mod tidy;
mod torch_suites;
mod ucx_bindings;

use anyhow::{bail, Result};

const USAGE: &str = "\
usage: cargo xtask <command> [args]

commands:
  demo [ARGS...]    build in release and train the paper's Listing 1 across 3 local processes
                    (distributed autograd + DistributedOptimizer), then locally for comparison:
                    ferry-autograd's `train` example (ARGS are passed through, e.g. --steps 1000);
                    then a pipelined model, 4 stages on 2 processes with Interleaved1F1B, and the
                    same in one process: ferry-pipeline's `train_pipeline` example (loss curves,
                    step time and speedup, a measured step beside the simulator's prediction in
                    the terminal and in target/demo/pipeline-step.svg, its Chrome trace beside it)
  test              everything CI runs: fmt, clippy, tests, doctests, fuzz check, cargo-deny
  torch-suites [--all [--update]]
                    PyTorch's RPC test suites (rpc_test.py, dist_autograd_test.py,
                    dist_optimizer_test.py) against ferry.rpc: the expected passes
                    (crates/ferry-py/tests/torch_suites/expected.txt), or with --all every test
                    not skipped (skips.txt), counts per suite and new passes, each test's outcome
                    in target/torch-suites.tsv; --update rewrites expected.txt
  bench [--quick]   criterion benches + Ferry vs peer tables (target/ferry-bench/):
                    RPC latency, tensor vs RRef argument overhead (the paper's Table 1) and
                    distributed autograd overhead (Table 2) against PyTorch RPC; the lighthouse
                    (quorum latency, heartbeats/s) against torchft 0.2.0's, installing torchft;
                    pipeline schedules (generate + lower + simulate) and pipeline-parallel
                    training (ferry-pipeline) against torch.distributed.pipelining; allreduce
                    and recovery of ferry-ft's process groups (in-process and Baby) against
                    torchft's Gloo and Baby Gloo; the peer scripts are in benches/peers/;
                    rewrites the sections of docs/benchmarks.md
                    it measured, under the host they ran on
        [--no-criterion] [--no-peer] [--table-only]
        [--only criterion|rpc|rref|autograd|lighthouse|schedule|pipeline|collective|ucx|cuda]
                    (--table-only: rebuild the tables and docs/benchmarks.md from the results
                     already in target/ferry-bench;
                     --only: run or tabulate just that benchmark; `--only ucx`, never run by
                     default: Ferry's ucx channel vs ucx_perftest for UCX_TLS shm and tcp, and
                     rpc_sync over the ucx transport vs the shm transport)
  gpu-bundle        build ferry-transport's CUDA tests and cuda_bench (release, feature cuda) into
                    target/gpu-bundle/ with run.sh, for a GPU machine without cargo or network:
                    there `bash target/gpu-bundle/run.sh` runs the GPU group and each CUDA
                    channel's bandwidth against a device-to-device copy
  ucx-bindings      regenerate ferry-transport's UCX bindings (src/ucx/sys.rs) with bindgen
                    against libucx-dev's headers (installs libucx-dev, libclang-dev, bindgen-cli)
  help              this text
";

fn main() {
    if let Err(err) = run() {
        eprintln!("xtask: error: {err:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let cmd = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    match cmd.as_str() {
        "demo" => demo::main(&rest),
        "test" => {
            no_args("test", &rest)?;
            test::main()
        }
        "torch-suites" => torch_suites::main(&rest),
        "bench" => bench::main(&bench::Options::parse(&rest)?),
        "gpu-bundle" => {
            no_args("gpu-bundle", &rest)?;
            gpu_bundle::main()
        }
        "ucx-bindings" => {
            no_args("ucx-bindings", &rest)?;
            ucx_bindings::main()
        }
        "" | "help" | "-h" | "--help" => {
            print!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown command `{other}`\n\n{USAGE}"),
    }
}

fn no_args(cmd: &str, rest: &[String]) -> Result<()> {
    if let Some(extra) = rest.first() {
        bail!("`cargo xtask {cmd}` takes no arguments (got `{extra}`)\n\n{USAGE}");
    }
    Ok(())
}
