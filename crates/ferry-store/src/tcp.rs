//! The store over TCP: a server serving a [`MemoryStore`] and a client
//! multiplexing requests over one connection.
//!
//! Every message is a frame: its length as a `u32` little-endian, then
//! the body ([`format`](crate::format) encodes and decodes both; this
//! module only moves frames over sockets). A request carries an id, which its
//! response repeats; responses come back in any order, so a blocking
//! `get` or `wait` (waited for on the server) never holds up another
//! request on the same connection.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry_transport::accept::{auth_opening, await_opening, AcceptBackoff, RefusalWarnings};
use ferry_transport::auth::{self, RecordReader, RecordWriter, Secret, AUTH_TIMEOUT};
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, Stream, StreamExt};
use futures::FutureExt;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::c10d::{
    self,
    server::{serve_c10d, Session},
};
use crate::format::{
    self, Failure, FormatError, Request, RequestFrame, Response, ResponseFrame, LENGTH_PREFIX_BYTES,
};
use crate::quota::{ConnId, Ledger, QuotaBound, Refusal, StoreLimits};
use crate::{MemoryStore, Store, StoreError, StoreFuture, DEFAULT_STORE_TIMEOUT};

/// How much longer than the server-side bound a client waits for the
/// answer to a blocking request before giving up on its own.
/// (At most: for a short timeout, as long as the timeout itself, but no
/// less than `MIN_GRACE`.)
const CLIENT_GRACE: Duration = Duration::from_secs(5);
const MIN_GRACE: Duration = Duration::from_millis(100);

/// First and largest pause between attempts to connect.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(500);
/// Least time one connection attempt gets, even at the deadline.
const MIN_ATTEMPT: Duration = Duration::from_millis(100);

// ---------------------------------------------------------------------------
// Frames off the socket (the bytes are `format`'s business)
// ---------------------------------------------------------------------------

/// Why reading a frame failed.
#[derive(Debug)]
enum FrameError {
    Io(io::Error),
    Format(FormatError),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Io(e) => write!(f, "{e}"),
            FrameError::Format(e) => write!(f, "{e}"),
        }
    }
}

/// A body decoder of [`format`](crate::format).
type Decode<T> = fn(&[u8]) -> Result<T, FormatError>;

/// Reads one frame and decodes its body with `decode`; `Ok(None)` on a
/// clean end of stream between frames.
async fn read_frame<R, T>(r: &mut R, decode: Decode<T>) -> Result<Option<T>, FrameError>
where
    R: AsyncRead + Unpin,
{
    let mut prefix = [0u8; LENGTH_PREFIX_BYTES];
    let n = r.read(&mut prefix).await.map_err(FrameError::Io)?;
    if n == 0 {
        return Ok(None);
    }
    r.read_exact(&mut prefix[n..])
        .await
        .map_err(FrameError::Io)?;
    let len = format::body_len(prefix).map_err(FrameError::Format)?;
    // Grow with what actually arrives rather than trusting the prefix.
    let mut body = Vec::with_capacity(len.min(64 << 10));
    r.take(len as u64)
        .read_to_end(&mut body)
        .await
        .map_err(FrameError::Io)?;
    if body.len() != len {
        return Err(FrameError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("connection closed inside a {len}-byte message"),
        )));
    }
    decode(&body).map(Some).map_err(FrameError::Format)
}

/// The frames of `r`, as a stream (so reading survives a `select!`).
fn frames<R, T>(
    r: R,
    decode: Decode<T>,
) -> Pin<Box<dyn Stream<Item = Result<T, FrameError>> + Send>>
where
    R: AsyncRead + Unpin + Send + 'static,
    T: Send + 'static,
{
    futures::stream::unfold(Some(r), move |r| async move {
        let mut r = r?;
        match read_frame(&mut r, decode).await {
            Ok(Some(msg)) => Some((Ok(msg), Some(r))),
            Ok(None) => None,
            Err(e) => Some((Err(e), None)),
        }
    })
    .boxed()
}

/// Writes the frames sent on `rx` until it closes or writing fails.
async fn write_frames<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::UnboundedReceiver<Vec<u8>>,
) -> io::Result<()> {
    while let Some(frame) = rx.recv().await {
        w.write_all(&frame).await?;
        // Whatever else is queued goes in the same records; then out.
        while let Ok(frame) = rx.try_recv() {
            w.write_all(&frame).await?;
        }
        w.flush().await?;
    }
    Ok(())
}

