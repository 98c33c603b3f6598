//! The agent: one per worker. It owns the runtime, the listener, the
//! connections to peers, the table of outstanding calls and the registry.
//!
//! Each worker opens its own connection to a peer the first time it calls
//! it (like TensorPipe's client pipes): requests go out on it and their
//! replies come back on it. Connections a worker accepts carry the peer's
//! requests and this worker's replies. Every connection has a reader task
//! and a writer task; the writer drains its queue into one vectored write,
//! so calls in flight share system calls.
//!
//! This file holds the agent's state ([`Inner`]), its start, accessors,
//! task set and shutdown; its jobs live beside it:
//! - `calls.rs`: issuing calls and completing them (reply, timeout,
//!   connection failure), a shell over the pure pending-call table of
//!   [`crate::pending`], and the timer task;
//! - `connections.rs`: connecting (lazily, again after a failure),
//!   accepting, the handshake's checks, a connection's reader and writer,
//!   failing a connection;
//! - `serving.rs`: dispatching what a connection reads, running function
//!   bodies and service handlers, replying.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry_transport::Endpoint;
use ferry_wire::MessageKind;
use parking_lot::Mutex;
use tokio::runtime::{Handle, Runtime};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tracing::{debug, info_span, warn, Instrument};

use crate::call::CallSlot;
use crate::current;
use crate::outbox::Outbox;
use crate::pending::PendingCalls;
use crate::service::{Interceptor, Service};
use crate::store::{Store, TcpStoreServer};
use crate::throttle::Throttle;
use crate::{Functions, RpcError, RpcOptions, WorkerInfo, WorkerRef};

mod calls;
mod connections;
mod serving;
mod shutdown;

const RUNNING: u8 = 0;
const JOINING: u8 = 1;
const STOPPED: u8 = 2;

/// How long rank 0's stop waits for its store server to write the answers
/// it already gave (a client that reads nothing must not hold it up).
const STORE_CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// A worker's RPC agent. Cheap to clone; all clones are the same agent.
#[derive(Clone)]
pub struct Agent {
    pub(crate) inner: Arc<Inner>,
}

#[derive(Clone)]
struct Link {
    conn: u64,
    outbox: Outbox,
}

/// What a connection with a peer runs on: its transport and, per device
/// pair, the channel of the tensors each way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    /// The transport carrying the frames (`"tcp"` or `"shm"`).
    pub transport: &'static str,
    /// Channels of the tensors this worker sends to the peer.
    pub outgoing: Vec<ferry_wire::ChannelChoice>,
    /// Channels of the tensors this worker receives from the peer.
    pub incoming: Vec<ferry_wire::ChannelChoice>,
    /// Why UCX was left out after the selection picked it (the link then
    /// runs on the next viable transport and channels), if it was.
    pub ucx_fallback: Option<ferry_transport::UcxFallback>,
}

pub(crate) struct Inner {
    /// Where this worker sits on its host.
    local: crate::topology::LocalTopology,
    pub(crate) me: WorkerInfo,
    pub(crate) workers: Vec<WorkerInfo>,
    by_name: HashMap<String, u32>,
    addrs: Vec<SocketAddr>,
    endpoint: Endpoint,
    pub(crate) handle: Handle,
    runtime: Mutex<Option<Runtime>>,
    /// Where plain function bodies run (see [`crate::blocking_pool`]).
    pub(crate) bodies: crate::blocking_pool::BlockingPool,
    pub(crate) functions: Functions,
    services: HashMap<MessageKind, Arc<dyn Service>>,
    layers: Vec<Arc<dyn std::any::Any + Send + Sync>>,
    interceptors: Vec<Arc<dyn Interceptor>>,
    links: Mutex<HashMap<u32, Link>>,
    /// What the latest connection with each peer selected.
    link_info: Mutex<HashMap<u32, LinkInfo>>,
    /// The calls awaiting replies (see [`crate::pending`]).
    calls: Mutex<PendingCalls<Arc<CallSlot>>>,
    /// Woken when a call's deadline is earlier than the timer's.
    timer_wake: Notify,
    next_conn: AtomicU64,
    /// Calls sent, lost and served per peer (shutdown's termination detection).
    pub(crate) tally: crate::tally::Tally,
    /// Calls outstanding here: sent and unanswered, or received and running.
    active: AtomicU64,
    /// Woken when `active` drops to zero.
    pub(crate) idle: Notify,
    state: AtomicU8,
    pub(crate) store: Arc<dyn Store>,
    store_server: Mutex<Option<TcpStoreServer>>,
    /// The default timeout of calls, in nanoseconds (0: none): the
    /// options' until [`Agent::set_rpc_timeout`] changes it.
    rpc_timeout: AtomicU64,
    pub(crate) init_timeout: Duration,
    /// Graceful shutdown's bound without progress.
    pub(crate) shutdown_timeout: Duration,
    /// What connections tell of each peer (shutdown tells a gone peer by it).
    pub(crate) liveness: crate::tally::Liveness,
    /// Bound on the wait for an incoming connection's first message.
    handshake_timeout: Duration,
    /// The agent's own tasks (accept loop, timer, connections, layers'
    /// background work); finished ones are reaped as new ones start, and
    /// stopping aborts the rest.
    tasks: Mutex<JoinSet<()>>,
    span: tracing::Span,
    /// Budget of the warning about replies that match no call of theirs.
    foreign_replies: Throttle,
}

