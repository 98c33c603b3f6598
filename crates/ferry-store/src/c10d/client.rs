//! A [`Store`] over c10d's `TCPStore` protocol: a client of PyTorch's
//! store server (the one torchrun's agent hosts) or of Ferry's.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use futures::FutureExt;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::debug;

use super::wire::{self, Query, Reply, ReplyKind, WaitReply, KEY_PREFIX, VALIDATION_MAGIC};
use super::C10dFormatError;
use crate::tcp::connect::connect_with_retry;
use crate::{Store, StoreError, StoreFuture};

/// Room made in the read buffer before each read.
const READ_CHUNK: usize = 16 << 10;

/// How long a client waits for the answer to `CANCEL_WAIT` at most.
const CANCEL_BOUND: Duration = Duration::from_secs(5);

/// A client of a c10d `TCPStore` server: PyTorch's (`torch.distributed.TCPStore`
/// with `is_master=True`, or the store torchrun's agent hosts) or a Ferry
/// [`TcpStoreServer`](crate::TcpStoreServer), which speaks both protocols.
///
/// Like PyTorch's client it validates each connection (`VALIDATE` with
/// the magic number, then a `PING`) and puts [`KEY_PREFIX`] (`/`) before
/// every key, so a Ferry worker and a PyTorch process see the same keys.
///
/// The protocol answers one query at a time per connection and a `WAIT`
/// holds its connection until it is answered, so the client keeps a pool
/// of connections: each operation takes an idle one (or opens one), and
/// concurrent operations never wait for each other. `set` is followed by
/// a `PING` on the same connection, so once it returns every later
/// operation (on any connection) sees the key. Every operation is bounded
/// by the client's timeout.
#[derive(Debug)]
pub struct C10dStore {
    addr: SocketAddr,
    timeout: Duration,
    idle: Mutex<Vec<Connection>>,
    nonce: AtomicU32,
}

/// One validated connection and the bytes read past the last reply.
#[derive(Debug)]
struct Connection {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Connection {
    async fn send(&mut self, addr: SocketAddr, query: &Query) -> Result<(), StoreError> {
        let bytes = wire::encode_query(query).map_err(|source| c10d_error(addr, source))?;
        self.stream
            .write_all(&bytes)
            .await
            .map_err(|source| io_error(addr, source))
    }

    async fn recv(&mut self, addr: SocketAddr, kind: ReplyKind) -> Result<Reply, StoreError> {
        loop {
            if let Some((reply, used)) =
                wire::decode_reply(kind, &self.buf).map_err(|source| c10d_error(addr, source))?
            {
                self.buf.drain(..used);
                return Ok(reply);
            }
            self.buf.reserve(READ_CHUNK);
            let n = self
                .stream
                .read_buf(&mut self.buf)
                .await
                .map_err(|source| io_error(addr, source))?;
            if n == 0 {
                return Err(StoreError::Closed);
            }
        }
    }
}

fn io_error(addr: SocketAddr, source: std::io::Error) -> StoreError {
    StoreError::Io {
        addr: addr.to_string(),
        source,
    }
}

fn c10d_error(addr: SocketAddr, source: C10dFormatError) -> StoreError {
    StoreError::C10d {
        addr: addr.to_string(),
        source,
    }
}

fn unexpected(operation: &str, reply: Reply) -> StoreError {
    StoreError::Protocol(format!("unexpected c10d reply to {operation}: {reply:?}"))
}

fn prefixed(key: &str) -> String {
    format!("{KEY_PREFIX}{key}")
}

impl C10dStore {
    /// Connects to the c10d store server at `addr`, retrying with capped
    /// back-off while nobody listens there yet, for at most `timeout`, and
    /// validates the connection. `timeout` also bounds every operation and
    /// is how long [`Store::get`] waits for a missing key.
    pub async fn connect(addr: SocketAddr, timeout: Duration) -> Result<C10dStore, StoreError> {
        let store = C10dStore {
            addr,
            timeout,
            idle: Mutex::new(Vec::new()),
            nonce: AtomicU32::new(std::process::id()),
        };
        let first = store.open().await?;
        store.idle.lock().push(first);
        debug!(%addr, "connected to the c10d store");
        Ok(store)
    }

    /// The server's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bound on every operation.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// How many keys the whole store holds (every client's, with or
    /// without the `/` prefix): c10d's `num_keys`.
    pub async fn num_keys(&self) -> Result<i64, StoreError> {
        match self.exchange("num_keys", &[], Query::NumKeys).await? {
            Reply::Int(n) => Ok(n),
            other => Err(unexpected("num_keys", other)),
        }
    }

    /// Appends `value` to the value of `key` (an absent key counts as
    /// empty): c10d's `append`.
    pub async fn append(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        let query = Query::Append {
            key: prefixed(key),
            value,
        };
        self.acknowledged("append", key, query).await
    }

