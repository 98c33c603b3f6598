//! The store server: [`TcpStoreServer`] accepts clients and serves
//! Ferry's requests (c10d's are served by [`crate::c10d::server`]).

use std::net::SocketAddr;
use std::sync::Arc;

use ferry_transport::accept::{auth_opening, await_opening, AcceptBackoff};
use ferry_transport::auth::{self, Secret, AUTH_TIMEOUT};
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use tokio::io::{AsyncRead, AsyncReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tracing::debug;

use super::frames::{frames, halves, write_frames};
use super::served::{closing, Served};
use crate::c10d::{
    self,
    server::{serve_c10d, Session},
};
use crate::format::{
    self, Failure, Request, RequestFrame, Response, ResponseFrame, LENGTH_PREFIX_BYTES,
};
use crate::quota::{ConnId, Refusal, StoreLimits};
use crate::{MemoryStore, StoreError, DEFAULT_STORE_TIMEOUT};

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
    /// only Ferry's clients ([`TcpStore::connect_authenticated`](super::TcpStore::connect_authenticated)).
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncWriteExt;

    use super::*;
    use crate::tcp::frames::read_frame;
    use crate::{Store, TcpStore};

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
