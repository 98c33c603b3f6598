//! `cargo xtask test`: everything CI runs, in one place.

use anyhow::{Context, Result};

use crate::setup::{
    ensure_cargo_tool, ensure_debian_package, ensure_python_test_tools, ensure_torchft,
    ensure_venv, ferry_py_dir, has_cargo_tool, install_ferry_py, venv_python, with_libtorch,
};
use crate::steps::{cargo, cmd, is_ci, root, run, Steps};
use crate::torch_suites;

/// Workspace crates that link libtorch. They are excluded from the plain
/// clippy/test runs (which must work without libtorch); adding a crate here is
/// the one edit needed when such a crate lands.
pub(crate) const LIBTORCH_CRATES: &[&str] = &[
    "ferry-tch",
    "ferry-autograd",
    "ferry-pipeline",
    "ferry-facade-only",
    "ferry-py",
];

/// Target dir of the fuzz harness (its own workspace), kept under `target/`
/// so it is cached with everything else.
const FUZZ_TARGET_DIR: &str = "target/fuzz";
/// Target directory of the loom build (`--cfg loom` changes every crate).
const LOOM_TARGET_DIR: &str = "target/loom";
/// (transport, channel) pairs the RPC suite runs over besides the defaults
/// (shm transport, cma channel). `cma` is never selected over TCP: nothing
/// there ties a record's sender to a process the kernel vouches for.
const LINK_COMBINATIONS: &[(&str, &str)] = &[
    ("tcp", "inline"),
    ("tcp", "shm"),
    ("tcp", "mpt"),
    ("shm", "inline"),
    ("shm", "shm"),
    ("shm", "mpt"),
];
/// (transport, channel, `UCX_TLS`) runs of the RPC suite built with the
/// `ucx` feature: the `ucx` channel, then the `ucx` transport, each over
/// UCX's TCP and over its shared-memory transports.
const UCX_COMBINATIONS: &[(&str, &str, &str)] = &[
    ("tcp", "ucx", "tcp"),
    ("tcp", "ucx", "shm,self"),
    ("ucx", "inline", "tcp"),
    ("ucx", "inline", "shm,self"),
];
/// UCX's library, loaded at run time by the `ucx` feature.
const LIBUCP: &str = "/usr/lib/x86_64-linux-gnu/libucp.so.0";

/// A path between hosts the RPC suite runs over with every rank on a host
/// of its own (`FERRY_TEST_CROSS_HOST=1`, see `ferry_testkit::hosts`).
struct CrossHostPath {
    /// Its name in the step's title.
    name: &'static str,
    /// The environment that selects it (besides `FERRY_TEST_CROSS_HOST`).
    env: &'static [(&'static str, &'static str)],
    /// Extra cargo arguments (e.g. a feature the path needs).
    cargo_args: &'static [&'static str],
}

/// The cross-host paths: `mpt` is what selection picks between hosts by
/// default (`cma` and `shm` ruled out by their domains), `tcp` forces the
/// tensors inline on the TCP connection, and with the `ucx` feature the
/// `ucx` channel and the `ucx` transport go over UCX's TCP transport (which
/// finds the hosts' link since each host mounts its own sysfs).
const CROSS_HOST_PATHS: &[CrossHostPath] = &[
    CrossHostPath {
        name: "mpt",
        env: &[],
        cargo_args: &[],
    },
    CrossHostPath {
        name: "tcp",
        env: &[("FERRY_CHANNELS", "inline")],
        cargo_args: &[],
    },
    CrossHostPath {
        name: "the ucx channel (UCX_TLS=tcp)",
        env: &[
            ("FERRY_CHANNELS", "ucx"),
            ("FERRY_TRANSPORTS", "tcp"),
            ("UCX_TLS", "tcp"),
        ],
        cargo_args: &["--features", "ucx"],
    },
    CrossHostPath {
        name: "the ucx transport (UCX_TLS=tcp)",
        env: &[
            ("FERRY_CHANNELS", "inline"),
            ("FERRY_TRANSPORTS", "ucx"),
            ("UCX_TLS", "tcp"),
        ],
        cargo_args: &["--features", "ucx"],
    },
];

/// Why workers cannot be run on separate hosts here (`None`: they can):
/// root (CAP_SYS_ADMIN, CAP_NET_ADMIN), `ip` (iproute2), `unshare` and
/// `nsenter` (util-linux), and a kernel that grants the namespaces a host
/// gets. The same check the tests make at run time
/// (`ferry_testkit::hosts::availability`).
fn cross_host_unavailable() -> Option<String> {
    ferry_testkit::hosts::availability()
        .err()
        .map(|e| e.to_string())
}