    /// Opens and validates a new connection.
    async fn open(&self) -> Result<Connection, StoreError> {
        let stream = connect_with_retry(self.addr, self.timeout).await?;
        let _ = stream.set_nodelay(true);
        let mut conn = Connection {
            stream,
            buf: Vec::new(),
        };
        let nonce = self.nonce.fetch_add(1, Ordering::Relaxed);
        let handshake = async {
            conn.send(
                self.addr,
                &Query::Validate {
                    magic: VALIDATION_MAGIC,
                },
            )
            .await?;
            conn.send(self.addr, &Query::Ping { nonce }).await?;
            conn.recv(self.addr, ReplyKind::Nonce).await
        };
        match tokio::time::timeout(self.timeout, handshake).await {
            Ok(Ok(Reply::Nonce(n))) if n == nonce => Ok(conn),
            Ok(Ok(other)) => Err(StoreError::Protocol(format!(
                "the c10d store at {} answered the validation ping {nonce} with {other:?}",
                self.addr
            ))),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(StoreError::NoAnswer {
                operation: "validate",
                keys: Vec::new(),
                after: self.timeout,
            }),
        }
    }

    /// An idle connection, or a new one.
    async fn checkout(&self) -> Result<Connection, StoreError> {
        let idle = self.idle.lock().pop();
        match idle {
            Some(conn) => Ok(conn),
            None => self.open().await,
        }
    }

    fn checkin(&self, conn: Connection) {
        self.idle.lock().push(conn);
    }

    /// Sends `query` and reads its reply on one connection, within the
    /// client's timeout. A connection that failed or timed out is dropped.
    async fn exchange(
        &self,
        operation: &'static str,
        keys: &[&str],
        query: Query,
    ) -> Result<Reply, StoreError> {
        let Some(kind) = query.reply_kind() else {
            return Err(StoreError::Protocol(format!(
                "{operation}: {:?} has no reply",
                query.query_type()
            )));
        };
        let mut conn = self.checkout().await?;
        let round = async {
            conn.send(self.addr, &query).await?;
            conn.recv(self.addr, kind).await
        };
        match tokio::time::timeout(self.timeout, round).await {
            Ok(Ok(reply)) => {
                self.checkin(conn);
                Ok(reply)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(self.no_answer(operation, keys)),
        }
    }

    /// Sends a query that has no reply, then a `PING` on the same
    /// connection: once the ping is echoed, the server has handled it.
    async fn acknowledged(
        &self,
        operation: &'static str,
        key: &str,
        query: Query,
    ) -> Result<(), StoreError> {
        let nonce = self.nonce.fetch_add(1, Ordering::Relaxed);
        let mut conn = self.checkout().await?;
        let round = async {
            conn.send(self.addr, &query).await?;
            conn.send(self.addr, &Query::Ping { nonce }).await?;
            conn.recv(self.addr, ReplyKind::Nonce).await
        };
        match tokio::time::timeout(self.timeout, round).await {
            Ok(Ok(Reply::Nonce(n))) if n == nonce => {
                self.checkin(conn);
                Ok(())
            }
            Ok(Ok(other)) => Err(unexpected(operation, other)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(self.no_answer(operation, &[key])),
        }
    }

    fn no_answer(&self, operation: &'static str, keys: &[&str]) -> StoreError {
        StoreError::NoAnswer {
            operation,
            keys: keys.iter().map(|k| k.to_string()).collect(),
            after: self.timeout,
        }
    }

    /// Waits on `conn` until every key exists, at most `timeout`; on
    /// expiry cancels the wait (the connection stays usable) and names
    /// the keys still missing. `keys` are the caller's, unprefixed.
    async fn wait_on(
        &self,
        conn: &mut Connection,
        keys: &[String],
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let query = Query::Wait {
            keys: keys.iter().map(|k| prefixed(k)).collect(),
        };
        conn.send(self.addr, &query).await?;
        match tokio::time::timeout(timeout, conn.recv(self.addr, ReplyKind::Wait)).await {
            Ok(Ok(Reply::Wait(WaitReply::StopWaiting))) => return Ok(()),
            Ok(Ok(other)) => return Err(unexpected("wait", other)),
            Ok(Err(e)) => return Err(e),
            Err(_) => {}
        }
        // Time is up: cancel. The server may have answered the wait just
        // before; then `STOP_WAITING` comes first, `WAIT_CANCELED` after.
        let cancel = async {
            conn.send(self.addr, &Query::CancelWait).await?;
            loop {
                match conn.recv(self.addr, ReplyKind::Wait).await? {
                    Reply::Wait(WaitReply::WaitCanceled) => return Ok(()),
                    Reply::Wait(WaitReply::StopWaiting) => {}
                    other => return Err(unexpected("cancel_wait", other)),
                }
            }
        };
        match tokio::time::timeout(CANCEL_BOUND.min(self.timeout), cancel).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(StoreError::NoAnswer {
                    operation: "cancel_wait",
                    keys: keys.to_vec(),
                    after: CANCEL_BOUND.min(self.timeout),
                })
            }
        }
        let mut missing = Vec::new();
        for key in keys {
            let check = Query::Check {
                keys: vec![prefixed(key)],
            };
            conn.send(self.addr, &check).await?;
            if let Reply::Check(false) = conn.recv(self.addr, ReplyKind::Check).await? {
                missing.push(key.clone());
            }
        }
        Err(StoreError::Timeout {
            keys: missing,
            after: timeout,
        })
    }

