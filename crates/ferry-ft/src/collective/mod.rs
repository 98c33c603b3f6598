//! Collectives across the replica groups of a quorum: the data-parallel
//! gradient allreduce of torchft's fault-tolerant DDP, over
//! `ferry-transport`.
//!
//! - [`ProcessGroup`]: bound once per replica group, [configured](ProcessGroup::configure)
//!   with every quorum result, rebuilt when the quorum changes; its
//!   [`allreduce`](ProcessGroup::allreduce) gives every member bit-identical
//!   results, and fails (never hangs) when a peer dies or stalls.
//! - The rendezvous store is `ferry-store`'s
//!   ([`TcpStoreServer`](ferry_store::TcpStoreServer), like c10d's
//!   `TCPStore`): every replica group runs one and gives its address
//!   (`host:port`) to its manager as the group's `store_address`.
//! - [`segment`], [`reduce_in_rank_order`] and [`reduce_in_place`]: the
//!   allreduce's arithmetic, sans-IO.
//!
//! ## Finding the peers: the store address
//!
//! A quorum result names the members (`replica_ids`, in replica-rank order)
//! but not where their process groups listen. torchft solves this with the
//! `store_address` the lighthouse hands out: the store of the quorum's
//! primary, shared by every member, where each member's process group
//! rendezvous under a prefix holding the quorum id. Ferry does the same:
//! each member writes its listen address to
//! `ferry_ft/pg/{quorum_id}/{membership}/{replica_rank}` in the primary's
//! store and reads the others'. The alternative, the `data` field of
//! `QuorumMember`, reaches the lighthouse but not the ranks: the manager's
//! answer (`ManagerQuorumResponse`) does not carry the members' data, so a
//! rank could not read it without a second channel. The store needs
//! nothing beyond torchft's wire contract, and it is where torchft looks.
//!
//! ## Determinism
//!
//! The buffer is cut into one segment per member. Member `k` receives
//! everyone's segment `k`, adds them up in replica-rank order, and sends
//! the result to all: every element is computed once, by one member, in a
//! fixed order, so every member ends with the same bits regardless of
//! arrival order or timing.
//!
//! ```no_run
//! use ferry_ft::collective::{ProcessGroup, ProcessGroupOptions};
//! use ferry_ft::manager::QuorumResult;
//!
//! # async fn step(pg: &mut ProcessGroup, quorum: &QuorumResult, grads: &mut [f32])
//! # -> Result<(), ferry_ft::collective::CollectiveError> {
//! pg.configure(quorum).await?; // a no-op unless the quorum changed
//! pg.allreduce_mean(grads).await?; // an error here: do not commit the step
//! # Ok(()) }
//! ```

mod allreduce;
mod error;
mod peer;
mod process_group;
mod reduce;

pub use error::CollectiveError;
#[cfg(feature = "nccl")]
pub(crate) use process_group::membership;
pub(crate) use process_group::quorum_rank;
pub use process_group::{ProcessGroup, ProcessGroupOptions};
pub use reduce::{reduce_in_place, reduce_in_rank_order, segment, ReduceOp};
