//! The crate map of `docs/architecture.md` checked against the manifests:
//! which crate may depend on which, where libtorch and `anyhow` may
//! appear, and that message kinds come from `ferry_wire::kinds` alone.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{bail, ensure, Context, Result};

use super::{package_dirs, read, rel, table_lines};

/// One row of the crate map: its layer (a number, or `top`, `tool`, ...)
/// and the text of its "depends on" column.
struct Row {
    layer: String,
    depends_on: String,
    /// Marked *(planned)*: not a workspace crate yet.
    planned: bool,
}

/// The rows of the crate map table, by crate name.
fn crate_map() -> Result<BTreeMap<String, Row>> {
    let doc = read("docs/architecture.md")?;
    let section = doc
        .split("## Crate map and layering")
        .nth(1)
        .context("docs/architecture.md has no `## Crate map and layering` section")?;
    let mut rows = BTreeMap::new();
    for line in section.lines().skip_while(|l| !l.starts_with('|')) {
        if !line.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        if cells.len() < 4 || cells[0] == "layer" || cells[0].starts_with("---") {
            continue;
        }
        let name = cells[1]
            .split('`')
            .nth(1)
            .with_context(|| format!("crate map row without a `crate` name: {line}"))?;
        rows.insert(
            name.to_string(),
            Row {
                layer: cells[0].to_string(),
                depends_on: cells[cells.len() - 1].to_string(),
                planned: cells[1].contains("planned"),
            },
        );
    }
    ensure!(!rows.is_empty(), "the crate map table is empty");
    Ok(rows)
}

/// A package's name and the names in its `[dependencies]` table.
fn manifest_deps(manifest: &str) -> Result<(String, Vec<(String, bool)>)> {
    let name = table_lines(manifest, "package")
        .iter()
        .find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == "name").then(|| v.trim().trim_matches('"').to_string())
        })
        .context("a manifest without a package name")?;
    let deps = table_lines(manifest, "dependencies")
        .iter()
        .filter_map(|l| {
            let key = l.split('=').next()?.trim();
            let dep = key.split('.').next()?.trim();
            Some((dep.to_string(), l.contains("optional = true")))
        })
        .collect();
    Ok((name, deps))
}

/// Whether the "depends on" text names workspace crate `dep`, in full
/// (`ferry-rpc`) or short (`rpc`), or says "all of the above".
fn mentions(depends_on: &str, dep: &str) -> bool {
    let short = dep.strip_prefix("ferry-").unwrap_or(dep);
    depends_on.contains("all of the above")
        || depends_on
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
            .any(|w| w == dep || w == short)
}

