//! Installing what the other commands need, skipping what is already there.

use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::steps::{cargo, cmd, free_gib, root, run, succeeds};

/// The torch version the peer benchmarks were measured with.
pub(crate) const TORCH_VERSION: &str = "2.13.0";

/// Whether `cargo <sub> --version` works (the tool is installed).
pub(crate) fn has_cargo_tool(sub: &str) -> bool {
    succeeds(&mut cargo(&[sub, "--version"]))
}

/// Installs `crate_name` with `cargo install --locked` unless `cargo <sub>` works.
pub(crate) fn ensure_cargo_tool(crate_name: &str, sub: &str) -> Result<&'static str> {
    if has_cargo_tool(sub) {
        eprintln!("    {crate_name} is installed");
        return Ok("present");
    }
    eprintln!("    {crate_name} is missing: installing it (takes a few minutes, once)");
    run(&mut cmd("cargo", &["install", "--locked", crate_name]))
        .with_context(|| format!("could not install {crate_name}"))?;
    Ok("installed")
}

/// The project-local Python interpreter (`.venv/bin/python`).
pub(crate) fn venv_python() -> PathBuf {
    root().join(".venv").join("bin").join("python")
}

/// Ensures `.venv` exists with `torch==TORCH_VERSION` and `numpy`.
pub(crate) fn ensure_venv() -> Result<&'static str> {
    let py_path = venv_python();
    let py = py_path.to_string_lossy().into_owned();
    let check = format!(
        "import torch, numpy; assert torch.__version__.startswith('{TORCH_VERSION}'), torch.__version__"
    );
    if succeeds(&mut cmd(&py, &["-c", &check])) {
        eprintln!("    .venv has torch {TORCH_VERSION} and numpy");
        return Ok("present");
    }
    if !py_path.exists() {
        run(&mut cmd("python3", &["-m", "venv", ".venv"]))
            .context("could not create .venv (is python3 with the venv module installed?)")?;
    }
    let torch = format!("torch=={TORCH_VERSION}");
    pip_install(&py, &[&torch, "numpy"]).context("could not install torch and numpy into .venv")?;
    run(&mut cmd(&py, &["-c", &check]))
        .context(".venv still lacks torch/numpy after pip install")?;
    Ok("installed")
}

/// About how much disk PyPI's torch (a CUDA build: torch, triton and the
/// `nvidia-*` wheels) takes while pip installs it without a cache: the
/// downloaded wheels (3.5 GiB) plus the unpacked `.venv` (4.8 GiB).
const TORCH_INSTALL_GIB: f64 = 9.0;

/// `pip install --no-cache-dir <packages>` with `.venv`'s python `py`.
///
/// No cache: pip would otherwise keep a second copy of every wheel under
/// `~/.cache/pip`, about 3.5 GiB for torch, which a small CI disk may not
/// have. A failure names the free disk space, since running out of it is
/// the usual cause.
fn pip_install(py: &str, packages: &[&str]) -> Result<()> {
    let mut args = vec![
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-cache-dir",
    ];
    args.extend_from_slice(packages);
    let free = free_gib(&root());
    if let Some(free) = free.filter(|&f| f < TORCH_INSTALL_GIB) {
        eprintln!(
            "    warning: {free:.1} GiB free on the disk of {}; torch needs about \
             {TORCH_INSTALL_GIB} GiB while it installs",
            root().display()
        );
    }
    run(&mut cmd(py, &args)).with_context(|| match free {
        Some(free) => format!(
            "{free:.1} GiB were free before pip started (torch needs about {TORCH_INSTALL_GIB} GiB)"
        ),
        None => "the free disk space could not be read".to_owned(),
    })
}

/// Points `c` (a cargo command building a libtorch crate) at the `.venv`'s
/// PyTorch: `LIBTORCH_USE_PYTORCH=1` with the venv's python first on `PATH`
/// (torch-sys asks it where libtorch is). The crates' build scripts then
/// give every test and binary an rpath to that libtorch, so nothing needs
/// `LD_LIBRARY_PATH` at run time.
pub(crate) fn with_libtorch(c: &mut std::process::Command) -> &mut std::process::Command {
    let venv = root().join(".venv");
    let mut path = std::ffi::OsString::from(venv.join("bin"));
    if let Some(p) = std::env::var_os("PATH") {
        path.push(":");
        path.push(p);
    }
    c.env("LIBTORCH_USE_PYTORCH", "1")
        .env("VIRTUAL_ENV", &venv)
        .env("PATH", path)
}

/// Installs the Debian package `package` with apt-get unless `path` exists.
/// A failed install is reported, not fatal: the tests that need the
/// package then say they skipped.
pub(crate) fn ensure_debian_package(package: &str, path: &str) -> Result<&'static str> {
    if std::path::Path::new(path).exists() {
        eprintln!("    {path} is there");
        return Ok("present");
    }
    let install = || succeeds(&mut cmd("apt-get", &["install", "-y", "-q", package]));
    if install() || (succeeds(&mut cmd("apt-get", &["update", "-q"])) && install()) {
        return Ok("installed");
    }
    eprintln!("    could not install {package} with apt-get: the tests that need it will skip");
    Ok("missing")
}

/// The torchft release whose client and lighthouse the lighthouse benchmark
/// and the interop test (`ferry-ft`'s `tests/torchft_interop.rs`) run.
pub(crate) const TORCHFT_VERSION: &str = "0.2.0";

