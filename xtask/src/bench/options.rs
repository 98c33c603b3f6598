//! `cargo xtask bench`'s command line: which benchmarks run, and how.

use anyhow::{bail, Context, Result};

/// The benchmarks `cargo xtask bench` runs (`--only` picks one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bench {
    /// The criterion benches (`ferry-benches`, bench `wire`).
    Criterion,
    /// RPC latency and throughput, Ferry vs PyTorch.
    Rpc,
    /// Tensor vs RRef argument overhead (Table 1), Ferry vs PyTorch.
    Rref,
    /// Ferry from Python: `ferry.rpc` vs `torch.distributed.rpc`, both
    /// from the same script, RPC latency and Table 1, with the Rust
    /// `rpc_sync` for Python's overhead ([`super::python`]).
    Python,
    /// Distributed autograd overhead (Table 2), Ferry vs PyTorch.
    Autograd,
    /// Lighthouse quorum latency and heartbeat rate, `ferry-lighthouse` vs
    /// torchft 0.2.0's lighthouse, both driven by torchft's own client.
    Lighthouse,
    /// Generating, lowering and simulating pipeline schedules,
    /// `ferry-schedule` vs `torch.distributed.pipelining`
    /// ([`super::schedule`]).
    Schedule,
    /// Pipeline-parallel training, `ferry-pipeline` vs
    /// `torch.distributed.pipelining` ([`super::pipeline`]).
    Pipeline,
    /// Allreduce and recovery, `ferry-ft`'s `ProcessGroup` and
    /// `BabyProcessGroup` vs torchft 0.2.0's `ProcessGroupGloo` and
    /// `ProcessGroupBabyGloo` ([`super::collective`]).
    Collective,
    /// Ferry's `ucx` channel vs `ucx_perftest`, and `rpc_sync` over the
    /// `ucx` transport vs the `shm` transport ([`super::ucx`]); only
    /// with `--only ucx` (it builds the `ucx` feature and installs
    /// `ucx-utils`).
    Ucx,
    /// The CUDA channels (`cuda_staged`, `cuda_ipc`) against a local
    /// device-to-device copy (`ferry-transport`'s `cuda_bench` example);
    /// only with `--only cuda`. Prints `SKIPPED: no CUDA device (<reason>)`
    /// on a host without one.
    Cuda,
}

impl Bench {
    pub(crate) fn parse(name: &str) -> Option<Self> {
        match name {
            "criterion" => Some(Bench::Criterion),
            "rpc" => Some(Bench::Rpc),
            "rref" => Some(Bench::Rref),
            "python" => Some(Bench::Python),
            "autograd" => Some(Bench::Autograd),
            "lighthouse" => Some(Bench::Lighthouse),
            "schedule" => Some(Bench::Schedule),
            "pipeline" => Some(Bench::Pipeline),
            "collective" => Some(Bench::Collective),
            "ucx" => Some(Bench::Ucx),
            "cuda" => Some(Bench::Cuda),
            _ => None,
        }
    }
}

/// What `--only` accepts, for error texts.
const ONLY_NAMES: &str =
    "criterion, rpc, rref, python, autograd, lighthouse, schedule, pipeline, collective, ucx, cuda";

/// Command-line options of `cargo xtask bench`.
#[derive(Debug, Default)]
pub(crate) struct Options {
    /// Short settings everywhere (the whole bench in under ten minutes).
    pub(crate) quick: bool,
    /// Skip the criterion benches.
    pub(crate) no_criterion: bool,
    /// Skip the peer (and its `.venv`): Ferry column only.
    pub(crate) no_peer: bool,
    /// Run nothing: rebuild the tables from the JSON results already in
    /// `target/ferry-bench/`.
    pub(crate) table_only: bool,
    /// Run (or tabulate) only this benchmark.
    pub(crate) only: Option<Bench>,
}

impl Options {
    pub(crate) fn parse(args: &[String]) -> Result<Self> {
        let mut o = Options::default();
        let mut args = args.iter();
        while let Some(a) = args.next() {
            match a.as_str() {
                "--quick" => o.quick = true,
                "--no-criterion" => o.no_criterion = true,
                "--no-peer" => o.no_peer = true,
                "--table-only" => o.table_only = true,
                "--only" => {
                    let name = args.next().map(String::as_str).unwrap_or("");
                    o.only = Some(Bench::parse(name).with_context(|| {
                        format!("`--only` takes one of {ONLY_NAMES} (got `{name}`)")
                    })?);
                }
                other => bail!(
                    "unknown option `{other}` for `cargo xtask bench` \
                     (expected --quick, --no-criterion, --no-peer, --table-only, \
                     --only {{{}}})",
                    ONLY_NAMES.replace(", ", "|")
                ),
            }
        }
        Ok(o)
    }