/// At most this many warnings about foreign replies per [`FOREIGN_REPLY_WINDOW`].
const FOREIGN_REPLY_LINES: u32 = 5;
const FOREIGN_REPLY_WINDOW: Duration = Duration::from_secs(10);

impl Agent {
    /// Starts a worker: rendezvous with the group, then serve.
    ///
    /// Blocks until every worker of the group has joined the rendezvous.
    /// Fails if the options are invalid, a name is taken twice, or the
    /// group does not assemble within `init_timeout`.
    pub fn start(options: RpcOptions) -> Result<Agent, RpcError> {
        options.validate()?;
        let thread_starts = options.hooks.thread_starts.clone();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(options.io_threads)
            .thread_name(format!("ferry-{}", options.name))
            .on_thread_start(move || thread_starts.iter().for_each(|start| start()))
            .enable_all()
            .build()
            .map_err(|e| RpcError::Config(format!("cannot start the agent's runtime: {e}")))?;
        let handle = runtime.handle().clone();
        let span = info_span!("worker", name = %options.name, rank = options.rank);
        let rendezvous =
            handle.block_on(crate::rendezvous::rendezvous(&options).instrument(span.clone()))?;
        let names: Vec<String> = rendezvous.workers.iter().map(|w| w.name.clone()).collect();
        options
            .channel_config
            .device_maps
            .validate(Some(&names), ferry_transport::cuda::availability())
            .map_err(ferry_transport::TransportError::from)?;
        let me = rendezvous.workers[options.rank as usize].clone();
        let world = rendezvous.workers.len();
        let by_name = rendezvous
            .workers
            .iter()
            .map(|w| (w.name.clone(), w.id))
            .collect();
        let mut endpoint = Endpoint::new(options.name.clone(), options.rank);
        endpoint.channels = options.channels.clone();
        endpoint.transports = options.transports.clone();
        endpoint.limits = options.limits;
        endpoint.allocator = options.allocator.clone();
        endpoint.config = options.channel_config.clone();
        endpoint.keepalive = options.keepalive;
        endpoint.auth = options.auth.clone();
        let inner = Arc::new(Inner {
            local: options.local,
            me,
            workers: rendezvous.workers,
            by_name,
            addrs: rendezvous.addrs,
            endpoint,
            handle: handle.clone(),
            runtime: Mutex::new(Some(runtime)),
            bodies: crate::blocking_pool::BlockingPool::new(
                handle.clone(),
                options.channel_config.spin,
                options.hooks.thread_starts.clone(),
                &options.name,
            ),
            functions: crate::dynamic::with_builtins(options.functions.clone()),
            services: options.hooks.services.iter().cloned().collect(),
            layers: options.hooks.layers.clone(),
            interceptors: options.hooks.interceptors.clone(),
            links: Mutex::new(HashMap::new()),
            link_info: Mutex::new(HashMap::new()),
            calls: Mutex::new(PendingCalls::new()),
            timer_wake: Notify::new(),
            next_conn: AtomicU64::new(1),
            tally: crate::tally::Tally::new(world),
            active: AtomicU64::new(0),
            idle: Notify::new(),
            state: AtomicU8::new(RUNNING),
            store: rendezvous.store,
            store_server: Mutex::new(rendezvous.server),
            rpc_timeout: AtomicU64::new(nanos(options.rpc_timeout)),
            init_timeout: options.init_timeout,
            shutdown_timeout: options.shutdown_timeout.unwrap_or(options.init_timeout),
            liveness: crate::tally::Liveness::new(world),
            handshake_timeout: options.handshake_timeout,
            tasks: Mutex::new(JoinSet::new()),
            span: span.clone(),
            foreign_replies: Throttle::new(FOREIGN_REPLY_LINES, FOREIGN_REPLY_WINDOW),
        });
        let agent = Agent {
            inner: inner.clone(),
        };
        // Layers learn their agent before any message can arrive.
        for service in agent.inner.services.values() {
            service.started(&agent);
        }
        inner.spawn_task(
            connections::accept_loop(inner.clone(), rendezvous.listener).instrument(span.clone()),
        );
        inner.spawn_task(calls::timer_loop(inner.clone()).instrument(span));
        tracing::debug!(parent: &inner.span, workers = inner.workers.len(), "agent started");
        Ok(agent)
    }

