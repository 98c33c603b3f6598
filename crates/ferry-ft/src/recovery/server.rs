//! The source side of live recovery: a checkpoint server over
//! `ferry-transport`.

use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use ferry_transport::accept::{auth_opening, await_opening, RefusalWarnings};
use ferry_transport::auth::{is_auth_failure, Secret, AUTH_TIMEOUT};
use ferry_transport::{OutgoingMessage, PeerConnection, RawTensor};
use ferry_wire::payload::OutgoingTensor;
use ferry_wire::Limits;
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, info, info_span, warn, Instrument};

use super::error::CheckpointServerError;
use super::link::{self, ReadError};
use super::protocol::{
    check_stream_request, ChunkHeader, ChunkPlan, Manifest, Refusal, Reply, Request, TensorMeta,
    KIND_CHUNK, KIND_REPLY, KIND_REQUEST,
};
use super::CheckpointState;
use crate::net::accept_loop;

/// A checkpoint server's knobs.
///
/// ```
/// use std::time::Duration;
/// use ferry_ft::recovery::CheckpointServerOptions;
///
/// let options = CheckpointServerOptions::new("replica_a")
///     .with_io_timeout(Duration::from_secs(5));
/// assert_eq!(options.replica_id, "replica_a");
/// ```
#[derive(Debug, Clone)]
pub struct CheckpointServerOptions {
    /// The replica group serving (in handshakes, spans and logs).
    pub replica_id: String,
    /// How long a handshake, or one batched write of chunks, may take
    /// before the transfer is dropped (a healing replica that stopped
    /// reading cannot hold the source). Default 30 s.
    pub io_timeout: Duration,
    /// The longest a manifest request may wait for a checkpoint to be
    /// allowed (the client names its own wait, capped by this). Default
    /// 60 s.
    pub max_wait: Duration,
    /// How long a connection may sit idle between requests. Default 300 s.
    pub idle_timeout: Duration,
    /// Chunks handed to the socket per vectored write (at least 1).
    /// Default 4.
    pub window: usize,
    /// The group's shared secret: with one, a healing replica must prove
    /// it holds it ([`ferry_transport::auth`]) before a request of it is
    /// read; one that fails is closed with a warning naming its address
    /// (rate-limited: at most one line every 10 s, counting the others).
    /// A connection whose first bytes cannot open the authentication
    /// handshake (c10d's 5-byte `VALIDATE`, a replica without a secret,
    /// garbage) is refused as soon as they arrive, not after a timeout.
    /// Default none.
    pub auth: Option<Secret>,
}

impl CheckpointServerOptions {
    /// The defaults for replica group `replica_id`.
    pub fn new(replica_id: impl Into<String>) -> Self {
        Self {
            replica_id: replica_id.into(),
            io_timeout: Duration::from_secs(30),
            max_wait: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(300),
            window: 4,
            auth: None,
        }
    }

    /// Sets [`auth`](Self::auth).
    pub fn with_auth_secret(mut self, secret: Secret) -> Self {
        self.auth = Some(secret);
        self
    }

    /// Sets [`io_timeout`](Self::io_timeout).
    pub fn with_io_timeout(mut self, io_timeout: Duration) -> Self {
        self.io_timeout = io_timeout;
        self
    }

    /// Sets [`max_wait`](Self::max_wait).
    pub fn with_max_wait(mut self, max_wait: Duration) -> Self {
        self.max_wait = max_wait;
        self
    }

    /// Sets [`idle_timeout`](Self::idle_timeout).
    pub fn with_idle_timeout(mut self, idle_timeout: Duration) -> Self {
        self.idle_timeout = idle_timeout;
        self
    }

    /// Sets [`window`](Self::window).
    pub fn with_window(mut self, window: usize) -> Self {
        self.window = window;
        self
    }
}

/// What a checkpoint server has done so far ([`CheckpointServer::stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckpointServerStats {
    /// The step served now, if a checkpoint is allowed.
    pub serving: Option<i64>,
    /// Manifest requests waiting for a checkpoint to be allowed.
    pub waiting: usize,
    /// Manifests sent.
    pub manifests: u64,
    /// Requests refused (step mismatch, nothing served, bad requests).
    pub refusals: u64,
    /// Lane streams started.
    pub streams_started: u64,
    /// Lane streams sent to the end.
    pub streams_completed: u64,
    /// Lane streams in progress.
    pub in_flight: usize,
    /// Chunks sent.
    pub chunks_sent: u64,
    /// Tensor bytes sent.
    pub bytes_sent: u64,
}

