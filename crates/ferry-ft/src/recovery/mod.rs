//! Live recovery: a healing replica fetches the model and optimizer state
//! from an up-to-date replica of the quorum over `ferry-transport`,
//! streaming, with the step checked.
//!
//! torchft's managers tell a replica group to *heal* and from whom
//! (`recover_src_manager_address`); the state itself travels through a
//! *checkpoint transport*. This is Ferry's, in place of torchft's HTTP one:
//!
//! - The source runs a [`CheckpointServer`] (bound once, e.g. on
//!   `127.0.0.1:0`) and registers its [`address`](CheckpointServer::address)
//!   as the checkpoint metadata of its quorum requests. When the quorum
//!   names it as a recovery source it [`allow`](CheckpointServer::allow)s its
//!   [`CheckpointState`] (named tensors plus the step), and
//!   [`disallow`](CheckpointServer::disallow)s it before changing its state.
//! - The healing replica asks the source's manager for that metadata
//!   ([`ManagerClient::checkpoint_metadata`](crate::manager::ManagerClient::checkpoint_metadata))
//!   and calls [`fetch_checkpoint`] (or [`fetch_checkpoint_into`], reusing
//!   its own tensors) with the quorum's `max_step`.
//!
//! On the wire: a manifest (names, dtypes, shapes) for the requested step,
//! or a refusal naming the step served; then every tensor cut into chunks,
//! dealt round-robin over several connections (*lanes*), each chunk one
//! message whose tensor table holds a view of the source's storage (sent
//! from its memory, no copy) and whose bytes the receiver's allocation hook
//! lands straight in the destination tensor at the planned offset. There
//! is no per-chunk round trip: a lane streams its chunks back to back, so
//! several are in flight at once on every lane.
//!
//! Every wait is bounded: connecting, each read (a source that stalls),
//! the wait for the source to allow its checkpoint, and, on the source,
//! each write (a healing replica that stopped reading). Failures are typed
//! ([`RecoveryError`]): a dead source, a step mismatch, malformed data.
//!
//! ```no_run
//! use ferry_ft::recovery::{fetch_checkpoint, FetchOptions};
//!
//! # async fn heal(metadata: &str, max_step: i64) -> Result<(), ferry_ft::recovery::RecoveryError> {
//! let state = fetch_checkpoint(metadata, max_step, &FetchOptions::new("replica_b")).await?;
//! assert_eq!(state.step, max_step);
//! for (name, tensor) in &state.tensors {
//!     println!("{name}: {:?} {}", tensor.shape(), tensor.dtype());
//! }
//! # Ok(()) }
//! ```

mod client;
mod error;
pub(crate) mod link;
mod protocol;
mod server;
mod state;

pub use client::{fetch_checkpoint, fetch_checkpoint_into, FetchOptions};
pub use error::{CheckpointServerError, RecoveryError};
pub use server::{CheckpointServer, CheckpointServerOptions, CheckpointServerStats};
pub use state::CheckpointState;

#[cfg(test)]
mod tests;