/// A connection's halves: after the authentication handshake, read and
/// written in records sealed with its session ([`auth::records`]), so a
/// relay that passed the handshake through can neither speak for either
/// end nor alter, drop or reorder a byte; without a secret, as they are.
fn halves(
    stream: TcpStream,
    session: Option<&auth::SessionKey>,
) -> (RecordReader<OwnedReadHalf>, RecordWriter<OwnedWriteHalf>) {
    let (rd, wr) = stream.into_split();
    match session {
        Some(s) => (s.reader(rd), s.writer(wr)),
        None => (RecordReader::new(rd, None), RecordWriter::new(wr, None)),
    }
}

// ---------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------

/// The store server rank 0 hosts, like c10d's `TCPStore` master.
///
/// [`bind`](Self::bind) binds and returns; a spawned tokio task then
/// accepts and serves clients. [`close`](Self::close) stops it gracefully:
/// no request is read any more, but every answer already given is still
/// written before its connection closes (a client whose `set` the others
/// have seen also gets its acknowledgement). Dropping the server (or
/// [`shutdown`](Self::shutdown)) stops it at once: the listener and every
/// client connection close, and clients' outstanding requests fail.
///
/// A client sending a malformed or oversized message is disconnected
/// (with a warning); the others are served on. A request that would
/// exceed one of the server's [`StoreLimits`] is refused with
/// [`StoreError::Quota`] naming the bound; a connection that completes no
/// request within [`StoreLimits::first_request_timeout`] is closed. Out
/// of file descriptors, accepting backs off (up to a second between
/// attempts) with a rate-limited warning.
#[derive(Debug)]
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    task: JoinHandle<()>,
    /// Set to `true` by [`close`](Self::close).
    closing: watch::Sender<bool>,
    state: Arc<MemoryStore>,
    accept_failures: watch::Receiver<u64>,
}

/// What every connection of a server shares.
#[derive(Debug)]
pub(crate) struct Served {
    pub(crate) state: Arc<MemoryStore>,
    pub(crate) limits: StoreLimits,
    pub(crate) ledger: Mutex<Ledger>,
    /// With a secret, every client proves it holds it before a byte of
    /// its requests is read.
    pub(crate) auth: Option<Secret>,
    /// The rate-limited warnings about clients refused for failing
    /// authentication (an outsider can open thousands a second).
    pub(crate) refusals: RefusalWarnings,
    /// The rate-limited warnings about clients closed for breaking the
    /// protocol (malformed or oversized input, either protocol).
    pub(crate) broken: RefusalWarnings,
}

impl Served {
    /// What the connections of a server serving `state` share.
    pub(crate) fn new(state: Arc<MemoryStore>, limits: StoreLimits, auth: Option<Secret>) -> Self {
        Served {
            state,
            limits,
            ledger: Mutex::new(Ledger::default()),
            auth,
            refusals: RefusalWarnings::new(
                "store server",
                "refused a store client that failed authentication",
            ),
            broken: RefusalWarnings::new(
                "store server",
                "closed a store client that broke the protocol",
            ),
        }
    }
}

/// The quota's checks, shared by both protocols' requests (Ferry's and
/// c10d's): one place that admits and charges a write, one counter charge,
/// one bound on waiting requests.
impl Served {
    /// Runs the write `store` to `key` for connection `conn` if the quota
    /// admits `bytes` there, under the ledger's lock (so concurrent
    /// writers cannot together exceed a bound). `store` returns its
    /// result and the bytes the key now holds if it stored (`None`:
    /// nothing stored, nothing charged).
    pub(crate) fn write<T>(
        &self,
        conn: ConnId,
        key: &str,
        bytes: usize,
        store: impl FnOnce() -> (T, Option<usize>),
    ) -> Result<T, Refusal> {
        let mut ledger = self.ledger.lock();
        ledger.admit(&self.limits, conn, key, bytes)?;
        let (out, stored) = store();
        if let Some(len) = stored {
            ledger.stored(conn, key, len);
        }
        Ok(out)
    }

    /// Adds `delta` to the counter at `key` for connection `conn`: admitted
    /// as the longest counter ([`COUNTER_BYTES`]), charged as the decimal
    /// text it now holds.
    pub(crate) fn add(
        &self,
        conn: ConnId,
        key: &str,
        delta: i64,
    ) -> Result<Result<i64, StoreError>, Refusal> {
        self.write(conn, key, COUNTER_BYTES, || {
            let added = self.state.increment(key, delta);
            let len = added.as_ref().ok().map(|n| n.to_string().len());
            (added, len)
        })
    }