/// The checkpoint being served.
struct Snapshot {
    manifest: Manifest,
    tensors: Vec<RawTensor>,
    byte_lens: Vec<u64>,
}

struct Shared {
    options: CheckpointServerOptions,
    local_addr: SocketAddr,
    serving: Mutex<Option<Arc<Snapshot>>>,
    stats: watch::Sender<CheckpointServerStats>,
    /// Warnings about replicas that failed authentication, at most one
    /// every 10 s (an outsider can open thousands of connections a second).
    refusals: RefusalWarnings,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A source replica's checkpoint server: healing replicas fetch its model
/// and optimizer state from it over `ferry-transport`, streaming, with the
/// step checked (torchft's checkpoint transport, without HTTP).
///
/// The replica [`allow`](Self::allow)s a [`CheckpointState`] when it is a
/// recovery source for the quorum (torchft's `send_checkpoint`) and
/// [`disallow`](Self::disallow)s it before it changes its state (torchft
/// calls it in `should_commit`). `disallow` waits for the transfers in
/// progress to end, after which the server holds no reference to the
/// state's tensors. Requests that arrive while nothing is allowed wait for
/// the next `allow` (up to their wait); requests for another step than the
/// one allowed are refused.
///
/// [`address`](Self::address) is what the replica puts in its manager's
/// checkpoint metadata, where a healing replica finds it with
/// [`ManagerClient::checkpoint_metadata`](crate::manager::ManagerClient::checkpoint_metadata).
///
/// ```no_run
/// use ferry_ft::recovery::{CheckpointServer, CheckpointServerOptions, CheckpointState};
/// use ferry_transport::RawTensor;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let server = CheckpointServer::bind("127.0.0.1:0", CheckpointServerOptions::new("replica_a")).await?;
/// let metadata = server.address(); // sent with every quorum request
/// let weights = RawTensor::from_slice(&[0.5f32; 1024], &[1024])?;
/// server.allow(CheckpointState::new(7).with_tensor("model.weight", weights))?;
/// // ... healing replicas fetch step 7 ...
/// server.disallow().await;
/// # let _ = metadata; Ok(()) }
/// ```
pub struct CheckpointServer {
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl fmt::Debug for CheckpointServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CheckpointServer")
            .field("local_addr", &self.shared.local_addr)
            .field("options", &self.shared.options)
            .finish_non_exhaustive()
    }
}

impl CheckpointServer {
    /// Binds `addr` (e.g. `"127.0.0.1:0"`) and serves on the current tokio
    /// runtime until [`shutdown`](Self::shutdown) or drop. Nothing is
    /// allowed yet.
    pub async fn bind(
        addr: impl ToSocketAddrs + fmt::Display,
        options: CheckpointServerOptions,
    ) -> Result<Self, CheckpointServerError> {
        let bind_error = |source| CheckpointServerError::Bind {
            addr: addr.to_string(),
            source,
        };
        let listener = TcpListener::bind(&addr).await.map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let span = info_span!(
            "checkpoint_server",
            replica_id = %options.replica_id,
            addr = %local_addr
        );
        let shared = Arc::new(Shared {
            options,
            local_addr,
            serving: Mutex::new(None),
            stats: watch::channel(CheckpointServerStats::default()).0,
            refusals: RefusalWarnings::new(
                "checkpoint server",
                "refused a healing replica that failed authentication",
            ),
        });
        let accept = {
            let shared = Arc::clone(&shared);
            tokio::spawn(
                accept_loop(listener, "checkpoint server", move |stream, _| {
                    serve_connection(Arc::clone(&shared), stream)
                })
                .instrument(span),
            )
        };
        info!(replica_id = %shared.options.replica_id, addr = %local_addr, "checkpoint server listening");
        Ok(Self { shared, accept })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local_addr
    }

    /// `host:port` for healing replicas: the checkpoint metadata to register
    /// with the manager. It is the bound address, so bind an address the
    /// other replica groups can reach (not `0.0.0.0`).
    pub fn address(&self) -> String {
        self.shared.local_addr.to_string()
    }

