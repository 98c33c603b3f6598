//! The store client: [`TcpStore`], many requests over one connection.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry_transport::auth::{self, Secret, AUTH_TIMEOUT};
use futures::FutureExt;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, BufReader};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::connect::connect_with_retry;
use super::frames::{halves, read_frame, write_frames, FrameError};
use crate::format::{self, FormatError, Request, RequestFrame, Response, ResponseFrame};
use crate::{Store, StoreError, StoreFuture};

/// How much longer than the server-side bound a client waits for the
/// answer to a blocking request before giving up on its own.
/// (At most: for a short timeout, as long as the timeout itself, but no
/// less than `MIN_GRACE`.)
const CLIENT_GRACE: Duration = Duration::from_secs(5);
const MIN_GRACE: Duration = Duration::from_millis(100);

/// A client of a [`TcpStoreServer`](super::TcpStoreServer), like c10d's `TCPStore` on a non-zero
/// rank.
///
/// One connection carries every request; concurrent requests do not wait
/// for each other (a blocking [`Store::wait`] does not hold up a
/// [`Store::set`] from the same client). When the connection is lost,
/// outstanding and later requests fail with [`StoreError::Closed`],
/// [`StoreError::Io`] or [`StoreError::Format`]; nothing hangs.
#[derive(Debug)]
pub struct TcpStore {
    addr: SocketAddr,
    timeout: Duration,
    shared: Arc<Shared>,
    tx: mpsc::UnboundedSender<Vec<u8>>,
    reader: JoinHandle<()>,
    writer: JoinHandle<()>,
}

#[derive(Debug, Default)]
struct Shared {
    next_id: AtomicU64,
    calls: Mutex<Calls>,
}

type Reply = oneshot::Sender<Result<Response, StoreError>>;

#[derive(Debug, Default)]
struct Calls {
    pending: HashMap<u64, Reply>,
    /// Set once the connection is gone.
    lost: Option<Lost>,
}

/// Why the connection is gone (clonable, unlike `StoreError`).
#[derive(Debug, Clone)]
enum Lost {
    Closed,
    Io(io::ErrorKind, String),
    Format(FormatError),
}

impl Lost {
    fn error(&self, addr: SocketAddr) -> StoreError {
        match self {
            Lost::Closed => StoreError::Closed,
            Lost::Io(kind, message) => StoreError::Io {
                addr: addr.to_string(),
                source: io::Error::new(*kind, message.clone()),
            },
            Lost::Format(source) => StoreError::Format {
                addr: addr.to_string(),
                source: source.clone(),
            },
        }
    }
}

impl Shared {
    /// Marks the connection lost and fails every outstanding request.
    fn lose(&self, lost: Lost, addr: SocketAddr) {
        let (lost, pending) = {
            let mut calls = self.calls.lock();
            let lost = calls.lost.get_or_insert(lost).clone();
            (lost, std::mem::take(&mut calls.pending))
        };
        for (_, reply) in pending {
            let _ = reply.send(Err(lost.error(addr)));
        }
    }

    fn lost_error(&self, addr: SocketAddr) -> StoreError {
        self.calls
            .lock()
            .lost
            .as_ref()
            .map_or(StoreError::Closed, |l| l.error(addr))
    }
}

/// Forgets a request whose caller stopped waiting for it.
struct PendingGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.shared.calls.lock().pending.remove(&self.id);
    }
}

impl TcpStore {
    /// Connects to the server at `addr`, retrying with capped back-off
    /// while nobody listens there yet (rank 0 may start later), for at
    /// most `timeout`. `timeout` is also how long [`Store::get`] waits for
    /// a missing key.
    pub async fn connect(addr: SocketAddr, timeout: Duration) -> Result<TcpStore, StoreError> {
        Self::connect_authenticated(addr, timeout, None).await
    }

    /// [`connect`](Self::connect) to a server that authenticates its
    /// clients ([`TcpStoreServer::bind_authenticated`](super::TcpStoreServer::bind_authenticated)) with `secret`:
    /// this client proves it holds the secret, and the server that it
    /// does, before any request is sent.
    pub async fn connect_authenticated(
        addr: SocketAddr,
        timeout: Duration,
        secret: Option<Secret>,
    ) -> Result<TcpStore, StoreError> {
        let mut stream = connect_with_retry(addr, timeout).await?;
        let session = match &secret {
            Some(secret) => Some(
                auth::connect(&mut stream, secret.key(), AUTH_TIMEOUT)
                    .await
                    .map_err(|source| StoreError::Auth {
                        addr: addr.to_string(),
                        source,
                    })?,
            ),
            None => None,
        };
        let _ = stream.set_nodelay(true);
        let (rd, wr) = halves(stream, session.as_ref());
        let shared = Arc::new(Shared::default());
        let (tx, rx) = mpsc::unbounded_channel();
        let writer = {
            let shared = shared.clone();
            tokio::spawn(async move {
                if let Err(e) = write_frames(wr, rx).await {
                    shared.lose(Lost::Io(e.kind(), e.to_string()), addr);
                }
            })
        };
        let reader = tokio::spawn(read_responses(BufReader::new(rd), shared.clone(), addr));
        debug!(%addr, "connected to the store");
        Ok(TcpStore {
            addr,
            timeout,
            shared,
            tx,
            reader,
            writer,
        })
    }

