//! The peer benchmark scripts Ferry is compared with.

use std::path::{Path, PathBuf};

use crate::steps::root;

/// The directory of the peer benchmark scripts (read-only), if present:
/// `$FERRY_PEERS_DIR`, else `../shared/peers` next to the repository.
pub(crate) fn peers_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("FERRY_PEERS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("..").join("shared").join("peers"));
    dir.is_dir().then_some(dir)
}

/// The peer script `name` in `peers`, if both are there; says so when the
/// directory is there but the script is not.
pub(crate) fn peer_script(peers: Option<&Path>, name: &str) -> Option<PathBuf> {
    let script = peers?.join(name);
    if script.is_file() {
        Some(script)
    } else {
        eprintln!(
            "peer script {} not found: skipping its column",
            script.display()
        );
        None
    }
}