    /// Deletes `key` (and its charge); whether it was there.
    pub(crate) fn delete(&self, key: &str) -> bool {
        let mut ledger = self.ledger.lock();
        ledger.deleted(key);
        self.state.remove(key)
    }

    /// Admits one more blocking request (`get`, `wait`) on a connection
    /// with `waiting` under way.
    pub(crate) fn admit_wait(&self, waiting: usize) -> Result<(), Refusal> {
        let limit = self.limits.max_waits_per_connection;
        if waiting >= limit {
            return Err(Refusal {
                bound: QuotaBound::ConnectionWaits,
                limit: limit as u64,
                requested: waiting as u64 + 1,
            });
        }
        Ok(())
    }
}

impl TcpStoreServer {
    /// Binds `addr` (port 0: any free port) and starts serving in a
    /// spawned task on the current tokio runtime.
    pub async fn bind(addr: SocketAddr) -> Result<TcpStoreServer, StoreError> {
        Self::bind_with(addr, StoreLimits::default()).await
    }

    /// [`bind`](Self::bind) with the given bounds.
    pub async fn bind_with(
        addr: SocketAddr,
        limits: StoreLimits,
    ) -> Result<TcpStoreServer, StoreError> {
        Self::bind_authenticated(addr, limits, None).await
    }

    /// [`bind_with`](Self::bind_with), where with `secret` every client
    /// must first pass the [`auth`] handshake: one that fails (another
    /// secret, none, a replayed handshake) is closed with a warning naming
    /// its address before any request of it is read. torch's c10d
    /// `TCPStore` clients know no secret, so a server with one serves
    /// only Ferry's clients ([`TcpStore::connect_authenticated`]).
    pub async fn bind_authenticated(
        addr: SocketAddr,
        limits: StoreLimits,
        secret: Option<Secret>,
    ) -> Result<TcpStoreServer, StoreError> {
        let io_err = |source| StoreError::Io {
            addr: addr.to_string(),
            source,
        };
        let listener = TcpListener::bind(addr).await.map_err(io_err)?;
        let local_addr = listener.local_addr().map_err(io_err)?;
        let state = Arc::new(MemoryStore::new(DEFAULT_STORE_TIMEOUT));
        let (closing, closed) = watch::channel(false);
        let (failures_tx, accept_failures) = watch::channel(0);
        let served = Arc::new(Served::new(state.clone(), limits, secret));
        let task = tokio::spawn(serve(listener, served, closed, failures_tx));
        debug!(%local_addr, "store server listening");
        Ok(TcpStoreServer {
            local_addr,
            task,
            closing,
            state,
            accept_failures,
        })
    }

    /// The state the server serves, for the hosting process to use
    /// without a connection (its writes are not charged to any quota).
    pub fn memory(&self) -> Arc<MemoryStore> {
        self.state.clone()
    }

