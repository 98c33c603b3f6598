//! The manager as a server: `torchft.ManagerService` over gRPC (tonic), one
//! per replica group.
//!
//! A thin shell around the sans-IO rules: [`QuorumGather`] collects the
//! ranks' quorum requests; when the last of the `world_size` ranks has
//! asked, a task sends the group's one request to the lighthouse (retrying
//! with back-off, reconnecting each time) and hands the outcome to every
//! rank of the round, each of which answers with its own
//! [`compute_quorum_results`]. [`ShouldCommitVotes`] runs the per-step
//! commit vote; the consecutive failed commits ride on the next lighthouse
//! request. A background task heartbeats to the lighthouse.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::net::{TcpListener, ToSocketAddrs};

use crate::access::{client_endpoint, tls_failure, Access, ClientTls, EndpointError};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Response, Status};
use tracing::{debug, error, info, info_span, warn, Instrument};

use super::{compute_quorum_results, ManagerInfo, QuorumGather, ShouldCommitVotes};
use crate::grpc::{error_chain, finish_serving, request_timeout};
use crate::proto::lighthouse_service_client::LighthouseServiceClient;
use crate::proto::manager_service_server::{ManagerService, ManagerServiceServer};
use crate::proto::{
    CheckpointMetadataRequest, CheckpointMetadataResponse, KillRequest, KillResponse,
    LighthouseHeartbeatRequest, LighthouseQuorumRequest, ManagerQuorumRequest,
    ManagerQuorumResponse, Quorum, ShouldCommitRequest, ShouldCommitResponse,
};
use crate::FtError;

/// The shortest pause between two lighthouse quorum attempts (torchft:
/// 100 ms).
const MIN_RETRY_BACKOFF: Duration = Duration::from_millis(100);

/// Metadata key of a manager's error answers saying what failed, for
/// [`ManagerClient`](super::ManagerClient) to type the error.
pub(crate) const ERROR_KIND_KEY: &str = "ferry-ft-error";
/// [`ERROR_KIND_KEY`]'s value when the lighthouse could not be reached.
pub(crate) const LIGHTHOUSE_UNREACHABLE: &str = "lighthouse-unreachable";
/// Metadata key carrying how many retries were made.
pub(crate) const RETRIES_KEY: &str = "ferry-ft-retries";

/// What the manager does on `Kill`: called with the request's message.
/// torchft's manager exits the process; see [`exit_on_kill`].
pub type KillHook = Arc<dyn Fn(String) + Send + Sync>;

/// The default [`KillHook`], torchft's behaviour: logs the message and
/// exits the process with status 1.
pub fn exit_on_kill() -> KillHook {
    Arc::new(|msg: String| {
        // The message is the requester's: escaped and bounded.
        error!(
            "got kill request: {}; exiting",
            ferry_wire::PeerText::new(&msg)
        );
        std::process::exit(1)
    })
}

/// A manager's knobs, as torchft's `Manager::new` takes them.
///
/// ```
/// use std::time::Duration;
/// use ferry_ft::manager::ManagerOptions;
///
/// let options = ManagerOptions {
///     quorum_retries: 3,
///     ..ManagerOptions::new("replica_a", "http://lighthouse:29510", "replica_a:29500", 8)
/// }
/// .with_heartbeat_interval(Duration::from_millis(200));
/// assert_eq!(options.world_size, 8);
/// ```
#[derive(Clone)]
pub struct ManagerOptions {
    /// The replica group's id (torchft: `{name}:{uuid}` or a uuid).
    pub replica_id: String,
    /// The lighthouse's address (`http://host:port`, or `host:port`).
    pub lighthouse_addr: String,
    /// The host name the manager advertises in its address (torchft's
    /// `hostname`). Without one: the bound IP, or, bound to an unspecified
    /// address (`0.0.0.0`, `[::]`), the machine's host name.
    pub hostname: Option<String>,
    /// The replica group's store address, handed to the lighthouse.
    pub store_address: String,
    /// Ranks in the replica group: a quorum round starts when this many have
    /// asked.
    pub world_size: u64,
    /// How often to heartbeat to the lighthouse (torchft: 100 ms). Zero is
    /// taken as 1 ms.
    pub heartbeat_interval: Duration,
    /// How long connecting to the lighthouse may take (torchft's Python
    /// `Manager`: 60 s). Also bounds each heartbeat.
    pub connect_timeout: Duration,
    /// How many times a failed lighthouse quorum request is retried before
    /// the ranks are told it failed (torchft: 0).
    pub quorum_retries: u32,
    /// Opaque data sent to the lighthouse with the group (`QuorumMember.data`;
    /// JSON in torchft, empty by default).
    pub data: String,
    /// What `Kill` does; [`exit_on_kill`] by default.
    pub on_kill: KillHook,
    /// Who may connect to this manager: TLS and the allowed client
    /// networks (default: plain text, every client, as torchft).
    pub access: Access,
    /// How to reach a lighthouse serving over TLS: the CA certificate to
    /// trust and the name its certificate carries ([`ClientTls`]; the
    /// address is then `https://host:port` or `host:port`). `None`: plain
    /// text, torchft's default.
    pub lighthouse_tls: Option<ClientTls>,
}

