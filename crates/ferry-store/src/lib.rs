//! # ferry-store
//!
//! Ferry's rendezvous key-value store, like PyTorch's c10d `TCPStore`: the
//! place where the workers of a group find each other before they have
//! any other connection. `ferry-rpc` rendezvous through it (and
//! re-exports it as `ferry_rpc::store`); `ferry-ft`'s replica groups use it
//! without the RPC agent. It needs no RPC, no libtorch.
//!
//! Rank 0 hosts a [`TcpStoreServer`]; every worker (rank 0 included)
//! talks to it through a [`TcpStore`] client. Workers publish what the
//! others need to find them with [`Store::set`] and block on each other
//! with [`Store::get`] and [`Store::wait`]; [`Store::add`] and
//! [`Store::compare_set`] give atomic counters and claims.
//!
//! - [`Store`]: the object-safe interface (`Arc<dyn Store>`), async methods
//!   returning boxed futures.
//! - [`MemoryStore`]: the state — a map plus per-key waiters woken by the
//!   change they wait for, no I/O and no polling. The TCP server serves
//!   one; it is also a [`Store`] on its own for single-process use and
//!   tests.
//! - [`TcpStoreServer`] / [`TcpStore`]: the server and client over TCP,
//!   length-prefixed (u32 LE) messages no larger than
//!   [`MAX_MESSAGE_BYTES`], encoded and decoded by the pure functions of
//!   [`format`](mod@format) (which documents the bytes). Requests carry
//!   ids and blocking ones (`get`, `wait`) are served server-side, so they
//!   never hold up the other requests of the same client. The server
//!   enforces [`StoreLimits`].
//! - [`C10dStore`] and [`c10d`]: PyTorch's c10d `TCPStore` protocol. The
//!   client joins a store PyTorch hosts (torchrun's agent's); the
//!   [`TcpStoreServer`] serves PyTorch's clients on the same port as
//!   Ferry's, telling the protocols apart by a connection's first bytes.
//! - [`PrefixStore`]: a namespace (`"{prefix}/{key}"`) over another store.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use ferry_store::{PrefixStore, Store, TcpStore, TcpStoreServer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), ferry_store::StoreError> {
//! // Rank 0 hosts the store (port 0: any free port).
//! let server = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).await?;
//! let timeout = Duration::from_secs(10);
//! let store: Arc<dyn Store> = Arc::new(TcpStore::connect(server.local_addr(), timeout).await?);
//!
//! store.set("worker/0", b"10.0.0.1:4000".to_vec()).await?;
//! assert_eq!(store.get("worker/0").await?, b"10.0.0.1:4000");
//! assert_eq!(store.add("joined", 1).await?, 1);
//! assert_eq!(store.get("joined").await?, b"1"); // counters are decimal text
//!
//! let job = PrefixStore::new("job7", store.clone());
//! job.set("epoch", b"3".to_vec()).await?; // stored as "job7/epoch"
//! assert!(store.check(&["job7/epoch".to_string()]).await?);
//! server.shutdown();
//! # Ok(()) }
//! ```

use std::time::Duration;

use futures::future::BoxFuture;

pub mod c10d;
pub mod format;
mod memory;
mod prefix;
mod quota;
mod tcp;

pub use c10d::{C10dFormatError, C10dStore};
pub use format::{FormatError, MAX_MESSAGE_BYTES};
pub use memory::MemoryStore;
pub use prefix::PrefixStore;
pub use quota::{QuotaBound, StoreLimits};
pub use tcp::{TcpStore, TcpStoreServer};

/// A reasonable bound on [`Store::get`] when nothing else is known
/// (c10d's default store timeout is 300 s too).
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(300);

/// The future every [`Store`] method returns.
pub type StoreFuture<'a, T> = BoxFuture<'a, Result<T, StoreError>>;