    /// Serves `state` from now on, in place of whatever was allowed before
    /// (transfers of the previous state in progress finish with it).
    /// Contiguous tensors are shared, not copied; other views are copied
    /// into contiguous tensors first.
    pub fn allow(&self, state: CheckpointState) -> Result<(), CheckpointServerError> {
        let step = state.step;
        let mut tensors = Vec::with_capacity(state.tensors.len());
        let mut metas = Vec::with_capacity(state.tensors.len());
        let mut byte_lens = Vec::with_capacity(state.tensors.len());
        for (name, tensor) in state.tensors {
            let tensor = if tensor.is_contiguous() {
                tensor
            } else {
                tensor
                    .contiguous()
                    .map_err(|source| CheckpointServerError::Tensor {
                        name: name.clone(),
                        source,
                    })?
            };
            let byte_len = tensor.numel() * tensor.dtype().size() as u64;
            metas.push(TensorMeta {
                name,
                dtype: tensor.dtype(),
                shape: tensor.shape().to_vec(),
                byte_len,
            });
            byte_lens.push(byte_len);
            tensors.push(tensor);
        }
        let snapshot = Snapshot {
            manifest: Manifest {
                step,
                tensors: metas,
            },
            tensors,
            byte_lens,
        };
        *lock(&self.shared.serving) = Some(Arc::new(snapshot));
        self.shared
            .stats
            .send_modify(|stats| stats.serving = Some(step));
        debug!(replica_id = %self.shared.options.replica_id, step, "checkpoint allowed");
        Ok(())
    }

    /// Stops serving and waits until the transfers in progress have ended
    /// (sent, failed, or dropped after [`io_timeout`](CheckpointServerOptions::io_timeout)
    /// without progress). Afterwards the server holds no reference to the
    /// tensors it served.
    pub async fn disallow(&self) {
        *lock(&self.shared.serving) = None;
        self.shared.stats.send_modify(|stats| stats.serving = None);
        let mut stats = self.shared.stats.subscribe();
        // The sender lives in `self.shared`: `wait_for` cannot fail here.
        let _ = stats.wait_for(|stats| stats.in_flight == 0).await;
    }

    /// The step served now, if any.
    pub fn serving_step(&self) -> Option<i64> {
        self.shared.stats.borrow().serving
    }

    /// What the server has done so far.
    pub fn stats(&self) -> CheckpointServerStats {
        self.shared.stats.borrow().clone()
    }

    /// Waits until `done` holds for the [stats](Self::stats), re-checking on
    /// every change; bound it with a timeout where it might never hold.
    pub async fn wait_for_stats(
        &self,
        mut done: impl FnMut(&CheckpointServerStats) -> bool,
    ) -> CheckpointServerStats {
        let mut stats = self.shared.stats.subscribe();
        let result = match stats.wait_for(|s| done(s)).await {
            Ok(stats) => stats.clone(),
            // Unreachable while `self` holds the sender.
            Err(_) => self.stats(),
        };
        result
    }

    /// Stops accepting and cuts every connection.
    pub async fn shutdown(mut self) {
        self.accept.abort();
        // An aborted task reports a cancellation; nothing else to learn.
        let _ = (&mut self.accept).await;
    }
}