    /// The server's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    /// How long [`Store::get`] waits for a missing key.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sends `request` and waits for its response, for at most the
    /// client's timeout: a server that accepted but never answers ends in
    /// [`StoreError::NoAnswer`] naming `operation` and `key`.
    async fn call_op(
        &self,
        operation: &'static str,
        key: &str,
        request: Request,
    ) -> Result<Response, StoreError> {
        match tokio::time::timeout(self.timeout, self.call(request)).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::NoAnswer {
                operation,
                keys: vec![key.to_owned()],
                after: self.timeout,
            }),
        }
    }

    /// Sends `request` and waits for its response.
    async fn call(&self, request: Request) -> Result<Response, StoreError> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = format::encode_request(&RequestFrame { id, request }).map_err(|source| {
            StoreError::Format {
                addr: self.addr.to_string(),
                source,
            }
        })?;
        let (reply, response) = oneshot::channel();
        {
            let mut calls = self.shared.calls.lock();
            if let Some(lost) = &calls.lost {
                return Err(lost.error(self.addr));
            }
            calls.pending.insert(id, reply);
        }
        let _guard = PendingGuard {
            shared: &self.shared,
            id,
        };
        if self.tx.send(frame).is_err() {
            return Err(self.shared.lost_error(self.addr));
        }
        match response.await {
            Ok(result) => result,
            Err(_) => Err(self.shared.lost_error(self.addr)),
        }
    }

    /// [`call`](Self::call) for a request the server bounds by `timeout`;
    /// gives up on its own a little later (a server that stopped answering
    /// without closing the connection).
    async fn call_within(
        &self,
        operation: &'static str,
        request: Request,
        timeout: Duration,
        keys: impl FnOnce() -> Vec<String>,
    ) -> Result<Response, StoreError> {
        let grace = CLIENT_GRACE.min(timeout.max(MIN_GRACE));
        match tokio::time::timeout(timeout.saturating_add(grace), self.call(request)).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::NoAnswer {
                operation,
                keys: keys(),
                after: timeout,
            }),
        }
    }
}

impl Drop for TcpStore {
    fn drop(&mut self) {
        self.reader.abort();
        self.writer.abort();
    }
}

/// Dispatches responses to their requests until the connection ends.
async fn read_responses<R: AsyncRead + Unpin>(mut rd: R, shared: Arc<Shared>, addr: SocketAddr) {
    let lost = loop {
        match read_frame(&mut rd, format::decode_response).await {
            Ok(Some(ResponseFrame { id, response })) => {
                let reply = shared.calls.lock().pending.remove(&id);
                if let Some(reply) = reply {
                    let _ = reply.send(Ok(response));
                }
            }
            Ok(None) => break Lost::Closed,
            Err(FrameError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
                break Lost::Closed
            }
            Err(FrameError::Io(e)) => break Lost::Io(e.kind(), e.to_string()),
            Err(FrameError::Format(e)) => {
                warn!(%addr, error = %e, "closing the store connection");
                break Lost::Format(e);
            }
        }
    };
    debug!(%addr, ?lost, "store connection lost");
    shared.lose(lost, addr);
}

fn unexpected(op: &str, response: Response) -> StoreError {
    match response {
        Response::Failed(f) => f.into(),
        other => StoreError::Protocol(format!("unexpected response to {op}: {other:?}")),
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: Vec<u8>) -> StoreFuture<'_, ()> {
        let key_name = key.to_owned();
        let request = Request::Set {
            key: key.to_owned(),
            value,
        };
        async move {
            match self.call_op("set", &key_name, request).await? {
                Response::Done => Ok(()),
                other => Err(unexpected("set", other)),
            }
        }
        .boxed()
    }

    fn get(&self, key: &str) -> StoreFuture<'_, Vec<u8>> {
        let key = key.to_owned();
        async move {
            let request = Request::Get {
                key: key.clone(),
                timeout: self.timeout,
            };
            match self
                .call_within("get", request, self.timeout, || vec![key])
                .await?
            {
                Response::Value(v) => Ok(v),
                other => Err(unexpected("get", other)),
            }
        }
        .boxed()
    }

    fn wait(&self, keys: &[String], timeout: Duration) -> StoreFuture<'_, ()> {
        let keys = keys.to_vec();
        async move {
            let request = Request::Wait {
                keys: keys.clone(),
                timeout,
            };
            match self.call_within("wait", request, timeout, || keys).await? {
                Response::Done => Ok(()),
                other => Err(unexpected("wait", other)),
            }
        }
        .boxed()
    }

    fn add(&self, key: &str, delta: i64) -> StoreFuture<'_, i64> {
        let key_name = key.to_owned();
        let request = Request::Add {
            key: key.to_owned(),
            delta,
        };
        async move {
            match self.call_op("add", &key_name, request).await? {
                Response::Counter(n) => Ok(n),
                other => Err(unexpected("add", other)),
            }
        }
        .boxed()
    }

    fn compare_set(
        &self,
        key: &str,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    ) -> StoreFuture<'_, Vec<u8>> {
        let key_name = key.to_owned();
        let request = Request::CompareSet {
            key: key.to_owned(),
            expected,
            desired,
        };
        async move {
            match self.call_op("compare_set", &key_name, request).await? {
                Response::Value(v) => Ok(v),
                other => Err(unexpected("compare_set", other)),
            }
        }
        .boxed()
    }

    fn delete(&self, key: &str) -> StoreFuture<'_, bool> {
        let key_name = key.to_owned();
        let request = Request::Delete {
            key: key.to_owned(),
        };
        async move {
            match self.call_op("delete", &key_name, request).await? {
                Response::Bool(b) => Ok(b),
                other => Err(unexpected("delete", other)),
            }
        }
        .boxed()
    }

    fn check(&self, keys: &[String]) -> StoreFuture<'_, bool> {
        let key_name = keys.first().cloned().unwrap_or_default();
        let request = Request::Check {
            keys: keys.to_vec(),
        };
        async move {
            match self.call_op("check", &key_name, request).await? {
                Response::Bool(b) => Ok(b),
                other => Err(unexpected("check", other)),
            }
        }
        .boxed()
    }
}
