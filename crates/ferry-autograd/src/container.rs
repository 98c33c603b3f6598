//! The worker's distributed autograd container (PyTorch's
//! `DistAutogradContainer`): its contexts, the ids it hands out, the
//! context current on each thread, and the hooks through which the RPC
//! layer and tensor serialisation reach it.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use ferry_rpc::service::{IncomingCall, Interceptor, OutgoingCall};
use ferry_rpc::{Agent, CallScope, Extension, WeakAgent};
use ferry_tch::grad::{GradMeta, GradRecorder};
use parking_lot::{Condvar, Mutex};
use tch::Tensor;

use crate::context::Context;
use crate::message::{send_with_retries, AutogradMessage, SERVICE_NAME};
use crate::AutogradError;

/// The extension id under which calls carry their context id.
pub(crate) const CONTEXT_EXTENSION: u16 = 0x0a01;

/// The extension id under which messages carry context releases.
const RELEASE_EXTENSION: u16 = 0x0a02;

/// How long a release waits for a message to ride on before it is sent
/// on its own.
const RELEASE_DELAY: Duration = Duration::from_millis(20);

/// How many released context ids a worker remembers (late messages of a
/// released context must not bring it back).
const TOMBSTONES: usize = 1 << 16;

/// Ids are `worker_id << 48 | counter`, unique across the cluster.
const COUNTER_BITS: u32 = 48;