    /// Whether benchmark `b` is selected (all but `ucx` and `cuda` are,
    /// without `--only`).
    pub(crate) fn runs(&self, b: Bench) -> bool {
        match self.only {
            None => !matches!(b, Bench::Ucx | Bench::Cuda),
            Some(only) => only == b,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse() {
        let o = Options::parse(&["--quick".into()]).expect("valid");
        assert!(o.quick && !o.no_peer && !o.no_criterion && o.only.is_none());
        assert!(o.runs(Bench::Rpc) && o.runs(Bench::Rref) && o.runs(Bench::Criterion));
        assert!(Options::parse(&["--slow".into()]).is_err());
        let o = Options::parse(&["--only".into(), "rref".into(), "--quick".into()]).expect("valid");
        assert_eq!(o.only, Some(Bench::Rref));
        assert!(o.quick && o.runs(Bench::Rref) && !o.runs(Bench::Rpc));
        let err = Options::parse(&["--only".into(), "wire".into()]).expect_err("unknown name");
        assert!(
            format!("{err:#}").contains("criterion, rpc, rref"),
            "{err:#}"
        );
        assert!(Options::parse(&["--only".into()]).is_err());
        let err = Options::parse(&["--slow".into()]).expect_err("unknown option");
        assert!(
            format!("{err}").contains(
                "--only {criterion|rpc|rref|python|autograd|lighthouse|schedule|pipeline|collective|ucx|cuda}"
            ),
            "{err}"
        );
        let o = Options::parse(&["--only".into(), "python".into()]).expect("valid");
        assert!(o.runs(Bench::Python) && !o.runs(Bench::Rpc) && !o.runs(Bench::Rref));
        assert!(Options::default().runs(Bench::Python));
        let o = Options::parse(&["--only".into(), "autograd".into()]).expect("valid");
        assert!(o.runs(Bench::Autograd) && !o.runs(Bench::Rref) && !o.runs(Bench::Criterion));
        assert!(Options::default().runs(Bench::Autograd));
        // `ucx` runs only when asked for.
        assert!(!Options::default().runs(Bench::Ucx));
        let o = Options::parse(&["--only".into(), "ucx".into()]).expect("valid");
        assert!(o.runs(Bench::Ucx) && !o.runs(Bench::Rpc));
        assert!(!Options::default().runs(Bench::Cuda));
        let o = Options::parse(&["--only".into(), "cuda".into()]).expect("valid");
        assert!(o.runs(Bench::Cuda) && !o.runs(Bench::Ucx));
        let o = Options::parse(&["--only".into(), "lighthouse".into()]).expect("valid");
        assert!(o.runs(Bench::Lighthouse) && !o.runs(Bench::Autograd) && !o.runs(Bench::Rpc));
        assert!(Options::default().runs(Bench::Lighthouse));
        let o = Options::parse(&["--only".into(), "schedule".into(), "--no-peer".into()])
            .expect("valid");
        assert_eq!(o.only, Some(Bench::Schedule));
        assert!(o.no_peer && o.runs(Bench::Schedule));
        assert!(!o.runs(Bench::Lighthouse) && !o.runs(Bench::Criterion) && !o.runs(Bench::Rpc));
        let o = Options::parse(&["--table-only".into(), "--only".into(), "schedule".into()])
            .expect("valid");
        assert!(o.table_only && o.runs(Bench::Schedule) && !o.runs(Bench::Autograd));
        assert!(Options::default().runs(Bench::Schedule));
        let o =
            Options::parse(&["--only".into(), "pipeline".into(), "--quick".into()]).expect("valid");
        assert!(o.quick && o.runs(Bench::Pipeline) && !o.runs(Bench::Schedule));
        assert!(Options::default().runs(Bench::Pipeline));
        let o = Options::parse(&["--only".into(), "collective".into()]).expect("valid");
        assert!(o.runs(Bench::Collective) && !o.runs(Bench::Pipeline));
        assert!(Options::default().runs(Bench::Collective));
        let err = Options::parse(&["--only".into(), "schedules".into()]).expect_err("unknown");
        assert!(
            format!("{err:#}").contains("lighthouse, schedule"),
            "{err:#}"
        );
    }
}
