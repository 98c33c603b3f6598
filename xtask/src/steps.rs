//! Running commands from the repository root as named, timed steps.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The repository root (the parent of `xtask/`).
pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// A command run from the repository root.
pub(crate) fn cmd(program: &str, args: &[&str]) -> Command {
    let mut c = Command::new(program);
    c.args(args).current_dir(root());
    c
}

/// `cargo` with the given arguments, from the repository root.
///
/// Under CI (`CI=true`), unless the environment already says otherwise:
/// - incremental compilation is off: a CI run builds once from a clean
///   clone, where incremental data only costs time and disk (it was half of
///   a long-lived `target/`);
/// - debug info is off, and what is linked is stripped of it (the
///   precompiled standard library's included): a backtrace names
///   functions but not lines, and the artifacts take about half the disk
///   of line tables (ferry-rpc's tests: 843 -> 474 MB, its `rpc` test
///   binary 30 -> 13 MB).
///
/// CI machines' disks can be small: CI runs failed with "No space left on
/// device" while building the libtorch crates' tests (with full debug
/// info), then while building the loom step (with line tables).
pub(crate) fn cargo(args: &[&str]) -> Command {
    let mut c = cmd("cargo", args);
    if is_ci() {
        for (key, value) in CI_CARGO_ENV {
            if std::env::var_os(key).is_none() {
                c.env(key, value);
            }
        }
    }
    c
}

/// The environment [`cargo`] sets under CI, where not already set.
const CI_CARGO_ENV: &[(&str, &str)] = &[
    ("CARGO_INCREMENTAL", "0"),
    ("CARGO_PROFILE_DEV_DEBUG", "0"),
    ("CARGO_PROFILE_DEV_STRIP", "debuginfo"),
    ("CARGO_PROFILE_RELEASE_DEBUG", "0"),
    ("CARGO_PROFILE_RELEASE_STRIP", "debuginfo"),
];

/// Whether this is a CI run (`CI=true`).
pub(crate) fn is_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The free space, in GiB, of the file system holding `path`, as `df` reports
/// it; `None` where `df` cannot tell.
pub(crate) fn free_gib(path: &Path) -> Option<f64> {
    let out = Command::new("df").arg("-Pk").arg(path).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    // `df -P`: a header line, then "fs blocks used available capacity mount".
    let kib: f64 = text
        .lines()
        .nth(1)?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()?;
    Some(kib / (1024.0 * 1024.0))
}

/// Runs `c` with inherited stdio; an error names the command and its exit status.
pub(crate) fn run(c: &mut Command) -> Result<()> {
    let line = display(c);
    eprintln!("    $ {line}");
    let status = c
        .status()
        .with_context(|| format!("could not start `{line}`"))?;
    if !status.success() {
        bail!("`{line}` failed ({status})");
    }
    Ok(())
}

/// Whether `c` runs and exits with success; its output is discarded.
pub(crate) fn succeeds(c: &mut Command) -> bool {
    c.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn display(c: &Command) -> String {
    let mut parts = vec![c.get_program().to_string_lossy().into_owned()];
    parts.extend(c.get_args().map(|a| {
        let a = a.to_string_lossy();
        if a.is_empty() || a.contains(char::is_whitespace) {
            format!("'{a}'")
        } else {
            a.into_owned()
        }
    }));
    parts.join(" ")
}

/// Named steps with their wall times; fails fast on the first failing step.
#[derive(Default)]
pub(crate) struct Steps {
    done: Vec<(String, Duration, &'static str)>,
}

impl Steps {
    /// Runs `f` as step `name`, printing its name and wall time.
    pub(crate) fn step(&mut self, name: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
        self.step_with(name, || f().map(|()| "ok"))
    }

    /// Like [`Steps::step`], but `f` returns the word reported for the step
    /// ("ok", "skipped", "installed", …).
    pub(crate) fn step_with(
        &mut self,
        name: &str,
        f: impl FnOnce() -> Result<&'static str>,
    ) -> Result<()> {
        eprintln!("\n==> {name}");
        let t0 = Instant::now();
        let res = f();
        let took = t0.elapsed();
        match res {
            Ok(word) => {
                eprintln!("<== {name}: {word} ({:.1}s)", took.as_secs_f64());
                self.done.push((name.to_string(), took, word));
                Ok(())
            }
            Err(e) => {
                self.summary();
                eprintln!(
                    "\nxtask: step `{name}` FAILED after {:.1}s",
                    took.as_secs_f64()
                );
                // Running out of disk is a common cause; say how much is left.
                if let Some(free) = free_gib(&root()) {
                    eprintln!("xtask: {free:.1} GiB free on the repository's disk");
                }
                Err(e.context(format!("step `{name}` failed")))
            }
        }
    }

    /// Prints every finished step with its wall time.
    pub(crate) fn summary(&self) {
        if self.done.is_empty() {
            return;
        }
        let width = self.done.iter().map(|(n, _, _)| n.len()).max().unwrap_or(0);
        let total: Duration = self.done.iter().map(|(_, d, _)| *d).sum();
        eprintln!("\nsteps:");
        for (name, took, word) in &self.done {
            eprintln!("  {name:<width$}  {:>7.1}s  {word}", took.as_secs_f64());
        }
        eprintln!("  {:<width$}  {:>7.1}s", "total", total.as_secs_f64());
        if let Some(free) = free_gib(&root()) {
            eprintln!("  ({free:.1} GiB free on the repository's disk)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_gib_reads_the_repository_disk() {
        let free = free_gib(&root()).expect("df reports the repository's disk");
        assert!(free.is_finite() && free >= 0.0, "{free}");
    }

    #[test]
    fn free_gib_is_none_for_a_missing_path() {
        assert_eq!(free_gib(Path::new("/no/such/ferry/path")), None);
    }
}
