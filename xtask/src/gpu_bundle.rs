//! `cargo xtask gpu-bundle`: the GPU check as prebuilt binaries, for a
//! machine with a GPU but no Rust toolchain or network (this project's
//! device machines).
//!
//! It builds `ferry-transport` with feature `cuda` in release: the unit
//! tests, the GPU group (`tests/cuda.rs`), the CPU-side CUDA tests
//! (`tests/cuda_cpu.rs`) and the `cuda_bench` example. It copies them,
//! without debug info, into `target/gpu-bundle/bin/` beside `run.sh`
//! (`xtask/gpu/run.sh`), which runs them there and says whether the GPU
//! group ran. The bundle stays under the device tool's 64 MiB carry limit
//! (checked here). Nothing of CUDA is needed to build: the driver is loaded
//! at run time.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::steps::{cargo, root, run, Steps};

/// The script the bundle runs on the GPU machine.
const RUN_SH: &str = include_str!("../gpu/run.sh");
/// Most bytes the bundle may take: the device tool carries at most 64 MiB,
/// the repository's tracked files included.
const MAX_BUNDLE_BYTES: u64 = 56 << 20;

/// Which built artifact becomes which file of `bin/`: (target name, target
/// kind, file name). Tests are their test harnesses; the example is its
/// plain binary (not built as a test).
const BINARIES: &[(&str, &str, &str)] = &[
    ("ferry_transport", "lib", "unit"),
    ("cuda", "test", "cuda"),
    ("cuda_cpu", "test", "cuda_cpu"),
    ("cuda_bench", "example", "cuda_bench"),
];

/// Builds the bundle into `target/gpu-bundle/`.
pub(crate) fn main() -> Result<()> {
    let mut steps = Steps::default();
    let mut built = Vec::new();
    steps.step("build: ferry-transport --features cuda (release)", || {
        let tests = cargo_json(&[
            "test", "--no-run", "--lib", "--test", "cuda", "--test", "cuda_cpu",
        ])?;
        let bench = cargo_json(&["build", "--example", "cuda_bench"])?;
        built = executables(&format!("{tests}\n{bench}"))?;
        Ok(())
    })?;
    let bundle = root().join("target/gpu-bundle");
    steps.step("bundle: target/gpu-bundle", || {
        if bundle.exists() {
            std::fs::remove_dir_all(&bundle)
                .with_context(|| format!("removing {}", bundle.display()))?;
        }
        let bin = bundle.join("bin");
        std::fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
        for (file, from) in &built {
            let to = bin.join(file);
            run(std::process::Command::new("strip")
                .arg("--strip-debug")
                .arg("-o")
                .arg(&to)
                .arg(from))?;
        }
        let script = bundle.join("run.sh");
        std::fs::write(&script, RUN_SH).with_context(|| format!("writing {}", script.display()))?;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("making {} executable", script.display()))?;
        let bytes = size(&bundle)?;
        eprintln!("    {} MiB in {}", bytes >> 20, bundle.display());
        if bytes > MAX_BUNDLE_BYTES {
            bail!(
                "the bundle takes {} MiB, over the {} MiB the device tool can carry beside the repository",
                bytes >> 20,
                MAX_BUNDLE_BYTES >> 20
            );
        }
        Ok(())
    })?;
    steps.summary();
    eprintln!(
        "\nOn the GPU machine (device tool): run `bash target/gpu-bundle/run.sh` with carry \
         [\"target/gpu-bundle\"]. Here it runs too, and says the GPU group skipped."
    );
    Ok(())
}

