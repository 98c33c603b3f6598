//! No import cycles between the files of one crate.
//!
//! A crate's files form a tree of modules from its root (`src/lib.rs`,
//! `src/main.rs`, each `src/bin/*.rs`): the root is `crate`, `a.rs` or
//! `a/mod.rs` is `crate::a`, `a/b.rs` is `crate::a::b`, and a
//! `#[path = "..."] mod m;` names its own file.
//!
//! **File `A` depends on file `B`** when the code of `A` (`use` items and
//! every other path, in test and other inline modules too) holds a path
//! that
//!
//! - starts with `crate::` (or a macro's `$crate::`), `super::` (counted
//!   from the inline module it is written in, as the compiler counts) or
//!   `self::`; each leaf of a use tree is a path of its own
//!   (`use crate::{a::X, b::{self, Y}}` holds `crate::a::X`, `crate::b`
//!   and `crate::b::Y`), and
//! - made absolute, has `B`'s module as its longest prefix among the
//!   crate's file modules (`crate::a::b::f` is `a/b.rs`'s when that file
//!   exists, else `a.rs`'s; `crate::Error` is the root's),
//!
//! and `A` is not `B`. Not dependencies: comments (doc links included),
//! string and char literals, `mod a;` declarations, paths that start with a
//! plain name (`a::X` in `a`'s parent: a parent that declares and
//! re-exports its children is their facade, not their user), and the
//! visibility `pub(in crate::a)`. A re-export is not followed: `crate::X`
//! is the root's even where the root has `pub use a::X`.
//!
//! The check fails on any cycle of these dependencies, `a → b → a` or
//! longer, naming its files in order and the other files tangled with
//! them.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};

use super::{package_dirs, rel};

/// One crate's files: module path (`["a", "b"]` for `crate::a::b`) to file.
type Modules = BTreeMap<Vec<String>, PathBuf>;

/// Each file of a crate and the files it depends on.
type Graph = BTreeMap<PathBuf, BTreeSet<PathBuf>>;

#[test]
fn no_import_cycles_between_files() -> Result<()> {
    let mut problems = Vec::new();
    for dir in package_dirs()? {
        for root in crate_roots(&dir.join("src"))? {
            for (cycle, knot) in crate_cycles(&root)? {
                let names: Vec<String> = cycle.iter().map(|p| rel(p)).collect();
                let mut line = format!("{} → {}", names.join(" → "), names[0]);
                let others: Vec<String> = knot
                    .iter()
                    .filter(|f| !cycle.contains(f))
                    .map(|p| rel(p))
                    .collect();
                if !others.is_empty() {
                    line.push_str(&format!(" (tangled with {})", others.join(", ")));
                }
                problems.push(line);
            }
        }
    }
    ensure!(
        problems.is_empty(),
        "import cycles between the files of a crate (break each: move what both \
         files use into a leaf module, or turn one dependency around; \
         xtask/src/tidy/cycles.rs says what counts as a dependency):\n  {}",
        problems.join("\n  ")
    );
    Ok(())
}

/// The crate roots under a package's `src/`: `lib.rs`, `main.rs`, and the
/// binaries of `src/bin/`.
fn crate_roots(src: &Path) -> Result<Vec<PathBuf>> {
    let mut roots: Vec<PathBuf> = ["lib.rs", "main.rs"]
        .iter()
        .map(|r| src.join(r))
        .filter(|r| r.is_file())
        .collect();
    let bin = src.join("bin");
    if bin.is_dir() {
        for entry in std::fs::read_dir(&bin).with_context(|| format!("reading {}", rel(&bin)))? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "rs") {
                roots.push(path);
            } else if path.join("main.rs").is_file() {
                roots.push(path.join("main.rs"));
            }
        }
    }
    roots.sort();
    Ok(roots)
}