    /// How many accepts have failed so far (out of file descriptors and
    /// the like), as a watch to monitor or await.
    pub fn accept_failures(&self) -> watch::Receiver<u64> {
        self.accept_failures.clone()
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops serving, as dropping the server does: the listener and the
    /// client connections close as soon as the runtime cancels the
    /// serving task.
    pub fn shutdown(self) {}

    /// Stops serving gracefully: stops accepting clients and reading
    /// requests, writes every answer already given, then closes each
    /// connection; completes when all are closed. Requests still waiting
    /// (a `wait` on a missing key) get no answer.
    pub async fn close(mut self) {
        let _ = self.closing.send(true);
        let _ = (&mut self.task).await;
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Completes once the server is closing (or gone).
pub(crate) async fn closing(closed: &mut watch::Receiver<bool>) {
    let _ = closed.wait_for(|c| *c).await;
}

/// Accepts clients until cancelled or closed. Connection tasks live in a
/// `JoinSet`, so cancelling this task cancels them all; once `closed`
/// turns `true` it stops accepting and waits for the connections to
/// finish their answers.
async fn serve(
    listener: TcpListener,
    served: Arc<Served>,
    mut closed: watch::Receiver<bool>,
    failures: watch::Sender<u64>,
) {
    let mut connections = JoinSet::new();
    let for_connections = closed.clone();
    let mut backoff = AcceptBackoff::new();
    let mut next_conn: ConnId = 0;
    loop {
        tokio::select! {
            () = closing(&mut closed) => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    backoff.succeeded();
                    next_conn += 1;
                    connections.spawn(serve_connection(
                        served.clone(),
                        next_conn,
                        stream,
                        peer,
                        for_connections.clone(),
                    ));
                }
                Err(e) => {
                    // Out of descriptors and the like: back off, warn
                    // now and then, and keep serving the connections.
                    failures.send_replace(backoff.failures() + 1);
                    let pause = backoff.pause_after("store server", &e);
                    tokio::pin!(pause);
                    loop {
                        tokio::select! {
                            () = &mut pause => break,
                            Some(_) = connections.join_next(), if !connections.is_empty() => {}
                        }
                    }
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// What a request needs: an answer now, or a wait first.
enum Handled {
    Now(Response),
    Later(BoxFuture<'static, Response>),
}

/// The answer to a request the quota refuses.
fn refused(key: &str, r: Refusal) -> Response {
    Response::Failed(Failure::Quota {
        bound: r.bound,
        key: key.to_owned(),
        limit: r.limit,
        requested: r.requested,
    })
}

/// The longest decimal text of an `i64` counter.
pub(crate) const COUNTER_BYTES: usize = 20;

/// Handles `request` from connection `conn`, which has `waiting` blocking
/// requests under way. Writes are checked against the quota and recorded
/// in the ledger under its lock, so that concurrent writers cannot
/// together exceed a bound.
fn handle(served: &Served, conn: ConnId, waiting: usize, request: Request) -> Handled {
    let state = &served.state;
    let answer = |r: Result<Response, StoreError>| r.unwrap_or_else(|e| Response::Failed(e.into()));
    let blocking = match &request {
        Request::Get { key, .. } => Some(key.as_str()),
        Request::Wait { keys, .. } => Some(keys.first().map_or("", String::as_str)),
        _ => None,
    };
    if let (Some(key), Err(r)) = (blocking, served.admit_wait(waiting)) {
        return Handled::Now(refused(key, r));
    }
    match request {
        Request::Set { key, value } => {
            let len = value.len();
            match served.write(conn, &key, len, || (state.insert(&key, value), Some(len))) {
                Ok(()) => Handled::Now(Response::Done),
                Err(r) => Handled::Now(refused(&key, r)),
            }
        }
        Request::Add { key, delta } => match served.add(conn, &key, delta) {
            Ok(added) => Handled::Now(answer(added.map(Response::Counter))),
            Err(r) => Handled::Now(refused(&key, r)),
        },
        Request::CompareSet {
            key,
            expected,
            desired,
        } => {
            let len = desired.len();
            let swapped = served.write(conn, &key, len, || {
                let now = state.swap_if(&key, expected.as_deref(), desired);
                // Stored (or already equal, which costs the same).
                let stored = now.len() == len && state.contains_all(std::slice::from_ref(&key));
                (now, stored.then_some(len))
            });
            match swapped {
                Ok(now) => Handled::Now(Response::Value(now)),
                Err(r) => Handled::Now(refused(&key, r)),
            }
        }
        Request::Delete { key } => Handled::Now(Response::Bool(served.delete(&key))),
        Request::Check { keys } => Handled::Now(Response::Bool(state.contains_all(&keys))),
        Request::Get { key, timeout } => {
            let state = state.clone();
            Handled::Later(
                async move { answer(state.get_within(&key, timeout).await.map(Response::Value)) }
                    .boxed(),
            )
        }
        Request::Wait { keys, timeout } => {
            let state = state.clone();
            Handled::Later(
                async move {
                    answer(
                        state
                            .wait_for(&keys, timeout)
                            .await
                            .map(|()| Response::Done),
                    )
                }
                .boxed(),
            )
        }
    }
}

/// Serves one client until it disconnects, sends bad input, or the server
/// closes; on the way out, every answer already given is written. Its
/// pending waits are dropped with it.
///
/// This is the one accept path of both protocols: the first four bytes
/// say whether the client speaks Ferry's format or c10d's `TCPStore`
/// protocol ([`c10d::wire::connection_preamble`]).
async fn serve_connection(
    served: Arc<Served>,
    conn: ConnId,
    stream: TcpStream,
    peer: SocketAddr,
    closed: watch::Receiver<bool>,
) {
    let first_request_by = Instant::now() + served.limits.first_request_timeout;
    let _ = stream.set_nodelay(true);
    let mut stream = stream;
    let mut session = None;
    if let Some(secret) = &served.auth {
        let authenticate = async {
            // Bytes that cannot open the handshake (c10d's `VALIDATE`, a
            // client without a secret) are refused as soon as they are in,
            // not after `AUTH_TIMEOUT` (the handshake reads a whole header
            // first, and `VALIDATE` is shorter).
            await_opening(&stream, auth_opening)
                .await
                .map_err(|e| e.to_string())?;
            auth::accept(&mut stream, secret.key(), AUTH_TIMEOUT)
                .await
                .map_err(|e| e.to_string())
        };
        let mut watching = closed.clone();
        let proved = tokio::select! {
            () = closing(&mut watching) => return,
            proved = tokio::time::timeout(AUTH_TIMEOUT, authenticate) => proved,
        };
        match proved {
            Ok(Ok(s)) => session = Some(s),
            Ok(Err(why)) => return served.refusals.refused(peer, why),
            Err(_) => {
                let why = format!("no handshake within {AUTH_TIMEOUT:?}");
                return served.refusals.refused(peer, why);
            }
        }
    }
    let (mut rd, wr) = halves(stream, session.as_ref());
    let mut head = [0u8; LENGTH_PREFIX_BYTES];
    let mut watching = closed.clone();
    let got = tokio::select! {
        () = closing(&mut watching) => return,
        () = tokio::time::sleep_until(first_request_by) => {
            debug!(%peer, "closing a store connection that completed no request in time");
            return;
        }
        got = rd.read_exact(&mut head) => got,
    };
    if let Err(e) = got {
        debug!(%peer, error = %e, "store client left before its first request");
        return;
    }
    let rd = std::io::Cursor::new(head).chain(rd);
    let (tx, rx) = mpsc::unbounded_channel();
    // Owns the sender: once reading stops, the writer ends after the
    // answers queued so far.
    let read = if head == c10d::wire::connection_preamble() {
        debug!(%peer, "a c10d TCPStore client");
        let session = Session::new(served, conn);
        serve_c10d(session, rd, tx, peer, closed, first_request_by).boxed()
    } else {
        serve_ferry(served, conn, rd, tx, peer, closed, first_request_by).boxed()
    };
    let write = write_frames(wr, rx);
    tokio::pin!(write);
    tokio::select! {
        () = read => {}
        written = &mut write => {
            if let Err(e) = written {
                debug!(%peer, error = %e, "cannot write to store client");
            }
            return;
        }
    }
    // Reading stopped and its sender is gone: write what is queued.
    if let Err(e) = write.await {
        debug!(%peer, error = %e, "cannot write to store client");
    }
}

/// Reads a Ferry client's requests and queues their answers on `tx`.
async fn serve_ferry<R>(
    served: Arc<Served>,
    conn: ConnId,
    rd: R,
    tx: mpsc::UnboundedSender<Vec<u8>>,
    peer: SocketAddr,
    mut closed: watch::Receiver<bool>,
    first_request_by: Instant,
) where
    R: AsyncRead + Unpin + Send + 'static,
{
    let mut requests = frames(BufReader::new(rd), format::decode_request);
    let respond = |id: u64, response: Response| {
        let frame = format::encode_response(&ResponseFrame { id, response }).or_else(|e| {
            let response = Response::Failed(Failure::Other(e.to_string()));
            format::encode_response(&ResponseFrame { id, response })
        });
        if let Ok(frame) = frame {
            // Fails only once the writer has stopped, which ends the
            // connection anyway.
            let _ = tx.send(frame);
        }
    };
    let mut waits = FuturesUnordered::new();
    let mut requested_any = false;
    loop {
        tokio::select! {
            () = closing(&mut closed) => return,
            () = tokio::time::sleep_until(first_request_by), if !requested_any => {
                debug!(%peer, "closing a store connection that completed no request in time");
                return;
            }
            request = requests.next() => match request {
                None => {
                    debug!(%peer, "store client disconnected");
                    return;
                }
                Some(Err(e)) => {
                    served.broken.refused(peer, e);
                    return;
                }
                Some(Ok(RequestFrame { id, request })) => {
                    // A whole request arrived: the client is not idle
                    // (its first request may wait long for a key).
                    requested_any = true;
                    match handle(&served, conn, waits.len(), request) {
                        Handled::Now(response) => respond(id, response),
                        Handled::Later(wait) => waits.push(wait.map(move |r| (id, r))),
                    }
                }
            },
            Some((id, response)) = waits.next(), if !waits.is_empty() => respond(id, response),
        }
    }
}

// ---------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------

/// A client of a [`TcpStoreServer`], like c10d's `TCPStore` on a non-zero
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
    /// clients ([`TcpStoreServer::bind_authenticated`]) with `secret`:
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

pub(crate) async fn connect_with_retry(
    addr: SocketAddr,
    timeout: Duration,
) -> Result<TcpStream, StoreError> {
    let start = Instant::now();
    let deadline = start.checked_add(timeout);
    let mut backoff = FIRST_BACKOFF;
    loop {
        let remaining = deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        let error = match tokio::time::timeout(remaining.max(MIN_ATTEMPT), TcpStream::connect(addr))
            .await
        {
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(e)) if retryable(&e) => e,
            Ok(Err(e)) => {
                return Err(StoreError::Io {
                    addr: addr.to_string(),
                    source: e,
                })
            }
            Err(_) => io::Error::new(io::ErrorKind::TimedOut, "connection attempt timed out"),
        };
        let now = Instant::now();
        let left = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(now));
        if left.is_zero() {
            return Err(StoreError::Io {
                addr: addr.to_string(),
                source: io::Error::new(
                    error.kind(),
                    format!("no store server reachable within {timeout:?}: {error}"),
                ),
            });
        }
        debug!(%addr, error = %error, "store server not reachable yet; retrying");
        tokio::time::sleep(backoff.min(left)).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Whether a failed connection attempt is worth repeating: nobody
/// listening yet, or the network not ready yet.
fn retryable(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused
            | ConnectionReset
            | ConnectionAborted
            | NotConnected
            | TimedOut
            | Interrupted
            | WouldBlock
            | AddrNotAvailable
            | HostUnreachable
            | NetworkUnreachable
    )
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MAX_MESSAGE_BYTES;

    /// The socket shell reads whole frames and hands their bodies to
    /// `format` (whose own tests cover the bytes): a clean end between
    /// frames, an end inside one, and the limit on the length prefix.
    #[tokio::test]
    async fn the_shell_reads_frames_and_stops_at_the_limits() {
        let frame = format::encode_request(&RequestFrame {
            id: 7,
            request: Request::Check {
                keys: vec!["a".into()],
            },
        })
        .unwrap();
        let mut two = frame.clone();
        two.extend_from_slice(&frame);
        let mut r = &two[..];
        for _ in 0..2 {
            let back = read_frame(&mut r, format::decode_request).await.unwrap();
            assert_eq!(back.unwrap().id, 7);
        }
        assert!(read_frame(&mut r, format::decode_request)
            .await
            .unwrap()
            .is_none());

        let mut cut = &frame[..frame.len() - 1];
        assert!(matches!(
            read_frame(&mut cut, format::decode_request).await,
            Err(FrameError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof
        ));
        let huge = ((MAX_MESSAGE_BYTES + 1) as u32).to_le_bytes();
        let mut r = &huge[..];
        assert!(matches!(
            read_frame(&mut r, format::decode_request).await,
            Err(FrameError::Format(FormatError::TooLarge { .. }))
        ));
    }

    /// Sends `request` as frame `id` on a raw connection.
    async fn send_raw(w: &mut TcpStream, id: u64, request: Request) {
        w.write_all(&format::encode_request(&RequestFrame { id, request }).unwrap())
            .await
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn closing_writes_the_answers_already_given_then_closes() {
        let server = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let addr = server.local_addr();
        // A raw client that sends a `set` and reads nothing yet.
        let mut raw = TcpStream::connect(addr).await.unwrap();
        send_raw(
            &mut raw,
            1,
            Request::Set {
                key: "exit/3".into(),
                value: vec![],
            },
        )
        .await;
        // Another client sees the key: the `set` was handled and answered.
        let other = TcpStore::connect(addr, Duration::from_secs(10))
            .await
            .unwrap();
        other
            .wait(&["exit/3".to_string()], Duration::from_secs(10))
            .await
            .unwrap();
        // A request that can only wait: closing does not answer it.
        send_raw(
            &mut raw,
            2,
            Request::Wait {
                keys: vec!["never".into()],
                timeout: Duration::from_secs(60),
            },
        )
        .await;
        tokio::time::timeout(Duration::from_secs(10), server.close())
            .await
            .expect("close completes");
        // The answer to the `set` arrives, then the end of the stream.
        let mut rd = BufReader::new(raw);
        let first = read_frame(&mut rd, format::decode_response)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(first.id, 1);
        assert!(
            matches!(first.response, Response::Done),
            "{:?}",
            first.response
        );
        assert!(read_frame(&mut rd, format::decode_response)
            .await
            .unwrap()
            .is_none());
        // No new client is accepted.
        assert!(TcpStore::connect(addr, Duration::from_millis(300))
            .await
            .is_err());
    }
}