/// A rendezvous key-value store shared by the workers of a group.
///
/// Keys are strings, values are bytes. Object safe: used as
/// `Arc<dyn Store>`. The futures borrow only the store, not the arguments.
/// Every method may be called concurrently; a blocking call (`get`,
/// `wait`) never holds up the others.
pub trait Store: Send + Sync + 'static {
    /// Stores `value` under `key`, replacing any previous value, and wakes
    /// everyone waiting for `key`.
    fn set(&self, key: &str, value: Vec<u8>) -> StoreFuture<'_, ()>;

    /// The value of `key`, waiting until it exists, at most for the
    /// store's own timeout (then [`StoreError::Timeout`]).
    fn get(&self, key: &str) -> StoreFuture<'_, Vec<u8>>;

    /// Waits until every key of `keys` exists, at most for `timeout`; on
    /// expiry [`StoreError::Timeout`] names the keys still missing.
    fn wait(&self, keys: &[String], timeout: Duration) -> StoreFuture<'_, ()>;

    /// Atomically adds `delta` to the counter `key` and returns its new
    /// value. An absent key counts as 0. Counters are stored as decimal
    /// text (as in c10d), so `get` reads them as e.g. `b"42"`; a key whose
    /// value is not such text gives [`StoreError::NotACounter`].
    fn add(&self, key: &str, delta: i64) -> StoreFuture<'_, i64>;

    /// Atomically stores `desired` under `key` if its current value equals
    /// `expected` (`None`: the key is absent), and returns the value stored
    /// afterwards: `desired` on success, the current value on a mismatch.
    /// As in c10d's `compareSet`, when the key is absent and `expected` is
    /// `Some`, nothing is stored and `expected` is returned.
    fn compare_set(
        &self,
        key: &str,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    ) -> StoreFuture<'_, Vec<u8>>;

    /// Removes `key`; `true` if it existed.
    fn delete(&self, key: &str) -> StoreFuture<'_, bool>;

    /// Whether every key of `keys` exists now (no waiting).
    fn check(&self, keys: &[String]) -> StoreFuture<'_, bool>;
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Keys did not appear in time.
    #[error("timed out after {after:?} waiting for store keys {keys:?}")]
    Timeout {
        /// The keys still missing when the time ran out.
        keys: Vec<String>,
        /// How long was waited.
        after: Duration,
    },
    /// A store client operation got no answer within its timeout (a
    /// server that accepted but stopped answering, or a partition).
    #[error("store {operation} of {keys:?} got no answer within {after:?}")]
    NoAnswer {
        /// The operation: `set`, `get`, `wait`, `add`, `compare_set`,
        /// `delete` or `check`.
        operation: &'static str,
        /// The key or keys it was about.
        keys: Vec<String>,
        /// The timeout it was bounded by.
        after: Duration,
    },
    /// The server refused a request that would exceed one of its
    /// [`StoreLimits`].
    #[error("store refused {key:?}: the {bound} limit is {limit}, the request needs {requested}")]
    Quota {
        /// The bound that would be exceeded.
        bound: QuotaBound,
        /// The (first) key of the request.
        key: String,
        /// The bound's limit.
        limit: u64,
        /// What the request would have brought it to.
        requested: u64,
    },
    /// Connecting to, reading from or writing to the store failed.
    #[error("store at {addr}: {source}")]
    Io {
        /// The store's address.
        addr: String,
        /// What went wrong.
        source: std::io::Error,
    },
    /// A message that cannot be encoded (too large) or bytes from the
    /// store that are not a message.
    #[error("store at {addr}: {source}")]
    Format {
        /// The store's address.
        addr: String,
        /// What is wrong with the message.
        source: FormatError,
    },
    /// Bytes from a c10d `TCPStore` server that are not a reply, or a
    /// query that cannot be encoded (too large).
    #[error("c10d store at {addr}: {source}")]
    C10d {
        /// The store's address.
        addr: String,
        /// What is wrong with the bytes.
        source: C10dFormatError,
    },
    /// The server answered with something else than the request asks
    /// for, or reported an error of its own (as text).
    #[error("store protocol error: {0}")]
    Protocol(String),
    /// The store and this client do not share the group's secret (see
    /// [`ferry_transport::auth`]): one holds another secret, or only one
    /// side has one.
    #[error("authentication with the store at {addr} failed: {source}")]
    Auth {
        /// The store's address.
        addr: String,
        /// Why the handshake failed.
        source: ferry_transport::auth::AuthError,
    },
    /// The connection to the store is closed (the server went away or
    /// the client was shut down).
    #[error("the store connection is closed")]
    Closed,
    /// [`Store::add`] on a key whose value is not a decimal `i64`.
    #[error("store key {key:?} does not hold a decimal i64 counter")]
    NotACounter {
        /// The key.
        key: String,
    },
    /// [`Store::add`] would take the counter beyond the range of `i64`.
    #[error("adding {delta} to store counter {key:?} overflows i64")]
    Overflow {
        /// The key.
        key: String,
        /// The delta that did not fit.
        delta: i64,
    },
}
