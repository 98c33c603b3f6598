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
