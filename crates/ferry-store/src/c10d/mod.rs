//! PyTorch's c10d `TCPStore` protocol, both ends: the wire format
//! ([`wire`], sans-IO), a client ([`C10dStore`]) and the server side,
//! which is part of [`TcpStoreServer`](crate::TcpStoreServer).
//!
//! - A Ferry worker started by `torchrun` joins its group through the
//!   store torchrun's agent hosts (`TORCHELASTIC_USE_AGENT_STORE=True`,
//!   at `MASTER_ADDR:MASTER_PORT`) with a [`C10dStore`].
//! - A Ferry rank 0's [`TcpStoreServer`](crate::TcpStoreServer) also
//!   serves PyTorch processes: it tells the two protocols apart by a
//!   connection's first four bytes (c10d's `VALIDATE` and magic number
//!   would be an impossible Ferry frame length), so one port serves both,
//!   over one state and one quota. c10d has no error replies: a c10d
//!   client that sends bad bytes, breaks a quota or uses the queue
//!   operations (which Ferry does not serve) sees its connection closed,
//!   and the server logs a warning naming it.
//!
//! Keys: PyTorch's client puts `/` before every key it is given;
//! [`C10dStore`] does too, so `store.set("a", …)` in Python and
//! `C10dStore::set("a", …)` in Rust write the same key `"/a"`.
//!
//! ```no_run
//! use std::time::Duration;
//! use ferry_store::{c10d::C10dStore, Store};
//!
//! # async fn f() -> Result<(), ferry_store::StoreError> {
//! // The store torchrun's agent hosts for its workers.
//! let store = C10dStore::connect("127.0.0.1:29500".parse().unwrap(), Duration::from_secs(60)).await?;
//! store.set("ferry/hello", b"world".to_vec()).await?;
//! assert_eq!(store.add("ferry/joined", 1).await?, 1);
//! # Ok(()) }
//! ```

mod client;
pub(crate) mod server;
pub mod wire;

pub use client::C10dStore;
pub use wire::C10dFormatError;