    /// The agent this thread works for: set while a remote function runs
    /// (and while its arguments decode) and while a reply decodes, so that
    /// types deserialized there can find their worker. `None` elsewhere.
    pub fn current() -> Option<Agent> {
        current::get()
    }

    /// Runs `f` with this agent as the thread's [`current`](Self::current) one.
    pub fn enter<R>(&self, f: impl FnOnce() -> R) -> R {
        current::enter(self, f)
    }

    /// A reference that does not keep the agent alive.
    pub fn downgrade(&self) -> WeakAgent {
        WeakAgent(Arc::downgrade(&self.inner))
    }

    /// The layer of type `T` installed with [`Hooks::layer`](crate::Hooks::layer).
    pub fn layer<T: std::any::Any + Send + Sync>(&self) -> Option<Arc<T>> {
        self.inner
            .layers
            .iter()
            .find_map(|l| l.clone().downcast::<T>().ok())
    }

    /// Runs `future` as a task on the agent's runtime, in the worker's span.
    /// Layers use it for background work (retries, waits); it is stopped
    /// with the agent.
    pub fn spawn(&self, future: impl std::future::Future<Output = ()> + Send + 'static) {
        self.inner
            .spawn_task(future.instrument(self.inner.span.clone()));
    }

    /// The transport and channels of the latest connection with `worker`,
    /// once one has been made (either side may have opened it).
    pub fn link_info(&self, worker: impl Into<WorkerRef>) -> Result<Option<LinkInfo>, RpcError> {
        let rank = self.inner.resolve(&worker.into())?;
        Ok(self.inner.link_info.lock().get(&rank).cloned())
    }

    /// The default timeout of calls (zero: none): [`RpcOptions::rpc_timeout`]
    /// until [`set_rpc_timeout`](Self::set_rpc_timeout) changes it
    /// (PyTorch's `rpc._get_rpc_timeout`).
    pub fn rpc_timeout(&self) -> Duration {
        self.inner.rpc_timeout()
    }

    /// Changes the default timeout of the calls started from now on (zero:
    /// none), as PyTorch's `rpc._set_rpc_timeout` does: every call, proxy
    /// call, `remote` and `to_here` that names no timeout of its own reads
    /// it when it starts; calls already under way keep theirs. A timeout
    /// over about 584 years counts as that long.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// let agent = ferry_rpc::agent()?;
    /// agent.set_rpc_timeout(Duration::from_secs(5));
    /// assert_eq!(agent.rpc_timeout(), Duration::from_secs(5));
    /// # Ok::<(), ferry_rpc::RpcError>(())
    /// ```
    pub fn set_rpc_timeout(&self, timeout: Duration) {
        self.inner
            .rpc_timeout
            .store(nanos(timeout), Ordering::SeqCst);
    }

    /// This worker.
    pub fn worker_info(&self) -> &WorkerInfo {
        &self.inner.me
    }

    /// Where this worker sits on its host (`LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE`, `GROUP_RANK`, as [`RpcOptions`] had them).
    pub fn local_topology(&self) -> crate::topology::LocalTopology {
        self.inner.local
    }

    /// Every worker of the group, by rank.
    pub fn workers(&self) -> &[WorkerInfo] {
        &self.inner.workers
    }

    /// Looks a worker up by name or rank.
    pub fn get_worker_info(&self, worker: impl Into<WorkerRef>) -> Result<WorkerInfo, RpcError> {
        let rank = self.inner.resolve(&worker.into())?;
        Ok(self.inner.workers[rank as usize].clone())
    }

    /// The group's rendezvous store (namespaced for this agent); user code
    /// may keep its own keys there.
    pub fn store(&self) -> Arc<dyn Store> {
        self.inner.store.clone()
    }