/// The distributed autograd state of one worker.
pub struct DistAutogradContainer {
    agent: OnceLock<WeakAgent>,
    worker_id: OnceLock<u32>,
    next_context: AtomicU64,
    next_message: AtomicU64,
    contexts: Mutex<Contexts>,
    changed: Condvar,
    /// The distributed optimizer's local optimizers on this worker.
    pub(crate) optimizers: crate::optim::LocalOptimizers,
    /// Context releases owed to other workers, by rank: they ride on the
    /// next message to that worker, or go on their own after
    /// [`RELEASE_DELAY`] (see [`release`](Self::release)).
    pending_releases: Mutex<HashMap<u32, Vec<u64>>>,
    flush_scheduled: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct Contexts {
    live: HashMap<u64, Arc<Context>>,
    released: HashSet<u64>,
    released_order: VecDeque<u64>,
}

/// The context current on a thread: a user's (created by
/// [`context`](crate::context)) or a call's (from its caller). A call's
/// context comes into being here only when it is used.
#[derive(Clone)]
struct Current {
    id: u64,
    container: Arc<DistAutogradContainer>,
    /// The caller that brought the context here, if a call did.
    from: Option<u32>,
}

thread_local! {
    static CURRENT: RefCell<Option<Current>> = const { RefCell::new(None) };
}

/// Leaves the context entered on this thread when dropped.
pub(crate) struct Entered {
    previous: Option<Current>,
    _recorder: ferry_tch::grad::RecorderGuard,
}

impl Drop for Entered {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

impl DistAutogradContainer {
    pub(crate) fn new() -> Self {
        DistAutogradContainer {
            agent: OnceLock::new(),
            worker_id: OnceLock::new(),
            next_context: AtomicU64::new(0),
            next_message: AtomicU64::new(0),
            contexts: Mutex::new(Contexts::default()),
            changed: Condvar::new(),
            optimizers: Default::default(),
            pending_releases: Mutex::new(HashMap::new()),
            flush_scheduled: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub(crate) fn started(&self, agent: &Agent) {
        let _ = self.agent.set(agent.downgrade());
        let _ = self.worker_id.set(agent.worker_info().id);
    }

    /// The agent, while it runs.
    pub(crate) fn agent(&self) -> Result<Agent, AutogradError> {
        self.agent
            .get()
            .and_then(|w| w.upgrade())
            .ok_or_else(|| AutogradError::from(ferry_rpc::RpcError::NotInitialized))
    }

    pub(crate) fn worker_id(&self) -> u32 {
        self.worker_id.get().copied().unwrap_or(0)
    }

    pub(crate) fn worker_name(&self) -> String {
        self.agent()
            .map(|a| a.worker_info().name.clone())
            .unwrap_or_else(|_| format!("rank {}", self.worker_id()))
    }

    fn next_id(&self, counter: &AtomicU64) -> u64 {
        (u64::from(self.worker_id()) << COUNTER_BITS)
            | (counter.fetch_add(1, Ordering::Relaxed) & ((1 << COUNTER_BITS) - 1))
    }

    /// The largest id [`next_id`](Self::next_id) can give on this worker.
    pub(crate) fn max_id(&self) -> u64 {
        (u64::from(self.worker_id()) << COUNTER_BITS) | ((1 << COUNTER_BITS) - 1)
    }

    /// Creates a new context on this worker (the user's entry point).
    pub(crate) fn new_context(&self) -> Arc<Context> {
        let id = self.next_id(&self.next_context);
        let ctx = Arc::new(Context::new(id));
        self.contexts.lock().live.insert(id, ctx.clone());
        ctx
    }

    /// The context `id`, if it lives here.
    pub(crate) fn get(&self, id: u64) -> Result<Arc<Context>, AutogradError> {
        self.contexts
            .lock()
            .live
            .get(&id)
            .cloned()
            .ok_or_else(|| AutogradError::UnknownContext {
                context_id: id,
                worker: self.worker_name(),
            })
    }

    /// The context `id`, created here if new; `None` once released.
    fn get_or_create(&self, id: u64, from: Option<u32>) -> Option<Arc<Context>> {
        let mut c = self.contexts.lock();
        if c.released.contains(&id) {
            return None;
        }
        let ctx = c
            .live
            .entry(id)
            .or_insert_with(|| Arc::new(Context::new(id)))
            .clone();
        drop(c);
        if let Some(from) = from {
            ctx.know(from);
        }
        Some(ctx)
    }

    /// Ids of the contexts alive on this worker.
    pub fn context_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.contexts.lock().live.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Waits until no context is alive on this worker (clean-up of every
    /// context reached it); false if `timeout` passed first.
    pub fn wait_until_empty(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut c = self.contexts.lock();
        while !c.live.is_empty() {
            if self.changed.wait_until(&mut c, deadline).timed_out() {
                return c.live.is_empty();
            }
        }
        true
    }

    /// Releases context `id` here and passes the release on to every
    /// worker it exchanged messages with (but `except`), best effort.
    ///
    /// The release rides on the next message to each of them (as an
    /// extension), so steady training loops send no clean-up messages of
    /// their own; what has not left after [`RELEASE_DELAY`] is sent as a
    /// `ReleaseContexts` message, retried.
    pub(crate) fn release(self: &Arc<Self>, id: u64, except: Option<u32>) {
        let ctx = {
            let mut c = self.contexts.lock();
            let ctx = c.live.remove(&id);
            if c.released.insert(id) {
                c.released_order.push_back(id);
                while c.released_order.len() > TOMBSTONES {
                    if let Some(old) = c.released_order.pop_front() {
                        c.released.remove(&old);
                    }
                }
            }
            ctx
        };
        self.changed.notify_all();
        let Some(ctx) = ctx else { return };
        let known: Vec<u32> = ctx.state.lock().known_workers.iter().copied().collect();
        // Freeing a context's graph and gradients (megabytes handed back to
        // the OS) is left to a task: a release that rides on a call must
        // not delay that call.
        match self.agent() {
            Ok(agent) => agent.spawn(async move { drop(ctx) }),
            Err(_) => drop(ctx),
        }
        let me = self.worker_id();
        let mut queued = false;
        {
            let mut pending = self.pending_releases.lock();
            for w in known {
                if w != me && Some(w) != except {
                    pending.entry(w).or_default().push(id);
                    queued = true;
                }
            }
        }
        if queued && !self.flush_scheduled.swap(true, Ordering::SeqCst) {
            let Ok(agent) = self.agent() else { return };
            let this = self.clone();
            agent.spawn(async move {
                tokio::time::sleep(RELEASE_DELAY).await;
                this.flush_releases();
            });
        }
    }

    /// Sends every release still owed as its own message.
    pub(crate) fn flush_releases(&self) {
        self.flush_scheduled.store(false, Ordering::SeqCst);
        let pending = std::mem::take(&mut *self.pending_releases.lock());
        let Ok(agent) = self.agent() else { return };
        for (w, context_ids) in pending {
            send_with_retries(&agent, w, AutogradMessage::ReleaseContexts { context_ids });
        }
    }

    /// Makes context `id` current on this thread (`from`: the caller that
    /// brought it, for a call's context) until the guard drops.
    pub(crate) fn enter(self: &Arc<Self>, id: u64, from: Option<u32>) -> Entered {
        let previous = CURRENT.with(|c| {
            c.borrow_mut().replace(Current {
                id,
                container: self.clone(),
                from,
            })
        });
        Entered {
            previous,
            _recorder: ferry_tch::grad::enter(self.clone()),
        }
    }

    /// The thread's current context of this container, created here if a
    /// call brought it and this is its first use.
    pub(crate) fn current_context(self: &Arc<Self>) -> Option<Arc<Context>> {
        let cur = CURRENT.with(|c| c.borrow().clone())?;
        if !Arc::ptr_eq(&cur.container, self) {
            return None;
        }
        self.get_or_create(cur.id, cur.from)
    }
}

/// The id of the context current on this thread, if any.
pub(crate) fn current_id() -> Option<u64> {
    CURRENT.with(|c| c.borrow().as_ref().map(|c| c.id))
}

/// The context current on this thread, if any: its id and the container
/// it belongs to.
pub(crate) fn current() -> Option<(u64, Arc<DistAutogradContainer>)> {
    CURRENT.with(|c| c.borrow().as_ref().map(|c| (c.id, c.container.clone())))
}

impl GradRecorder for DistAutogradContainer {
    fn record_send(&self, tensor: &Tensor) -> Option<GradMeta> {
        let cur = CURRENT.with(|c| c.borrow().clone())?;
        let ctx = cur.container.current_context()?;
        let message_id = self.next_id(&self.next_message);
        ctx.record_send(message_id, tensor);
        Some(GradMeta {
            context_id: ctx.id,
            message_id,
            sender: self.worker_id(),
        })
    }

    fn record_recv(&self, tensor: Tensor, meta: GradMeta) -> Result<Tensor, String> {
        let Some(ctx) = self.get_or_create(meta.context_id, Some(meta.sender)) else {
            // The context was released here: the tensor arrives as plain data.
            return Ok(tensor);
        };
        let leaf = tensor.f_set_requires_grad(true).map_err(|e| {
            format!(
                "a tensor received in autograd context {} cannot require grad: {e}",
                meta.context_id
            )
        })?;
        ctx.record_recv(meta.message_id, meta.sender, &leaf);
        Ok(leaf)
    }
}

/// The interceptor: calls made inside a context carry its id; calls that
/// arrive with one run inside it.
pub(crate) struct ContextInterceptor(pub(crate) Arc<DistAutogradContainer>);

impl Interceptor for ContextInterceptor {
    fn on_send(&self, call: &mut OutgoingCall<'_>) {
        if let Some(ids) = self.0.pending_releases.lock().remove(&call.to.id) {
            call.extensions.push(Extension {
                id: RELEASE_EXTENSION,
                data: ids.iter().flat_map(|id| id.to_le_bytes()).collect(),
            });
        }
        let Some(ctx) = self.0.current_context() else {
            return;
        };
        ctx.know(call.to.id);
        call.extensions.push(Extension {
            id: CONTEXT_EXTENSION,
            data: ctx.id.to_le_bytes().to_vec(),
        });
    }

    fn on_receive(&self, call: &IncomingCall<'_>) -> Option<Arc<dyn CallScope>> {
        if let Some(ext) = call.extensions.iter().find(|e| e.id == RELEASE_EXTENSION) {
            for id in ext.data.chunks_exact(8) {
                if let Ok(bytes) = id.try_into() {
                    self.0
                        .release(u64::from_le_bytes(bytes), Some(call.from.id));
                }
            }
        }
        if call.function == SERVICE_NAME {
            return None;
        }
        let ext = call.extensions.iter().find(|e| e.id == CONTEXT_EXTENSION)?;
        let id = u64::from_le_bytes(ext.data.as_slice().try_into().ok()?);
        if self.0.contexts.lock().released.contains(&id) {
            return None;
        }
        if !call.service {
            // A function call brings the context to this worker at once
            // (a service message, such as an RRef control message, only
            // when it records something here).
            self.0.get_or_create(id, Some(call.from.id));
        }
        Some(Arc::new(ContextScope {
            id,
            from: call.from.id,
            container: self.0.clone(),
        }))
    }
}

/// A call's context, entered while the call runs.
struct ContextScope {
    id: u64,
    from: u32,
    container: Arc<DistAutogradContainer>,
}

impl CallScope for ContextScope {
    fn enter(&self) -> Box<dyn std::any::Any> {
        Box::new(self.container.enter(self.id, Some(self.from)))
    }
}