impl fmt::Debug for ManagerOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManagerOptions")
            .field("replica_id", &self.replica_id)
            .field("lighthouse_addr", &self.lighthouse_addr)
            .field("hostname", &self.hostname)
            .field("store_address", &self.store_address)
            .field("world_size", &self.world_size)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("connect_timeout", &self.connect_timeout)
            .field("quorum_retries", &self.quorum_retries)
            .field("data", &self.data)
            .finish_non_exhaustive()
    }
}

impl ManagerOptions {
    /// torchft's defaults for the rest: heartbeat every 100 ms, connect
    /// timeout 60 s, no quorum retries, no data, the hostname from the bound
    /// address, and exit on `Kill`.
    pub fn new(
        replica_id: impl Into<String>,
        lighthouse_addr: impl Into<String>,
        store_address: impl Into<String>,
        world_size: u64,
    ) -> Self {
        Self {
            replica_id: replica_id.into(),
            lighthouse_addr: lighthouse_addr.into(),
            hostname: None,
            store_address: store_address.into(),
            world_size,
            heartbeat_interval: Duration::from_millis(100),
            connect_timeout: Duration::from_secs(60),
            quorum_retries: 0,
            data: String::new(),
            on_kill: exit_on_kill(),
            access: Access::default(),
            lighthouse_tls: None,
        }
    }

    /// Sets [`access`](Self::access).
    pub fn with_access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    /// Sets [`lighthouse_tls`](Self::lighthouse_tls).
    pub fn with_lighthouse_tls(mut self, tls: ClientTls) -> Self {
        self.lighthouse_tls = Some(tls);
        self
    }

    /// Sets [`hostname`](Self::hostname).
    pub fn with_hostname(mut self, hostname: impl Into<String>) -> Self {
        self.hostname = Some(hostname.into());
        self
    }

    /// Sets [`heartbeat_interval`](Self::heartbeat_interval).
    pub fn with_heartbeat_interval(mut self, heartbeat_interval: Duration) -> Self {
        self.heartbeat_interval = heartbeat_interval;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout).
    pub fn with_connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self
    }

    /// Sets [`quorum_retries`](Self::quorum_retries).
    pub fn with_quorum_retries(mut self, quorum_retries: u32) -> Self {
        self.quorum_retries = quorum_retries;
        self
    }

    /// Sets [`data`](Self::data).
    pub fn with_data(mut self, data: impl Into<String>) -> Self {
        self.data = data.into();
        self
    }

    /// Sets [`on_kill`](Self::on_kill).
    pub fn with_on_kill(mut self, on_kill: impl Fn(String) + Send + Sync + 'static) -> Self {
        self.on_kill = Arc::new(on_kill);
        self
    }
}

/// Why the manager server could not start or stopped badly.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// The options cannot work (a zero world size).
    #[error("manager {replica_id}: invalid options: {reason}")]
    InvalidOptions {
        /// The replica group.
        replica_id: String,
        /// What is wrong.
        reason: String,
    },
    /// The lighthouse address is not a valid URI, or does not fit
    /// [`lighthouse_tls`](ManagerOptions::lighthouse_tls).
    #[error("manager {replica_id}: invalid lighthouse address {address:?}: {source}")]
    InvalidLighthouseAddress {
        /// The replica group.
        replica_id: String,
        /// The address given.
        address: String,
        /// Why it was refused.
        source: EndpointError,
    },
    /// The listening socket could not be bound.
    #[error("manager {replica_id}: cannot bind {addr}: {source}")]
    Bind {
        /// The replica group.
        replica_id: String,
        /// The address asked for.
        addr: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("manager: server failed: {0}")]
    Serve(#[source] tonic::transport::Error),
    /// The server task panicked or was cancelled.
    #[error("manager: server task ended abnormally: {0}")]
    Task(#[source] tokio::task::JoinError),
}

/// What a manager has done so far, for logs and tests
/// ([`Manager::status`], [`Manager::wait_for_status`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ManagerStatus {
    /// The group ranks that have asked in the open quorum round, ascending.
    pub waiting_ranks: Vec<i64>,
    /// Quorum rounds started (every rank asked).
    pub rounds: u64,
    /// Quorum rounds answered with a quorum.
    pub quorums: u64,
    /// Quorum rounds answered with an error (the lighthouse unreachable
    /// after every retry).
    pub failed_rounds: u64,
    /// The id of the last quorum received from the lighthouse.
    pub quorum_id: Option<i64>,
    /// Lighthouse quorum requests sent, retries included.
    pub lighthouse_attempts: u64,
    /// Lighthouse quorum requests that failed.
    pub lighthouse_failures: u64,
    /// Why the last one failed.
    pub last_lighthouse_error: Option<String>,
    /// The group ranks that have voted in the open should-commit round,
    /// ascending.
    pub voted_ranks: Vec<i64>,
    /// Should-commit rounds decided.
    pub commit_decisions: u64,
    /// Consecutive should-commit rounds decided false, reset by a true one;
    /// sent with the next quorum request.
    pub commit_failures: i64,
    /// Heartbeats the lighthouse acknowledged.
    pub heartbeats: u64,
    /// Heartbeats that failed.
    pub heartbeat_failures: u64,
    /// `Kill` requests received.
    pub kills: u64,
}