impl Drop for CheckpointServer {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// The limits a server reads requests with: small payloads, no tensors.
fn request_limits() -> Limits {
    Limits {
        max_payload_bytes: 64 << 10,
        max_descriptor_bytes: 1 << 10,
        max_tensors: 0,
        max_tensor_bytes: 0,
        max_message_tensor_bytes: 0,
        ..Limits::default()
    }
}

/// Runs one connection: handshake, then requests one after the other.
async fn serve_connection(shared: Arc<Shared>, stream: TcpStream) {
    let options = &shared.options;
    let mut endpoint = link::streaming_endpoint(&options.replica_id);
    endpoint.limits = request_limits();
    endpoint.auth = options.auth.clone();
    let from = stream.peer_addr().ok();
    let peer_addr = || from.map_or_else(|| "unknown peer".to_owned(), |a| a.to_string());
    let accept = async {
        if options.auth.is_some() {
            // Bytes that cannot open the authentication handshake (c10d's
            // `VALIDATE`, a replica without a secret, one byte of garbage)
            // are refused as soon as they are in: the handshake reads a
            // whole header first, and waits up to `AUTH_TIMEOUT` for one
            // that is shorter. The wait is bounded as the handshake's is.
            match tokio::time::timeout(AUTH_TIMEOUT, await_opening(&stream, auth_opening)).await {
                Ok(Ok(())) => {}
                Ok(Err(why)) => return Err(Refused(why.to_string())),
                Err(_) => {
                    let why = format!("no authentication handshake within {AUTH_TIMEOUT:?}");
                    return Err(Refused(why));
                }
            }
        }
        Ok(PeerConnection::accept(stream, &endpoint).await)
    };
    let conn = match tokio::time::timeout(options.io_timeout, accept).await {
        Ok(Ok(Ok(conn))) => conn,
        Ok(Err(Refused(why))) => {
            shared.refusals.refused(peer_addr(), why);
            return;
        }
        Ok(Ok(Err(error))) if is_auth_failure(&error) => {
            shared.refusals.refused(peer_addr(), error);
            return;
        }
        Ok(Ok(Err(error))) => {
            debug!("handshake failed: {error}");
            return;
        }
        Err(_) => {
            debug!("handshake timed out");
            return;
        }
    };
    let peer = conn.peer.worker_name.clone();
    let PeerConnection {
        mut reader,
        mut writer,
        ..
    } = conn;
    loop {
        let message = match link::read_message(&mut reader, options.idle_timeout).await {
            Ok(message) => message,
            Err(ReadError::Closed) => return,
            Err(ReadError::Timeout) => {
                debug!(%peer, "idle connection closed");
                return;
            }
            Err(ReadError::Transport(error)) => {
                debug!(%peer, "connection failed: {error}");
                return;
            }
        };
        let request = if message.header.kind == KIND_REQUEST {
            link::decode::<Request>(message).map_err(|error| error.to_string())
        } else {
            Err(format!("unexpected {} message", message.header.kind))
        };
        let request = match request {
            Ok(request) => request,
            Err(reason) => {
                refuse(&shared, &mut writer, Refusal::BadRequest { reason }).await;
                return;
            }
        };
        let keep_going = match request {
            Request::Manifest { step, wait_ms } => {
                serve_manifest(&shared, &mut writer, step, wait_ms).await
            }
            Request::Stream {
                step,
                lane,
                lanes,
                chunk_bytes,
            } => {
                let span = info_span!("stream", %peer, step, lane, lanes);
                serve_stream(&shared, &mut writer, step, lane, lanes, chunk_bytes)
                    .instrument(span)
                    .await
            }
        };
        if !keep_going {
            return;
        }
    }
}

/// Why a connection was refused before its handshake was read.
struct Refused(String);

type Writer = ferry_transport::FrameWriter<ferry_transport::PeerWriter>;

/// Writes `reply`; false if the connection is done for.
async fn send_reply(shared: &Shared, writer: &mut Writer, reply: &Reply) -> bool {
    let message = match link::message(KIND_REPLY, reply) {
        Ok(message) => message,
        Err(error) => {
            warn!("cannot encode a checkpoint reply: {error}");
            return false;
        }
    };
    match tokio::time::timeout(shared.options.io_timeout, writer.write(&message)).await {
        Ok(Ok(())) => true,
        Ok(Err(error)) => {
            debug!("cannot send a reply: {error}");
            false
        }
        Err(_) => {
            debug!("sending a reply timed out");
            false
        }
    }
}

async fn refuse(shared: &Shared, writer: &mut Writer, refusal: Refusal) -> bool {
    info!(?refusal, "checkpoint request refused");
    shared.stats.send_modify(|stats| stats.refusals += 1);
    send_reply(shared, writer, &Reply::Refused(refusal)).await
}

/// Answers a manifest request, waiting up to `wait_ms` (capped) for a
/// checkpoint to be allowed.
async fn serve_manifest(shared: &Shared, writer: &mut Writer, step: i64, wait_ms: u64) -> bool {
    let wait = Duration::from_millis(wait_ms).min(shared.options.max_wait);
    let deadline = tokio::time::Instant::now() + wait;
    let mut changes = shared.stats.subscribe();
    let mut waiting: Option<Waiting<'_>> = None;
    let outcome = loop {
        changes.borrow_and_update();
        let current = lock(&shared.serving)
            .as_ref()
            .map(|snapshot| snapshot.manifest.clone());
        match current {
            Some(manifest) if manifest.step == step => break Ok(manifest),
            Some(manifest) => {
                break Err(Refusal::StepMismatch {
                    requested: step,
                    serving: manifest.step,
                })
            }
            None => {}
        }
        if waiting.is_none() {
            shared.stats.send_modify(|stats| stats.waiting += 1);
            waiting = Some(Waiting(&shared.stats));
        }
        match tokio::time::timeout_at(deadline, changes.changed()).await {
            Ok(Ok(())) => {}
            // Sender gone (unreachable while `shared` lives) or the wait is over.
            Ok(Err(_)) | Err(_) => break Err(Refusal::NotServing { requested: step }),
        }
    };
    drop(waiting);
    match outcome {
        Ok(manifest) => {
            shared.stats.send_modify(|stats| stats.manifests += 1);
            debug!(step, tensors = manifest.tensors.len(), "sending manifest");
            send_reply(shared, writer, &Reply::Manifest(manifest)).await
        }
        Err(refusal) => refuse(shared, writer, refusal).await,
    }
}

/// Counts a manifest request waiting while alive.
struct Waiting<'a>(&'a watch::Sender<CheckpointServerStats>);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|stats| stats.waiting -= 1);
    }
}

