//! The agent: one per worker. It owns the runtime, the listener, the
//! connections to peers, the table of outstanding calls and the registry.
//!
//! Each worker opens its own connection to a peer the first time it calls
//! it (like TensorPipe's client pipes): requests go out on it and their
//! replies come back on it. Connections a worker accepts carry the peer's
//! requests and this worker's replies. Every connection has a reader task
//! and a writer task; the writer drains its queue into one vectored write,
//! so calls in flight share system calls.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_transport::{Endpoint, IncomingMessage, OutgoingMessage, PeerConnection};
use ferry_wire::payload::{self, Encoded, IncomingTensor};
use ferry_wire::{Flags, MessageKind, PeerText};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::runtime::{Handle, Runtime};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tracing::{debug, info_span, warn, Instrument};

use crate::call::{CallSlot, RpcFuture};
use crate::current;
use crate::functions::{panic_message, Body, CallResult, Function, Signature};
use crate::inline;
use crate::outbox::{outbox, Outbox, OutboxQueue, SendError};
use crate::pending::{self, Dropped, PendingCalls, Replied};
use crate::protocol::{CallHeader, Extension, Failure, FailureKind, ServiceHeader};
use crate::scope::{Scoped, Scopes};
use crate::service::{IncomingCall, Interceptor, OutgoingCall, Service};
use crate::store::{Store, TcpStoreServer};
use crate::throttle::Throttle;
use crate::watch;
use crate::{Functions, RpcError, RpcOptions, Value, WorkerInfo, WorkerRef};

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
}