/// A running manager: `torchft.ManagerService` (`Quorum`,
/// `CheckpointMetadata`, `ShouldCommit`, `Kill`) for the ranks of one
/// replica group, and a heartbeat to the lighthouse.
///
/// [`bind`](Self::bind) binds and returns at once (bind port 0 and read
/// [`local_addr`](Self::local_addr)); the lighthouse need not be up yet.
/// The server runs on the current tokio runtime until
/// [`shutdown`](Self::shutdown) or drop. Quorum requests must carry a gRPC
/// deadline, as torchft requires; it also bounds each lighthouse request.
///
/// ```no_run
/// use ferry_ft::manager::{Manager, ManagerOptions};
///
/// # async fn run() -> Result<(), ferry_ft::manager::ManagerError> {
/// let options = ManagerOptions::new("replica_a", "http://lighthouse:29510", "replica_a:29500", 8);
/// let manager = Manager::bind("[::]:0", options).await?;
/// println!("ranks connect to {}", manager.address());
/// // ... the group's ranks ask it for quorums (ManagerClient) ...
/// manager.shutdown().await?;
/// # Ok(()) }
/// ```
pub struct Manager {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    serve: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
    heartbeat: Option<JoinHandle<()>>,
}

impl fmt::Debug for Manager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Manager")
            .field("local_addr", &self.local_addr)
            .field("address", &self.shared.info.address)
            .field("options", &self.shared.opt)
            .finish_non_exhaustive()
    }
}