/// Ensures `.venv` has `torchft==TORCHFT_VERSION` (its compiled
/// `torchft._torchft.LighthouseClient` and `LighthouseServer`), next to the
/// torch [`ensure_venv`] installs; run [`ensure_venv`] first.
///
/// A plain `pip install` (with dependencies): torchft 0.2.0 asks for
/// `torch>=2.7`, which the `.venv`'s torch 2.13.0 satisfies, so pip keeps it
/// and adds only torchft's own light dependencies (opentelemetry, protobuf,
/// requests); torch is named on the same command line, pinned, so the
/// resolver cannot move it. `--no-deps` is not needed, and would leave out
/// those dependencies, which `import torchft` needs. The check afterwards
/// also asserts torch is still at [`TORCH_VERSION`].
pub(crate) fn ensure_torchft() -> Result<&'static str> {
    let py_path = venv_python();
    let py = py_path.to_string_lossy().into_owned();
    let check = format!(
        "import importlib.metadata as m, torch\n\
         from torchft._torchft import LighthouseClient, LighthouseServer\n\
         v = m.version('torchft')\n\
         assert v == '{TORCHFT_VERSION}', v\n\
         assert torch.__version__.startswith('{TORCH_VERSION}'), torch.__version__"
    );
    if succeeds(&mut cmd(&py, &["-c", &check])) {
        eprintln!("    .venv has torchft {TORCHFT_VERSION}");
        return Ok("present");
    }
    let torchft = format!("torchft=={TORCHFT_VERSION}");
    // torch is named too, pinned, so the resolver can never move it.
    let torch = format!("torch=={TORCH_VERSION}");
    pip_install(&py, &[&torchft, &torch])
        .with_context(|| format!("could not install {torchft} into .venv"))?;
    run(&mut cmd(&py, &["-c", &check])).with_context(|| {
        format!(
            ".venv still lacks {torchft} (or its torch is no longer {TORCH_VERSION}) after pip install"
        )
    })?;
    Ok("installed")
}

/// The maturin that builds ferry-py's extension module into `.venv`.
pub(crate) const MATURIN_VERSION: &str = "1.16.0";
/// The pytest that runs ferry-py's Python tests.
pub(crate) const PYTEST_VERSION: &str = "9.2.0";
/// The expecttest that `torch.testing._internal` imports (PyTorch's RPC
/// suites, `torch_suites`); torch's wheel does not require it.
pub(crate) const EXPECTTEST_VERSION: &str = "0.3.0";

/// Ensures `.venv` has `maturin==MATURIN_VERSION`,
/// `pytest==PYTEST_VERSION` and `expecttest==EXPECTTEST_VERSION`
/// (ferry-py's build and tests, PyTorch's RPC suites); run
/// [`ensure_venv`] first. All are pure-Python or prebuilt wheels from
/// PyPI and leave torch alone.
pub(crate) fn ensure_python_test_tools() -> Result<&'static str> {
    let py_path = venv_python();
    let py = py_path.to_string_lossy().into_owned();
    let check = format!(
        "import importlib.metadata as m\n\
         assert m.version('maturin') == '{MATURIN_VERSION}', m.version('maturin')\n\
         assert m.version('pytest') == '{PYTEST_VERSION}', m.version('pytest')\n\
         assert m.version('expecttest') == '{EXPECTTEST_VERSION}', m.version('expecttest')"
    );
    if succeeds(&mut cmd(&py, &["-c", &check])) {
        eprintln!(
            "    .venv has maturin {MATURIN_VERSION}, pytest {PYTEST_VERSION} and \
             expecttest {EXPECTTEST_VERSION}"
        );
        return Ok("present");
    }
    let maturin = format!("maturin=={MATURIN_VERSION}");
    let pytest = format!("pytest=={PYTEST_VERSION}");
    let expecttest = format!("expecttest=={EXPECTTEST_VERSION}");
    pip_install(&py, &[&maturin, &pytest, &expecttest])
        .context("could not install maturin, pytest and expecttest into .venv")?;
    run(&mut cmd(&py, &["-c", &check]))
        .context(".venv still lacks maturin, pytest or expecttest after pip install")?;
    Ok("installed")
}

/// ferry-py's crate directory, where its `pyproject.toml` is.
pub(crate) fn ferry_py_dir() -> PathBuf {
    root().join("crates").join("ferry-py")
}

/// Builds ferry-py's extension module and makes `.venv`'s `ferry` this
/// checkout's: `maturin develop` (an editable install of
/// `crates/ferry-py/python`) the first time, then `maturin develop
/// --skip-install`, which rebuilds the module in place only where cargo
/// finds it out of date. The dev profile, with the environment of
/// [`cargo`] (under CI its settings), so the build shares its dependencies
/// with the libtorch crates' tests.
pub(crate) fn install_ferry_py() -> Result<&'static str> {
    let py_path = venv_python();
    let py = py_path.to_string_lossy().into_owned();
    let here = ferry_py_dir().join("python").join("ferry");
    // Where `import ferry` finds the package, without importing it (and torch).
    let installed = format!(
        "import importlib.util, os, sys\n\
         spec = importlib.util.find_spec('ferry')\n\
         loc = spec and spec.submodule_search_locations\n\
         sys.exit(0 if loc and os.path.realpath(loc[0]) == os.path.realpath({:?}) else 1)",
        here.to_string_lossy()
    );
    let editable = succeeds(&mut cmd(&py, &["-c", &installed]));
    let maturin = root().join(".venv").join("bin").join("maturin");
    let mut c = std::process::Command::new(maturin);
    c.arg("develop").current_dir(ferry_py_dir());
    if editable {
        c.arg("--skip-install");
    }
    for (key, value) in cargo(&[]).get_envs() {
        match value {
            Some(v) => c.env(key, v),
            None => c.env_remove(key),
        };
    }
    run(with_libtorch(&mut c)).context("maturin could not build ferry-py")?;
    Ok(if editable {
        "rebuilt in place"
    } else {
        "installed"
    })
}