/// `--workspace` plus one `--exclude` per crate in [`LIBTORCH_CRATES`].
pub(crate) fn workspace_args() -> Vec<&'static str> {
    let mut args = vec!["--workspace"];
    for krate in LIBTORCH_CRATES {
        args.extend(["--exclude", krate]);
    }
    args
}

/// One `--package` per crate in [`LIBTORCH_CRATES`].
fn libtorch_args(prefix: &[&'static str], rest: &[&'static str]) -> Vec<&'static str> {
    let mut args = prefix.to_vec();
    for krate in LIBTORCH_CRATES {
        args.extend(["--package", krate]);
    }
    // The facade with its libtorch layers.
    args.extend(["--package", "ferry", "--features", "ferry/torch"]);
    args.extend(rest);
    args
}

fn with(prefix: &[&'static str], rest: &[&'static str]) -> Vec<&'static str> {
    let mut args = prefix.to_vec();
    args.extend(workspace_args());
    args.extend(rest);
    args
}

/// The multi-process RPC suite (nextest profile `profile`) with every
/// tensor over `channel` and the frames over `transport`. The test of the
/// fallback between the default channels is left out: it needs them.
fn rpc_suite_over(profile: &str, transport: &str, channel: &str) -> std::process::Command {
    let mut c = cargo(&["nextest", "run", "-p", "ferry-rpc", "--test", "rpc"]);
    c.args(["--profile", profile])
        .args([
            "-E",
            "not test(cma_across_user_namespaces_falls_back_to_shm)",
        ])
        .env("FERRY_TRANSPORTS", transport)
        .env("FERRY_CHANNELS", channel)
        .env("FERRY_SMALL_TENSOR_BYTES", "0");
    c
}