impl Manager {
    /// Binds `addr` (e.g. `"[::]:0"` or `"127.0.0.1:0"`) and starts serving
    /// and heartbeating on the current tokio runtime. Returns once the
    /// socket is bound; the lighthouse is first contacted by the heartbeat.
    pub async fn bind(
        addr: impl ToSocketAddrs + fmt::Display,
        options: ManagerOptions,
    ) -> Result<Self, ManagerError> {
        let replica_id = options.replica_id.clone();
        if options.world_size == 0 {
            return Err(ManagerError::InvalidOptions {
                replica_id,
                reason: "world_size must be at least 1".to_owned(),
            });
        }
        let (lighthouse, _) =
            client_endpoint(&options.lighthouse_addr, options.lighthouse_tls.as_ref()).map_err(
                |source| ManagerError::InvalidLighthouseAddress {
                    replica_id: replica_id.clone(),
                    address: options.lighthouse_addr.clone(),
                    source,
                },
            )?;
        let lighthouse = lighthouse
            .connect_timeout(options.connect_timeout)
            .tcp_nodelay(true);
        let bind_error = |source| ManagerError::Bind {
            replica_id: replica_id.clone(),
            addr: addr.to_string(),
            source,
        };
        let listener = TcpListener::bind(&addr).await.map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let mut server = options
            .access
            .server()
            .map_err(|e| ManagerError::InvalidOptions {
                replica_id: replica_id.clone(),
                reason: e.to_string(),
            })?;
        let incoming = options.access.incoming(listener, "manager");
        let address = advertised_address(
            options.hostname.as_deref(),
            local_addr,
            options.access.tls.is_some(),
        );

        let (shutdown, shutdown_rx) = watch::channel(false);
        let info = ManagerInfo {
            replica_id: replica_id.clone(),
            address,
            store_address: options.store_address.clone(),
            world_size: options.world_size,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                gather: QuorumGather::new(info.clone()),
                quorum_round: watch::channel(None).0,
                round_task: None,
                votes: ShouldCommitVotes::new(options.world_size),
                commit_round: watch::channel(None).0,
                commit_failures: 0,
            }),
            info,
            opt: options,
            lighthouse,
            lighthouse_client: Mutex::new(None),
            status: watch::channel(ManagerStatus::default()).0,
            shutdown: shutdown_rx.clone(),
        });

        let span = info_span!("manager", replica_id = %replica_id, addr = %local_addr);
        let heartbeat = tokio::spawn(
            run_heartbeats(Arc::clone(&shared), shutdown_rx.clone()).instrument(span.clone()),
        );
        let mut stop = shutdown_rx;
        let signal = async move {
            // Either `true` was sent or the `Manager` is gone: stop.
            let _ = stop.wait_for(|stop| *stop).await;
        };
        let serve = tokio::spawn(
            server
                .add_service(ManagerServiceServer::new(GrpcService {
                    shared: Arc::clone(&shared),
                }))
                .serve_with_incoming_shutdown(incoming, signal)
                .instrument(span),
        );
        info!(
            replica_id = %replica_id,
            lighthouse = %shared.opt.lighthouse_addr,
            world_size = shared.opt.world_size,
            "Manager listening on {}",
            shared.info.address
        );

        Ok(Self {
            local_addr,
            shared,
            shutdown,
            serve: Some(serve),
            heartbeat: Some(heartbeat),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The address the manager advertises to the lighthouse
    /// (`http://host:port`): where its ranks and healing replicas reach it.
    pub fn address(&self) -> &str {
        &self.shared.info.address
    }

    /// The replica group's id.
    pub fn replica_id(&self) -> &str {
        &self.shared.info.replica_id
    }

    /// The options it runs with.
    pub fn options(&self) -> &ManagerOptions {
        &self.shared.opt
    }

    /// What it has done so far.
    pub fn status(&self) -> ManagerStatus {
        self.shared.status.borrow().clone()
    }

    /// Waits until `done` holds for the [status](Self::status), re-checking
    /// it on every change (a rank asking, a lighthouse attempt, a quorum, a
    /// vote, a heartbeat, a kill). Returns the status that satisfied it.
    /// Bound it with a timeout where it might never hold.
    pub async fn wait_for_status(
        &self,
        mut done: impl FnMut(&ManagerStatus) -> bool,
    ) -> ManagerStatus {
        let mut status = self.shared.status.subscribe();
        let found = status
            .wait_for(|status| done(status))
            .await
            .map(|s| s.clone());
        match found {
            Ok(status) => status,
            // Unreachable while `self` holds the sender; never spin.
            Err(_) => std::future::pending().await,
        }
    }

    /// Stops the manager: waiting ranks are told `UNAVAILABLE`, the
    /// heartbeat stops, the listener closes (the port can be bound again
    /// once this returns), open connections get up to 5 s to finish before
    /// they are cut.
    pub async fn shutdown(mut self) -> Result<(), ManagerError> {
        info!(replica_id = %self.shared.info.replica_id, "Manager shutting down");
        self.shutdown.send_replace(true);
        if let Some(heartbeat) = self.heartbeat.take() {
            heartbeat.abort();
        }
        let Some(serve) = self.serve.take() else {
            return Ok(());
        };
        finish_serving(serve, &self.shared.info.replica_id)
            .await
            .map_err(ManagerError::Task)?
            .map_err(ManagerError::Serve)
    }
}

impl Drop for Manager {
    /// Stops the manager as [`shutdown`](Manager::shutdown) does, without
    /// waiting: open connections finish in the background.
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
        if let Some(heartbeat) = self.heartbeat.take() {
            heartbeat.abort();
        }
    }
}

/// `http://host:port` for the manager bound at `local_addr`.
fn advertised_address(hostname: Option<&str>, local_addr: SocketAddr, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    let port = local_addr.port();
    let host = match hostname {
        Some(host) => host.to_owned(),
        None if local_addr.ip().is_unspecified() => machine_hostname(),
        None => return format!("{scheme}://{}", SocketAddr::new(local_addr.ip(), port)),
    };
    match host.parse::<IpAddr>() {
        Ok(ip) => format!("{scheme}://{}", SocketAddr::new(ip, port)),
        Err(_) => format!("{scheme}://{host}:{port}"),
    }
}

/// The machine's host name (what torchft advertises), `localhost` where it
/// cannot be read.
fn machine_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// The outcome of one quorum round, for every rank of it.
#[derive(Clone)]
enum RoundOutcome {
    Quorum {
        quorum: Arc<Quorum>,
        init_sync: bool,
    },
    Failed(Arc<LighthouseFailure>),
}

/// The lighthouse could not be asked, after every retry.
#[derive(Debug)]
struct LighthouseFailure {
    lighthouse: String,
    retries: u32,
    error: String,
}

