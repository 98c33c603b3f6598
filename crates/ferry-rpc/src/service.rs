//! Hooks for the layers above the agent: services that handle their own
//! message kinds, and interceptors that see every call going out and coming in.

use std::sync::Arc;

use ferry_transport::IncomingMessage;
use ferry_wire::payload::{Encoded, IncomingTensor, OutgoingTensor};
use ferry_wire::MessageKind;

use crate::boxed::BoxFuture;
use crate::protocol::Extension;
use crate::scope::CallScope;
use crate::{Agent, WorkerInfo};

/// Handles messages of one service kind (at or above
/// [`MessageKind::FIRST_SERVICE`]). The RRef and autograd layers plug in here.
///
/// The reply goes back to the sender as the outcome of its
/// [`Agent::call_service`](crate::Agent::call_service); an `Err` arrives
/// there as [`RpcError::Remote`](crate::RpcError::Remote).
pub trait Service: Send + Sync + 'static {
    /// A short name for errors and logs (e.g. `"rref"`).
    fn name(&self) -> &str;
    /// Handles one message from `from`.
    ///
    /// The returned future is polled once right away on the thread that
    /// read the message (as an async function body is), and continues as a
    /// task only if it has to wait: it must not block, and heavy work
    /// belongs on another thread (`tokio::task::spawn_blocking`), awaited.
    fn handle(
        &self,
        from: WorkerInfo,
        message: IncomingMessage,
    ) -> BoxFuture<Result<Encoded, String>>;
    /// Called once the agent has started, before any message arrives.
    fn started(&self, agent: &Agent) {
        let _ = agent;
    }
    /// Called by graceful shutdown once no worker of the group has calls
    /// outstanding: send what this layer still owes other workers. A
    /// second round of termination detection waits for that traffic.
    fn after_join(&self) -> BoxFuture<()> {
        Box::pin(async {})
    }
    /// Called by graceful shutdown after that second round, just before the
    /// agent stops: release what is left.
    fn before_stop(&self) -> BoxFuture<()> {
        Box::pin(async {})
    }
}

/// A call about to leave this worker, as an interceptor sees it: a function
/// call, or a service message (then `function` is the service's name).
pub struct OutgoingCall<'a> {
    /// The callee.
    pub to: &'a WorkerInfo,
    /// The function name (or the service name for service messages).
    pub function: &'a str,
    /// The tensors the call carries.
    pub tensors: &'a [Arc<dyn OutgoingTensor>],
    /// Data to attach; the callee's interceptors see it.
    pub extensions: &'a mut Vec<Extension>,
}

/// A call that arrived at this worker, before its function runs.
pub struct IncomingCall<'a> {
    /// The caller.
    pub from: &'a WorkerInfo,
    /// The function name (the service's name for a service message).
    pub function: &'a str,
    /// Whether this is a service message rather than a function call.
    pub service: bool,
    /// The tensors the call carries.
    pub tensors: &'a [IncomingTensor],
    /// Data the caller's interceptors attached.
    pub extensions: &'a [Extension],
}

/// Sees every function call going out of and coming into this worker.
pub trait Interceptor: Send + Sync + 'static {
    /// Called on the caller before a request is sent; may attach extensions.
    fn on_send(&self, call: &mut OutgoingCall<'_>) {
        let _ = call;
    }
    /// Called on the callee before the function (or service handler) runs.
    /// A returned scope is entered while the arguments decode, the function
    /// runs and its result encodes (see [`scope`](crate::scope)).
    fn on_receive(&self, call: &IncomingCall<'_>) -> Option<Arc<dyn CallScope>> {
        let _ = call;
        None
    }
}

/// The services and interceptors of an agent.
#[derive(Clone, Default)]
pub struct Hooks {
    pub(crate) services: Vec<(MessageKind, Arc<dyn Service>)>,
    pub(crate) interceptors: Vec<Arc<dyn Interceptor>>,
    pub(crate) layers: Vec<Arc<dyn std::any::Any + Send + Sync>>,
    pub(crate) thread_starts: Vec<Arc<ThreadStart>>,
}

/// What [`Hooks::on_thread_start`] runs.
pub type ThreadStart = dyn Fn() + Send + Sync;

impl Hooks {
    /// Registers a service for `kind`.
    pub fn service(&mut self, kind: MessageKind, service: Arc<dyn Service>) -> &mut Self {
        self.services.push((kind, service));
        self
    }
    /// Installs a layer object that code can find again with
    /// [`Agent::layer`] (the RRef layer keeps its context here).
    pub fn layer<T: std::any::Any + Send + Sync>(&mut self, layer: Arc<T>) -> &mut Self {
        self.layers.push(layer);
        self
    }
    /// Whether a layer of type `T` is installed.
    pub fn has_layer<T: std::any::Any + Send + Sync>(&self) -> bool {
        self.layers
            .iter()
            .any(|l| l.clone().downcast::<T>().is_ok())
    }
    /// The layer of type `T`, if one is installed (as [`Agent::layer`]
    /// finds it once the agent runs).
    pub fn get_layer<T: std::any::Any + Send + Sync>(&self) -> Option<Arc<T>> {
        self.layers
            .iter()
            .find_map(|l| l.clone().downcast::<T>().ok())
    }
    /// Adds an interceptor.
    pub fn interceptor(&mut self, interceptor: Arc<dyn Interceptor>) -> &mut Self {
        self.interceptors.push(interceptor);
        self
    }
    /// Runs `start` first on every thread the agent starts: its I/O
    /// threads, its body threads and the blocking pool's threads, which
    /// run the registered functions. For per-thread settings of a library the functions call,
    /// which a thread does not inherit from the one that made them (libtorch's
    /// intra-op thread count: `ferry_tch::install` adds such a hook). Hooks
    /// run in the order they were added.
    ///
    /// ```
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use std::sync::Arc;
    ///
    /// static STARTED: AtomicUsize = AtomicUsize::new(0);
    /// let mut options = ferry_rpc::RpcOptions::new("worker0", 0, 1, "127.0.0.1:0".parse().unwrap());
    /// options.hooks.on_thread_start(Arc::new(|| {
    ///     STARTED.fetch_add(1, Ordering::Relaxed);
    /// }));
    /// ```
    pub fn on_thread_start(&mut self, start: Arc<ThreadStart>) -> &mut Self {
        self.thread_starts.push(start);
        self
    }
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field(
                "services",
                &self
                    .services
                    .iter()
                    .map(|(k, s)| (k.0, s.name().to_string()))
                    .collect::<Vec<_>>(),
            )
            .field("interceptors", &self.interceptors.len())
            .field("layers", &self.layers.len())
            .field("thread_starts", &self.thread_starts.len())
            .finish()
    }
}
