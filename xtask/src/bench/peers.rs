//! The peer benchmark scripts Ferry is compared with: the project's own,
//! in `benches/peers/`, run with the `.venv`'s Python (PyTorch, and
//! torchft for the lighthouse).

use std::path::PathBuf;

use crate::steps::root;

/// Where the peer scripts are, relative to the repository root.
pub(crate) const PEERS_DIR: &str = "benches/peers";

/// The peer script `name` (e.g. `pt_rpc_latency.py`), unless `no_peer`
/// (`--no-peer`) says to skip the peer's column.
pub(crate) fn peer_script(no_peer: bool, name: &str) -> Option<PathBuf> {
    (!no_peer).then(|| root().join(PEERS_DIR).join(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every peer script the bench names (a `"….py"` literal in its
    /// sources) is in `benches/peers/`, so a fresh clone has them all.
    #[test]
    fn every_peer_script_the_bench_names_is_in_the_repository() {
        let mut dirs = vec![root().join("xtask/src/bench")];
        let mut named = Vec::new();
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).expect("the bench's sources") {
                let path = entry.expect("a directory entry").path();
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                let text = std::fs::read_to_string(&path).expect("a source file");
                for piece in text.split('"').skip(1).step_by(2) {
                    let stem = piece.strip_suffix(".py").unwrap_or("");
                    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '/');
                    if !stem.is_empty() && stem.chars().all(plain) {
                        named.push(piece.rsplit('/').next().unwrap_or(piece).to_string());
                    }
                }
            }
        }
        named.sort();
        named.dedup();
        assert!(named.len() >= 5, "found only {named:?}");
        for name in &named {
            assert!(
                root().join(PEERS_DIR).join(name).is_file(),
                "{PEERS_DIR}/{name} is missing"
            );
        }
    }
}