impl LighthouseFailure {
    fn to_status(&self) -> Status {
        let mut metadata = MetadataMap::new();
        metadata.insert(
            ERROR_KIND_KEY,
            MetadataValue::from_static(LIGHTHOUSE_UNREACHABLE),
        );
        metadata.insert(RETRIES_KEY, MetadataValue::from(self.retries));
        Status::with_metadata(
            Code::Unavailable,
            format!(
                "lighthouse quorum failed after {} retries (lighthouse {}): {}",
                self.retries, self.lighthouse, self.error
            ),
            metadata,
        )
    }
}

/// Why one lighthouse request failed.
#[derive(Debug, thiserror::Error)]
enum AttemptError {
    #[error("cannot connect to the lighthouse within {0:?}")]
    ConnectTimeout(Duration),
    #[error("cannot connect to the lighthouse: {0}")]
    Connect(String),
    #[error("TLS with the lighthouse failed: {0}")]
    Tls(String),
    #[error("no answer from the lighthouse within {0:?}")]
    Timeout(Duration),
    #[error("lighthouse answered {}: {}", .0.code(), .0.message())]
    Rpc(Box<Status>),
    #[error("lighthouse answered without a quorum")]
    MissingQuorum,
}

impl AttemptError {
    /// A deadline passed (torchft retries those after 100 ms).
    fn is_timeout(&self) -> bool {
        match self {
            Self::Timeout(_) => true,
            Self::Rpc(status) => {
                status.code() == Code::DeadlineExceeded
                    || (status.code() == Code::Cancelled && status.message() == "Timeout expired")
            }
            _ => false,
        }
    }
}

/// The pause after a failed lighthouse request (torchft's): 100 ms after a
/// timeout, else the deadline spread over the attempts, at least 100 ms.
fn retry_backoff(error: &AttemptError, timeout: Duration, retries: u32) -> Duration {
    if error.is_timeout() {
        return MIN_RETRY_BACKOFF;
    }
    (timeout / retries.saturating_add(1)).max(MIN_RETRY_BACKOFF)
}

/// The manager's mutable state, behind one lock (never held across an
/// await).
struct State {
    gather: QuorumGather,
    /// The open quorum round; replaced when it starts.
    quorum_round: watch::Sender<Option<RoundOutcome>>,
    /// The task asking the lighthouse for the last round started.
    round_task: Option<tokio::task::AbortHandle>,
    votes: ShouldCommitVotes,
    /// The open should-commit round; replaced when it is decided.
    commit_round: watch::Sender<Option<bool>>,
    /// Consecutive failed commits (torchft's Python `Manager` counts them).
    commit_failures: i64,
}

/// What the gRPC service, the round tasks and the heartbeat share.
struct Shared {
    info: ManagerInfo,
    opt: ManagerOptions,
    lighthouse: Endpoint,
    /// The lighthouse connection, dropped after every failure so the next
    /// request reconnects.
    lighthouse_client: Mutex<Option<LighthouseServiceClient<Channel>>>,
    state: Mutex<State>,
    status: watch::Sender<ManagerStatus>,
    shutdown: watch::Receiver<bool>,
}