/// The UCX tests (`ferry-transport`'s `tests/ucx.rs` and unit tests), then
/// the RPC suite once per [`UCX_COMBINATIONS`], all built with the `ucx`
/// feature. `runner` is `nextest run --profile P` or `test`.
fn ucx_tests(steps: &mut Steps, runner: &[&'static str]) -> Result<()> {
    if !std::path::Path::new(LIBUCP).exists() {
        eprintln!("\n(UCX tests skipped: {LIBUCP} is missing and could not be installed)");
        return Ok(());
    }
    steps.step("ucx: ferry-transport with feature ucx", || {
        let mut args = runner.to_vec();
        args.extend([
            "-p",
            "ferry-transport",
            "--features",
            "ucx",
            "--lib",
            "--test",
            "ucx",
        ]);
        run(&mut cargo(&args))
    })?;
    for (transport, channel, tls) in UCX_COMBINATIONS {
        steps.step(
            &format!("rpc suite over transport {transport}, channel {channel}, UCX_TLS={tls}"),
            || {
                let mut args = runner.to_vec();
                args.extend(["-p", "ferry-rpc", "--features", "ucx", "--test", "rpc"]);
                let mut c = cargo(&args);
                if runner[0] == "nextest" {
                    c.args([
                        "-E",
                        "not test(cma_across_user_namespaces_falls_back_to_shm)",
                    ]);
                } else {
                    c.args([
                        "--",
                        "--skip",
                        "cma_across_user_namespaces_falls_back_to_shm",
                    ]);
                }
                run(c
                    .env("FERRY_TRANSPORTS", transport)
                    .env("FERRY_CHANNELS", channel)
                    .env("FERRY_SMALL_TENSOR_BYTES", "0")
                    .env("UCX_TLS", tls))
            },
        )?;
    }
    Ok(())
}

/// `ferry-transport` built with the `cuda` feature: its unit tests (the
/// staged pipeline on the host copy engine, device maps), the CPU-side
/// CUDA tests, and the GPU group (`tests/cuda.rs`), which prints
/// `SKIPPED: no CUDA device (<reason>)` on a host without one. Nothing of
/// CUDA is needed to build. `runner` is `nextest run --profile P` or `test`.
fn cuda_tests(steps: &mut Steps, runner: &[&'static str]) -> Result<()> {
    steps.step("cuda: ferry-transport with feature cuda", || {
        let mut args = runner.to_vec();
        args.extend([
            "-p",
            "ferry-transport",
            "--features",
            "cuda",
            "--lib",
            "--test",
            "cuda",
            "--test",
            "cuda_cpu",
        ]);
        run(&mut cargo(&args))
    })
}

/// Runs every CI step; stops at the first failure.
pub(crate) fn main() -> Result<()> {
    let mut steps = Steps::default();
    steps.step_with("setup: cargo-deny", || {
        ensure_cargo_tool("cargo-deny", "deny")
    })?;
    // The lighthouse dashboard's test drives headless Chromium.
    steps.step_with("setup: chromium (Debian)", || {
        ensure_debian_package("chromium", "/usr/bin/chromium")
    })?;
    // UCX's run-time library for the `ucx` channel and transport (without
    // it their tests say they skipped).
    steps.step_with("setup: libucx0 (Debian)", || {
        ensure_debian_package("libucx0", LIBUCP)
    })?;
    // torchft 0.2.0's own clients and managers talk to Ferry's lighthouse
    // and managers in ferry-ft's interop tests.
    steps.step_with("setup: .venv (torch, torchft)", || {
        ensure_venv()?;
        ensure_torchft()
    })?;
    // Separate hosts (namespaces joined by veth) for the cross-host tests.
    steps.step_with("setup: iproute2 (Debian)", || {
        ensure_debian_package("iproute2", "/sbin/ip")
    })?;
    steps.step_with("setup: util-linux (Debian)", || {
        ensure_debian_package("util-linux", "/usr/bin/nsenter")
    })?;
    steps.step("fmt", || {
        run(&mut cargo(&["fmt", "--all", "--", "--check"]))
            .context("code is not formatted: run `cargo fmt --all`")
    })?;
    steps.step("clippy", || {
        run(&mut cargo(&with(
            &["clippy"],
            &["--all-targets", "--", "-D", "warnings"],
        )))
    })?;
    steps.step("clippy (features ucx, cuda)", || {
        run(&mut cargo(&[
            "clippy",
            "-p",
            "ferry-transport",
            "-p",
            "ferry-rpc",
            "-p",
            "ferry",
            "--features",
            "ferry/ucx,ferry/cuda",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))
    })?;
    if has_cargo_tool("nextest") {
        let ci = is_ci();
        let profile = if ci { "ci" } else { "default" };
        steps.step(&format!("tests (nextest, profile {profile})"), || {
            run(&mut cargo(&with(
                &["nextest", "run"],
                &["--profile", profile],
            )))
        })?;
        // nextest does not run doctests.
        steps.step("doctests", || run(&mut cargo(&with(&["test"], &["--doc"]))))?;
        // The multi-process RPC suite once per transport/channel combination
        // (the run above used the defaults: shm transport, cma channel),
        // every tensor over the forced channel.
        for (transport, channel) in LINK_COMBINATIONS {
            steps.step(
                &format!("rpc suite over transport {transport}, channel {channel}"),
                || run(&mut rpc_suite_over(profile, transport, channel)),
            )?;
        }
        // Once more over the `shm` rings with no spin: every reader,
        // writer and caller that finds nothing sleeps after one round of
        // checks, so messages take the wake-up paths the spin usually hides.
        steps.step(
            "rpc suite over transport shm, channel shm, FERRY_SPIN_US=0",
            || run(rpc_suite_over(profile, "shm", "shm").env("FERRY_SPIN_US", "0")),
        )?;
        ucx_tests(&mut steps, &["nextest", "run", "--profile", profile])?;
        cuda_tests(&mut steps, &["nextest", "run", "--profile", profile])?;
        // The suite again with every rank on a host of its own, over each
        // cross-host path (`tests/cross_host.rs` ran in the run above: it
        // asserts the selected link and that `cma`/`shm` are ruled out).
        match cross_host_unavailable() {
            Some(why) => steps.step_with("rpc suite across hosts", || {
                eprintln!("    cannot run workers on separate hosts here: {why}");
                eprintln!("    (tests/cross_host.rs printed SKIPPED with the same reason)");
                Ok("skipped")
            })?,
            None => {
                if std::path::Path::new(LIBUCP).exists() {
                    // The UCX links across hosts: selected over UCX's TCP,
                    // falling back to `mpt` where UCX cannot reach the peer.
                    steps.step("cross-host UCX links (feature ucx)", || {
                        run(&mut cargo(&[
                            "nextest",
                            "run",
                            "-p",
                            "ferry-rpc",
                            "--features",
                            "ucx",
                            "--test",
                            "cross_host",
                            "--profile",
                            profile,
                            "-E",
                            "test(/^ucx::/)",
                        ]))
                    })?;
                }
                for path in CROSS_HOST_PATHS {
                    if path.cargo_args.contains(&"ucx") && !std::path::Path::new(LIBUCP).exists() {
                        continue;
                    }
                    steps.step(
                        &format!("rpc suite across hosts over {}", path.name),
                        || {
                            let mut c =
                                cargo(&["nextest", "run", "-p", "ferry-rpc", "--test", "rpc"]);
                            c.args(path.cargo_args)
                                .args(["--profile", profile])
                                // It asserts a same-host fallback.
                                .args([
                                    "-E",
                                    "not test(cma_across_user_namespaces_falls_back_to_shm)",
                                ])
                                .env("FERRY_TEST_CROSS_HOST", "1")
                                .env("FERRY_SMALL_TENSOR_BYTES", "0");
                            for (k, v) in path.env {
                                c.env(k, v);
                            }
                            run(&mut c)
                        },
                    )?;
                }
            }
        }
    } else {
        eprintln!("\n(cargo-nextest not installed: using `cargo test`, doctests included)");
        steps.step("tests + doctests (cargo test)", || {
            run(&mut cargo(&with(&["test"], &[])))
        })?;
        ucx_tests(&mut steps, &["test"])?;
        cuda_tests(&mut steps, &["test"])?;
    }
    // The shared-memory ring's lock-free protocol, model-checked.
    steps.step("loom (shm ring)", || {
        run(cargo(&[
            "test",
            "-p",
            "ferry-transport",
            "--release",
            "--lib",
            "--target-dir",
            LOOM_TARGET_DIR,
            "shm::",
        ])
        .env("RUSTFLAGS", "--cfg loom"))?;
        // `--cfg loom` rebuilds every crate for this step alone; a CI run
        // (a clean clone, nothing to cache for) gives that disk back.
        if is_ci() {
            std::fs::remove_dir_all(root().join(LOOM_TARGET_DIR))
                .with_context(|| format!("removing {LOOM_TARGET_DIR}"))?;
        }
        Ok(())
    })?;
    // The libtorch crates, built against the .venv's PyTorch.
    steps.step("clippy (libtorch crates)", || {
        run(with_libtorch(&mut cargo(&libtorch_args(
            &["clippy"],
            &["--all-targets", "--", "-D", "warnings"],
        ))))
    })?;
    if has_cargo_tool("nextest") {
        let ci = is_ci();
        let profile = if ci { "ci" } else { "default" };
        steps.step("tests (libtorch crates)", || {
            run(with_libtorch(&mut cargo(&libtorch_args(
                &["nextest", "run"],
                &["--profile", profile],
            ))))
        })?;
        steps.step("doctests (libtorch crates)", || {
            run(with_libtorch(&mut cargo(&libtorch_args(
                &["test"],
                &["--doc"],
            ))))
        })?;
    } else {
        steps.step("tests + doctests (libtorch crates)", || {
            run(with_libtorch(&mut cargo(&libtorch_args(&["test"], &[]))))
        })?;
    }
    // ferry-py: the Python package `ferry` built into .venv, then its
    // multi-process Python tests (ferry.rpc against worker processes).
    steps.step_with(
        "setup: maturin and pytest (.venv)",
        ensure_python_test_tools,
    )?;
    steps.step_with(
        "ferry-py: build the ferry package into .venv",
        install_ferry_py,
    )?;
    // The Rust workers of the mixed-group tests and example (Python and
    // Rust workers in one group), which the Python tests start.
    steps.step("ferry-py: the Rust workers its tests run", || {
        run(with_libtorch(&mut cargo(&[
            "build",
            "-p",
            "ferry",
            "--features",
            "torch",
            "--example",
            "mixed_worker",
            "--example",
            "param_server",
        ])))
    })?;
    steps.step("ferry-py: Python tests (pytest)", || {
        let py = venv_python();
        let mut c = cmd(&py.to_string_lossy(), &["-m", "pytest", "-q"]);
        c.current_dir(ferry_py_dir());
        run(with_libtorch(&mut c))
    })?;
    steps.step("ferry-py: PyTorch's RPC suites (expected passes)", || {
        torch_suites::run_suites(torch_suites::Select::Expected)
    })?;
    // ferry-tch with `cuda`: libtorch's CUDA backend loader, CUDA tensors
    // refused without a GPU; the GPU case skips here (it runs where CUDA is).
    steps.step("cuda: ferry-tch with feature cuda", || {
        run(with_libtorch(&mut cargo(&[
            "test",
            "-p",
            "ferry-tch",
            "--features",
            "cuda",
            "--lib",
            "--test",
            "cuda",
        ])))
    })?;
    // Every crate's docs, the libtorch ones included: no broken or
    // private intra-doc link, nothing rustdoc warns about.
    steps.step("docs (rustdoc, warnings denied)", || {
        run(with_libtorch(
            cargo(&["doc", "--no-deps", "--workspace"]).env("RUSTDOCFLAGS", "-D warnings"),
        ))
    })?;
    steps.step("fuzz harness compiles", || {
        run(&mut cargo(&[
            "check",
            "--manifest-path",
            "fuzz/Cargo.toml",
            "--target-dir",
            FUZZ_TARGET_DIR,
        ]))
    })?;
    steps.step("cargo-deny (licenses, bans, sources)", || {
        run(&mut cargo(&[
            "deny",
            "check",
            "--hide-inclusion-graph",
            "licenses",
            "bans",
            "sources",
        ]))
    })?;
    steps.summary();
    eprintln!("\nxtask test: all steps passed");
    Ok(())
}
