//! The lighthouse as a server: `torchft.LighthouseService` over gRPC (tonic)
//! and the status dashboard over HTTP/1, on one TCP port.
//!
//! A thin shell around [`LighthouseState`]: every quorum request joins the
//! state and ticks it at once, a background task ticks it every
//! `quorum_tick`, and each delivered quorum is broadcast to the waiting
//! requests; a request whose replica is not in the delivered quorum joins
//! the next round and keeps waiting, as torchft's server does.
//!
//! A delivered quorum is shared, not copied: the state keeps it behind an
//! `Arc`, its `LighthouseQuorumResponse` is encoded once, and each waiting
//! request sends those bytes. That is why the service's dispatch is written
//! here ([`LighthouseGrpc`]) rather than generated: tonic's gRPC machinery
//! all the same, with a codec that writes the encoded response as it is.
//! Log lines are written after the state's lock is let go of.
//!
//! The dashboard's routes answer only requests for the lighthouse's own
//! names (`Host`; see [`super::host`]), against DNS rebinding; the gRPC
//! service beside them answers whatever `:authority` its clients send.

use std::convert::Infallible;
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, Request as HttpRequest};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse};
use axum::routing::{get, post};
use prost::bytes::BufMut;
use tokio::net::{TcpListener, ToSocketAddrs};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;
use tonic::codec::{Codec, EncodeBuf, Encoder, ProstCodec};
use tonic::codegen::{http, Body, BoxFuture, Bytes, Service, StdError};
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::service::Routes;
use tonic::{Request, Response, Status};
use tracing::{debug, debug_span, info, info_span, warn, Instrument};

use super::dashboard::render_page;
use super::host::{BadAllowedHost, DashboardHosts, HostRefused};
use super::state::TickLog;
use super::status::{KillOutcome, LighthouseStatus};
use super::{check_replica_id, LighthouseOptions, LighthouseState};
use crate::access::{client_endpoint, ClientTls, EndpointError};
use crate::grpc::{error_chain, finish_serving, request_timeout};
use crate::proto::lighthouse_service_server::SERVICE_NAME;
use crate::proto::manager_service_client::ManagerServiceClient;
use crate::proto::{
    KillRequest, LighthouseHeartbeatRequest, LighthouseHeartbeatResponse, LighthouseQuorumRequest,
    LighthouseQuorumResponse, Quorum, QuorumMember,
};

/// How many delivered quorums a waiting request may fall behind before it
/// gives up (torchft: 16). Each slot is one `Arc`.
const QUORUM_CHANNEL_CAPACITY: usize = 1024;

/// How long the dashboard's `Kill` may take to connect and to be answered
/// (torchft's dashboard connects with a 10 s timeout).
const KILL_TIMEOUT: Duration = Duration::from_secs(10);

/// The message the dashboard's `Kill` carries (torchft's wording).
const KILL_MESSAGE: &str = "killed from dashboard";