/// Runs `cargo <args> --release -p ferry-transport --features cuda` with
/// JSON messages; returns them (diagnostics go to the terminal).
fn cargo_json(args: &[&str]) -> Result<String> {
    let mut all = args.to_vec();
    all.extend([
        "--release",
        "--message-format=json-render-diagnostics",
        "-p",
        "ferry-transport",
        "--features",
        "cuda",
    ]);
    let out = cargo(&all)
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("could not start cargo")?;
    if !out.status.success() {
        bail!("`cargo {}` failed ({})", all.join(" "), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The executables of [`BINARIES`] in cargo's JSON messages, as (file name
/// in `bin/`, built path); an error names any that is missing.
fn executables(messages: &str) -> Result<Vec<(&'static str, PathBuf)>> {
    let mut found: Vec<(&'static str, PathBuf)> = Vec::new();
    for line in messages.lines() {
        let Ok(msg) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        let name = msg["target"]["name"].as_str().unwrap_or_default();
        let kinds = msg["target"]["kind"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let harness = msg["profile"]["test"].as_bool().unwrap_or(false);
        let wanted = BINARIES.iter().find(|(n, kind, _)| {
            *n == name && kinds.iter().any(|k| k == kind) && harness == (*kind != "example")
        });
        if let Some((_, _, file)) = wanted {
            found.push((file, PathBuf::from(exe)));
        }
    }
    let missing: Vec<&str> = BINARIES
        .iter()
        .filter(|(_, _, file)| !found.iter().any(|(f, _)| f == file))
        .map(|(name, kind, _)| {
            if *kind == "lib" {
                "the unit tests"
            } else {
                *name
            }
        })
        .collect();
    if !missing.is_empty() {
        bail!("cargo built no executable for: {}", missing.join(", "));
    }
    Ok(found)
}

/// Bytes of the files under `dir`.
fn size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            size(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifact(name: &str, kind: &str, harness: bool, exe: Option<&str>) -> String {
        serde_json::json!({
            "reason": "compiler-artifact",
            "target": { "name": name, "kind": [kind] },
            "profile": { "test": harness },
            "executable": exe,
        })
        .to_string()
    }

    #[test]
    fn each_binary_is_found_by_name_and_kind() {
        let lines = [
            artifact("ferry_transport", "lib", false, None),
            artifact("ferry_transport", "lib", true, Some("/t/ferry_transport-1")),
            artifact("cuda", "test", true, Some("/t/cuda-2")),
            artifact("cuda_cpu", "test", true, Some("/t/cuda_cpu-3")),
            artifact("cuda_bench", "example", true, Some("/t/harness")),
            artifact("cuda_bench", "example", false, Some("/t/cuda_bench")),
            artifact("cuda", "bin", false, Some("/t/not-this-one")),
            r#"{"reason":"build-finished","success":true}"#.to_string(),
            "not json".to_string(),
        ];
        let found = executables(&lines.join("\n")).expect("all found");
        assert_eq!(
            found,
            vec![
                ("unit", PathBuf::from("/t/ferry_transport-1")),
                ("cuda", PathBuf::from("/t/cuda-2")),
                ("cuda_cpu", PathBuf::from("/t/cuda_cpu-3")),
                ("cuda_bench", PathBuf::from("/t/cuda_bench")),
            ]
        );
    }

    #[test]
    fn a_missing_binary_is_named() {
        let lines = [
            artifact("cuda", "test", true, Some("/t/cuda-2")),
            artifact("cuda_bench", "example", true, Some("/t/harness")),
        ];
        let err = executables(&lines.join("\n"))
            .expect_err("three missing")
            .to_string();
        assert!(err.contains("the unit tests"), "{err}");
        assert!(err.contains("cuda_cpu"), "{err}");
        assert!(err.contains("cuda_bench"), "{err}");
    }

    #[test]
    fn the_script_runs_every_binary_of_the_bundle() {
        for (_, _, file) in BINARIES {
            assert!(
                RUN_SH.contains(&format!("\"$here/bin/{file}\"")),
                "run.sh does not run bin/{file}"
            );
        }
    }

    #[test]
    fn the_steps_fit_in_one_device_command() {
        // The device tool runs one command for at most 10 minutes.
        let seconds: u64 = RUN_SH
            .lines()
            .filter_map(|l| l.strip_prefix("step "))
            .map(|l| {
                let limit = l.split_whitespace().nth(1).expect("a time limit");
                limit.parse::<u64>().expect("seconds")
            })
            .sum();
        assert!(seconds > 0, "no steps found");
        assert!(seconds <= 9 * 60, "the steps may take {seconds} s");
    }
}
