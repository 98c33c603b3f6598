//! # ferry-ft
//!
//! Fault tolerance for Ferry in the shape of torchft, and wire-compatible
//! with it: a *lighthouse* forms quorums of replica groups; each replica
//! group runs a *manager* that gathers its ranks, asks the lighthouse, and
//! tells every rank its place in the quorum, whether to *heal* (fetch the
//! state from an up-to-date replica) and, after each step, whether to
//! commit.
//!
//! ## Layout
//!
//! - [`proto`]: torchft's gRPC contract (package `torchft`): messages,
//!   `LighthouseService` and `ManagerService` server traits and clients,
//!   generated from `proto/torchft.proto` with the same names and field
//!   numbers as torchft, so torchft's clients work against Ferry's servers.
//! - [`lighthouse`]: the quorum decision ([`lighthouse::quorum_compute`], a
//!   pure function of now, state and options), the lighthouse state
//!   machine ([`lighthouse::LighthouseState`]: join, heartbeat, tick) and
//!   what its dashboard shows ([`lighthouse::LighthouseStatus`]); and the
//!   server around them, [`lighthouse::Lighthouse`]: `torchft.LighthouseService`
//!   over gRPC plus the status dashboard (`GET /`, `GET /status` as JSON,
//!   `POST /replica/{id}/kill`) on one port.
//! - [`manager`]: rank gathering ([`manager::QuorumGather`]), quorum results
//!   and recovery assignment ([`manager::compute_quorum_results`]), and the
//!   should-commit vote ([`manager::ShouldCommitVotes`]); and the server
//!   around them, [`manager::Manager`]: `torchft.ManagerService` over gRPC
//!   for the ranks of one replica group, asking the lighthouse (retries with
//!   back-off, a clear error to every rank after the last one) and
//!   heartbeating to it; with [`manager::ManagerClient`], what a rank uses
//!   to ask it for quorums, vote on commits and fetch checkpoint metadata.
//! - [`recovery`]: live recovery over `ferry-transport`: a replica's
//!   [`recovery::CheckpointServer`] streams its state (named tensors and the
//!   step, checked) to a healing replica's [`recovery::fetch_checkpoint_into`],
//!   in chunks over several connections, straight into its tensors.
//! - [`collective`]: the replica groups' allreduce over `ferry-transport`
//!   ([`collective::ProcessGroup`]), rebuilt on every quorum change, with a
//!   deterministic reduction order (every replica gets the same bits); its
//!   members find each other through the quorum primary's `ferry-store`
//!   store (the quorum's `store_address`).
//! - The `ft_train` example: fault-tolerant data parallelism end to end
//!   (3 replica groups, one killed and restarted, the newcomer healing from a
//!   live peer); `tests/ft_e2e.rs` runs it.
//! - The `ferry-lighthouse` binary (feature `cli`, on by default): the
//!   lighthouse as a program taking torchft's `torchft_lighthouse` flags
//!   (`--min_replicas` or `--min-replicas`, and so on).
//!
//! The rules are sans-IO: time comes in as an
//! [`Instant`](std::time::Instant) argument, nothing in them sleeps, reads a
//! clock or touches a socket, so every rule is tested with explicit
//! instants. The servers that wrap these state machines are thin tokio /
//! tonic shells on top: [`lighthouse::Lighthouse`] feeds requests in, ticks
//! the state every `quorum_tick` and on every request, and hands the quorums
//! out; [`manager::Manager`] gathers its ranks, forwards one request per
//! round to the lighthouse, and answers each rank with its own results.
//!
//! ## Example
//!
//! Two replica groups of one rank each form their first quorum; at step 0
//! with `init_sync`, the second heals from the first.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use ferry_ft::lighthouse::{LighthouseOptions, LighthouseState};
//! use ferry_ft::manager::{compute_quorum_results, ManagerInfo, QuorumGather};
//! use ferry_ft::proto::ManagerQuorumRequest;
//!
//! # fn main() -> Result<(), ferry_ft::FtError> {
//! let opt = LighthouseOptions::new(2).with_join_timeout(Duration::from_millis(100));
//! let mut lighthouse = LighthouseState::new();
//! let t0 = Instant::now();
//!
//! let mut rounds = Vec::new();
//! for name in ["replica_a", "replica_b"] {
//!     let mut gather = QuorumGather::new(ManagerInfo {
//!         replica_id: name.into(),
//!         address: format!("http://{name}:29512"),
//!         store_address: format!("{name}:29500"),
//!         world_size: 1,
//!     });
//!     let request = ManagerQuorumRequest { group_rank: 0, step: 0, init_sync: true, ..Default::default() };
//!     let round = gather.join(&request)?.expect("the only rank completes the round");
//!     lighthouse.join(t0, round.request.requester.clone().expect("requester"));
//!     rounds.push((name, round));
//! }
//!
//! let quorum = lighthouse.tick(t0, &opt).expect("both joined: quorum ready");
//! assert_eq!(quorum.quorum_id, 1);
//!
//! let a = compute_quorum_results(rounds[0].0, 0, &quorum, rounds[0].1.init_sync)?;
//! let b = compute_quorum_results(rounds[1].0, 0, &quorum, rounds[1].1.init_sync)?;
//! assert!(!a.heal && a.recover_dst_replica_ranks == vec![1]);
//! assert!(b.heal && b.recover_src_manager_address == "http://replica_a:29512");
//! # Ok(()) }
//! ```

pub mod access;
pub mod baby;
pub mod collective;
mod error;
mod grpc;
pub mod lighthouse;
pub mod manager;
mod net;
pub mod proto;
pub mod recovery;

pub use error::FtError;