pub(crate) struct Inner {
    pub(crate) me: WorkerInfo,
    pub(crate) workers: Vec<WorkerInfo>,
    by_name: HashMap<String, u32>,
    addrs: Vec<SocketAddr>,
    endpoint: Endpoint,
    pub(crate) handle: Handle,
    runtime: Mutex<Option<Runtime>>,
    functions: Functions,
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
    pub(crate) tally: crate::join::Tally,
    /// Calls outstanding here: sent and unanswered, or received and running.
    active: AtomicU64,
    /// Woken when `active` drops to zero.
    pub(crate) idle: Notify,
    state: AtomicU8,
    pub(crate) store: Arc<dyn Store>,
    store_server: Mutex<Option<TcpStoreServer>>,
    rpc_timeout: Duration,
    pub(crate) init_timeout: Duration,
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
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(options.io_threads)
            .thread_name(format!("ferry-{}", options.name))
            .enable_all()
            .build()
            .map_err(|e| RpcError::Config(format!("cannot start the agent's runtime: {e}")))?;
        let handle = runtime.handle().clone();
        let span = info_span!("worker", name = %options.name, rank = options.rank);
        let rendezvous =
            handle.block_on(crate::rendezvous::rendezvous(&options).instrument(span.clone()))?;
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
        let inner = Arc::new(Inner {
            me,
            workers: rendezvous.workers,
            by_name,
            addrs: rendezvous.addrs,
            endpoint,
            handle: handle.clone(),
            runtime: Mutex::new(Some(runtime)),
            functions: options.functions.clone(),
            services: options.hooks.services.iter().cloned().collect(),
            layers: options.hooks.layers.clone(),
            interceptors: options.hooks.interceptors.clone(),
            links: Mutex::new(HashMap::new()),
            link_info: Mutex::new(HashMap::new()),
            calls: Mutex::new(PendingCalls::new()),
            timer_wake: Notify::new(),
            next_conn: AtomicU64::new(1),
            tally: crate::join::Tally::new(world),
            active: AtomicU64::new(0),
            idle: Notify::new(),
            state: AtomicU8::new(RUNNING),
            store: rendezvous.store,
            store_server: Mutex::new(rendezvous.server),
            rpc_timeout: options.rpc_timeout,
            init_timeout: options.init_timeout,
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
        inner.spawn_task(accept_loop(inner.clone(), rendezvous.listener).instrument(span.clone()));
        inner.spawn_task(timer_loop(inner.clone()).instrument(span));
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

    /// Runs the registered function `function` on this worker, as a call
    /// from another worker would run it (blocking pool or task, panics
    /// caught), and returns its result as a [`Value`]. `signature` is the
    /// caller's [`Signature::id`]; `args` its encoded arguments.
    ///
    /// This is how a layer keeps a result on this worker instead of
    /// replying with it (an RRef's owner runs `remote` calls this way).
    pub fn run_function(
        &self,
        function: &str,
        signature: crate::SignatureId,
        args: Vec<u8>,
        tensors: Vec<IncomingTensor>,
    ) -> crate::functions::BoxFuture<Result<Value, RpcError>> {
        let inner = &self.inner;
        let worker = inner.me.name.clone();
        let name = function.to_string();
        let to_error = move |failure: Failure| {
            crate::call::failure_to_error(failure, &worker, &name, Signature::of::<(), ()>())
        };
        let body = match inner.lookup(function, signature) {
            Ok(f) => f.body,
            Err(failure) => {
                let e = to_error(failure);
                return Box::pin(async move { Err(e) });
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        inner.run_body(body, args, 0, tensors, Scopes::current(), move |result| {
            let _ = tx.send(result);
        });
        Box::pin(async move {
            match rx.await {
                Ok(result) => result.map_err(to_error),
                Err(_) => Err(RpcError::NotInitialized),
            }
        })
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

    /// The default timeout of calls.
    pub fn rpc_timeout(&self) -> Duration {
        self.inner.rpc_timeout
    }

    /// This worker.
    pub fn worker_info(&self) -> &WorkerInfo {
        &self.inner.me
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

    /// Calls `function` on `to` with `args` and blocks until its result arrives,
    /// using the agent's default timeout.
    pub fn rpc_sync<R: DeserializeOwned, A: Serialize>(
        &self,
        to: impl Into<WorkerRef>,
        function: &str,
        args: A,
    ) -> Result<R, RpcError> {
        self.rpc_async(to, function, args).wait()
    }

    /// Calls `function` on `to` with `args` and returns at once.
    pub fn rpc_async<R: DeserializeOwned, A: Serialize>(
        &self,
        to: impl Into<WorkerRef>,
        function: &str,
        args: A,
    ) -> RpcFuture<R> {
        self.rpc_async_timeout(to, function, args, self.inner.rpc_timeout)
    }

    /// [`rpc_sync`](Self::rpc_sync) with a per-call timeout (zero: none).
    pub fn rpc_sync_timeout<R: DeserializeOwned, A: Serialize>(
        &self,
        to: impl Into<WorkerRef>,
        function: &str,
        args: A,
        timeout: Duration,
    ) -> Result<R, RpcError> {
        self.rpc_async_timeout(to, function, args, timeout).wait()
    }

    /// [`rpc_async`](Self::rpc_async) with a per-call timeout (zero: none).
    pub fn rpc_async_timeout<R: DeserializeOwned, A: Serialize>(
        &self,
        to: impl Into<WorkerRef>,
        function: &str,
        args: A,
        timeout: Duration,
    ) -> RpcFuture<R> {
        self.call_signed(to.into(), function, Signature::of::<A, R>(), args, timeout)
    }

    /// Starts a call whose caller's signature is `signature`.
    pub(crate) fn call_signed<R, A: Serialize>(
        &self,
        to: WorkerRef,
        function: &str,
        signature: Signature,
        args: A,
        timeout: Duration,
    ) -> RpcFuture<R> {
        match self
            .inner
            .start_call(to, function, signature, &args, timeout)
        {
            Ok((slot, worker)) => RpcFuture::new(slot, worker, function.to_string(), signature)
                .with_agent(self.downgrade()),
            Err(e) => RpcFuture::failed(e, function, signature),
        }
    }

    /// Sends a message of a service kind to the service registered for it
    /// on `to`, and returns its reply as a raw message.
    pub fn call_service(
        &self,
        to: impl Into<WorkerRef>,
        kind: MessageKind,
        message: Encoded,
        timeout: Duration,
    ) -> ServiceFuture {
        let inner = &self.inner;
        let sig = Signature::of::<(), ()>();
        let result = (|| {
            if !kind.is_service() {
                return Err(RpcError::Config(format!("{kind} is not a service kind")));
            }
            let rank = inner.resolve(&to.into())?;
            // Named as the service registered here for `kind` calls itself
            // (every worker registers the same ones), for interceptors and
            // errors: a timeout names "rref", not a number.
            let name = match inner.services.get(&kind) {
                Some(service) => service.name().to_string(),
                None => format!("service {}", kind.0),
            };
            let header = ServiceHeader {
                extensions: inner.intercept_send(rank, &name, &message.tensors),
            };
            let mut payload = Vec::with_capacity(8 + message.payload.len());
            payload::encode_into(&header, &mut payload).map_err(|e| RpcError::Codec {
                action: "encode the service header",
                function: name.clone(),
                message: e.to_string(),
            })?;
            payload.extend_from_slice(&message.payload);
            let slot = inner.send_request(rank, kind, &name, payload, message.tensors, timeout)?;
            Ok((slot, inner.workers[rank as usize].name.clone(), name))
        })();
        match result {
            Ok((slot, worker, name)) => ServiceFuture(RpcFuture::new(slot, worker, name, sig)),
            Err(e) => ServiceFuture(RpcFuture::failed(e, "service", sig)),
        }
    }

    /// Graceful shutdown: waits until no worker of the group has calls
    /// outstanding (PyTorch's `join`), then all workers stop together.
    ///
    /// Fails with [`RpcError::Join`] (and stops all the same) when the
    /// group makes no progress for `init_timeout`: a worker that does not
    /// come, calls that stay outstanding, a call that was never served,
    /// a store that does not answer.
    ///
    /// Call it from a thread, not from inside an async task on the agent's runtime.
    pub fn shutdown(&self) -> Result<(), RpcError> {
        let inner = &self.inner;
        if inner
            .state
            .compare_exchange(RUNNING, JOINING, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return Err(RpcError::NotInitialized);
        }
        let services: Vec<Arc<dyn Service>> = inner.services.values().cloned().collect();
        let result = inner.handle.block_on(
            async {
                crate::join::join(inner.clone(), "join").await?;
                if services.is_empty() {
                    return Ok(());
                }
                // The group is idle: layers send what they still owe (the
                // RRef layer deletes its users), then the group waits until
                // that traffic has drained too, and layers release the rest.
                // Each hook is bounded too: shutdown ends within its bounds.
                let mut hooks = Ok(());
                for s in &services {
                    hooks = hooks.and(
                        inner
                            .bounded_hook(s.name(), "after_join", s.after_join())
                            .await,
                    );
                }
                let drained = crate::join::join(inner.clone(), "drain").await;
                for s in &services {
                    hooks = hooks.and(
                        inner
                            .bounded_hook(s.name(), "before_stop", s.before_stop())
                            .await,
                    );
                }
                hooks.and(drained)
            }
            .instrument(inner.span.clone()),
        );
        self.stop();
        result
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

/// A reference to an [`Agent`] that does not keep it alive.
#[derive(Clone, Debug)]
pub struct WeakAgent(std::sync::Weak<Inner>);

impl WeakAgent {
    /// The agent, if it still exists.
    pub fn upgrade(&self) -> Option<Agent> {
        self.0.upgrade().map(|inner| Agent { inner })
    }
}

/// The reply of a service message: await it or [`wait`](ServiceFuture::wait).
#[derive(Debug)]
pub struct ServiceFuture(RpcFuture<()>);

impl ServiceFuture {
    /// Blocks until the reply arrives; decode it with [`ferry_wire::payload::decode`].
    pub fn wait(self) -> Result<IncomingMessage, RpcError> {
        self.0.wait_raw()
    }
}

impl std::future::Future for ServiceFuture {
    type Output = Result<IncomingMessage, RpcError>;
    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        self.get_mut().0.poll_raw(cx)
    }
}

impl Inner {
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

    fn start_call<A: Serialize>(
        self: &Arc<Self>,
        to: WorkerRef,
        function: &str,
        signature: Signature,
        args: &A,
        timeout: Duration,
    ) -> Result<(Arc<CallSlot>, String), RpcError> {
        self.running()?;
        let rank = self.resolve(&to)?;
        let mut header = CallHeader {
            function: function.to_string(),
            signature: signature.id(),
            extensions: Vec::new(),
        };
        let codec = |e: ferry_wire::WireError| RpcError::Codec {
            action: "encode the arguments",
            function: function.to_string(),
            message: e.to_string(),
        };
        let mut args_payload = Vec::with_capacity(64);
        // Layers that fork state into the arguments (RRefs) learn how the
        // call ends; a call that never leaves undoes it now.
        let (tensors, watches) =
            watch::encoding_message(|| payload::encode_into(args, &mut args_payload));
        let sent = (|| {
            let tensors = tensors.map_err(codec)?;
            header.extensions = self.intercept_send(rank, function, &tensors);
            let mut payload_bytes = Vec::with_capacity(32 + function.len() + args_payload.len());
            payload::encode_into(&header, &mut payload_bytes).map_err(codec)?;
            payload_bytes.extend_from_slice(&args_payload);
            self.send_request(
                rank,
                MessageKind::REQUEST,
                function,
                payload_bytes,
                tensors,
                timeout,
            )
        })();
        match sent {
            Ok(slot) => {
                slot.watch(watches);
                Ok((slot, self.workers[rank as usize].name.clone()))
            }
            Err(e) => {
                watches.settle(watch::Delivery::NotDecoded);
                Err(e)
            }
        }
    }

    /// Runs the interceptors over a call about to leave; returns what they attach.
    fn intercept_send(
        &self,
        rank: u32,
        function: &str,
        tensors: &[Arc<dyn ferry_wire::OutgoingTensor>],
    ) -> Vec<Extension> {
        let mut extensions: Vec<Extension> = Vec::new();
        let mut call = OutgoingCall {
            to: &self.workers[rank as usize],
            function,
            tensors,
            extensions: &mut extensions,
        };
        for i in &self.interceptors {
            i.on_send(&mut call);
        }
        extensions
    }

    /// Runs the interceptors over a call that arrived; returns the scopes
    /// it is to run in.
    fn intercept_receive(
        &self,
        from: &WorkerInfo,
        function: &str,
        service: bool,
        tensors: &[IncomingTensor],
        extensions: &[Extension],
    ) -> Scopes {
        if self.interceptors.is_empty() {
            return Scopes::default();
        }
        let call = IncomingCall {
            from,
            function,
            service,
            tensors,
            extensions,
        };
        Scopes::new(
            self.interceptors
                .iter()
                .filter_map(|i| i.on_receive(&call))
                .collect(),
        )
    }

    /// Registers a pending call and queues its request on the link to `rank`.
    fn send_request(
        self: &Arc<Self>,
        rank: u32,
        kind: MessageKind,
        function: &str,
        payload: Vec<u8>,
        tensors: Vec<Arc<dyn ferry_wire::OutgoingTensor>>,
        timeout: Duration,
    ) -> Result<Arc<CallSlot>, RpcError> {
        self.running()?;
        let slot = CallSlot::new();
        let link = self.link(rank);
        self.active.fetch_add(1, Ordering::SeqCst);
        // Counted while the call is outstanding, so no shutdown round
        // reads a send half-done; a send that fails is taken back.
        self.tally.sending(rank);
        let issued = self.calls.lock().issue(
            Instant::now(),
            rank,
            link.conn,
            function,
            timeout,
            slot.clone(),
        );
        if issued.wake_timer {
            self.timer_wake.notify_one();
        }
        let id = issued.id;
        let message = OutgoingMessage {
            kind,
            flags: Flags::NONE,
            request_id: id,
            payload,
            tensors,
        };
        match link.outbox.send(message) {
            Ok(()) => {}
            Err(SendError::Closed) => {
                self.tally.not_sent(rank);
                self.fail_call(id, |worker| RpcError::PeerUnreachable {
                    worker,
                    reason: "its connection closed".into(),
                });
            }
            Err(SendError::Write(e)) => {
                // This request was not written; the others on the
                // connection may have been (they count as lost).
                self.tally.not_sent(rank);
                let reason = e.to_string();
                self.fail_call(id, |worker| RpcError::PeerUnreachable {
                    worker,
                    reason: reason.clone(),
                });
                self.fail_connection(link.conn, reason);
            }
            Err(SendError::TooLarge(e)) => {
                // Never sent: the call is forgotten, not counted as sent.
                self.tally.not_sent(rank);
                let cancelled = self.calls.lock().cancel(id);
                if cancelled.is_some() {
                    self.call_done();
                }
                let worker = self.workers[rank as usize].name.clone();
                return Err(RpcError::too_large(worker, function.to_string(), e));
            }
        }
        Ok(slot)
    }

    /// A message the writer task of a connection with `peer` kept back,
    /// over the peer's limits (queued before the handshake told them): a
    /// request fails its call, never counted as sent; a reply is replaced
    /// by an error reply naming the limit.
    fn refused(
        &self,
        peer: &WorkerInfo,
        message: OutgoingMessage,
        e: ferry_wire::WireError,
    ) -> Option<OutgoingMessage> {
        if message.flags.contains(Flags::REPLY) {
            return Some(self.result_too_large(peer, message.request_id, &e));
        }
        // Never sent (even if the call has timed out meanwhile).
        self.tally.not_sent(peer.id);
        let cancelled = self.calls.lock().cancel(message.request_id);
        if let Some(p) = cancelled {
            let worker = self.workers[p.to as usize].name.clone();
            p.slot
                .complete(Err(RpcError::too_large(worker, p.function, e)));
            self.call_done();
        }
        None
    }

    /// The error reply that replaces a reply over the caller's limits.
    fn result_too_large(
        &self,
        caller: &WorkerInfo,
        request_id: u64,
        e: &ferry_wire::WireError,
    ) -> OutgoingMessage {
        OutgoingMessage {
            kind: MessageKind::ERROR,
            flags: Flags::REPLY,
            request_id,
            payload: payload::encode(&result_too_large(caller, e))
                .unwrap_or_default()
                .payload,
            tensors: Vec::new(),
        }
    }

    /// The link to `rank`, connecting lazily.
    fn link(self: &Arc<Self>, rank: u32) -> Link {
        let mut links = self.links.lock();
        if let Some(l) = links.get(&rank) {
            if !l.outbox.is_closed() {
                return l.clone();
            }
        }
        let (outbox, rx) = outbox(self.handle.clone());
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let link = Link {
            conn,
            outbox: outbox.clone(),
        };
        links.insert(rank, link.clone());
        let inner = self.clone();
        let span = self.span.clone();
        self.spawn_task(
            async move { inner.connect_and_serve(rank, conn, outbox, rx).await }.instrument(span),
        );
        link
    }

    async fn connect_and_serve(
        self: Arc<Self>,
        rank: u32,
        conn: u64,
        outbox: Outbox,
        rx: OutboxQueue,
    ) {
        let peer = &self.workers[rank as usize];
        let addr = self.addrs[rank as usize];
        let connected = tokio::time::timeout(
            self.init_timeout,
            PeerConnection::connect(addr, &self.endpoint),
        )
        .await;
        let connection = match connected {
            Ok(Ok(c)) if c.peer.worker_name == peer.name && c.peer.rank == peer.id => c,
            Ok(Ok(c)) => {
                return self.fail_connection(
                    conn,
                    format!(
                        "{addr} answered as {:?} (rank {})",
                        PeerText::new(&c.peer.worker_name),
                        c.peer.rank
                    ),
                )
            }
            Ok(Err(e)) => return self.fail_connection(conn, e.to_string()),
            Err(_) => return self.fail_connection(conn, format!("connecting to {addr} timed out")),
        };
        debug!(peer = %peer.name, "connected");
        self.serve_connection(connection, conn, peer.clone(), outbox, rx)
            .await;
    }

    /// Runs a handshaken connection until it closes: a writer task drains
    /// the outbox, this task reads frames and dispatches them.
    async fn serve_connection(
        self: &Arc<Self>,
        connection: PeerConnection,
        conn: u64,
        peer: WorkerInfo,
        outbox: Outbox,
        rx: OutboxQueue,
    ) {
        debug!(
            peer = %peer.name,
            transport = connection.transport,
            channels = ?connection.outgoing_channels(),
            "connection established"
        );
        self.link_info.lock().insert(
            peer.id,
            LinkInfo {
                transport: connection.transport,
                outgoing: connection.outgoing_channels().to_vec(),
                incoming: connection.incoming_channels().to_vec(),
            },
        );
        let releases = connection.writer.release_signal();
        let mut reader = connection.reader;
        rx.install(connection.writer).await;
        let me = self.clone();
        let peer_of_writer = peer.clone();
        let writer_task = self.handle.spawn(
            async move {
                let refused = |m, e| me.refused(&peer_of_writer, m, e);
                if let Err(e) = rx.drain(releases, refused).await {
                    me.fail_connection(conn, e.to_string());
                }
            }
            .in_current_span(),
        );
        loop {
            match reader.read().await {
                Ok(Some(msg)) => {
                    if self.on_message(&peer, conn, msg, &outbox) {
                        // The message woke or spawned a task, which tokio
                        // runs on this thread after this one returns: if
                        // the next read finds nothing, it lets that task
                        // run before it spins for what the task may cause.
                        reader.stream_mut().yield_before_spin();
                    }
                }
                Ok(None) => {
                    self.fail_connection(conn, "the connection was closed".into());
                    break;
                }
                Err(e) => {
                    if self.state.load(Ordering::SeqCst) == RUNNING {
                        warn!(peer = %peer.name, error = %e, "connection failed");
                    }
                    self.fail_connection(conn, e.to_string());
                    break;
                }
            }
        }
        drop(outbox);
        writer_task.abort();
    }

    /// Fails every call waiting on connection `conn` and forgets the link.
    fn fail_connection(&self, conn: u64, reason: String) {
        {
            let mut links = self.links.lock();
            links.retain(|_, l| l.conn != conn);
        }
        let failed = self.calls.lock().connection_failed(conn, &reason);
        for f in failed {
            self.fail(f);
        }
    }

    /// Completes a call that ended without its reply with its error.
    fn fail(&self, failed: pending::Failed<Arc<CallSlot>>) {
        let (call, error) = match failed {
            pending::Failed::TimedOut(call) => {
                let error = RpcError::Timeout {
                    worker: self.workers[call.to as usize].name.clone(),
                    function: call.function.clone(),
                    after: call.timeout.unwrap_or_default(),
                };
                (call, error)
            }
            pending::Failed::Unreachable { call, reason } => {
                // Sent, and maybe served: shutdown counts it as lost.
                self.tally.lost(call.to);
                let worker = self.workers[call.to as usize].name.clone();
                (call, RpcError::PeerUnreachable { worker, reason })
            }
        };
        call.slot.complete(Err(error));
        self.call_done();
    }

    /// Fails call `id`, whose request was never sent, with `error`.
    fn fail_call(&self, id: u64, error: impl FnOnce(String) -> RpcError) {
        let cancelled = self.calls.lock().cancel(id);
        if let Some(p) = cancelled {
            let worker = self.workers[p.to as usize].name.clone();
            p.slot.complete(Err(error(worker)));
            self.call_done();
        }
    }

    fn call_done(&self) {
        if self.active.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
    }

    /// Runs a layer's shutdown hook for at most `init_timeout`.
    async fn bounded_hook(
        &self,
        layer: &str,
        hook: &str,
        run: crate::functions::BoxFuture<()>,
    ) -> Result<(), RpcError> {
        tokio::time::timeout(self.init_timeout, run)
            .await
            .map_err(|_| {
                RpcError::Join(format!(
                    "the {layer:?} layer's {hook} did not finish within {:?}",
                    self.init_timeout
                ))
            })
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

    /// Handles one message; returns whether it left a task queued on this
    /// runtime (a woken caller, a body or handler that has to wait).
    /// A reply (frame on connection `conn` from `peer`, with `id`)
    /// completes a call only if that call's request went out to that peer
    /// on that very connection: request ids are guessable, so an id alone
    /// proves nothing.
    fn on_message(
        self: &Arc<Self>,
        peer: &WorkerInfo,
        conn: u64,
        msg: IncomingMessage,
        outbox: &Outbox,
    ) -> bool {
        let kind = msg.header.kind;
        if msg.header.flags.contains(Flags::REPLY) {
            let id = msg.header.request_id;
            let replied = self.calls.lock().reply(Instant::now(), conn, peer.id, id);
            match replied {
                Replied::Complete(p) => {
                    let woke = p.slot.complete(Ok(msg));
                    self.call_done();
                    woke
                }
                Replied::Late(failed) => {
                    debug!(peer = %peer.name, id, "a reply came after its call's deadline");
                    self.fail(failed);
                    false
                }
                Replied::Dropped(Dropped::NoCall) => {
                    debug!(peer = %peer.name, id, "dropping a late reply");
                    false
                }
                Replied::Dropped(Dropped::Foreign { callee: to }) => {
                    if let Some(suppressed) = self.foreign_replies.allow(Instant::now()) {
                        warn!(
                            peer = %peer.name,
                            id,
                            callee = %self.workers[to as usize].name,
                            suppressed,
                            "dropping a reply that did not come from the callee on the \
                             connection its request went out on"
                        );
                    }
                    false
                }
            }
        } else if kind == MessageKind::REQUEST {
            self.active.fetch_add(1, Ordering::SeqCst);
            self.serve_request(peer, msg, outbox.clone())
        } else if kind.is_service() {
            self.active.fetch_add(1, Ordering::SeqCst);
            self.serve_service(peer.clone(), msg, outbox.clone())
        } else {
            warn!(peer = %peer.name, %kind, "ignoring an unexpected message");
            false
        }
    }

    /// Sends the reply to a call from `caller` and counts the call served.
    fn reply(
        &self,
        caller: &WorkerInfo,
        outbox: &Outbox,
        request_id: u64,
        result: Result<Encoded, Failure>,
    ) {
        let (kind, encoded) = match result {
            Ok(e) => (MessageKind::RESPONSE, e),
            Err(f) => (MessageKind::ERROR, payload::encode(&f).unwrap_or_default()),
        };
        let mut sent = outbox.send(OutgoingMessage {
            kind,
            flags: Flags::REPLY,
            request_id,
            payload: encoded.payload,
            tensors: encoded.tensors,
        });
        if let Err(SendError::TooLarge(e)) = &sent {
            sent = outbox.send(self.result_too_large(caller, request_id, e));
        }
        if let Err(SendError::Write(e)) = sent {
            warn!(request_id, error = %e, "cannot send a reply");
        }
        self.tally.served(caller.id);
        self.call_done();
    }

    /// Runs a request's function; returns whether it left a task queued.
    fn serve_request(
        self: &Arc<Self>,
        from: &WorkerInfo,
        msg: IncomingMessage,
        outbox: Outbox,
    ) -> bool {
        let id = msg.header.request_id;
        let (header, rest) = match split_header::<CallHeader>(&msg.payload, "call") {
            Ok(split) => split,
            Err(failure) => {
                self.reply(from, &outbox, id, Err(failure));
                return false;
            }
        };
        let function = match self.lookup(&header.function, header.signature) {
            Ok(f) => f,
            Err(failure) => {
                self.reply(from, &outbox, id, Err(failure));
                return false;
            }
        };
        let scopes = self.intercept_receive(
            from,
            &header.function,
            false,
            &msg.tensors,
            &header.extensions,
        );
        let IncomingMessage {
            payload, tensors, ..
        } = msg;
        let inner = self.clone();
        let caller = from.clone();
        self.run_body(
            function.body.clone(),
            payload,
            rest,
            tensors,
            scopes,
            move |result| {
                let (encoded, watches) = watch::encoding_message(|| {
                    result.and_then(|v| {
                        v.encode()
                            .map_err(|e| Failure::failed(format!("cannot encode the result: {e}")))
                    })
                });
                // A result over the caller's limits is never sent either.
                let encoded = encoded.and_then(|e| match outbox.check(&e.payload, &e.tensors) {
                    Ok(()) => Ok(e),
                    Err(too_large) => Err(result_too_large(&caller, &too_large)),
                });
                // A result that did not encode is never sent.
                watches.settle(match encoded {
                    Ok(_) => watch::Delivery::Decoded,
                    Err(_) => watch::Delivery::NotDecoded,
                });
                inner.reply(&caller, &outbox, id, encoded);
            },
        )
    }

    /// Runs a function body the way its registration asks (blocking pool or
    /// task), with this agent as the current one, then hands the outcome to
    /// `done`. Returns whether it left a task queued on this runtime.
    fn run_body(
        self: &Arc<Self>,
        body: Body,
        payload: Vec<u8>,
        offset: usize,
        tensors: Vec<IncomingTensor>,
        scopes: Scopes,
        done: impl FnOnce(CallResult) + Send + 'static,
    ) -> bool {
        let agent = Agent {
            inner: self.clone(),
        };
        match body {
            Body::Blocking(f) => {
                self.handle.spawn_blocking(move || {
                    current::enter(&agent, || {
                        scopes.run(|| {
                            let result = f(&payload[offset..], tensors);
                            done(result)
                        })
                    })
                });
                false
            }
            Body::Async(f) => {
                let fut = current::enter(&agent, || scopes.run(|| f(&payload[offset..], tensors)));
                let fut = std::panic::AssertUnwindSafe(Scoped {
                    scopes: scopes.clone(),
                    future: Box::pin(fut),
                });
                let span = self.span.clone();
                // A body that is ready at once (most are) answers without a
                // trip through the scheduler; one that waits continues as a task.
                !inline::run_or_spawn(
                    &self.handle,
                    Box::pin(
                        async move {
                            let result = match futures::FutureExt::catch_unwind(fut).await {
                                Ok(r) => r,
                                Err(panic) => Err(Failure::failed(panic_message(&*panic))),
                            };
                            current::enter(&agent, || scopes.run(|| done(result)));
                        }
                        .instrument(span),
                    ),
                )
            }
        }
    }

    /// The registered function `name`, if it accepts the caller's signature.
    fn lookup(&self, name: &str, signature: crate::SignatureId) -> Result<Function, Failure> {
        let Some(function) = self.functions.get(name) else {
            return Err(Failure::new(FailureKind::UnknownFunction, String::new()));
        };
        if !function.signature.accepts(&signature) {
            return Err(Failure {
                kind: FailureKind::WrongType,
                message: String::new(),
                expected: function.signature.to_string(),
            });
        }
        Ok(function.clone())
    }

    /// Hands a service message to its service; returns whether it left a
    /// task queued. The handler's future is polled here first, like an
    /// async body, and continues as a task only if it has to wait.
    fn serve_service(
        self: &Arc<Self>,
        from: WorkerInfo,
        msg: IncomingMessage,
        outbox: Outbox,
    ) -> bool {
        let id = msg.header.request_id;
        let kind = msg.header.kind;
        let Some(service) = self.services.get(&kind).cloned() else {
            self.reply(
                &from,
                &outbox,
                id,
                Err(Failure::new(FailureKind::UnknownFunction, String::new())),
            );
            return false;
        };
        let (header, offset) = match split_header::<ServiceHeader>(&msg.payload, "service") {
            Ok(split) => split,
            Err(failure) => {
                self.reply(&from, &outbox, id, Err(failure));
                return false;
            }
        };
        let scopes = self.intercept_receive(
            &from,
            service.name(),
            true,
            &msg.tensors,
            &header.extensions,
        );
        let mut msg = msg;
        msg.payload.drain(..offset);
        let inner = self.clone();
        let agent = Agent {
            inner: self.clone(),
        };
        let caller = from.clone();
        let handled = current::enter(&agent, || scopes.run(|| service.handle(from, msg)));
        let handled = Scoped {
            scopes,
            future: Box::pin(handled),
        };
        !inline::run_or_spawn(
            &self.handle,
            Box::pin(
                async move {
                    let result = handled.await.map_err(Failure::failed);
                    inner.reply(&caller, &outbox, id, result);
                }
                .instrument(self.span.clone()),
            ),
        )
    }

    /// Expires calls whose deadline passed and re-arms the timer.
    fn expire(&self, now: Instant) {
        let expired = self.calls.lock().tick(now);
        for f in expired {
            self.fail(f);
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

/// The failure that replaces a result over the caller's limits.
fn result_too_large(caller: &WorkerInfo, e: &ferry_wire::WireError) -> Failure {
    Failure::failed(format!(
        "the result was not sent: worker {:?} would refuse it ({e})",
        caller.name
    ))
}

/// The postcard header `H` at the start of a payload, and the offset of
/// what follows it; a `BadRequest` failure naming the `what` header if it
/// does not decode.
fn split_header<H: serde::de::DeserializeOwned>(
    payload: &[u8],
    what: &str,
) -> Result<(H, usize), Failure> {
    postcard::take_from_bytes::<H>(payload)
        .map(|(header, rest)| (header, payload.len() - rest.len()))
        .map_err(|e| {
            Failure::new(
                FailureKind::BadRequest,
                format!("malformed {what} header: {e}"),
            )
        })
}

async fn timer_loop(inner: Arc<Inner>) {
    loop {
        let armed = inner.calls.lock().timer();
        match armed {
            None => inner.timer_wake.notified().await,
            Some(at) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(at.into()) => {
                        inner.expire(Instant::now());
                    }
                    // An earlier deadline was armed.
                    _ = inner.timer_wake.notified() => {}
                }
            }
        }
    }
}

async fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    let mut backoff = ferry_transport::accept::AcceptBackoff::new();
    loop {
        let (stream, addr) = match listener.accept().await {
            Ok(s) => {
                backoff.succeeded();
                s
            }
            Err(e) => {
                // Out of descriptors: back off instead of spinning.
                backoff.pause_after("rpc agent", &e).await;
                continue;
            }
        };
        let inner2 = inner.clone();
        inner.spawn_task(
            async move {
                let handshake = tokio::time::timeout(
                    inner2.init_timeout,
                    PeerConnection::accept(stream, &inner2.endpoint),
                )
                .await;
                let connection = match handshake {
                    Ok(Ok(c)) => c,
                    Ok(Err(e)) => return warn!(%addr, error = %e, "rejected a connection"),
                    Err(_) => return warn!(%addr, "rejected a connection: handshake timed out"),
                };
                let rank = connection.peer.rank;
                let known = inner2
                    .workers
                    .get(rank as usize)
                    .is_some_and(|w| w.name == connection.peer.worker_name);
                if !known {
                    return warn!(
                        %addr,
                        name = ?PeerText::new(&connection.peer.worker_name),
                        rank,
                        "rejected a connection from a worker outside the group"
                    );
                }
                let peer = inner2.workers[rank as usize].clone();
                let (outbox, rx) = outbox(inner2.handle.clone());
                let conn = inner2.next_conn.fetch_add(1, Ordering::Relaxed);
                inner2
                    .serve_connection(connection, conn, peer, outbox, rx)
                    .await;
            }
            .in_current_span(),
        );
    }
}

#[cfg(test)]
#[path = "connections_tests.rs"]
mod connections_tests;