/// Why the lighthouse server could not start or stopped badly.
#[derive(Debug, thiserror::Error)]
pub enum LighthouseError {
    /// The listening socket could not be bound.
    #[error("lighthouse: cannot bind {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The gRPC/HTTP server failed.
    #[error("lighthouse: server failed: {0}")]
    Serve(#[source] tonic::transport::Error),
    /// The server task panicked or was cancelled.
    #[error("lighthouse: server task ended abnormally: {0}")]
    Task(#[source] tokio::task::JoinError),
    /// The TLS configuration was refused.
    #[error("lighthouse: {0}")]
    Access(#[from] crate::access::AccessError),
    /// An entry of [`LighthouseOptions::allowed_hosts`] is not a host name.
    #[error("lighthouse: {0}")]
    AllowedHost(#[from] BadAllowedHost),
}

/// A running lighthouse: `torchft.LighthouseService` (`Quorum`, `Heartbeat`)
/// and the dashboard (`GET /`, `GET /status`, `POST /replica/{id}/kill`) on
/// one TCP port.
///
/// [`bind`](Self::bind) binds and returns at once (bind port 0 and read
/// [`local_addr`](Self::local_addr)); the server runs on the current tokio
/// runtime until [`shutdown`](Self::shutdown) or drop. Quorum requests must
/// carry a gRPC deadline (`grpc-timeout`), as torchft requires.
///
/// ```no_run
/// use ferry_ft::lighthouse::{Lighthouse, LighthouseOptions};
///
/// # async fn run() -> Result<(), ferry_ft::lighthouse::LighthouseError> {
/// let lighthouse = Lighthouse::bind("127.0.0.1:29510", LighthouseOptions::new(2)).await?;
/// println!("lighthouse and dashboard on http://{}", lighthouse.local_addr());
/// // ... replica groups' managers ask it for quorums ...
/// lighthouse.shutdown().await?;
/// # Ok(()) }
/// ```
pub struct Lighthouse {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    serve: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
    ticker: Option<JoinHandle<()>>,
}

impl fmt::Debug for Lighthouse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lighthouse")
            .field("local_addr", &self.local_addr)
            .field("options", &self.shared.opt)
            .finish_non_exhaustive()
    }
}

impl Lighthouse {
    /// Binds `addr` (e.g. `"[::]:29510"`, torchft's default, or
    /// `"127.0.0.1:0"`) and starts serving on the current tokio runtime.
    /// Returns once the socket is bound.
    ///
    /// A zero `quorum_tick` is taken as 1 ms.
    pub async fn bind(
        addr: impl ToSocketAddrs + fmt::Display,
        options: LighthouseOptions,
    ) -> Result<Self, LighthouseError> {
        let hosts = DashboardHosts::new(machine_hostname().as_deref(), &options.allowed_hosts)?;
        let bind_error = |source| LighthouseError::Bind {
            addr: addr.to_string(),
            source,
        };
        let listener = TcpListener::bind(&addr).await.map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let server = options.access.server()?;
        let incoming = options.access.incoming(listener, "lighthouse");

        let (shutdown, shutdown_rx) = watch::channel(false);
        let (quorums, _) = broadcast::channel(QUORUM_CHANNEL_CAPACITY);
        let (changes, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            local_addr,
            opt: options,
            state: Mutex::new(LighthouseState::new()),
            quorums,
            changes,
            shutdown: shutdown_rx.clone(),
            last_kill: Mutex::new(None),
            kill_token: random_token(),
        });

        let span = info_span!("lighthouse", addr = %local_addr);
        let ticker = tokio::spawn(
            run_ticks(Arc::clone(&shared), shutdown_rx.clone()).instrument(span.clone()),
        );

        let routes = Routes::from(dashboard_router(Arc::clone(&shared), hosts)).add_service(
            LighthouseGrpc {
                shared: Arc::clone(&shared),
            },
        );
        let mut stop = shutdown_rx;
        let signal = async move {
            // Either `true` was sent or the `Lighthouse` is gone: stop.
            let _ = stop.wait_for(|stop| *stop).await;
        };
        let serve = tokio::spawn(
            server
                .accept_http1(true)
                .add_routes(routes)
                .serve_with_incoming_shutdown(incoming, signal)
                .instrument(span),
        );
        let scheme = if shared.opt.access.tls.is_some() {
            "https"
        } else {
            "http"
        };
        info!(
            addr = %local_addr,
            min_replicas = shared.opt.min_replicas,
            "Lighthouse listening on {scheme}://{local_addr}"
        );

        Ok(Self {
            local_addr,
            shared,
            shutdown,
            serve: Some(serve),
            ticker: Some(ticker),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// `http://` (`https://` with TLS) and [`local_addr`](Self::local_addr): what clients connect
    /// to and browsers open.
    pub fn url(&self) -> String {
        let scheme = if self.shared.opt.access.tls.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.local_addr)
    }

    /// The options it runs with.
    pub fn options(&self) -> &LighthouseOptions {
        &self.shared.opt
    }

    /// What the dashboard shows now.
    pub fn status(&self) -> LighthouseStatus {
        self.shared.status()
    }

    /// Waits until `done` holds for the [status](Self::status), re-checking
    /// it on every change: a join, a heartbeat, a tick (so at least every
    /// `quorum_tick`), a delivered quorum, a kill. Returns the status that
    /// satisfied it. Bound it with a timeout where it might never hold.
    pub async fn wait_for_status(
        &self,
        mut done: impl FnMut(&LighthouseStatus) -> bool,
    ) -> LighthouseStatus {
        let mut changes = self.shared.changes.subscribe();
        loop {
            changes.borrow_and_update();
            let status = self.shared.status();
            if done(&status) {
                return status;
            }
            if changes.changed().await.is_err() {
                // Unreachable while `self` holds the sender; never spin.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Stops the lighthouse: waiting quorum requests fail with
    /// `UNAVAILABLE`, the listener closes (the port can be bound again once
    /// this returns), open connections get up to 5 s to finish before they
    /// are cut.
    pub async fn shutdown(mut self) -> Result<(), LighthouseError> {
        info!(addr = %self.local_addr, "Lighthouse shutting down");
        self.shutdown.send_replace(true);
        if let Some(ticker) = self.ticker.take() {
            ticker.abort();
        }
        let Some(serve) = self.serve.take() else {
            return Ok(());
        };
        finish_serving(serve, &self.local_addr)
            .await
            .map_err(LighthouseError::Task)?
            .map_err(LighthouseError::Serve)
    }
}

impl Drop for Lighthouse {
    /// Stops the lighthouse as [`shutdown`](Lighthouse::shutdown) does,
    /// without waiting: open connections finish in the background.
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
        if let Some(ticker) = self.ticker.take() {
            ticker.abort();
        }
    }
}

/// What the gRPC service, the dashboard and the ticker share.
struct Shared {
    local_addr: SocketAddr,
    opt: LighthouseOptions,
    state: Mutex<LighthouseState>,
    /// Every delivered quorum, to the waiting quorum requests.
    quorums: broadcast::Sender<Arc<Delivered>>,
    /// Bumped on every change, for [`Lighthouse::wait_for_status`].
    changes: watch::Sender<u64>,
    shutdown: watch::Receiver<bool>,
    last_kill: Mutex<Option<KillOutcome>>,
    /// The token the dashboard's kill must carry (see [`kill_allowed`]).
    kill_token: String,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, LighthouseState> {
        // The state stays consistent across a panic elsewhere: keep going.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn touch(&self) {
        // Without a `wait_for_status` running there is nothing to wake, and
        // nothing is missed: a waiter subscribes before it first reads the
        // state, so it reads every earlier change and is woken for later ones.
        if self.changes.receiver_count() > 0 {
            self.changes.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Ticks the state and broadcasts the quorum it delivers, if any,
    /// encoded once for all its waiting requests. Returns the tick's log
    /// lines, for the caller to write once it has let go of the lock.
    fn tick_locked(&self, state: &mut LighthouseState) -> TickLog {
        let tick = state.tick_quiet(Instant::now(), Some(SystemTime::now()), &self.opt);
        if let Some(quorum) = tick.quorum {
            // No receiver means nobody is waiting: nothing to deliver to.
            let _ = self.quorums.send(Arc::new(Delivered::new(quorum)));
        }
        tick.log
    }

    fn tick(&self) {
        let log = {
            let mut state = self.lock();
            self.tick_locked(&mut state)
        };
        log.emit();
        self.touch();
    }

    fn status(&self) -> LighthouseStatus {
        let mut status = {
            let state = self.lock();
            LighthouseStatus::new(Instant::now(), SystemTime::now(), &state, &self.opt)
        };
        status.last_kill = self
            .last_kill
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        status
    }

    /// The manager address of `replica_id`: from the previous quorum, else
    /// from this round's participants.
    fn member_address(&self, replica_id: &str) -> Option<String> {
        let state = self.lock();
        state
            .prev_quorum()
            .and_then(|quorum| {
                quorum
                    .participants
                    .iter()
                    .find(|member| member.replica_id == replica_id)
            })
            .or_else(|| {
                state
                    .participants()
                    .get(replica_id)
                    .map(|details| &details.member)
            })
            .map(|member| member.address.clone())
    }

    /// Joins `requester` and waits for a quorum that includes it; returns
    /// that quorum's encoded `LighthouseQuorumResponse`.
    async fn quorum(&self, requester: QuorumMember) -> Result<Bytes, Status> {
        let (mut quorums, log) = {
            let mut state = self.lock();
            state.join(Instant::now(), requester.clone());
            // Subscribe before ticking, so the quorum this tick may deliver
            // reaches this request too.
            let quorums = self.quorums.subscribe();
            let log = self.tick_locked(&mut state);
            (quorums, log)
        };
        log.emit();
        self.touch();

        let mut shutdown = self.shutdown.clone();
        loop {
            let quorum = tokio::select! {
                received = quorums.recv() => match received {
                    Ok(quorum) => quorum,
                    Err(RecvError::Lagged(missed)) => {
                        return Err(Status::internal(format!(
                            "missed {missed} quorums while waiting; ask again"
                        )))
                    }
                    Err(RecvError::Closed) => {
                        return Err(Status::unavailable("lighthouse is shutting down"))
                    }
                },
                _ = shutdown.wait_for(|stop| *stop) => {
                    return Err(Status::unavailable("lighthouse is shutting down"));
                }
            };

            if quorum.includes(&requester.replica_id) {
                debug!(
                    quorum_id = quorum.quorum.quorum_id,
                    participants = quorum.quorum.participants.len(),
                    "Replica {} got its quorum",
                    requester.replica_id
                );
                return Ok(quorum.response.clone());
            }

            // Left out (e.g. a newcomer during shrink_only): join the next
            // round and keep waiting, as torchft does.
            self.lock().join(Instant::now(), requester.clone());
            self.touch();
            debug!(
                quorum_id = quorum.quorum.quorum_id,
                "Replica {} not in quorum, retrying", requester.replica_id
            );
        }
    }

    /// The dashboard's kill: asks the replica's manager to exit.
    async fn kill(&self, replica_id: String) -> (StatusCode, KillOutcome) {
        let address = self.member_address(&replica_id);
        let result = match &address {
            None => Err(KillError::UnknownReplica),
            Some(address) => kill_manager(address, self.opt.manager_tls.as_ref()).await,
        };
        let code = match &result {
            Ok(()) => StatusCode::OK,
            Err(KillError::UnknownReplica) => StatusCode::NOT_FOUND,
            Err(_) => StatusCode::BAD_GATEWAY,
        };
        let outcome = KillOutcome {
            replica_id,
            address,
            ok: result.is_ok(),
            error: result.err().map(|error| error_chain(&error)),
            at_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |since| {
                    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
                }),
        };
        match &outcome.error {
            None => warn!(
                address = outcome.address.as_deref().unwrap_or_default(),
                "Killed replica {} from the dashboard", outcome.replica_id
            ),
            Some(error) => warn!(
                address = outcome.address.as_deref().unwrap_or_default(),
                "Kill of replica {} failed: {error}", outcome.replica_id
            ),
        }
        *self
            .last_kill
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(outcome.clone());
        self.touch();
        (code, outcome)
    }
}

/// Ticks every `quorum_tick` until shutdown.
async fn run_ticks(shared: Arc<Shared>, mut shutdown: watch::Receiver<bool>) {
    let period = shared.opt.quorum_tick.max(Duration::from_millis(1));
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = interval.tick() => shared.tick(),
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
    }
}

/// A delivered quorum, as every waiting request gets it.
#[derive(Debug)]
struct Delivered {
    /// The quorum, shared with the state (its previous quorum).
    quorum: Arc<Quorum>,
    /// Its `LighthouseQuorumResponse`, encoded once.
    response: Bytes,
}

impl Delivered {
    fn new(quorum: Arc<Quorum>) -> Self {
        let response = encode_quorum_response(&quorum);
        Self { quorum, response }
    }

    /// Whether `replica_id` is a member (the members are sorted by replica
    /// id, as the state delivers them).
    fn includes(&self, replica_id: &str) -> bool {
        self.quorum
            .participants
            .binary_search_by(|member| member.replica_id.as_str().cmp(replica_id))
            .is_ok()
    }
}

/// `LighthouseQuorumResponse { quorum: Some(quorum) }`, encoded, without
/// copying the quorum: its only field, `quorum = 1`, is the quorum as an
/// embedded message.
fn encode_quorum_response(quorum: &Quorum) -> Bytes {
    const QUORUM_FIELD: u32 = 1;
    let mut buf = Vec::with_capacity(prost::encoding::message::encoded_len(QUORUM_FIELD, quorum));
    prost::encoding::message::encode(QUORUM_FIELD, quorum, &mut buf);
    Bytes::from(buf)
}

/// gRPC path of `torchft.LighthouseService/Quorum`.
const QUORUM_PATH: &str = "/torchft.LighthouseService/Quorum";
/// gRPC path of `torchft.LighthouseService/Heartbeat`.
const HEARTBEAT_PATH: &str = "/torchft.LighthouseService/Heartbeat";

/// `torchft.LighthouseService` over the shared state: the dispatch tonic
/// generates for `LighthouseServiceServer`, with `Quorum` answered by
/// [`EncodedQuorumCodec`] (the response bytes of the delivered quorum, as
/// they are) and `Heartbeat` by prost's codec. Compression and message
/// sizes are tonic's defaults, as the generated server's.
#[derive(Clone)]
struct LighthouseGrpc {
    shared: Arc<Shared>,
}

impl NamedService for LighthouseGrpc {
    const NAME: &'static str = SERVICE_NAME;
}

impl<B> Service<http::Request<B>> for LighthouseGrpc
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let shared = Arc::clone(&self.shared);
        match request.uri().path() {
            QUORUM_PATH => Box::pin(async move {
                let mut grpc = Grpc::new(EncodedQuorumCodec);
                Ok(grpc.unary(QuorumMethod(shared), request).await)
            }),
            HEARTBEAT_PATH => Box::pin(async move {
                let mut grpc = Grpc::new(ProstCodec::<
                    LighthouseHeartbeatResponse,
                    LighthouseHeartbeatRequest,
                >::default());
                Ok(grpc.unary(HeartbeatMethod(shared), request).await)
            }),
            _ => Box::pin(async { Ok(Status::unimplemented("").into_http()) }),
        }
    }
}

/// `Quorum`: checks the deadline, joins and waits ([`Shared::quorum`]).
struct QuorumMethod(Arc<Shared>);

impl UnaryService<LighthouseQuorumRequest> for QuorumMethod {
    type Response = Bytes;
    type Future = BoxFuture<Response<Bytes>, Status>;

    fn call(&mut self, request: Request<LighthouseQuorumRequest>) -> Self::Future {
        let shared = Arc::clone(&self.0);
        Box::pin(async move {
            let timeout = request_timeout(request.metadata()).map_err(Status::invalid_argument)?;
            let requester = request
                .into_inner()
                .requester
                .ok_or_else(|| Status::invalid_argument("missing requester"))?;
            check_replica_id(&requester.replica_id)
                .map_err(|e| Status::invalid_argument(e.to_string()))?;
            let span = debug_span!(
                "quorum",
                lighthouse = %shared.local_addr,
                replica_id = %requester.replica_id,
            );
            async {
                debug!(
                    step = requester.step,
                    timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                    "Received quorum request for replica {}",
                    requester.replica_id
                );
                shared.quorum(requester).await.map(Response::new)
            }
            .instrument(span)
            .await
        })
    }
}

/// `Heartbeat`: records it.
struct HeartbeatMethod(Arc<Shared>);

impl UnaryService<LighthouseHeartbeatRequest> for HeartbeatMethod {
    type Response = LighthouseHeartbeatResponse;
    type Future = std::future::Ready<Result<Response<LighthouseHeartbeatResponse>, Status>>;

    fn call(&mut self, request: Request<LighthouseHeartbeatRequest>) -> Self::Future {
        let replica_id = request.into_inner().replica_id;
        if let Err(e) = check_replica_id(&replica_id) {
            return std::future::ready(Err(Status::invalid_argument(e.to_string())));
        }
        tracing::trace!(lighthouse = %self.0.local_addr, %replica_id, "heartbeat");
        self.0.lock().heartbeat(Instant::now(), replica_id);
        self.0.touch();
        std::future::ready(Ok(Response::new(LighthouseHeartbeatResponse {})))
    }
}

/// The codec of `Quorum`: requests decoded by prost, responses written as
/// the bytes [`Delivered`] encoded once.
struct EncodedQuorumCodec;

/// prost's decoder of quorum requests.
type QuorumRequestDecoder =
    <ProstCodec<LighthouseQuorumResponse, LighthouseQuorumRequest> as Codec>::Decoder;

impl Codec for EncodedQuorumCodec {
    type Encode = Bytes;
    type Decode = LighthouseQuorumRequest;
    type Encoder = EncodedEncoder;
    type Decoder = QuorumRequestDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        EncodedEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<LighthouseQuorumResponse, LighthouseQuorumRequest>::default().decoder()
    }
}

/// Writes an encoded message as it is.
struct EncodedEncoder;

impl Encoder for EncodedEncoder {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

/// Why the dashboard's kill did not reach a manager.
#[derive(Debug, thiserror::Error)]
enum KillError {
    #[error("replica not found in the previous quorum or among the participants")]
    UnknownReplica,
    #[error("invalid manager address {address:?}")]
    InvalidAddress {
        address: String,
        #[source]
        source: EndpointError,
    },
    #[error("cannot connect to manager at {address}")]
    Connect {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("manager at {address} answered Kill with {}: {}", .status.code(), .status.message())]
    Rpc {
        address: String,
        status: Box<Status>,
    },
    #[error("manager at {address} did not answer Kill within {timeout:?}")]
    Timeout { address: String, timeout: Duration },
}

/// Calls `torchft.ManagerService/Kill` on the manager at `address`, over
/// TLS trusting `tls` when given.
async fn kill_manager(address: &str, tls: Option<&ClientTls>) -> Result<(), KillError> {
    let (endpoint, _) =
        client_endpoint(address, tls).map_err(|source| KillError::InvalidAddress {
            address: address.to_owned(),
            source,
        })?;
    let endpoint = endpoint.connect_timeout(KILL_TIMEOUT).timeout(KILL_TIMEOUT);
    let call = async {
        let channel = endpoint
            .connect()
            .await
            .map_err(|source| KillError::Connect {
                address: address.to_owned(),
                source,
            })?;
        let mut request = Request::new(KillRequest {
            msg: KILL_MESSAGE.to_owned(),
        });
        request.set_timeout(KILL_TIMEOUT);
        ManagerServiceClient::new(channel)
            .kill(request)
            .await
            .map_err(|status| KillError::Rpc {
                address: address.to_owned(),
                status: Box::new(status),
            })?;
        Ok(())
    };
    // Connecting and calling each have their own timeout; bound the sum too.
    tokio::time::timeout(KILL_TIMEOUT * 2, call)
        .await
        .unwrap_or_else(|_| {
            Err(KillError::Timeout {
                address: address.to_owned(),
                timeout: KILL_TIMEOUT * 2,
            })
        })
}

/// The dashboard's HTTP routes (gRPC goes to the tonic service beside them),
/// each answering only requests for one of `hosts` ([`check_host`]).
fn dashboard_router(shared: Arc<Shared>, hosts: DashboardHosts) -> axum::Router {
    let page = Arc::clone(&shared);
    let status = Arc::clone(&shared);
    let kill = shared;
    axum::Router::new()
        .route(
            "/",
            get(move |uri: Uri| {
                let shared = Arc::clone(&page);
                async move {
                    let page = query_param(&uri, "page")
                        .and_then(|p| p.parse().ok())
                        .unwrap_or(0);
                    (
                        [(header::CACHE_CONTROL, "no-store")],
                        Html(render_page(
                            &shared.status(),
                            shared.local_addr,
                            &shared.kill_token,
                            page,
                        )),
                    )
                }
            }),
        )
        .route(
            "/status",
            get(move || {
                let shared = Arc::clone(&status);
                async move { json_response(StatusCode::OK, &shared.status()) }
            }),
        )
        .route(
            "/replica/{replica_id}/kill",
            post(
                move |Path(replica_id): Path<String>, headers: HeaderMap, uri: Uri| {
                    let shared = Arc::clone(&kill);
                    let span = info_span!(
                        "kill",
                        lighthouse = %shared.local_addr,
                        replica_id = %replica_id,
                    );
                    async move {
                        if let Err(why) = kill_allowed(&headers, &uri, &shared.kill_token) {
                            warn!("Refused a kill from the dashboard: {why}");
                            let outcome = KillOutcome {
                                replica_id,
                                address: None,
                                ok: false,
                                error: Some(why),
                                at_unix_ms: unix_ms_now(),
                            };
                            return json_response(StatusCode::FORBIDDEN, &outcome);
                        }
                        let (code, outcome) = shared.kill(replica_id).await;
                        json_response(code, &outcome)
                    }
                    .instrument(span)
                },
            ),
        )
        // Only these routes: the gRPC service, added after, is not checked.
        .route_layer(axum::middleware::from_fn(
            move |request: HttpRequest, next: Next| {
                let refused = check_host(&hosts, &request);
                async move {
                    match refused {
                        None => next.run(request).await,
                        Some(response) => response,
                    }
                }
            },
        ))
}

/// `None` when `request` is for one of `hosts`, else the refusal to send:
/// 421 Misdirected Request, naming the host, in plain text. This is what
/// keeps a page of another site, its name rebound to the lighthouse's
/// address (DNS rebinding), from reading the page and its kill token.
fn check_host(hosts: &DashboardHosts, request: &HttpRequest) -> Option<axum::response::Response> {
    let mut values = request.headers().get_all(header::HOST).iter();
    let host = values
        .next()
        .map(|value| String::from_utf8_lossy(value.as_bytes()));
    let checked = if values.next().is_some() {
        Err(HostRefused::Several)
    } else {
        hosts.check(
            host.as_deref(),
            request.uri().authority().map(|a| a.as_str()),
        )
    };
    let refused = checked.err()?;
    warn!(
        method = %request.method(),
        path = request.uri().path(),
        "Refused a dashboard request: {refused}"
    );
    Some(
        (
            StatusCode::MISDIRECTED_REQUEST,
            [
                (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
                (header::CACHE_CONTROL, "no-store"),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            ],
            format!("lighthouse dashboard: {refused}\n"),
        )
            .into_response(),
    )
}

/// The machine's host name, which the dashboard answers to; `None` where
/// it cannot be read (not Linux).
fn machine_hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
}

/// Now, in milliseconds since the Unix epoch.
fn unix_ms_now() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A fresh random token for the dashboard's kill: 128 bits from two
/// `RandomState`s (SipHash keyed from the operating system's randomness).
fn random_token() -> String {
    use std::hash::{BuildHasher, Hasher};
    let half = |salt: u64| {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(salt);
        hasher.finish()
    };
    format!("{:016x}{:016x}", half(1), half(2))
}

/// The value of `name` in `uri`'s query (no percent-decoding: the values
/// the dashboard uses are plain).
fn query_param<'u>(uri: &'u Uri, name: &str) -> Option<&'u str> {
    uri.query()?
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

/// Whether a kill request comes from the dashboard itself: it carries the
/// server's token (`?token=`, embedded in the page, which another origin
/// cannot read; a rebound name cannot either, as [`check_host`] refuses
/// it before this runs), and a browser's `Origin` (when sent) names the
/// host the request was sent to and `Sec-Fetch-Site` (when sent) is not
/// `cross-site`. The reason for a refusal otherwise.
fn kill_allowed(headers: &HeaderMap, uri: &Uri, token: &str) -> Result<(), String> {
    let header = |name: header::HeaderName| {
        headers
            .get(name)
            .map(|v| v.to_str().unwrap_or("(not text)"))
    };
    if header(header::HeaderName::from_static("sec-fetch-site")) == Some("cross-site") {
        return Err("a cross-site request may not kill".to_owned());
    }
    if let Some(origin) = header(header::ORIGIN) {
        let host = header(header::HOST).unwrap_or("");
        let same = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .is_some_and(|o| !host.is_empty() && o == host);
        if !same {
            return Err(format!(
                "a request from origin {:?} may not kill (the dashboard is at host {:?})",
                origin.chars().take(200).collect::<String>(),
                host.chars().take(200).collect::<String>()
            ));
        }
    }
    if !token_matches(query_param(uri, "token"), token) {
        return Err("the kill needs the dashboard's token: reload the dashboard".to_owned());
    }
    Ok(())
}

/// Whether `given` is the kill token, compared in constant time (the time
/// taken tells nothing about how much of it was right).
fn token_matches(given: Option<&str>, token: &str) -> bool {
    use subtle::ConstantTimeEq;
    // Different lengths compare unequal at once: the length is no secret.
    given.is_some_and(|given| bool::from(given.as_bytes().ct_eq(token.as_bytes())))
}

/// `value` as a JSON response with `code`.
fn json_response(code: StatusCode, value: &impl serde::Serialize) -> axum::response::Response {
    match serde_json::to_string(value) {
        Ok(body) => (
            code,
            [
                (header::CONTENT_TYPE, "application/json"),
                (header::CACHE_CONTROL, "no-store"),
            ],
            body,
        )
            .into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode the answer: {error}"),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    fn member(id: &str) -> QuorumMember {
        QuorumMember {
            replica_id: id.to_owned(),
            address: format!("http://{id}:1"),
            store_address: format!("{id}:2"),
            step: 7,
            world_size: 2,
            data: "d".to_owned(),
            commit_failures: 1,
            ..Default::default()
        }
    }

    #[test]
    fn delivered_response_is_the_generated_encoding() {
        let quorum = Quorum {
            quorum_id: 3,
            participants: vec![member("a"), member("b"), member("c")],
            created: Some(SystemTime::UNIX_EPOCH.into()),
        };
        let delivered = Delivered::new(Arc::new(quorum.clone()));
        let expected = LighthouseQuorumResponse {
            quorum: Some(quorum.clone()),
        }
        .encode_to_vec();
        assert_eq!(delivered.response.as_ref(), expected.as_slice());
        let decoded = LighthouseQuorumResponse::decode(delivered.response.clone()).unwrap();
        assert_eq!(decoded.quorum, Some(quorum));

        assert!(delivered.includes("a") && delivered.includes("b") && delivered.includes("c"));
        assert!(!delivered.includes("") && !delivered.includes("bb") && !delivered.includes("d"));
    }

    #[test]
    fn token_comparison() {
        let token = random_token();
        assert_eq!(token.len(), 32);
        assert!(token_matches(Some(&token), &token));
        assert!(!token_matches(None, &token));
        assert!(!token_matches(Some(""), &token));
        assert!(!token_matches(Some(&token[..31]), &token));
        assert!(!token_matches(Some(&format!("{token}0")), &token));
        let mut wrong = token.clone().into_bytes();
        wrong[31] = if wrong[31] == b'0' { b'1' } else { b'0' };
        assert!(!token_matches(
            Some(std::str::from_utf8(&wrong).unwrap()),
            &token
        ));
    }
}