/// Counts a stream in flight while alive.
struct InFlight<'a>(&'a watch::Sender<CheckpointServerStats>);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|stats| stats.in_flight -= 1);
    }
}

/// Streams one lane's chunks of the checkpoint at `step`.
async fn serve_stream(
    shared: &Shared,
    writer: &mut Writer,
    step: i64,
    lane: u32,
    lanes: u32,
    chunk_bytes: u64,
) -> bool {
    if let Err(reason) = check_stream_request(lane, lanes, chunk_bytes) {
        return refuse(shared, writer, Refusal::BadRequest { reason }).await;
    }
    // Take the snapshot and count the stream in flight atomically with
    // respect to `disallow`, which clears the snapshot under the same lock.
    let snapshot = {
        let serving = lock(&shared.serving);
        match serving.as_ref() {
            Some(snapshot) if snapshot.manifest.step == step => {
                shared.stats.send_modify(|stats| {
                    stats.in_flight += 1;
                    stats.streams_started += 1;
                });
                Ok(Arc::clone(snapshot))
            }
            Some(snapshot) => Err(Refusal::StepMismatch {
                requested: step,
                serving: snapshot.manifest.step,
            }),
            None => Err(Refusal::NotServing { requested: step }),
        }
    };
    let snapshot = match snapshot {
        Ok(snapshot) => snapshot,
        Err(refusal) => return refuse(shared, writer, refusal).await,
    };
    let _in_flight = InFlight(&shared.stats);

    let plan = ChunkPlan::new(&snapshot.byte_lens, chunk_bytes);
    let window = shared.options.window.max(1);
    let mut batch: Vec<OutgoingMessage> = Vec::with_capacity(window);
    let mut batch_bytes = 0;
    let mut sent = 0u64;
    let mut chunks = plan.lane(lane, lanes).peekable();
    while let Some(chunk) = chunks.next() {
        let tensor = &snapshot.tensors[chunk.tensor];
        let element = tensor.dtype().size() as u64;
        let view = match tensor.as_strided(
            &[(chunk.len / element) as i64],
            &[1],
            (chunk.offset / element) as i64,
        ) {
            Ok(view) => view,
            Err(error) => {
                warn!("cannot cut chunk {}: {error}", chunk.index);
                return false;
            }
        };
        let header = ChunkHeader {
            index: chunk.index,
            tensor: chunk.tensor as u32,
            offset: chunk.offset,
        };
        let mut message = match link::message(KIND_CHUNK, &header) {
            Ok(message) => message,
            Err(error) => {
                warn!("cannot encode chunk {}: {error}", chunk.index);
                return false;
            }
        };
        message.request_id = chunk.index;
        message.tensors = vec![Arc::new(view) as Arc<dyn OutgoingTensor>];
        batch.push(message);
        batch_bytes += chunk.len;
        if batch.len() == window || chunks.peek().is_none() {
            match tokio::time::timeout(shared.options.io_timeout, writer.write_batch(&batch)).await
            {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    info!("stream ended by the transport: {error}");
                    return false;
                }
                Err(_) => {
                    warn!(
                        "stream dropped: no progress for {:?}",
                        shared.options.io_timeout
                    );
                    return false;
                }
            }
            let count = batch.len() as u64;
            sent += count;
            shared.stats.send_modify(|stats| {
                stats.chunks_sent += count;
                stats.bytes_sent += batch_bytes;
            });
            batch.clear();
            batch_bytes = 0;
        }
    }
    let ok = send_reply(shared, writer, &Reply::End { chunks: sent }).await;
    if ok {
        shared
            .stats
            .send_modify(|stats| stats.streams_completed += 1);
    }
    ok
}