/// `mutex`'s guard; what it guards stays consistent across a panic
/// elsewhere, so keep going.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The value of `round` once it has one; `None` when the round was dropped
/// undecided.
async fn round_value<T: Clone>(round: &mut watch::Receiver<Option<T>>) -> Option<T> {
    let decided = round.wait_for(Option::is_some).await.map(|v| v.clone());
    decided.ok().flatten()
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Waits for the round's outcome, or shutdown.
    async fn wait_round<T: Clone>(
        &self,
        round: &mut watch::Receiver<Option<T>>,
        what: &str,
    ) -> Result<T, Status> {
        let mut shutdown = self.shutdown.clone();
        tokio::select! {
            value = round_value(round) => value.ok_or_else(|| {
                Status::aborted(format!("{what} round abandoned; ask again"))
            }),
            _ = shutdown.wait_for(|stop| *stop) => {
                Err(Status::unavailable("manager is shutting down"))
            }
        }
    }

    /// Rank `req.group_rank` asks for the next quorum.
    async fn quorum(
        self: &Arc<Self>,
        req: ManagerQuorumRequest,
        timeout: Duration,
    ) -> Result<ManagerQuorumResponse, Status> {
        let group_rank = req.group_rank;
        info!(
            step = req.step,
            timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            "Start quorum for group_rank {group_rank}"
        );
        let mut round = {
            let mut state = self.state();
            let gathered = state
                .gather
                .join(&req)
                .map_err(|error| Status::invalid_argument(error.to_string()))?;
            let round = state.quorum_round.subscribe();
            let started = gathered.is_some();
            if let Some(gathered) = gathered {
                let sender = std::mem::replace(&mut state.quorum_round, watch::channel(None).0);
                if let Some(step) = state.votes.step() {
                    // Every rank moved on to the next quorum: the open vote
                    // can no longer complete. Its waiters are told so.
                    warn!(step, "dropping the unfinished should_commit round");
                    state.votes.reset();
                    state.commit_round = watch::channel(None).0;
                }
                let mut request = gathered.request;
                if let Some(member) = request.requester.as_mut() {
                    member.data.clone_from(&self.opt.data);
                    member.commit_failures = member.commit_failures.max(state.commit_failures);
                }
                let span = info_span!(
                    "quorum_round",
                    replica_id = %self.info.replica_id,
                    step = request.requester.as_ref().map_or(0, |m| m.step),
                );
                let shared = Arc::clone(self);
                let task = tokio::spawn(
                    async move {
                        shared
                            .run_round(request, gathered.init_sync, timeout, sender)
                            .await;
                    }
                    .instrument(span),
                );
                // Every rank has left the previous round (each asks again
                // only once its last request ended): if it is still asking
                // the lighthouse (retrying past the ranks' deadlines), it
                // can serve nobody.
                if let Some(previous) = state.round_task.replace(task.abort_handle()) {
                    previous.abort();
                }
            }
            let waiting: Vec<i64> = state.gather.waiting().collect();
            let voted: Vec<i64> = state.votes.voted().collect();
            self.status.send_modify(|status| {
                status.waiting_ranks = waiting;
                status.voted_ranks = voted;
                status.rounds += u64::from(started);
            });
            round
        };

        match self.wait_round(&mut round, "quorum").await? {
            RoundOutcome::Quorum { quorum, init_sync } => {
                let reply =
                    compute_quorum_results(&self.info.replica_id, group_rank, &quorum, init_sync)
                        .map_err(|error| match error {
                        FtError::NotInQuorum { .. } => Status::not_found(error.to_string()),
                        other => Status::invalid_argument(other.to_string()),
                    })?;
                info!(
                    quorum_id = reply.quorum_id,
                    heal = reply.heal,
                    "Finished quorum for group_rank {group_rank}"
                );
                Ok(reply)
            }
            RoundOutcome::Failed(failure) => Err(failure.to_status()),
        }
    }

    /// Asks the lighthouse for the round's quorum and hands the outcome to
    /// the round's ranks. On shutdown the round is dropped undecided (the
    /// ranks see the shutdown themselves).
    async fn run_round(
        &self,
        request: LighthouseQuorumRequest,
        init_sync: bool,
        timeout: Duration,
        round: watch::Sender<Option<RoundOutcome>>,
    ) {
        info!("All workers joined - starting quorum");
        let mut shutdown = self.shutdown.clone();
        let outcome = tokio::select! {
            result = self.lighthouse_quorum(&request, timeout) => result,
            _ = shutdown.wait_for(|stop| *stop) => return,
        };
        let outcome = match outcome {
            Ok(quorum) => {
                let quorum_id = quorum.quorum_id;
                self.status.send_modify(|status| {
                    status.quorums += 1;
                    status.quorum_id = Some(quorum_id);
                });
                RoundOutcome::Quorum {
                    quorum: Arc::new(quorum),
                    init_sync,
                }
            }
            Err(failure) => {
                error!(
                    retries = failure.retries,
                    "lighthouse quorum failed after {} retries: {}", failure.retries, failure.error
                );
                self.status.send_modify(|status| status.failed_rounds += 1);
                RoundOutcome::Failed(Arc::new(failure))
            }
        };
        round.send_replace(Some(outcome));
    }

    /// The lighthouse quorum request with torchft's retries: after a
    /// failure, pause ([`retry_backoff`]), reconnect and try again, up to
    /// `quorum_retries` times.
    async fn lighthouse_quorum(
        &self,
        request: &LighthouseQuorumRequest,
        timeout: Duration,
    ) -> Result<Quorum, LighthouseFailure> {
        let retries = self.opt.quorum_retries;
        let mut retry = 0;
        loop {
            self.status
                .send_modify(|status| status.lighthouse_attempts += 1);
            let error = match self.lighthouse_quorum_once(request, timeout).await {
                Ok(quorum) => {
                    info!(
                        quorum_id = quorum.quorum_id,
                        participants = quorum.participants.len(),
                        "got lighthouse quorum"
                    );
                    return Ok(quorum);
                }
                Err(error) => error,
            };
            self.forget_lighthouse_client();
            let message = error.to_string();
            warn!(
                attempt = retry + 1,
                of = retries.saturating_add(1),
                "lighthouse quorum failed: {message}"
            );
            self.status.send_modify(|status| {
                status.lighthouse_failures += 1;
                status.last_lighthouse_error = Some(message.clone());
            });
            if retry >= retries {
                return Err(LighthouseFailure {
                    lighthouse: self.opt.lighthouse_addr.clone(),
                    retries,
                    error: message,
                });
            }
            tokio::time::sleep(retry_backoff(&error, timeout, retries)).await;
            retry += 1;
        }
    }

    async fn lighthouse_quorum_once(
        &self,
        request: &LighthouseQuorumRequest,
        timeout: Duration,
    ) -> Result<Quorum, AttemptError> {
        let mut client = self.lighthouse_client().await?;
        let mut call = Request::new(request.clone());
        call.set_timeout(timeout);
        let response = tokio::time::timeout(timeout, client.quorum(call))
            .await
            .map_err(|_| AttemptError::Timeout(timeout))?
            .map_err(|status| AttemptError::Rpc(Box::new(status)))?;
        response
            .into_inner()
            .quorum
            .ok_or(AttemptError::MissingQuorum)
    }

    async fn heartbeat_once(&self) -> Result<(), AttemptError> {
        let mut client = self.lighthouse_client().await?;
        let limit = self.opt.connect_timeout;
        let mut call = Request::new(LighthouseHeartbeatRequest {
            replica_id: self.info.replica_id.clone(),
        });
        call.set_timeout(limit);
        tokio::time::timeout(limit, client.heartbeat(call))
            .await
            .map_err(|_| AttemptError::Timeout(limit))?
            .map_err(|status| AttemptError::Rpc(Box::new(status)))?;
        Ok(())
    }

    /// The cached lighthouse client, or a new connection.
    async fn lighthouse_client(&self) -> Result<LighthouseServiceClient<Channel>, AttemptError> {
        if let Some(client) = lock(&self.lighthouse_client).clone() {
            return Ok(client);
        }
        let limit = self.opt.connect_timeout;
        debug!(lighthouse = %self.opt.lighthouse_addr, "connecting to the lighthouse");
        let channel = tokio::time::timeout(limit, self.lighthouse.connect())
            .await
            .map_err(|_| AttemptError::ConnectTimeout(limit))?
            .map_err(|error| match tls_failure(&error) {
                Some(reason) => AttemptError::Tls(reason),
                None => AttemptError::Connect(error_chain(&error)),
            })?;
        let client = LighthouseServiceClient::new(channel);
        *lock(&self.lighthouse_client) = Some(client.clone());
        Ok(client)
    }

    fn forget_lighthouse_client(&self) {
        lock(&self.lighthouse_client).take();
    }
}