    /// [`wait_on`](Self::wait_on) on a pooled connection, returned to the
    /// pool unless it broke.
    async fn wait_keys(&self, keys: &[String], timeout: Duration) -> Result<(), StoreError> {
        let mut conn = self.checkout().await?;
        let result = self.wait_on(&mut conn, keys, timeout).await;
        if matches!(result, Ok(()) | Err(StoreError::Timeout { .. })) {
            self.checkin(conn);
        }
        result
    }
}

impl Store for C10dStore {
    fn set(&self, key: &str, value: Vec<u8>) -> StoreFuture<'_, ()> {
        let key = key.to_owned();
        async move {
            let query = Query::Set {
                key: prefixed(&key),
                value,
            };
            self.acknowledged("set", &key, query).await
        }
        .boxed()
    }

    fn get(&self, key: &str) -> StoreFuture<'_, Vec<u8>> {
        let key = key.to_owned();
        async move {
            // As PyTorch's client does: wait for the key, then read it.
            let mut conn = self.checkout().await?;
            let keys = [key.clone()];
            let waited = self.wait_on(&mut conn, &keys, self.timeout).await;
            if let Err(e) = waited {
                if matches!(e, StoreError::Timeout { .. }) {
                    self.checkin(conn);
                }
                return Err(e);
            }
            let round = async {
                conn.send(
                    self.addr,
                    &Query::Get {
                        key: prefixed(&key),
                    },
                )
                .await?;
                conn.recv(self.addr, ReplyKind::Value).await
            };
            match tokio::time::timeout(self.timeout, round).await {
                Ok(Ok(Reply::Value(v))) => {
                    self.checkin(conn);
                    Ok(v)
                }
                Ok(Ok(other)) => Err(unexpected("get", other)),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(self.no_answer("get", &[&key])),
            }
        }
        .boxed()
    }

    fn wait(&self, keys: &[String], timeout: Duration) -> StoreFuture<'_, ()> {
        let keys = keys.to_vec();
        async move { self.wait_keys(&keys, timeout).await }.boxed()
    }

    fn add(&self, key: &str, delta: i64) -> StoreFuture<'_, i64> {
        let key = key.to_owned();
        async move {
            let query = Query::Add {
                key: prefixed(&key),
                delta,
            };
            match self.exchange("add", &[&key], query).await? {
                Reply::Int(n) => Ok(n),
                other => Err(unexpected("add", other)),
            }
        }
        .boxed()
    }

    /// c10d has no "absent" expected value: `None` is sent as an empty
    /// expected value, which also matches a key holding an empty value.
    fn compare_set(
        &self,
        key: &str,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    ) -> StoreFuture<'_, Vec<u8>> {
        let key = key.to_owned();
        async move {
            let query = Query::CompareSet {
                key: prefixed(&key),
                expected: expected.unwrap_or_default(),
                desired,
            };
            match self.exchange("compare_set", &[&key], query).await? {
                Reply::Value(v) => Ok(v),
                other => Err(unexpected("compare_set", other)),
            }
        }
        .boxed()
    }

    fn delete(&self, key: &str) -> StoreFuture<'_, bool> {
        let key = key.to_owned();
        async move {
            let query = Query::DeleteKey {
                key: prefixed(&key),
            };
            match self.exchange("delete", &[&key], query).await? {
                Reply::Int(n) => Ok(n == 1),
                other => Err(unexpected("delete", other)),
            }
        }
        .boxed()
    }

    fn check(&self, keys: &[String]) -> StoreFuture<'_, bool> {
        let keys = keys.to_vec();
        async move {
            let query = Query::Check {
                keys: keys.iter().map(|k| prefixed(k)).collect(),
            };
            let first = keys.first().map_or("", String::as_str);
            match self.exchange("check", &[first], query).await? {
                Reply::Check(ready) => Ok(ready),
                other => Err(unexpected("check", other)),
            }
        }
        .boxed()
    }
}