#[test]
fn the_crate_map_matches_the_manifests() -> Result<()> {
    let map = crate_map()?;
    let mut problems = Vec::new();
    let mut packages = BTreeMap::new();
    for dir in package_dirs()? {
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml"))?;
        let (name, deps) = manifest_deps(&manifest)?;
        packages.insert(name, (rel(&dir), deps));
    }
    let workspace: BTreeSet<&str> = packages.keys().map(String::as_str).collect();
    for (name, (dir, deps)) in &packages {
        let Some(row) = map.get(name) else {
            problems.push(format!(
                "{dir}: crate `{name}` has no row in docs/architecture.md's crate map"
            ));
            continue;
        };
        for (dep, _) in deps.iter().filter(|(d, _)| workspace.contains(d.as_str())) {
            if !mentions(&row.depends_on, dep) {
                problems.push(format!(
                    "`{name}` depends on `{dep}`, which its crate map row does not list \
                     (depends on: {})",
                    row.depends_on
                ));
            }
            // Dependencies point down: a numbered layer only uses lower ones.
            if let (Ok(mine), Some(Ok(theirs))) = (
                row.layer.parse::<u32>(),
                map.get(dep.as_str()).map(|r| r.layer.parse::<u32>()),
            ) {
                if theirs >= mine {
                    problems.push(format!(
                        "`{name}` (layer {mine}) depends on `{dep}` (layer {theirs}): \
                         dependencies must point down the table"
                    ));
                }
            }
        }
        // libtorch: only ferry-tch and the crates built on it (directly,
        // or through the facade, whose `torch` feature is ferry-tch).
        let links_torch = deps.iter().any(|(d, _)| d == "tch" || d == "torch-sys");
        let on_tch = name == "ferry-tch"
            || deps
                .iter()
                .any(|(d, _)| d == "ferry-tch" || (d == "ferry" && name != "ferry"));
        if links_torch && !on_tch {
            problems.push(format!(
                "`{name}` links libtorch (tch/torch-sys) without being built on ferry-tch"
            ));
        }
        // anyhow: xtask, benches and binaries behind a feature only.
        let tool = matches!(name.as_str(), "xtask" | "ferry-benches");
        if let Some((_, optional)) = deps.iter().find(|(d, _)| d == "anyhow") {
            if !tool && !optional {
                problems.push(format!(
                    "library crate `{name}` depends on anyhow: type its errors with thiserror \
                     (anyhow only in xtask, benches, examples, tests, or an optional binary feature)"
                ));
            }
        }
    }
    for (name, row) in &map {
        if !workspace.contains(name.as_str()) && !row.planned {
            problems.push(format!(
                "docs/architecture.md's crate map lists `{name}`, which is not a workspace crate                  (mark it *(planned)* if it is to come)"
            ));
        }
    }
    ensure!(
        problems.is_empty(),
        "crate map problems:\n  {}",
        problems.join("\n  ")
    );
    Ok(())
}

#[test]
fn message_kinds_come_from_the_registry() -> Result<()> {
    let mut problems = Vec::new();
    for dir in package_dirs()? {
        if dir.ends_with("ferry-wire") || dir.ends_with("xtask") {
            continue;
        }
        for sub in ["src", "tests", "examples", "benches"] {
            let path = dir.join(sub);
            if path.is_dir() {
                scan(&path, &mut problems)?;
            }
        }
    }
    ensure!(
        problems.is_empty(),
        "message kinds defined outside ferry_wire::kinds (add them to its REGISTRY):\n  {}",
        problems.join("\n  ")
    );
    Ok(())
}

/// Records every `MessageKind(<number>)` literal under `dir`.
fn scan(dir: &std::path::Path, problems: &mut Vec<String>) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            scan(&path, problems)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path)?;
            for (n, line) in text.lines().enumerate() {
                if literal_kind(line) {
                    problems.push(format!("{}:{}: {}", rel(&path), n + 1, line.trim()));
                }
            }
        }
    }
    Ok(())
}

fn literal_kind(line: &str) -> bool {
    line.match_indices("MessageKind(").any(|(i, m)| {
        line[i + m.len()..]
            .trim_start()
            .starts_with(|c: char| c.is_ascii_digit())
    })
}

#[test]
fn the_checks_see_what_they_look_for() -> Result<()> {
    assert!(literal_kind("const K: MessageKind = MessageKind(0x0f00);"));
    assert!(!literal_kind("let k = MessageKind(raw);"));
    assert!(mentions("ferry-transport, ferry-wire, tokio", "ferry-wire"));
    assert!(mentions("wire, transport, rpc, tch", "ferry-rpc"));
    assert!(!mentions("ferry-rpc-macros", "ferry-rpc"));
    let (name, deps) = manifest_deps(
        "[package]\nname = \"x\"\n[dependencies]\nferry-rpc.workspace = true\n\
         anyhow = { workspace = true, optional = true }\n[dev-dependencies]\ntch = \"1\"\n",
    )?;
    assert_eq!(name, "x");
    assert_eq!(
        deps,
        [
            ("ferry-rpc".to_string(), false),
            ("anyhow".to_string(), true)
        ]
    );
    if mentions("", "ferry-rpc") {
        bail!("an empty column mentions nothing");
    }
    Ok(())
}