/// Heartbeats to the lighthouse every `heartbeat_interval` until shutdown.
async fn run_heartbeats(shared: Arc<Shared>, mut shutdown: watch::Receiver<bool>) {
    let period = shared.opt.heartbeat_interval.max(Duration::from_millis(1));
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
        let result = tokio::select! {
            result = shared.heartbeat_once() => result,
            _ = shutdown.wait_for(|stop| *stop) => return,
        };
        match result {
            Ok(()) => {
                if failing {
                    info!("heartbeats reach the lighthouse again");
                    failing = false;
                }
                shared.status.send_modify(|status| status.heartbeats += 1);
            }
            Err(error) => {
                shared.forget_lighthouse_client();
                if failing {
                    debug!("Failed to send heartbeat to lighthouse: {error}");
                } else {
                    warn!(
                        lighthouse = %shared.opt.lighthouse_addr,
                        "Failed to send heartbeat to lighthouse: {error}"
                    );
                    failing = true;
                }
                shared
                    .status
                    .send_modify(|status| status.heartbeat_failures += 1);
            }
        }
    }
}

/// `torchft.ManagerService` over the shared state.
struct GrpcService {
    shared: Arc<Shared>,
}

#[tonic::async_trait]
impl ManagerService for GrpcService {
    async fn quorum(
        &self,
        request: Request<ManagerQuorumRequest>,
    ) -> Result<Response<ManagerQuorumResponse>, Status> {
        let timeout = request_timeout(request.metadata()).map_err(Status::invalid_argument)?;
        let req = request.into_inner();
        let span = info_span!(
            "quorum",
            replica_id = %self.shared.info.replica_id,
            group_rank = req.group_rank,
        );
        self.shared
            .quorum(req, timeout)
            .instrument(span)
            .await
            .map(Response::new)
    }

    async fn checkpoint_metadata(
        &self,
        request: Request<CheckpointMetadataRequest>,
    ) -> Result<Response<CheckpointMetadataResponse>, Status> {
        let rank = request.into_inner().rank;
        let state = self.shared.state();
        let checkpoint_metadata = state
            .gather
            .checkpoint_metadata(rank)
            .ok_or_else(|| Status::invalid_argument("rank not found"))?
            .to_owned();
        Ok(Response::new(CheckpointMetadataResponse {
            checkpoint_metadata,
        }))
    }