    /// Runs a future on the agent's runtime from a thread outside it
    /// (e.g. a store operation).
    pub fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.inner.handle.block_on(future)
    }

    /// The address a worker listens on for RPC connections.
    pub fn worker_addr(&self, worker: impl Into<WorkerRef>) -> Result<SocketAddr, RpcError> {
        let rank = self.inner.resolve(&worker.into())?;
        Ok(self.inner.addrs[rank as usize])
    }

    /// Immediate shutdown: outstanding calls fail with a shut-down error,
    /// connections close, nothing waits for the other workers.
    pub fn shutdown_now(&self) {
        self.inner.state.store(JOINING, Ordering::SeqCst);
        self.stop();
    }

    /// Whether the agent is still serving.
    pub fn is_running(&self) -> bool {
        self.inner.state.load(Ordering::SeqCst) != STOPPED
    }

    fn stop(&self) {
        let inner = &self.inner;
        if inner.state.swap(STOPPED, Ordering::SeqCst) == STOPPED {
            return;
        }
        inner.links.lock().clear();
        let pending = inner.calls.lock().drain();
        for p in pending {
            let worker = inner.workers[p.to as usize].name.clone();
            p.slot.complete(Err(RpcError::ShutDown {
                worker,
                function: p.function,
            }));
        }
        // Dropping the set aborts every task still in it.
        let tasks = std::mem::take(&mut *inner.tasks.lock());
        drop(tasks);
        // The store server (rank 0 only) closes gracefully where this
        // thread may block on the runtime: the answers it already gave
        // still reach their workers (the other ranks' last `set` of the
        // shutdown rounds, which this rank has seen, is acknowledged).
        // Elsewhere dropping it stops it at once.
        let server = inner.store_server.lock().take();
        if let Some(server) = server {
            if tokio::runtime::Handle::try_current().is_err() {
                // The timer is made inside the runtime.
                let _ = inner.handle.block_on(async {
                    tokio::time::timeout(STORE_CLOSE_TIMEOUT, server.close()).await
                });
            }
        }
        inner.bodies.close();
        if let Some(rt) = inner.runtime.lock().take() {
            rt.shutdown_background();
        }
        debug!(parent: &inner.span, "agent stopped");
    }

    /// Number of calls this worker has outstanding (sent and unanswered, or
    /// received and still running).
    pub fn active_calls(&self) -> u64 {
        self.inner.active.load(Ordering::SeqCst)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.get_mut().take() {
            rt.shutdown_background();
        }
    }
}

/// Names the worker: `Agent { name: "worker0", rank: 0, world_size: 2 }`.
impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.inner.me.name)
            .field("rank", &self.inner.me.id)
            .field("world_size", &self.inner.workers.len())
            .finish()
    }
}

/// `timeout` in whole nanoseconds, saturating at `u64::MAX`.
fn nanos(timeout: Duration) -> u64 {
    u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX)
}

/// A reference to an [`Agent`] that does not keep it alive.
#[derive(Clone, Debug)]
pub struct WeakAgent(std::sync::Weak<Inner>);

impl WeakAgent {
    /// The agent, if it still exists.
    pub fn upgrade(&self) -> Option<Agent> {
        self.0.upgrade().map(|inner| Agent { inner })
    }
}

impl Inner {
    /// The default timeout of calls (see [`Agent::rpc_timeout`]).
    pub(crate) fn rpc_timeout(&self) -> Duration {
        Duration::from_nanos(self.rpc_timeout.load(Ordering::SeqCst))
    }

    fn running(&self) -> Result<(), RpcError> {
        if self.state.load(Ordering::SeqCst) == STOPPED {
            Err(RpcError::NotInitialized)
        } else {
            Ok(())
        }
    }

    pub(crate) fn resolve(&self, to: &WorkerRef) -> Result<u32, RpcError> {
        match to {
            WorkerRef::Name(n) => self
                .by_name
                .get(n)
                .copied()
                .ok_or_else(|| RpcError::UnknownWorker(n.clone())),
            WorkerRef::Rank(r) if (*r as usize) < self.workers.len() => Ok(*r),
            WorkerRef::Rank(r) => Err(RpcError::InvalidRank {
                rank: *r,
                world_size: self.workers.len() as u32,
            }),
            WorkerRef::OutOfRange(r) => Err(RpcError::RankOutOfRange {
                rank: *r,
                world_size: self.workers.len() as u32,
            }),
        }
    }

    /// Runs `task` on the agent's runtime as one of the agent's tasks
    /// (aborted when it stops), first reaping those that have finished, so
    /// the set holds only the running ones and the few that ended since.
    fn spawn_task(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut tasks = self.tasks.lock();
        reap(&mut tasks);
        tasks.spawn_on(task, &self.handle);
    }

    /// How many of the agent's tasks are running (finished ones reaped).
    #[cfg(test)]
    pub(crate) fn task_count(&self) -> usize {
        let mut tasks = self.tasks.lock();
        reap(&mut tasks);
        tasks.len()
    }

    /// Calls outstanding here.
    pub(crate) fn active(&self) -> u64 {
        self.active.load(Ordering::SeqCst)
    }

    /// Waits until this worker has no outstanding calls.
    pub(crate) async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.active.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// Takes the finished tasks out of `tasks`; a task that panicked is logged.
fn reap(tasks: &mut JoinSet<()>) {
    while let Some(ended) = tasks.try_join_next() {
        if let Err(e) = ended {
            if e.is_panic() {
                warn!(error = %e, "an agent task panicked");
            }
        }
    }
}

#[cfg(test)]
mod connections_tests;