/// The cycles among the files of the crate rooted at `root`: for each knot
/// of files that all reach each other, a shortest cycle through its first
/// file, and the knot.
fn crate_cycles(root: &Path) -> Result<Vec<(Vec<PathBuf>, BTreeSet<PathBuf>)>> {
    let mut modules = Modules::new();
    collect_modules(root, Vec::new(), true, &mut modules)?;
    let mut graph = Graph::new();
    for (module, file) in &modules {
        let text = std::fs::read_to_string(file)?;
        let mut deps = file_dependencies(&text, module, &modules);
        deps.remove(file);
        graph.insert(file.clone(), deps);
    }
    Ok(knots(&graph)
        .into_iter()
        .filter_map(|knot| {
            let first = knot.iter().next()?.clone();
            Some((shortest_cycle(&graph, &first)?, knot))
        })
        .collect())
}

/// Walks the `mod name;` declarations from `file`, the file of `module`.
/// `owns_dir`: `file` is a crate root or a `mod.rs`, whose children live
/// beside it rather than in a directory named after it.
fn collect_modules(
    file: &Path,
    module: Vec<String>,
    owns_dir: bool,
    modules: &mut Modules,
) -> Result<()> {
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", rel(file)))?;
    let dir = file.parent().context("a file without a directory")?;
    let children_dir = if owns_dir {
        dir.to_path_buf()
    } else {
        dir.join(file.file_stem().context("a file without a name")?)
    };
    modules.insert(module.clone(), file.to_path_buf());
    for decl in mod_declarations(&text) {
        let mut child = module.clone();
        child.push(decl.name.clone());
        let (path, owns) = match &decl.path {
            Some(p) => (dir.join(p), false),
            None => {
                let flat = children_dir.join(format!("{}.rs", decl.name));
                if flat.is_file() {
                    (flat, false)
                } else {
                    (children_dir.join(&decl.name).join("mod.rs"), true)
                }
            }
        };
        // A module another target or platform declares may have no file
        // here; the compiler checks the rest.
        if path.is_file() {
            collect_modules(&path, child, owns, modules)?;
        }
    }
    Ok(())
}

/// An out-of-line `mod name;`, with its `#[path = "..."]` if it has one.
struct ModDecl {
    name: String,
    path: Option<String>,
}

/// The out-of-line module declarations at the top level of a file.
fn mod_declarations(text: &str) -> Vec<ModDecl> {
    let tokens = tokens(text);
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut pending_path = None;
    for (i, t) in tokens.iter().enumerate() {
        match t {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => depth = depth.saturating_sub(1),
            Tok::PathAttr(p) if depth == 0 => pending_path = Some(p.clone()),
            Tok::Ident(m) if m == "mod" && depth == 0 => {
                if let (Some(Tok::Ident(name)), Some(Tok::Punct(';'))) =
                    (tokens.get(i + 1), tokens.get(i + 2))
                {
                    out.push(ModDecl {
                        name: name.clone(),
                        path: pending_path.take(),
                    });
                }
            }
            Tok::Punct(';') => pending_path = None,
            _ => {}
        }
    }
    out
}

