//! Repository checks run as unit tests (`cargo test -p xtask`), in the style
//! of rust-analyzer's tidy tests: cheap, no network, no tools beyond std.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};

use crate::steps::root;

#[cfg(test)]
mod cycles;
#[cfg(test)]
mod layers;
#[cfg(test)]
mod links;

pub(crate) fn read(rel: &str) -> Result<String> {
    let path = root().join(rel);
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// Commands in fenced code blocks of a markdown text, in order (`$ ` prompts
/// stripped, blank and comment lines skipped).
fn fenced_commands(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_fence = false;
    for line in markdown.lines() {
        let t = line.trim();
        if t.starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence && !t.is_empty() && !t.starts_with('#') {
            out.push(t.trim_start_matches("$ ").to_string());
        }
    }
    out
}

#[test]
fn readme_opens_with_demo_then_test() -> Result<()> {
    let readme = read("README.md")?;
    let cmds = fenced_commands(&readme);
    ensure!(
        cmds.len() >= 2 && cmds[0] == "cargo xtask demo" && cmds[1] == "cargo xtask test",
        "README.md's first two commands must be `cargo xtask demo` then `cargo xtask test`, found {:?}",
        cmds.iter().take(2).collect::<Vec<_>>()
    );
    Ok(())
}

#[test]
fn ci_run_calls_xtask_test_only() -> Result<()> {
    let script = read(".ci/run")?;
    ensure!(
        script.starts_with("#!/usr/bin/env bash\n"),
        ".ci/run must start with `#!/usr/bin/env bash`"
    );
    let commands: Vec<&str> = script
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter(|l| !l.starts_with("set ") && !l.starts_with("cd "))
        .collect();
    ensure!(
        matches!(
            commands.as_slice(),
            ["exec cargo xtask test" | "cargo xtask test"]
        ),
        ".ci/run must call `cargo xtask test` and nothing else, found {commands:?}"
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(root().join(".ci/run"))?
            .permissions()
            .mode();
        ensure!(
            mode & 0o111 != 0,
            ".ci/run must be executable (chmod +x .ci/run)"
        );
    }
    Ok(())
}

#[test]
fn no_bincode_in_lockfile() -> Result<()> {
    let lock = read("Cargo.lock")?;
    ensure!(
        !lock.contains("bincode"),
        "Cargo.lock mentions bincode: Ferry's payloads use postcard; remove the dependency"
    );
    Ok(())
}

/// Package directories checked for manifest hygiene: every crate under
/// `crates/`, plus the other workspace members.
pub(crate) fn package_dirs() -> Result<Vec<PathBuf>> {
    let mut dirs = Vec::new();
    for entry in std::fs::read_dir(root().join("crates")).context("reading crates/")? {
        let dir = entry?.path();
        if dir.join("Cargo.toml").is_file() {
            dirs.push(dir);
        }
    }
    dirs.sort();
    ensure!(!dirs.is_empty(), "no crates found under crates/");
    for extra in ["benches", "xtask", "tests/facade-only"] {
        let dir = root().join(extra);
        if dir.join("Cargo.toml").is_file() {
            dirs.push(dir);
        }
    }
    Ok(dirs)
}

/// The `key = value` lines of one `[table]` of a Cargo.toml (no nested tables).
pub(crate) fn table_lines<'a>(manifest: &'a str, table: &str) -> Vec<&'a str> {
    let header = format!("[{table}]");
    let mut inside = false;
    let mut out = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == header;
        } else if inside && !line.is_empty() && !line.starts_with('#') {
            out.push(line);
        }
    }
    out
}

fn key_is(line: &str, key: &str) -> bool {
    line.split_once('=').is_some_and(|(k, _)| k.trim() == key)
}

pub(crate) fn rel(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

#[test]
fn every_crate_uses_workspace_lints_and_has_a_description() -> Result<()> {
    let mut problems = Vec::new();
    for dir in package_dirs()? {
        let manifest_path = dir.join("Cargo.toml");
        let manifest = std::fs::read_to_string(&manifest_path)?;
        let lints_inherited = table_lines(&manifest, "lints")
            .iter()
            .any(|l| l.replace(' ', "") == "workspace=true")
            || manifest
                .lines()
                .any(|l| l.replace(' ', "") == "lints.workspace=true");
        if !lints_inherited {
            problems.push(format!(
                "{}: needs `[lints] workspace = true`",
                rel(&manifest_path)
            ));
        }
        let has_description = table_lines(&manifest, "package")
            .iter()
            .any(|l| key_is(l, "description") || key_is(l, "description.workspace"));
        if !has_description {
            problems.push(format!("{}: needs a `description`", rel(&manifest_path)));
        }
    }
    ensure!(
        problems.is_empty(),
        "manifest problems:\n  {}",
        problems.join("\n  ")
    );
    Ok(())
}

#[test]
fn every_lib_starts_with_crate_docs() -> Result<()> {
    let mut problems = Vec::new();
    for dir in package_dirs()? {
        let lib = dir.join("src").join("lib.rs");
        if !lib.is_file() {
            continue;
        }
        let text = std::fs::read_to_string(&lib)?;
        if !text.starts_with("//!") {
            problems.push(format!(
                "{}: must start with a `//!` crate doc comment",
                rel(&lib)
            ));
        }
    }
    ensure!(
        problems.is_empty(),
        "crate docs missing:\n  {}",
        problems.join("\n  ")
    );
    Ok(())
}

#[test]
fn fenced_commands_skip_prompts_and_comments() {
    let md = "# T\n\n```sh\n# comment\n$ cargo xtask demo\n```\ntext\n```\ncargo xtask test\n```\n";
    assert_eq!(
        fenced_commands(md),
        ["cargo xtask demo", "cargo xtask test"]
    );
}
