//! Links between the repository's markdown files resolve: every relative
//! link in the README, CONTRIBUTING.md and `docs/` names a file or
//! directory that exists, and a `#fragment` into a markdown file names one
//! of its headings (GitHub's anchors).

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};

use crate::steps::root;

/// The markdown files checked, relative to the repository root.
fn documents() -> Result<Vec<PathBuf>> {
    let mut files = vec![PathBuf::from("README.md"), PathBuf::from("CONTRIBUTING.md")];
    let mut dirs = vec![PathBuf::from("docs")];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(root().join(&dir))
            .with_context(|| format!("reading {}", dir.display()))?;
        for entry in entries {
            let path = dir.join(entry?.file_name());
            if root().join(&path).is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.retain(|f| root().join(f).is_file());
    files.sort();
    Ok(files)
}

/// The lines of `text` outside fenced code blocks.
fn prose(text: &str) -> impl Iterator<Item = &str> {
    let mut fence = false;
    text.lines().filter(move |line| {
        if line.trim_start().starts_with("```") {
            fence = !fence;
            return false;
        }
        !fence
    })
}

/// GitHub's anchor for a heading's text: lower case, punctuation other
/// than `-` and `_` dropped, spaces as `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a markdown text's headings.
fn anchors(text: &str) -> Vec<String> {
    prose(text)
        .filter_map(|line| {
            let rest = line.trim_start_matches('#');
            (line.starts_with('#') && rest.starts_with(' ')).then(|| anchor(rest))
        })
        .collect()
}

/// The targets of the inline links `[text](target)` in a markdown text,
/// outside code (fenced blocks and `code spans`).
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose(text) {
        // Drop code spans: what is between backticks is not a link.
        let mut plain = String::new();
        for (i, piece) in line.split('`').enumerate() {
            if i % 2 == 0 {
                plain.push_str(piece);
            }
        }
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].trim().to_string());
            rest = &after[end..];
        }
    }
    out
}

/// The broken links of `doc` (relative to the root): `(link, why)`.
fn broken(doc: &Path, text: &str) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for link in links(text) {
        if link.contains("://") || link.starts_with("mailto:") || link.is_empty() {
            continue;
        }
        let (path, fragment) = link.split_once('#').unwrap_or((&link, ""));
        let target = if path.is_empty() {
            doc.to_path_buf()
        } else {
            doc.parent().unwrap_or(Path::new("")).join(path)
        };
        let full = root().join(&target);
        if !full.exists() {
            out.push((link.clone(), "no such file".to_string()));
            continue;
        }
        if !fragment.is_empty() && full.extension().is_some_and(|e| e == "md") {
            let text = std::fs::read_to_string(&full)
                .with_context(|| format!("reading {}", target.display()))?;
            if !anchors(&text).iter().any(|a| a == fragment) {
                out.push((link.clone(), "no such heading".to_string()));
            }
        }
    }
    Ok(out)
}

#[test]
fn links_between_documents_resolve() -> Result<()> {
    let mut problems = Vec::new();
    for doc in documents()? {
        let text = std::fs::read_to_string(root().join(&doc))
            .with_context(|| format!("reading {}", doc.display()))?;
        for (link, why) in broken(&doc, &text)? {
            problems.push(format!("{}: ({link}): {why}", doc.display()));
        }
    }
    ensure!(
        problems.is_empty(),
        "broken links in the docs:\n  {}",
        problems.join("\n  ")
    );
    Ok(())
}

#[test]
fn anchors_and_links_are_read_as_github_does() {
    assert_eq!(
        anchor(" Embedding only `ferry-transport`"),
        "embedding-only-ferry-transport"
    );
    assert_eq!(anchor("UCX (feature `ucx`)"), "ucx-feature-ucx");
    assert_eq!(
        anchor("Compared with `torch.distributed.pipelining`"),
        "compared-with-torchdistributedpipelining"
    );
    let text = "# T\n\n```sh\n# not a heading\n[x](nowhere.md)\n```\n## Sub part\n\
                see [a](b.md#c), `[code](span.md)` and [web](https://x.y/z).\n";
    assert_eq!(anchors(text), ["t", "sub-part"]);
    assert_eq!(links(text), ["b.md#c", "https://x.y/z"]);
}