/// The files that the file of `module`, whose text is `text`, depends on
/// (itself included, where it names itself).
fn file_dependencies(text: &str, module: &[String], modules: &Modules) -> BTreeSet<PathBuf> {
    let tokens = tokens(text);
    let mut deps = BTreeSet::new();
    // The inline modules open, with the brace depth inside each.
    let mut inline: Vec<(usize, String)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            Tok::Punct('{') => {
                depth += 1;
                if let (Some(Tok::Ident(kw)), Some(Tok::Ident(name))) = (
                    i.checked_sub(2).map(|j| &tokens[j]),
                    i.checked_sub(1).map(|j| &tokens[j]),
                ) {
                    if kw == "mod" {
                        inline.push((depth, name.clone()));
                    }
                }
            }
            Tok::Punct('}') => {
                if inline.last().is_some_and(|(d, _)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Tok::Ident(start)
                if matches!(start.as_str(), "crate" | "super" | "self")
                    && tokens.get(i + 1) == Some(&Tok::ColonColon)
                    && !(i > 0 && tokens[i - 1] == Tok::Ident("in".into())) =>
            {
                let mut here = module.to_vec();
                here.extend(inline.iter().map(|(_, name)| name.clone()));
                let (paths, next) = use_tree(&tokens, i);
                for path in paths {
                    if let Some(file) = absolute(&here, &path).and_then(|a| owner(&a, modules)) {
                        deps.insert(file.clone());
                    }
                }
                i = next;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    deps
}

/// `path` (segments as written, `crate`, `super` and `self` included) made
/// absolute from module `here`; `None` where it climbs above the crate.
fn absolute(here: &[String], path: &[String]) -> Option<Vec<String>> {
    let mut out = if path.first().is_some_and(|s| s == "crate") {
        Vec::new()
    } else {
        here.to_vec()
    };
    for (n, segment) in path.iter().enumerate() {
        match segment.as_str() {
            "crate" if n == 0 => {}
            "self" => {}
            "super" => {
                out.pop()?;
            }
            _ => out.push(segment.clone()),
        }
    }
    Some(out)
}

/// The file whose module is the longest prefix of `abs`.
fn owner<'a>(abs: &[String], modules: &'a Modules) -> Option<&'a PathBuf> {
    (0..=abs.len()).rev().find_map(|n| modules.get(&abs[..n]))
}

/// The paths of the use tree or expression path at `tokens[start]`, as
/// segments (a glob or `as name` ends a path; generics end an expression
/// path), and the index after it.
fn use_tree(tokens: &[Tok], start: usize) -> (Vec<Vec<String>>, usize) {
    let mut prefix = Vec::new();
    let mut i = start;
    loop {
        match tokens.get(i) {
            Some(Tok::Ident(segment)) => {
                prefix.push(segment.clone());
                i += 1;
                if tokens.get(i) != Some(&Tok::ColonColon) {
                    return (vec![prefix], i);
                }
                i += 1;
            }
            Some(Tok::Punct('{')) => {
                let mut out = Vec::new();
                i += 1;
                while i < tokens.len() && tokens[i] != Tok::Punct('}') {
                    if tokens[i] == Tok::Punct(',') {
                        i += 1;
                        continue;
                    }
                    let (subtrees, next) = use_tree(tokens, i);
                    out.extend(subtrees.into_iter().map(|sub| {
                        let mut path = prefix.clone();
                        path.extend(sub);
                        path
                    }));
                    // Past what ends the subtree (`as name`, a glob).
                    i = next.max(i + 1);
                    while i < tokens.len() && !matches!(tokens[i], Tok::Punct(',' | '}')) {
                        i += 1;
                    }
                }
                return (out, i + 1);
            }
            _ => return (vec![prefix], i),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    ColonColon,
    Punct(char),
    /// A whole `#[path = "..."]` attribute, with its value.
    PathAttr(String),
}

/// Rust source as identifiers (`$crate` as `crate`), `::`, other
/// punctuation one character at a time and `#[path]` attributes; comments,
/// literals and whitespace left out.
fn tokens(text: &str) -> Vec<Tok> {
    let b: Vec<char> = text.chars().collect();
    let at = |i: usize| b.get(i).copied();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = at(i + 1);
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut nesting = 0usize;
            while i < b.len() {
                if b[i] == '/' && at(i + 1) == Some('*') {
                    nesting += 1;
                    i += 2;
                } else if b[i] == '*' && at(i + 1) == Some('/') {
                    nesting -= 1;
                    i += 2;
                    if nesting == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if let Some(end) = raw_string(&b, i) {
            i = end;
        } else if c == '"' {
            i = string_end(&b, i + 1);
        } else if c == 'b' && next == Some('"') {
            i = string_end(&b, i + 2);
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if next == Some('\\') {
                i += 3;
                while i < b.len() && b[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == Some('\'') {
                i += 3;
            } else {
                i += 1;
            }
        } else if c == '#' && next == Some('[') {
            let end = (i..b.len()).find(|&j| b[j] == ']').unwrap_or(b.len());
            let attr: String = b[i + 2..end].iter().collect();
            let value = attr
                .trim()
                .strip_prefix("path")
                .and_then(|rest| rest.trim_start().strip_prefix('='));
            match value {
                Some(value) => {
                    out.push(Tok::PathAttr(value.trim().trim_matches('"').to_string()));
                    i = end + 1;
                }
                None => {
                    out.push(Tok::Punct('#'));
                    i += 1;
                }
            }
        } else if c == '$' && b[i + 1..].starts_with(&['c', 'r', 'a', 't', 'e']) {
            i += 1;
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            out.push(Tok::Ident(b[start..i].iter().collect()));
        } else if c == ':' && next == Some(':') {
            out.push(Tok::ColonColon);
            i += 2;
        } else if c.is_ascii_digit() {
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
        } else {
            if !c.is_whitespace() {
                out.push(Tok::Punct(c));
            }
            i += 1;
        }
    }
    out
}

/// The index after a string whose body starts at `i`.
fn string_end(b: &[char], mut i: usize) -> usize {
    while i < b.len() {
        match b[i] {
            '\\' => i += 2,
            '"' => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// The index after the raw string (`r"..."`, `r#"..."#`, `br"..."`) that
/// starts at `i`, if one does.
fn raw_string(b: &[char], i: usize) -> Option<usize> {
    let mut j = i + usize::from(b.get(i) == Some(&'b'));
    if b.get(j) != Some(&'r') || (i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_')) {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while b.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    if b.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < b.len() {
        if b[j] == '"' && (1..=hashes).all(|k| b.get(j + k) == Some(&'#')) {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(j)
}

/// The files `from` reaches through one dependency or more.
fn reachable<'a>(graph: &'a Graph, from: &'a PathBuf) -> BTreeSet<&'a PathBuf> {
    let mut seen = BTreeSet::new();
    let mut queue = VecDeque::from([from]);
    while let Some(node) = queue.pop_front() {
        for next in graph.get(node).into_iter().flatten() {
            if seen.insert(next) {
                queue.push_back(next);
            }
        }
    }
    seen
}

/// The knots of `graph`: its sets of two or more files that all reach each
/// other (strongly connected components), each once.
fn knots(graph: &Graph) -> Vec<BTreeSet<PathBuf>> {
    let reach: BTreeMap<&PathBuf, BTreeSet<&PathBuf>> =
        graph.keys().map(|f| (f, reachable(graph, f))).collect();
    let mut placed = BTreeSet::new();
    let mut out = Vec::new();
    for (file, from_file) in &reach {
        if placed.contains(*file) || !from_file.contains(*file) {
            continue;
        }
        let knot: BTreeSet<PathBuf> = from_file
            .iter()
            .filter(|other| reach[**other].contains(*file))
            .map(|other| (*other).clone())
            .collect();
        placed.extend(knot.iter().cloned());
        out.push(knot);
    }
    out
}

/// A shortest cycle through `start`, as its files from `start` on.
fn shortest_cycle(graph: &Graph, start: &PathBuf) -> Option<Vec<PathBuf>> {
    let mut parent: BTreeMap<&PathBuf, &PathBuf> = BTreeMap::new();
    let mut queue = VecDeque::from([start]);
    while let Some(node) = queue.pop_front() {
        for next in graph.get(node).into_iter().flatten() {
            if next == start {
                let mut cycle = vec![node.clone()];
                let mut at = node;
                while at != start {
                    at = parent[at];
                    cycle.push(at.clone());
                }
                cycle.reverse();
                return Some(cycle);
            }
            if !parent.contains_key(next) {
                parent.insert(next, node);
                queue.push_back(next);
            }
        }
    }
    None
}

#[test]
fn the_cycle_check_reads_paths_as_documented() {
    let modules: Modules = [
        (&[][..], "lib.rs"),
        (&["a"][..], "a.rs"),
        (&["a", "b"][..], "a/b.rs"),
        (&["c"][..], "c/mod.rs"),
    ]
    .into_iter()
    .map(|(m, f)| (m.iter().map(|s| s.to_string()).collect(), PathBuf::from(f)))
    .collect();
    let deps = |text: &str, module: &[&str]| -> Vec<String> {
        let module: Vec<String> = module.iter().map(|s| s.to_string()).collect();
        file_dependencies(text, &module, &modules)
            .into_iter()
            .map(|p| p.display().to_string())
            .collect()
    };
    // Use trees, expression paths, macros' `$crate`, `super` and `self`.
    assert_eq!(
        deps("use crate::{a::{b::X, Y as Z}, c::*};", &[]),
        ["a/b.rs", "a.rs", "c/mod.rs"]
    );
    assert_eq!(
        deps("fn f() { crate::c::g::<u8>(); }", &["a"]),
        ["c/mod.rs"]
    );
    assert_eq!(
        deps("macro_rules! m { () => { $crate::c::g() } }", &["a"]),
        ["c/mod.rs"]
    );
    assert_eq!(deps("use super::X;", &["a", "b"]), ["a.rs"]);
    assert_eq!(deps("use super::super::c::Z;", &["a", "b"]), ["c/mod.rs"]);
    assert_eq!(deps("use self::b::Z;", &["a"]), ["a/b.rs"]);
    assert_eq!(deps("use crate::Error;", &["a"]), ["lib.rs"]);
    // `super` in an inline module counts from that module.
    assert_eq!(deps("mod tests { use super::*; }", &["a"]), ["a.rs"]);
    assert_eq!(
        deps("mod tests { use super::super::c; }", &["a"]),
        ["c/mod.rs"]
    );
    // Not dependencies: comments, literals, visibilities, plain paths.
    assert!(deps(
        "//! [`crate::c`]\n// crate::a::X\n/* crate::c */ const S: &str = \"crate::a\";\n\
         const R: &str = r#\"crate::a\"#; const C: char = '{';\n\
         pub(crate) fn f() {} pub(in crate::a) fn g() {} use b::X;",
        &["a"]
    )
    .is_empty());
    // Lifetimes do not start char literals.
    assert_eq!(
        deps(
            "fn f<'a>(x: &'a str) -> crate::c::T<'a> { todo!() }",
            &["a"]
        ),
        ["c/mod.rs"]
    );
    assert_eq!(
        mod_declarations("#[path = \"t.rs\"] mod tests; mod a; mod b { mod c; }")
            .iter()
            .map(|d| (d.name.as_str(), d.path.as_deref()))
            .collect::<Vec<_>>(),
        [("tests", Some("t.rs")), ("a", None)]
    );
    // x → y → z → x is one knot (w only points into it); v → v is none.
    let graph: Graph = [
        ("x", &["y"][..]),
        ("y", &["z"][..]),
        ("z", &["x", "y"][..]),
        ("w", &["x"][..]),
    ]
    .into_iter()
    .map(|(k, v)| (PathBuf::from(k), v.iter().map(PathBuf::from).collect()))
    .collect();
    let found = knots(&graph);
    assert_eq!(
        found,
        [["x", "y", "z"].into_iter().map(PathBuf::from).collect()]
    );
    assert_eq!(
        shortest_cycle(&graph, &PathBuf::from("y")),
        Some(["y", "z"].map(PathBuf::from).to_vec())
    );
    assert_eq!(shortest_cycle(&graph, &PathBuf::from("w")), None);
}