    async fn should_commit(
        &self,
        request: Request<ShouldCommitRequest>,
    ) -> Result<Response<ShouldCommitResponse>, Status> {
        let req = request.into_inner();
        let span = info_span!(
            "should_commit",
            replica_id = %self.shared.info.replica_id,
            group_rank = req.group_rank,
            step = req.step,
        );
        async {
            info!(
                "should_commit request from {} should_commit={}",
                req.group_rank, req.should_commit
            );
            let mut round = {
                let mut state = self.shared.state();
                let round = state.commit_round.subscribe();
                let decision = state
                    .votes
                    .vote(req.group_rank, req.step, req.should_commit)
                    .map_err(|error| Status::invalid_argument(error.to_string()))?;
                if let Some(decision) = decision {
                    state.commit_failures = if decision {
                        0
                    } else {
                        state.commit_failures.saturating_add(1)
                    };
                    let sender = std::mem::replace(&mut state.commit_round, watch::channel(None).0);
                    sender.send_replace(Some(decision));
                }
                let voted: Vec<i64> = state.votes.voted().collect();
                let commit_failures = state.commit_failures;
                self.shared.status.send_modify(|status| {
                    status.voted_ranks = voted;
                    status.commit_decisions += u64::from(decision.is_some());
                    status.commit_failures = commit_failures;
                });
                round
            };
            let should_commit = self.shared.wait_round(&mut round, "should_commit").await?;
            Ok(Response::new(ShouldCommitResponse { should_commit }))
        }
        .instrument(span)
        .await
    }

    async fn kill(&self, request: Request<KillRequest>) -> Result<Response<KillResponse>, Status> {
        let msg = request.into_inner().msg;
        warn!(
            replica_id = %self.shared.info.replica_id,
            "got kill request: {}",
            ferry_wire::PeerText::new(&msg)
        );
        self.shared.status.send_modify(|status| status.kills += 1);
        (self.shared.opt.on_kill)(msg);
        Ok(Response::new(KillResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_torchfts() {
        let timeout = Duration::from_secs(10);
        let refused = AttemptError::Connect("refused".into());
        assert_eq!(retry_backoff(&refused, timeout, 0), Duration::from_secs(10));
        assert_eq!(retry_backoff(&refused, timeout, 4), Duration::from_secs(2));
        assert_eq!(
            retry_backoff(&refused, Duration::from_millis(300), 9),
            MIN_RETRY_BACKOFF
        );
        assert_eq!(
            retry_backoff(&AttemptError::Timeout(timeout), timeout, 1),
            MIN_RETRY_BACKOFF
        );
        let expired = AttemptError::Rpc(Box::new(Status::cancelled("Timeout expired")));
        assert_eq!(retry_backoff(&expired, timeout, 1), MIN_RETRY_BACKOFF);
    }

    #[test]
    fn advertised_addresses() {
        let v4: SocketAddr = "127.0.0.1:29512".parse().expect("addr");
        let v6: SocketAddr = "[::1]:29512".parse().expect("addr");
        let any: SocketAddr = "0.0.0.0:29512".parse().expect("addr");
        assert_eq!(
            advertised_address(None, v4, false),
            "http://127.0.0.1:29512"
        );
        assert_eq!(advertised_address(None, v6, false), "http://[::1]:29512");
        assert_eq!(
            advertised_address(Some("node7"), any, false),
            "http://node7:29512"
        );
        assert_eq!(
            advertised_address(Some("::1"), any, false),
            "http://[::1]:29512"
        );
        assert_eq!(
            advertised_address(Some("node7"), any, true),
            "https://node7:29512"
        );
        let host = advertised_address(None, any, false);
        assert!(
            host.starts_with("http://") && host.ends_with(":29512") && !host.contains("0.0.0.0"),
            "{host}"
        );
    }

    #[test]
    fn lighthouse_failures_are_tagged() {
        let status = LighthouseFailure {
            lighthouse: "http://lh:1".into(),
            retries: 3,
            error: "refused".into(),
        }
        .to_status();
        assert_eq!(status.code(), Code::Unavailable);
        assert!(
            status.message().contains("after 3 retries") && status.message().contains("refused"),
            "{}",
            status.message()
        );
        assert_eq!(
            status
                .metadata()
                .get(ERROR_KIND_KEY)
                .and_then(|v| v.to_str().ok()),
            Some(LIGHTHOUSE_UNREACHABLE)
        );
        assert_eq!(
            status
                .metadata()
                .get(RETRIES_KEY)
                .and_then(|v| v.to_str().ok()),
            Some("3")
        );
    }
}
