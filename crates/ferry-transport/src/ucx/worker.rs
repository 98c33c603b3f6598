//! One connection's UCP worker and endpoint, its requests and their
//! progress.
//!
//! Every operation posts a request with a completion callback whose user
//! data is the request's [`Completion`]. A [`Pending`] request owns what
//! UCX reads or writes (`keep`): when it is dropped before UCX completed
//! it, it is cancelled and moved, buffer and all, into the worker's
//! in-flight list, which is swept after each progress call; memory UCX may
//! still write is never freed. Fire-and-forget sends (tensors, frame
//! chunks) go to the same list.
//!
//! A task waiting for a receive first spins on `ucp_worker_progress` for
//! at most the configured spin time since UCX last reported progress (ten
//! times that while the link moves bulk data: [`Shared::spin_budget`]),
//! then sleeps on the worker's event fd
//! itself (tokio `AsyncFd`, plus a backstop timer): it progresses, arms
//! the worker and waits for the fd, and again each time it wakes, until
//! its request completes. While it sleeps its waker is also kept in the
//! completion, so a request that another task's progress call completes
//! wakes it too; once awake it takes the waker back out, so that its own
//! progress call does not wake it again. The event that ends the sleep
//! thus wakes the waiting task directly, with no other task in between:
//! measured on a link that sleeps before every message, 20–26% less CPU
//! time and about 0.7 times the one-way latency over UCX's tcp and shared
//! memory (see the user guide). The connection's progress task works only
//! while a send UCX has not finished is in flight: it spins on progress
//! while UCX keeps moving the send (as a waiting receive spins), then arms
//! the worker and sleeps on the fd; each time it wakes it progresses the
//! worker and sweeps the finished sends. Otherwise it sleeps, with no timer, until such a send
//! exists. While nothing sleeps the worker stays unarmed: an armed worker
//! makes the peer signal it for the next message (a system call there, a
//! wake-up here), which a task spinning for that message does not need.

use std::any::Any;
use std::ffi::c_void;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use super::sockaddr;
use super::{context, exit, status_text, sys, Context};
use crate::shm::{spin_while_active_in_rounds, Check};
use crate::{channel, TransportError};

/// How long the progress task sleeps on the event fd at most (a backstop
/// for events the fd does not signal).
const BACKSTOP: Duration = Duration::from_millis(5);
/// Progress calls per lock while draining.
const DRAIN: usize = 64;
/// Times a sleeping receive progresses and re-arms the worker while UCX
/// reports events pending (`UCS_ERR_BUSY`) before it yields to tokio.
const ARM_TRIES: usize = 4;
/// Progress calls per round of a spinning wait before the CPU is yielded.
/// A progress call (with the link's lock) costs about 250 ns over UCX's
/// tcp and 25 ns over its shared memory, where an `shm` ring check costs a
/// few, so over tcp the rings' round
/// ([`SPIN_ITERATIONS`](crate::shm::SPIN_ITERATIONS), 64) would hold the
/// core for about 16 µs, while on a small host the thread that must answer
/// may be waiting for it. Measured on the 2-vCPU VM, empty `rpc_sync` over
/// UCX shm, median of 10 alternating runs: 64 per round 18.1 µs, 16 16.1,
/// 4 16.7, 1 16.3 (Ferry's `shm` transport 13.3); bandwidth unchanged.
const PROGRESS_CALLS_PER_ROUND: u32 = 16;
/// A send or receive at least this long marks its link as streaming
/// ([`Shared::spin_budget`]): its bytes take hundreds of microseconds to
/// move at the few GB/s of a host's copies, several times the spin.
const STREAMING_BYTES: usize = 1 << 20;
/// How long after its last such send or receive was posted a link counts
/// as streaming.
const STREAMING_FOR: Duration = Duration::from_millis(2);
/// How many times the configured spin a wait on a streaming link spins
/// for. Over TCP a transfer's bytes arrive as the socket drains, and on a
/// small host the gaps between them (the other side's thread descheduled
/// for a moment) often outlast the configured spin: the wait then sleeps on
/// the event fd and pays a wake-up, again and again within one transfer.
/// Measured with `ucx_bench` over UCX's tcp, two sets of 8 rounds
/// alternating with the build before: 4 MiB one way 3452 -> 3653 MiB/s
/// and 2996 -> 3233 (faster in 6 of 8 each), 64 MiB 3201 -> 3224 and
/// 2956 -> 3005 (6 and 5 of 8); the machine's idle share during the
/// 64 MiB phase fell from 16-22% to 5-9%. Over UCX's shared memory it
/// changed nothing (6 rounds, 1.01 and 1.00). The cost is bounded: only
/// links moving bulk data spin longer, and only while bytes keep moving or
/// for the longer budget after they stop.
const STREAMING_SPIN_FACTOR: u32 = 10;
/// Tag of the probe each side sends once its endpoint exists (see
/// [`UcxLink::probe`]): in the frames' half of the tag space, above any
/// chunk sequence number a connection reaches.
const PROBE_TAG: u64 = super::FRAME_TAG | (1 << 62);

/// Where a request's callback reports.
#[derive(Default)]
pub(crate) struct Completion {
    done: AtomicBool,
    status: AtomicI8,
    len: AtomicUsize,
    waker: Mutex<Option<Waker>>,
}

impl Completion {
    fn complete(&self, status: sys::ucs_status_t, len: usize) {
        self.status.store(status, Ordering::Relaxed);
        self.len.store(len, Ordering::Relaxed);
        self.done.store(true, Ordering::Release);
        let waker = self.lock_waker().take();
        if let Some(w) = waker {
            w.wake();
        }
    }
    fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }
    fn result(&self) -> (sys::ucs_status_t, usize) {
        (
            self.status.load(Ordering::Relaxed),
            self.len.load(Ordering::Relaxed),
        )
    }
    fn lock_waker(&self) -> MutexGuard<'_, Option<Waker>> {
        self.waker.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Forgets the registered waker, for a task that is awake and about to
    /// progress the worker itself: a completion its own progress call
    /// causes must not wake it again. Such a self-wake makes tokio queue
    /// the task once more and wake another worker thread, which then
    /// often takes the task over (see the user guide).
    fn unregister(&self) {
        self.lock_waker().take();
    }
    /// Makes `waker` the one [`complete`](Self::complete) wakes (kept when
    /// it already wakes the same task).
    fn register(&self, waker: &Waker) {
        let mut slot = self.lock_waker();
        if !slot.as_ref().is_some_and(|w| w.will_wake(waker)) {
            *slot = Some(waker.clone());
        }
    }
}

unsafe extern "C" fn recv_done(
    _request: *mut c_void,
    status: sys::ucs_status_t,
    info: *const sys::ucp_tag_recv_info_t,
    user: *mut c_void,
) {
    // SAFETY: `user` is the `Completion` of a request that keeps it alive
    // (in its `Pending` or in the in-flight list) until the request is
    // freed; `info` is valid for the call when non-null.
    let c = unsafe { &*(user as *const Completion) };
    let len = if info.is_null() {
        0
    } else {
        // SAFETY: non-null, provided by UCX for this call.
        unsafe { (*info).length }
    };
    c.complete(status, len);
}

unsafe extern "C" fn ep_failed(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` is the `Shared` that owns the endpoint; the endpoint is
    // closed before the `Shared` is freed, and this runs inside progress,
    // under the state lock its owner holds.
    let shared = unsafe { &*(arg as *const Shared) };
    shared.fail(format!(
        "the UCX endpoint failed: {}",
        status_text(shared.api, status)
    ));
}

/// A connection request UCX's listener handed over, not yet accepted or
/// rejected.
struct ConnRequest(sys::ucp_conn_request_h);

// SAFETY: a UCX handle, used only under the worker's state lock.
unsafe impl Send for ConnRequest {}

unsafe extern "C" fn conn_requested(request: sys::ucp_conn_request_h, arg: *mut c_void) {
    // SAFETY: `arg` is the `Shared` that owns the listener; the listener is
    // destroyed before the `Shared` is freed, and this runs inside
    // progress, under the state lock its owner holds (so only the
    // `requests` list is taken here).
    let shared = unsafe { &*(arg as *const Shared) };
    shared
        .requests
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(ConnRequest(request));
}

/// What one step of waiting for a connection request found.
enum ListenStep {
    /// The peer's request, to accept.
    Accepted(ConnRequest),
    /// UCX has events pending: progress again.
    Busy,
    /// The worker is armed: sleep on its event fd.
    Armed,
}

/// A request UCX has not completed, with what it owns.
struct Inflight {
    request: *mut c_void,
    /// `None`: a send posted without a callback, checked with
    /// `ucp_request_check_status`.
    completion: Option<Arc<Completion>>,
    /// What UCX reads or writes, dropped only once the request is done.
    _keep: Box<dyn Any + Send>,
}

/// The worker's state, under the lock.
struct State {
    worker: sys::ucp_worker_h,
    ep: sys::ucp_ep_h,
    /// The listener of a worker that waits for its peer's client-server
    /// connection ([`UcxWorker::listen`]); null otherwise.
    listener: sys::ucp_listener_h,
    inflight: Vec<Inflight>,
    /// Completions tasks wait on, woken when the link fails.
    waiters: Vec<Weak<Completion>>,
    /// A writer waiting for in-flight requests to finish
    /// ([`UcxLink::poll_in_flight_at_most`]), woken by the sweep that
    /// shortens the list (or by the link's failure).
    room: Option<Waker>,
}

// SAFETY: the worker is created `UCS_THREAD_MODE_SERIALIZED` and only used
// under the `Mutex` around this state; the raw pointers are UCX handles.
unsafe impl Send for State {}

pub(crate) struct Shared {
    api: &'static sys::Ucp,
    state: Mutex<State>,
    failed: Mutex<Option<String>>,
    has_failed: AtomicBool,
    /// Connection requests the listener's callback put here.
    requests: Mutex<Vec<ConnRequest>>,
    /// Senders waiting for the state lock (see [`Shared::lock_for_send`]).
    senders: AtomicUsize,
    stop: Notify,
    /// Tells the progress task that something now needs UCX's events (a
    /// send is in flight).
    wanted: Notify,
    efd: Option<AsyncFd<RawFd>>,
    spin: Duration,
    /// When the link last posted a send or receive of at least
    /// [`STREAMING_BYTES`]: nanoseconds after `created`, plus one (zero:
    /// never). See [`Shared::spin_budget`].
    streamed_at: AtomicU64,
    created: Instant,
    /// How long a sleep on the event fd lasts at most ([`BACKSTOP`]).
    backstop: Duration,
    /// The peer's name, set when the endpoint connects.
    peer: OnceLock<String>,
    _context: Arc<Context>,
}

impl Shared {
    /// Nanoseconds since the link was created, plus one (so that zero
    /// means "never" in [`streamed_at`](Self::streamed_at)).
    fn now(&self) -> u64 {
        u64::try_from(self.created.elapsed().as_nanos()).unwrap_or(u64::MAX - 1) + 1
    }

    /// Notes a send or receive of `len` bytes being posted: a long one
    /// marks the link as streaming.
    fn posting(&self, len: usize) {
        if len >= STREAMING_BYTES {
            self.streamed_at.store(self.now(), Ordering::Relaxed);
        }
    }

    /// How long a wait spins after UCX last reported progress: the
    /// configured spin, or [`STREAMING_SPIN_FACTOR`] times it on a link
    /// that posted a send or receive of at least [`STREAMING_BYTES`] in
    /// the last [`STREAMING_FOR`].
    fn spin_budget(&self) -> Duration {
        // A link that never streamed (small messages only) reads no clock.
        if self.streamed_at.load(Ordering::Relaxed) == 0 {
            return self.spin;
        }
        self.spin_budget_at(self.now())
    }

    /// [`spin_budget`](Self::spin_budget) at `now` (as [`now`](Self::now)
    /// counts).
    fn spin_budget_at(&self, now: u64) -> Duration {
        let at = self.streamed_at.load(Ordering::Relaxed);
        let streaming = at != 0 && Duration::from_nanos(now.saturating_sub(at)) < STREAMING_FOR;
        if streaming {
            self.spin.saturating_mul(STREAMING_SPIN_FACTOR)
        } else {
            self.spin
        }
    }

    fn peer(&self) -> &str {
        self.peer.get().map_or("", String::as_str)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lock, for a send: a task spinning on progress (on another
    /// thread: the RPC caller sends from its own) leaves the lock alone
    /// while a sender waits for it, so the sender takes it at once instead
    /// of parking on it and being woken by a system call.
    fn lock_for_send(&self) -> MutexGuard<'_, State> {
        self.senders.fetch_add(1, Ordering::AcqRel);
        let state = self.lock();
        self.senders.fetch_sub(1, Ordering::AcqRel);
        state
    }

    fn fail(&self, reason: String) {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if failed.is_none() {
            tracing::warn!(peer = %self.peer(), %reason, "UCX link failed");
            *failed = Some(reason);
        }
        self.has_failed.store(true, Ordering::Release);
    }

    fn failure(&self) -> Option<TransportError> {
        if !self.has_failed.load(Ordering::Acquire) {
            return None;
        }
        let reason = self
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_default();
        Some(TransportError::Channel {
            channel: channel::UCX,
            peer: self.peer().to_owned(),
            reason,
        })
    }

    /// Progresses until UCX reports nothing more, sweeps the in-flight
    /// list, and wakes every waiter when the link failed.
    fn progress(&self, state: &mut State) {
        for _ in 0..DRAIN {
            // SAFETY: the worker is live; we hold the state lock.
            if unsafe { self.api.ucp_worker_progress(state.worker) } == 0 {
                break;
            }
        }
        self.sweep(state);
    }

    /// Spins on progress ([`spin_while_active_in_rounds`], with
    /// [`PROGRESS_CALLS_PER_ROUND`] calls per round) until `done` holds
    /// (`true`), or until the [spin budget](Self::spin_budget) has passed
    /// since UCX last reported progress (`false`): a transfer whose bytes
    /// keep arriving (or leaving) is polled to its end, the way
    /// `ucx_perftest` polls, instead of sleeping on the event fd between
    /// its fragments; a quiet link costs at most the budget. A check leaves
    /// the lock alone while a sender waits for it (see
    /// [`Shared::lock_for_send`]). `done` gets the state and whether this
    /// check's progress call reported anything.
    fn spin(&self, mut done: impl FnMut(&mut State, bool) -> bool) -> bool {
        spin_while_active_in_rounds(self.spin_budget(), PROGRESS_CALLS_PER_ROUND, || {
            if self.senders.load(Ordering::Acquire) > 0 {
                return Check::Waiting;
            }
            let Ok(mut state) = self.state.try_lock() else {
                return Check::Waiting;
            };
            // SAFETY: a live worker, under the lock.
            let progressed = unsafe { self.api.ucp_worker_progress(state.worker) } != 0;
            match (done(&mut state, progressed), progressed) {
                (true, _) => Check::Ready,
                (false, true) => Check::Progressed,
                (false, false) => Check::Waiting,
            }
        })
    }

    /// One step of waiting for the peer's connection request: progresses
    /// the worker, then takes the first request from `from` among those the
    /// listener handed over (rejecting the others), or arms the worker.
    fn take_conn_request(&self, from: IpAddr) -> Result<ListenStep, TransportError> {
        let api = self.api;
        let mut state = self.lock();
        if state.listener.is_null() {
            return Err(TransportError::Channel {
                channel: channel::UCX,
                peer: self.peer().to_owned(),
                reason: "this side's UCX worker is not listening".into(),
            });
        }
        self.progress(&mut state);
        let requests =
            std::mem::take(&mut *self.requests.lock().unwrap_or_else(|p| p.into_inner()));
        let mut accepted = None;
        for request in requests {
            // SAFETY: zeroed is a valid attribute block.
            let mut attr: sys::ucp_conn_request_attr_t = unsafe { std::mem::zeroed() };
            attr.field_mask = sys::UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR as u64;
            // SAFETY: a request UCX handed over and not yet accepted or
            // rejected; out-parameter.
            let status = unsafe { api.ucp_conn_request_query(request.0, &mut attr) };
            let client = (status == sys::UCS_OK)
                // SAFETY: filled by UCX, as the query succeeded.
                .then(|| unsafe { sockaddr::parse(&raw const attr.client_address) })
                .flatten();
            if accepted.is_none()
                && client.is_some_and(|c| c.ip().to_canonical() == from.to_canonical())
            {
                accepted = Some(request);
            } else {
                tracing::warn!(
                    client = ?client,
                    expected = %from,
                    "rejected a UCX connection request that is not the peer's"
                );
                // SAFETY: the listener that handed the request over is live;
                // rejected once.
                unsafe { api.ucp_listener_reject(state.listener, request.0) };
            }
        }
        if let Some(request) = accepted {
            return Ok(ListenStep::Accepted(request));
        }
        // SAFETY: a live worker, under the lock.
        Ok(match unsafe { api.ucp_worker_arm(state.worker) } {
            sys::UCS_ERR_BUSY => ListenStep::Busy,
            _ => ListenStep::Armed,
        })
    }

    /// Frees the finished requests of the in-flight list, waking a writer
    /// waiting for room, and every waiter when the link failed.
    fn sweep(&self, state: &mut State) {
        let api = self.api;
        let before = state.inflight.len();
        state.inflight.retain(|f| {
            let status = match &f.completion {
                Some(c) if !c.is_done() => return true,
                Some(c) => c.result().0,
                // SAFETY: a live request of this worker, under the lock.
                None => match unsafe { api.ucp_request_check_status(f.request) } {
                    sys::UCS_INPROGRESS => return true,
                    status => status,
                },
            };
            if status != sys::UCS_OK && status != sys::UCS_ERR_CANCELED {
                tracing::debug!(status = %status_text(api, status), "a UCX send failed");
            }
            // SAFETY: completed; freed once, here.
            unsafe { api.ucp_request_free(f.request) };
            false
        });
        let failed = self.has_failed.load(Ordering::Acquire);
        if state.inflight.len() < before || failed {
            if let Some(waker) = state.room.take() {
                waker.wake();
            }
        }
        if failed {
            for w in state.waiters.drain(..) {
                if let Some(c) = w.upgrade() {
                    if let Some(waker) = c.lock_waker().take() {
                        waker.wake();
                    }
                }
            }
        }
    }
}

impl State {
    /// Whether the progress task must arm the worker and watch its event
    /// fd: a send (or a cancelled request) is unfinished. A task waiting
    /// for a receive progresses by itself, spinning and then sleeping on
    /// the fd (see [`Pending::poll_done`]).
    fn needs_events(&self) -> bool {
        !self.inflight.is_empty()
    }

    /// Adds an unfinished request; the first one wakes the progress task.
    fn push_inflight(&mut self, shared: &Shared, inflight: Inflight) {
        self.inflight.push(inflight);
        if self.inflight.len() == 1 {
            shared.wanted.notify_one();
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The fd belongs to the worker: deregister it first.
        drop(self.efd.take());
        // Under the registry's lock, so the process does not exit in the
        // middle; once it is exiting, UCX is left alone (see `exit`).
        let registry = exit::registry();
        let api = self.api;
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if registry.exiting {
            // What UCX may still write is leaked, not freed.
            std::mem::forget(std::mem::take(&mut state.inflight));
            return;
        }
        destroy(api, state, &self.requests);
    }
}

impl exit::Quiesce for Shared {
    fn quiesce(&self) {
        let state = self.lock();
        // Kept locked: nothing uses this worker again in this process.
        std::mem::forget(state);
    }
}

/// Closes the listener and the endpoint, cancels what is in flight and
/// destroys the worker.
fn destroy(api: &sys::Ucp, state: &mut State, requests: &Mutex<Vec<ConnRequest>>) {
    close_listener(api, state, requests);
    if !state.ep.is_null() {
        // SAFETY: zeroed is a valid parameter block; the endpoint is live.
        let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
        // SAFETY: the endpoint is live and closed once.
        let req = unsafe { api.ucp_ep_close_nbx(state.ep, &param) };
        if is_request(req) {
            for _ in 0..10_000 {
                // SAFETY: worker and request are live.
                unsafe { api.ucp_worker_progress(state.worker) };
                // SAFETY: as above.
                if unsafe { api.ucp_request_check_status(req) } != sys::UCS_INPROGRESS {
                    break;
                }
            }
            // SAFETY: freed once; UCX completes or drops it with the worker.
            unsafe { api.ucp_request_free(req) };
        }
        state.ep = std::ptr::null_mut();
    }
    for f in &state.inflight {
        // SAFETY: a live request of this worker; cancelled and released
        // (the worker's destruction below ends it either way).
        unsafe {
            api.ucp_request_cancel(state.worker, f.request);
        }
    }
    // SAFETY: every request and the endpoint are done with; nothing of
    // this worker is used after this.
    unsafe { api.ucp_worker_destroy(state.worker) };
    // The buffers in `inflight` are dropped after the worker is gone.
    state.inflight.clear();
}

fn is_request(ptr: *mut c_void) -> bool {
    // UCS_PTR_IS_ERR: addresses from (uintptr_t)UCS_ERR_LAST up are status
    // codes; null is UCS_OK.
    !ptr.is_null() && (ptr as usize) < (sys::UCS_ERR_LAST as isize) as usize
}

fn ptr_status(ptr: *mut c_void) -> sys::ucs_status_t {
    if ptr.is_null() {
        sys::UCS_OK
    } else {
        ptr as isize as sys::ucs_status_t
    }
}

fn is_error_ptr(ptr: *mut c_void) -> bool {
    !ptr.is_null() && !is_request(ptr)
}

/// A link to the peer's UCX worker: cloned by the connection's reader,
/// writer and channels; the last handle stops the progress task, which
/// then releases the worker.
pub(crate) struct UcxLink {
    shared: Arc<Shared>,
    _handle: Arc<StopOnDrop>,
}

impl Clone for UcxLink {
    fn clone(&self) -> Self {
        UcxLink {
            shared: self.shared.clone(),
            _handle: self._handle.clone(),
        }
    }
}

struct StopOnDrop(Arc<Shared>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stop.notify_one();
    }
}

/// A worker whose endpoint is not connected yet: its address goes in the
/// handshake.
pub(crate) struct UcxWorker {
    shared: Arc<Shared>,
    address: Vec<u8>,
    /// Whether UCX's transports may include one with peer failure
    /// detection (see [`UcxWorker::connect`]).
    peer_mode: bool,
}

/// Whether a `UCX_TLS` list (`None`: UCX's default, every transport) names
/// a transport other than the shared-memory ones and `self`, which have no
/// peer failure detection in UCX 1.13.
fn may_detect_peer_failure(tls: Option<&str>) -> bool {
    tls.is_none_or(|list| {
        list.split(',').map(str::trim).any(|t| {
            let t = t.trim_start_matches('^');
            !(super::is_shared_memory(t) || t == "self" || t.is_empty())
        })
    })
}

/// A new worker's address and event fd, or what failed with UCX's status.
fn describe(
    api: &sys::Ucp,
    worker: sys::ucp_worker_h,
) -> Result<(Vec<u8>, RawFd), (&'static str, sys::ucs_status_t)> {
    let mut addr: *mut sys::ucp_address_t = std::ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: a live worker; out-parameters.
    let status = unsafe { api.ucp_worker_get_address(worker, &mut addr, &mut len) };
    if status != sys::UCS_OK {
        return Err(("reading the UCX worker's address failed", status));
    }
    // SAFETY: UCX returned `len` bytes at `addr`, released right after.
    let address = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
    // SAFETY: released once.
    unsafe { api.ucp_worker_release_address(worker, addr) };
    let mut efd: RawFd = -1;
    // SAFETY: a live worker created with wakeup events; out-parameter.
    let status = unsafe { api.ucp_worker_get_efd(worker, &mut efd) };
    if status != sys::UCS_OK {
        return Err(("the UCX worker has no event fd", status));
    }
    Ok((address, efd))
}

impl UcxWorker {
    /// Creates a worker on the context for `tls`.
    pub(crate) fn new(tls: Option<&str>, spin: Duration) -> Result<Self, TransportError> {
        Self::with_backstop(tls, spin, BACKSTOP)
    }

    /// [`new`](Self::new) with another backstop: the tests use one so
    /// long that only the event fd can end a sleep.
    fn with_backstop(
        tls: Option<&str>,
        spin: Duration,
        backstop: Duration,
    ) -> Result<Self, TransportError> {
        let api = super::api()?;
        // Held until the worker is registered (see `exit`).
        let mut registry = exit::registry();
        if registry.exiting {
            return Err(TransportError::Unavailable {
                what: "UCX",
                reason: "the process is exiting".into(),
            });
        }
        let ctx = context(tls)?;
        let unavailable = |what: &str, status| TransportError::Unavailable {
            what: "UCX",
            reason: format!("{what}: {}", status_text(api, status)),
        };
        // SAFETY: zeroed is a valid parameter block.
        let mut params: sys::ucp_worker_params_t = unsafe { std::mem::zeroed() };
        params.field_mask =
            (sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE | sys::UCP_WORKER_PARAM_FIELD_EVENTS) as u64;
        params.thread_mode = sys::UCS_THREAD_MODE_SERIALIZED;
        params.events = sys::UCP_WAKEUP_TAG_SEND
            | sys::UCP_WAKEUP_TAG_RECV
            | sys::UCP_WAKEUP_TX
            | sys::UCP_WAKEUP_RX;
        let mut worker: sys::ucp_worker_h = std::ptr::null_mut();
        // SAFETY: a live context; out-parameter.
        let status = unsafe { api.ucp_worker_create(ctx.handle, &params, &mut worker) };
        if status != sys::UCS_OK {
            return Err(unavailable("creating a UCX worker failed", status));
        }
        // What UCX says of the new worker; on failure the worker is
        // destroyed here (no `Shared` owns it yet).
        let described = describe(api, worker).inspect_err(|_| {
            // SAFETY: created above, used by nothing else.
            unsafe { api.ucp_worker_destroy(worker) };
        });
        let (address, efd) = match described {
            Ok(d) => d,
            Err((what, status)) => return Err(unavailable(what, status)),
        };
        // SAFETY: the worker owns the fd and keeps it open until it is
        // destroyed, which `Shared::drop` does only after dropping this.
        let fd =
            match unsafe { AsyncFd::register_with_interest(efd, tokio::io::Interest::READABLE) } {
                Ok(fd) => fd,
                Err(e) => {
                    // SAFETY: as above.
                    unsafe { api.ucp_worker_destroy(worker) };
                    return Err(TransportError::Unavailable {
                        what: "UCX",
                        reason: format!("cannot watch the UCX worker's event fd: {e}"),
                    });
                }
            };
        let shared = Arc::new(Shared {
            api,
            state: Mutex::new(State {
                worker,
                ep: std::ptr::null_mut(),
                listener: std::ptr::null_mut(),
                inflight: Vec::new(),
                waiters: Vec::new(),
                room: None,
            }),
            failed: Mutex::new(None),
            has_failed: AtomicBool::new(false),
            requests: Mutex::new(Vec::new()),
            senders: AtomicUsize::new(0),
            stop: Notify::new(),
            wanted: Notify::new(),
            efd: Some(fd),
            spin,
            streamed_at: AtomicU64::new(0),
            created: Instant::now(),
            backstop,
            peer: OnceLock::new(),
            _context: ctx,
        });
        let weak: Weak<Shared> = Arc::downgrade(&shared);
        registry.push(weak);
        drop(registry);
        let peer_mode = may_detect_peer_failure(super::effective_tls(tls).as_deref());
        Ok(UcxWorker {
            shared,
            address,
            peer_mode,
        })
    }

    /// Whether UCX's transports may include one with peer failure
    /// detection (a network one): where they do, the endpoint asks for
    /// peer-failure handling, and the accepting side listens
    /// ([`listen`](Self::listen)).
    pub(crate) fn may_detect_peer_failure(&self) -> bool {
        self.peer_mode
    }

    /// The worker's address, for the peer.
    pub(crate) fn address(&self) -> &[u8] {
        &self.address
    }

    /// Connects to the peer's worker at `peer_address` and starts the
    /// progress task (on the current tokio runtime).
    pub(crate) fn connect(
        self,
        peer_address: &[u8],
        peer: &str,
    ) -> Result<UcxLink, TransportError> {
        self.connect_with(
            peer,
            "connecting to the peer's UCX worker",
            true,
            |params| {
                params.field_mask |= sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64;
                params.address = peer_address.as_ptr() as *const sys::ucp_address_t;
            },
        )
    }

    /// Connects to the peer's listener at `addr` ([`listen`](Self::listen)
    /// on its side) through UCX's connection manager, and starts the
    /// progress task (on the current tokio runtime).
    pub(crate) fn connect_to_listener(
        self,
        addr: SocketAddr,
        peer: &str,
    ) -> Result<UcxLink, TransportError> {
        let raw = socket2::SockAddr::from(addr);
        self.connect_with(
            peer,
            &format!("connecting to the peer's UCX listener at {addr}"),
            false,
            |params| {
                params.field_mask |=
                    (sys::UCP_EP_PARAM_FIELD_SOCK_ADDR | sys::UCP_EP_PARAM_FIELD_FLAGS) as u64;
                params.sockaddr = sockaddr::as_ucs(&raw);
                params.flags = sys::UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
            },
        )
    }

    /// Starts listening, on `ip` and a port the system picks, for the
    /// peer's client-server connection ([`connect_to_listener`] on its
    /// side), and returns the address the peer connects to; the worker then
    /// connects with [`accept`](Self::accept).
    ///
    /// Why: an endpoint UCX connects through its connection manager has its
    /// TCP lanes connected endpoint to endpoint, which lets UCX 1.13 keep
    /// zero-copy rendezvous (both sides' sockets close on a failure, so no
    /// memory registration needs invalidating) together with peer-failure
    /// handling. An endpoint created from a worker address with peer-failure
    /// handling gets neither over TCP, and its bulk data goes as fragments
    /// the receiver copies (see the user guide).
    ///
    /// [`connect_to_listener`]: Self::connect_to_listener
    pub(crate) fn listen(&mut self, ip: IpAddr) -> Result<SocketAddr, TransportError> {
        let shared = &self.shared;
        let api = shared.api;
        let fail = |what: &str, status| TransportError::Unavailable {
            what: "UCX",
            reason: format!("{what}: {}", status_text(api, status)),
        };
        let raw = socket2::SockAddr::from(SocketAddr::new(ip, 0));
        // SAFETY: zeroed is a valid parameter block.
        let mut params: sys::ucp_listener_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = (sys::UCP_LISTENER_PARAM_FIELD_SOCK_ADDR
            | sys::UCP_LISTENER_PARAM_FIELD_CONN_HANDLER) as u64;
        params.sockaddr = sockaddr::as_ucs(&raw);
        params.conn_handler.cb = Some(conn_requested);
        params.conn_handler.arg = Arc::as_ptr(shared) as *mut c_void;
        let mut state = shared.lock();
        let mut listener: sys::ucp_listener_h = std::ptr::null_mut();
        // SAFETY: a live worker under the lock; the address outlives the
        // call; the handler's argument outlives the listener (destroyed
        // before the `Shared` is).
        let status = unsafe { api.ucp_listener_create(state.worker, &params, &mut listener) };
        if status != sys::UCS_OK {
            return Err(fail(
                &format!("listening for UCX connections on {ip} failed"),
                status,
            ));
        }
        state.listener = listener;
        // SAFETY: zeroed is a valid attribute block.
        let mut attr: sys::ucp_listener_attr_t = unsafe { std::mem::zeroed() };
        attr.field_mask = sys::UCP_LISTENER_ATTR_FIELD_SOCKADDR as u64;
        // SAFETY: a live listener; out-parameter.
        let status = unsafe { api.ucp_listener_query(listener, &mut attr) };
        let addr = if status == sys::UCS_OK {
            // SAFETY: UCX filled the `sockaddr_storage`.
            unsafe { sockaddr::parse(&raw const attr.sockaddr) }.ok_or_else(|| {
                TransportError::Unavailable {
                    what: "UCX",
                    reason: "the UCX listener's address is neither IPv4 nor IPv6".into(),
                }
            })
        } else {
            Err(fail("reading the UCX listener's address failed", status))
        };
        if addr.is_err() {
            close_listener(api, &mut state, &shared.requests);
        }
        addr
    }

    /// Waits, at most `timeout`, for the peer's connection on the listener
    /// ([`listen`](Self::listen)), accepts the first request that comes
    /// from `from` (the address of the peer's TCP connection; others are
    /// rejected), closes the listener and starts the progress task. The
    /// probe that follows ([`UcxLink::probe`]) proves the endpoint reaches
    /// the peer of the handshake.
    pub(crate) async fn accept(
        self,
        from: IpAddr,
        peer: &str,
        timeout: Duration,
    ) -> Result<UcxLink, TransportError> {
        let shared = self.shared.clone();
        let api = shared.api;
        let wait = async {
            loop {
                match shared.take_conn_request(from)? {
                    ListenStep::Accepted(request) => return Ok::<_, TransportError>(request),
                    // Events pending: progress again, letting other tasks
                    // run in between.
                    ListenStep::Busy => tokio::task::yield_now().await,
                    ListenStep::Armed => sleep_on_fd(shared.clone()).await,
                }
            }
        };
        let request =
            tokio::time::timeout(timeout, wait)
                .await
                .map_err(|_| TransportError::Channel {
                    channel: channel::UCX,
                    peer: peer.to_owned(),
                    reason: format!(
                        "the peer did not connect to this side's UCX listener within {timeout:?}"
                    ),
                })??;
        let link = self.connect_with(
            peer,
            "accepting the peer's UCX connection",
            false,
            |params| {
                params.field_mask |= sys::UCP_EP_PARAM_FIELD_CONN_REQUEST as u64;
                params.conn_request = request.0;
            },
        );
        // Requests that came after the accepted one are rejected.
        close_listener(api, &mut shared.lock(), &shared.requests);
        link
    }

    /// Creates the endpoint (with what `fill` adds to its parameters) and
    /// starts the progress task (on the current tokio runtime). With
    /// `retry`, an endpoint with peer-failure handling that UCX finds no
    /// transport for is tried again without it; never for a connection
    /// request, which UCX releases when an endpoint cannot be made from it.
    fn connect_with(
        self,
        peer: &str,
        what: &str,
        retry: bool,
        fill: impl Fn(&mut sys::ucp_ep_params_t),
    ) -> Result<UcxLink, TransportError> {
        let UcxWorker {
            shared, peer_mode, ..
        } = self;
        let _ = shared.peer.set(peer.to_owned());
        let api = shared.api;
        {
            let mut state = shared.lock();
            // Peer failure handling where UCX's transports have it (its TCP
            // and network transports): without it, UCX 1.13 aborts the
            // process (an assertion in `ucp_ep_set_failed`) when a peer's
            // TCP endpoint fails. Its shared-memory transports have none:
            // with only those, the endpoint goes without (the peer's exit is
            // noticed on the connection's TCP socket, which the `ucx`
            // transport's reader watches, and by the frame stall timeout).
            let modes: &[sys::ucp_err_handling_mode_t] = if peer_mode && retry {
                &[
                    sys::UCP_ERR_HANDLING_MODE_PEER,
                    sys::UCP_ERR_HANDLING_MODE_NONE,
                ]
            } else if peer_mode {
                &[sys::UCP_ERR_HANDLING_MODE_PEER]
            } else {
                &[sys::UCP_ERR_HANDLING_MODE_NONE]
            };
            let mut status = sys::UCS_ERR_UNREACHABLE;
            let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
            for &mode in modes {
                // SAFETY: zeroed is a valid parameter block.
                let mut params: sys::ucp_ep_params_t = unsafe { std::mem::zeroed() };
                params.field_mask = (sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER)
                    as u64;
                fill(&mut params);
                params.err_mode = mode;
                params.err_handler.cb = Some(ep_failed);
                params.err_handler.arg = Arc::as_ptr(&shared) as *mut c_void;
                // SAFETY: a live worker; what `fill` points to outlives the
                // call (UCX copies or unpacks it); the handler's argument
                // outlives the endpoint.
                status = unsafe { api.ucp_ep_create(state.worker, &params, &mut ep) };
                if status != sys::UCS_ERR_UNREACHABLE {
                    break;
                }
            }
            if status != sys::UCS_OK {
                return Err(TransportError::Channel {
                    channel: channel::UCX,
                    peer: peer.to_owned(),
                    reason: format!("{what} failed: {}", status_text(api, status)),
                });
            }
            state.ep = ep;
        }
        tokio::spawn(drive(shared.clone()));
        Ok(UcxLink {
            _handle: Arc::new(StopOnDrop(shared.clone())),
            shared,
        })
    }
}

/// Destroys the listener, if any, rejecting the requests it handed over
/// (into `requests`) that were not accepted.
fn close_listener(api: &sys::Ucp, state: &mut State, requests: &Mutex<Vec<ConnRequest>>) {
    if state.listener.is_null() {
        return;
    }
    let pending = std::mem::take(&mut *requests.lock().unwrap_or_else(|p| p.into_inner()));
    for request in pending {
        // SAFETY: the listener is live; each request is rejected once.
        unsafe { api.ucp_listener_reject(state.listener, request.0) };
    }
    // SAFETY: a live listener, destroyed once, before its worker.
    unsafe { api.ucp_listener_destroy(state.listener) };
    state.listener = std::ptr::null_mut();
}

/// The progress task, until the last handle of the link is gone:
/// progress; then, while a send is unfinished ([`State::needs_events`]),
/// spin on progress while UCX keeps moving it, then arm the worker and
/// sleep on its event fd, bounded by the backstop
/// timer (one timer, reset rather than created anew each time);
/// otherwise sleep until a send is unfinished ([`Shared::wanted`]), with
/// no timer. Nothing needs this task then: a waiting receive progresses
/// the worker itself. A timer there woke a runtime thread every 5 ms for
/// nothing, and that thread then held tokio's I/O driver and took over the
/// receive its events woke, so a connection's reader moved between the
/// runtime's threads (see the user guide).
async fn drive(shared: Arc<Shared>) {
    let api = shared.api;
    let backstop = tokio::time::sleep(shared.backstop);
    tokio::pin!(backstop);
    loop {
        // While sends are unfinished and UCX keeps moving them, poll them
        // the way a waiting receive polls (for at most the spin time since
        // the last progress) rather than sleep on the fd between their
        // fragments: a rendezvous over TCP moves its data as the socket
        // drains. Measured with `ucx_bench` over UCX's tcp, 6 alternating
        // rounds: 4 MiB one way 2698 -> 3116 MB/s (faster in 5 of 6).
        if shared.lock().needs_events() {
            shared.spin(|state, _| {
                shared.sweep(state);
                !state.needs_events()
            });
        }
        let armed = {
            let mut state = shared.lock();
            shared.progress(&mut state);
            if state.needs_events() {
                // SAFETY: a live worker, under the lock.
                let status = unsafe { api.ucp_worker_arm(state.worker) };
                Some(status == sys::UCS_OK)
            } else {
                None
            }
        };
        if armed == Some(false) {
            // Events are pending (UCS_ERR_BUSY): progress again, letting
            // other tasks run in between.
            tokio::task::yield_now().await;
            continue;
        }
        let Some(fd) = shared.efd.as_ref() else {
            return;
        };
        if armed.is_none() {
            // Nothing unfinished: until a send is (no timer, see above).
            tokio::select! {
                _ = shared.wanted.notified() => continue,
                _ = shared.stop.notified() => return,
            }
        }
        backstop
            .as_mut()
            .reset(tokio::time::Instant::now() + shared.backstop);
        tokio::select! {
            ready = fd.readable() => {
                if let Ok(mut guard) = ready {
                    guard.clear_ready();
                }
            }
            _ = &mut backstop => {}
            _ = shared.stop.notified() => return,
        }
    }
}

impl UcxLink {
    /// Why the link failed, if it did.
    pub(crate) fn failure(&self) -> Option<TransportError> {
        self.shared.failure()
    }

    fn error(&self, what: &str, status: sys::ucs_status_t) -> TransportError {
        TransportError::Channel {
            channel: channel::UCX,
            peer: self.shared.peer().to_owned(),
            reason: format!("{what}: {}", status_text(self.shared.api, status)),
        }
    }

    /// Posts a tagged receive of at most `len` bytes into `ptr`.
    ///
    /// # Safety
    /// As [`Self::send_kept`]; the bytes must also be writable.
    unsafe fn post_recv(
        &self,
        state: &mut State,
        tag: u64,
        ptr: *mut u8,
        len: usize,
    ) -> Result<(*mut c_void, Arc<Completion>), TransportError> {
        self.shared.posting(len);
        let completion = Arc::new(Completion::default());
        // SAFETY: zeroed is a valid parameter block.
        let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        // Always a request, and the callback reports the length (UCX 1.13
        // leaves the receive information of an immediate completion unset).
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_CALLBACK
            | sys::UCP_OP_ATTR_FIELD_USER_DATA
            | sys::UCP_OP_ATTR_FIELD_DATATYPE
            | sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
        param.cb.recv = Some(recv_done);
        param.user_data = Arc::as_ptr(&completion) as *mut c_void;
        param.datatype = contig();
        // SAFETY: a live worker under the lock; the caller keeps the bytes.
        let req = unsafe {
            self.shared.api.ucp_tag_recv_nbx(
                state.worker,
                ptr as *mut c_void,
                len,
                tag,
                u64::MAX,
                &param,
            )
        };
        if is_error_ptr(req) {
            return Err(self.error("posting a UCX receive failed", ptr_status(req)));
        }
        if req.is_null() {
            return Err(self.error(
                "UCX completed a receive without a request",
                sys::UCS_ERR_INVALID_PARAM,
            ));
        }
        Ok((req, completion))
    }

    /// Sends `len` bytes at `ptr` with `tag`, fire and forget: `keep`
    /// (which owns the bytes) is held until UCX completed the send.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be owned by `keep` and stay valid while it lives.
    pub(crate) unsafe fn send_kept(
        &self,
        tag: u64,
        ptr: *const u8,
        len: usize,
        keep: Box<dyn Any + Send>,
    ) -> Result<(), TransportError> {
        // SAFETY: as this function's contract.
        unsafe { self.send_or_keep(tag, ptr, len, || keep) }.map(|_| ())
    }

    /// Sends `len` bytes at `ptr` with `tag`, fire and forget, in one UCX
    /// call. `Ok(true)`: UCX completed the send within the call (small
    /// messages: it copied the bytes into its own buffers), so they may be
    /// reused at once and `keep` was not called. `Ok(false)`: UCX still
    /// reads the bytes; `keep()`, which must take ownership of them, is
    /// held in the in-flight list until UCX completed the send.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid until this returns, and after it
    /// returns `false` for as long as what `keep()` returned lives (moving
    /// that must not move the bytes).
    pub(crate) unsafe fn send_or_keep(
        &self,
        tag: u64,
        ptr: *const u8,
        len: usize,
        keep: impl FnOnce() -> Box<dyn Any + Send>,
    ) -> Result<bool, TransportError> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        self.shared.posting(len);
        let mut state = self.shared.lock_for_send();
        // No callback: nobody waits for a fire-and-forget send; the sweep
        // checks its status.
        // SAFETY: zeroed is a valid parameter block.
        let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_DATATYPE;
        param.datatype = contig();
        // SAFETY: a live endpoint under the lock; the bytes stay valid
        // through the call, and after it, if UCX returns a request, in
        // what `keep` returns, which goes to the in-flight list until UCX
        // is done with them.
        let request = unsafe {
            self.shared
                .api
                .ucp_tag_send_nbx(state.ep, ptr as *const c_void, len, tag, &param)
        };
        if is_error_ptr(request) {
            return Err(self.error("posting a UCX send failed", ptr_status(request)));
        }
        if request.is_null() {
            return Ok(true);
        }
        let inflight = Inflight {
            request,
            completion: None,
            _keep: keep(),
        };
        state.push_inflight(&self.shared, inflight);
        Ok(false)
    }

    /// Unfinished fire-and-forget sends and cancelled requests.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        self.shared.lock().inflight.len()
    }

    /// Whether the progress task arms the worker (see
    /// [`State::needs_events`]).
    #[cfg(test)]
    fn needs_events(&self) -> bool {
        self.shared.lock().needs_events()
    }

    /// `Ready` once at most `limit` sends (and cancelled requests) are
    /// unfinished, or with the link's failure. Otherwise the task sleeps
    /// until the progress task's sweep finishes one: no polling.
    pub(crate) fn poll_in_flight_at_most(
        &self,
        cx: &mut TaskContext<'_>,
        limit: usize,
    ) -> Poll<Result<(), TransportError>> {
        if let Some(e) = self.failure() {
            return Poll::Ready(Err(e));
        }
        let shared = &self.shared;
        if shared.lock_for_send().inflight.len() <= limit {
            return Poll::Ready(Ok(()));
        }
        // Progress the sends while they move, as a receive does.
        shared.spin(|state, progressed| {
            if progressed {
                shared.sweep(state);
            }
            state.inflight.len() <= limit
        });
        let mut state = shared.lock_for_send();
        if state.inflight.len() <= limit {
            return Poll::Ready(Ok(()));
        }
        match &mut state.room {
            Some(w) => w.clone_from(cx.waker()),
            None => state.room = Some(cx.waker().clone()),
        }
        drop(state);
        // The failure may have come between the check and the waker.
        if let Some(e) = self.failure() {
            return Poll::Ready(Err(e));
        }
        Poll::Pending
    }

    /// Posts a receive into memory owned by `keep`, returning the request
    /// to wait for.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be owned by `keep`, writable, and stay valid
    /// while it lives (moving `keep` must not move the bytes).
    pub(crate) unsafe fn recv(
        &self,
        tag: u64,
        ptr: *mut u8,
        len: usize,
        keep: Box<dyn Any + Send>,
    ) -> Result<Pending, TransportError> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let mut state = self.shared.lock();
        // SAFETY: `keep` owns the bytes and travels with the request.
        let (request, completion) = unsafe { self.post_recv(&mut state, tag, ptr, len)? };
        state.waiters.retain(|w| w.strong_count() > 0);
        state.waiters.push(Arc::downgrade(&completion));
        Ok(Pending {
            link: self.clone(),
            request,
            completion: Some(completion),
            keep: Some(keep),
            spun: false,
            sleep: None,
        })
    }
}

impl UcxLink {
    /// The first UCX exchange of a connection: sends `PROBE_TAG` with
    /// `nonce` to the peer and waits, at most `timeout`, for the peer's
    /// probe. `Ok` once the peer's probe arrived whole, so the path from
    /// the peer to this side carries messages; the peer checks the other
    /// direction. An error says what failed (UCX's status, the endpoint's
    /// failure, or the time that ran out).
    pub(crate) async fn probe(&self, nonce: u64, timeout: Duration) -> Result<(), String> {
        let mut dest = Box::new(0u64);
        let dptr = (&mut *dest as *mut u64).cast::<u8>();
        // SAFETY: the boxed u64 owns the 8 bytes, moves with the request
        // and does not move its heap bytes when moved.
        let pending = unsafe { self.recv(PROBE_TAG, dptr, 8, dest) }.map_err(|e| e.to_string())?;
        let msg = Box::new(nonce.to_le_bytes());
        let mptr = msg.as_ptr();
        // SAFETY: as above, for the message's bytes.
        unsafe { self.send_kept(PROBE_TAG, mptr, 8, msg) }.map_err(|e| e.to_string())?;
        match tokio::time::timeout(timeout, pending).await {
            Err(_) => Err(format!("no probe from the peer within {timeout:?}")),
            Ok(Err(e)) => Err(e.to_string()),
            Ok(Ok((_, 8))) => Ok(()),
            Ok(Ok((_, n))) => Err(format!("the peer's probe had {n} bytes instead of 8")),
        }
    }
}

fn contig() -> sys::ucp_datatype_t {
    // ucp_dt_make_contig(1): (1 << UCP_DATATYPE_SHIFT) | UCP_DATATYPE_CONTIG.
    ((1u64) << sys::UCP_DATATYPE_SHIFT) | sys::UCP_DATATYPE_CONTIG as u64
}

/// A finished receive: its buffer (the `keep` it was posted with) and the
/// length UCX wrote.
pub(crate) type Received = (Box<dyn Any + Send>, usize);

/// A posted receive, owning its buffer until UCX is done with it.
pub(crate) struct Pending {
    link: UcxLink,
    request: *mut c_void,
    completion: Option<Arc<Completion>>,
    keep: Option<Box<dyn Any + Send>>,
    /// Whether this wait has spun already.
    spun: bool,
    /// While the task sleeps: its wait for the worker's event fd.
    sleep: Option<Sleep>,
}

/// A sleeping receive's wait: until the worker's event fd is readable (its
/// readiness then cleared, so the next wait waits for a new event) or the
/// backstop timer fires.
type Sleep = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

fn sleep_on_fd(shared: Arc<Shared>) -> Sleep {
    Box::pin(async move {
        let backstop = tokio::time::sleep(shared.backstop);
        let Some(fd) = shared.efd.as_ref() else {
            return backstop.await;
        };
        tokio::select! {
            ready = fd.readable() => {
                if let Ok(mut guard) = ready {
                    guard.clear_ready();
                }
            }
            _ = backstop => {}
        }
    })
}

// SAFETY: the request pointer is only used under the link's lock.
unsafe impl Send for Pending {}
// SAFETY: nothing is reachable through a shared reference (every method
// takes `&mut self`).
unsafe impl Sync for Pending {}

impl Pending {
    /// Polls for completion: `Ready` with the buffer and the received
    /// length, or an error (UCX's status, or the link's failure).
    pub(crate) fn poll_done(
        &mut self,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Result<Received, TransportError>> {
        let Some(c) = self.completion.clone() else {
            return Poll::Ready(Err(TransportError::Channel {
                channel: channel::UCX,
                peer: self.link.shared.peer().to_owned(),
                reason: "a UCX receive was polled after it finished".into(),
            }));
        };
        if !c.is_done() && !self.spun {
            // A bounded spin on progress, once per wait, the way the `shm`
            // transport's rings wait: rounds of checks with the CPU yielded
            // to the OS in between, so a thread with work on this core (often
            // the one about to answer) runs first; then sleep on the fd.
            self.spun = true;
            let shared = &self.link.shared;
            shared.spin(|state, _| {
                let done = c.is_done();
                if done {
                    // Only the sweep: the progress call that completed
                    // this receive ran just now, and whatever else it
                    // completed is swept; more progress would delay
                    // handing these bytes on.
                    shared.sweep(state);
                }
                done
            });
        }
        if !c.is_done() {
            std::task::ready!(self.poll_sleep(&c, cx))?;
        }
        self.spun = false;
        self.sleep = None;
        let result = c.result();
        let request = std::mem::replace(&mut self.request, std::ptr::null_mut());
        self.completion = None;
        {
            let shared = &self.link.shared;
            let _state = shared.lock();
            // SAFETY: completed; freed once, under the lock.
            unsafe { shared.api.ucp_request_free(request) };
        }
        let (status, len) = result;
        let keep = self.keep.take();
        if status != sys::UCS_OK {
            return Poll::Ready(Err(self.link.error("a UCX receive failed", status)));
        }
        match keep {
            Some(k) => Poll::Ready(Ok((k, len))),
            None => Poll::Ready(Err(self.link.error("a UCX receive finished twice", status))),
        }
    }
}

impl Pending {
    /// The sleeping half of [`poll_done`](Self::poll_done): `Ready(Ok)`
    /// once the request completed, `Ready(Err)` with the link's failure.
    /// Each round progresses the worker and, if the request is still
    /// open, arms the worker and waits for its event fd (the waker also
    /// kept in the completion, for a progress call made by another task).
    fn poll_sleep(
        &mut self,
        c: &Completion,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Result<(), TransportError>> {
        let shared = &self.link.shared;
        // Completed, or the link failed: the wait is over either way.
        let settled = || {
            if c.is_done() {
                Some(Ok(()))
            } else {
                shared.failure().map(Err)
            }
        };
        loop {
            if let Some(sleep) = self.sleep.as_mut() {
                // Polled by another task (or with another waker): that one
                // is woken from now on.
                c.register(cx.waker());
                if sleep.as_mut().poll(cx).is_pending() {
                    // Woken by the completion (another task's progress or
                    // the link's failure), or polled for another reason.
                    return settled().map_or(Poll::Pending, Poll::Ready);
                }
                self.sleep = None;
                // This task is awake and progresses the worker itself next:
                // a completion it causes must not wake it again.
                c.unregister();
            }
            let mut armed = false;
            for _ in 0..ARM_TRIES {
                let mut state = shared.lock();
                shared.progress(&mut state);
                if let Some(r) = settled() {
                    return Poll::Ready(r);
                }
                // SAFETY: a live worker, under the lock.
                match unsafe { shared.api.ucp_worker_arm(state.worker) } {
                    sys::UCS_OK => {
                        armed = true;
                        break;
                    }
                    // Events arrived since the progress call: again.
                    sys::UCS_ERR_BUSY => {}
                    status => {
                        return Poll::Ready(Err(self
                            .link
                            .error("arming the UCX worker failed", status)))
                    }
                }
            }
            if !armed {
                // UCX keeps reporting events: let other tasks run, then
                // try again.
                if crate::shm::yield_once(cx).is_pending() {
                    return Poll::Pending;
                }
                continue;
            }
            // The waker goes in before the last check: a progress call of
            // another task that completes the request after this check
            // finds it and wakes this task.
            c.register(cx.waker());
            if let Some(r) = settled() {
                return Poll::Ready(r);
            }
            self.sleep = Some(sleep_on_fd(shared.clone()));
        }
    }
}

impl std::future::Future for Pending {
    type Output = Result<Received, TransportError>;
    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        self.get_mut().poll_done(cx)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some(completion) = self.completion.take() else {
            return;
        };
        let keep = self.keep.take();
        let shared = &self.link.shared;
        let mut state = shared.lock();
        if !completion.is_done() {
            // SAFETY: a live request of this worker.
            unsafe { shared.api.ucp_request_cancel(state.worker, self.request) };
        }
        // Freed by the sweep once UCX completed it (the cancel completes
        // it with UCS_ERR_CANCELED, or the data arrived first).
        let inflight = Inflight {
            request: self.request,
            completion: Some(completion),
            _keep: Box::new(keep),
        };
        state.push_inflight(shared, inflight);
        shared.progress(&mut state);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::net::{IpAddr, Ipv4Addr};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::task::Poll;
    use std::time::Duration;

    use super::{UcxLink, UcxWorker, STREAMING_BYTES, STREAMING_FOR, STREAMING_SPIN_FACTOR};

    /// Two workers of this process connected to each other, or `None`
    /// (with the reason printed) where UCX does not load.
    pub(crate) fn linked(tls: &str) -> Option<(UcxLink, UcxLink)> {
        linked_spinning(tls, Duration::from_micros(20))
    }

    /// As [`linked`], with waits that spin for `spin`.
    fn linked_spinning(tls: &str, spin: Duration) -> Option<(UcxLink, UcxLink)> {
        linked_with(tls, spin, super::BACKSTOP)
    }

    /// As [`linked`], with waits that do not spin and sleeps that only the
    /// event fd ends (a backstop of a day).
    fn linked_asleep(tls: &str) -> Option<(UcxLink, UcxLink)> {
        linked_with(tls, Duration::ZERO, Duration::from_secs(86_400))
    }

    fn linked_with(tls: &str, spin: Duration, backstop: Duration) -> Option<(UcxLink, UcxLink)> {
        if let Err(reason) = super::super::viability() {
            eprintln!("skipped: {reason}");
            return None;
        }
        let a = UcxWorker::with_backstop(Some(tls), spin, backstop).unwrap();
        let b = UcxWorker::with_backstop(Some(tls), spin, backstop).unwrap();
        let (addr_a, addr_b) = (a.address().to_vec(), b.address().to_vec());
        Some((
            a.connect(&addr_b, "b").unwrap(),
            b.connect(&addr_a, "a").unwrap(),
        ))
    }

    /// Two workers of this process, connected through a listener the way
    /// the handshake connects them where UCX's transports include TCP
    /// ([`UcxWorker::listen`]), with waits that spin for `spin` and sleeps
    /// bounded by `backstop`; or `None` where UCX does not load.
    async fn linked_by_listener(
        tls: &str,
        spin: Duration,
        backstop: Duration,
    ) -> Option<(UcxLink, UcxLink)> {
        if let Err(reason) = super::super::viability() {
            eprintln!("skipped: {reason}");
            return None;
        }
        let mut a = UcxWorker::with_backstop(Some(tls), spin, backstop).unwrap();
        let b = UcxWorker::with_backstop(Some(tls), spin, backstop).unwrap();
        let here = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let addr = a.listen(here).unwrap();
        assert_eq!(addr.ip(), here);
        assert_ne!(addr.port(), 0, "the listener's address names its port");
        let b = b.connect_to_listener(addr, "a").unwrap();
        // The client's endpoint connects as its worker progresses: its
        // probe progresses it while this side accepts, as in the handshake.
        let (a, probed) = tokio::join!(
            async {
                let a = a.accept(here, "b", Duration::from_secs(30)).await.unwrap();
                a.probe(1, Duration::from_secs(30)).await.unwrap();
                a
            },
            b.probe(2, Duration::from_secs(30))
        );
        probed.unwrap();
        Some((a, b))
    }

    /// Sends `len` patterned bytes from `from` to `to` under `tag` and
    /// checks every byte that arrives.
    async fn cross(from: &UcxLink, to: &UcxLink, tag: u64, len: usize) {
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let ptr = bytes.as_ptr();
        // SAFETY: the vector owns the bytes and is kept with the request.
        unsafe { from.send_kept(tag, ptr, len, Box::new(bytes)) }.unwrap();
        let mut dest = vec![0u8; len];
        let dptr = dest.as_mut_ptr();
        // SAFETY: `dest`'s heap bytes move with it into the request.
        let pending = unsafe { to.recv(tag, dptr, len, Box::new(dest)) }.unwrap();
        let (keep, got) = tokio::time::timeout(Duration::from_secs(60), pending)
            .await
            .expect("the message never arrived")
            .unwrap();
        assert_eq!(got, len);
        let dest = keep.downcast::<Vec<u8>>().unwrap();
        assert!(dest.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_link_made_through_a_listener_carries_small_and_rendezvous_messages_both_ways() {
        let Some((a, b)) =
            linked_by_listener("tcp", Duration::from_micros(20), super::BACKSTOP).await
        else {
            return;
        };
        // 8 MiB is far above UCX's rendezvous threshold: the zero-copy
        // rendezvous this listener exists for.
        for (tag, len) in [(10, 8), (11, 8 << 20)] {
            cross(&a, &b, tag, len).await;
            cross(&b, &a, tag + 100, len).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_goes_away_fails_a_sleeping_receive_on_a_link_made_through_a_listener() {
        // Peer-failure handling with the connection manager's endpoints: the
        // failure reaches the receive (no backstop: through the event fd),
        // and the process goes on.
        let Some((a, b)) =
            linked_by_listener("tcp", Duration::ZERO, Duration::from_secs(86_400)).await
        else {
            return;
        };
        a_sleeping_receive_fails_when_its_peer_goes_away(a, b).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_listener_rejects_a_connection_from_another_address_than_the_peers() {
        if let Err(reason) = super::super::viability() {
            eprintln!("skipped: {reason}");
            return;
        }
        let mut a = UcxWorker::new(Some("tcp"), Duration::from_micros(20)).unwrap();
        let b = UcxWorker::new(Some("tcp"), Duration::from_micros(20)).unwrap();
        let addr = a.listen(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
        let b = b.connect_to_listener(addr, "a").unwrap();
        // This side expects its peer at 127.0.0.2; the request comes from
        // 127.0.0.1 and is rejected, so no connection is accepted. The
        // client's probe progresses its worker meanwhile, and fails: its
        // endpoint was rejected.
        let other = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
        let (accepted, probed) = tokio::join!(
            a.accept(other, "b", Duration::from_millis(500)),
            b.probe(4, Duration::from_secs(5))
        );
        let err = accepted
            .err()
            .expect("a request from another address was accepted");
        assert!(
            err.to_string()
                .contains("the peer did not connect to this side's UCX listener within 500ms"),
            "{err}"
        );
        assert!(probed.is_err(), "a rejected endpoint's probe was answered");
    }

    /// Owns bytes and says when it is dropped.
    struct Watched {
        bytes: Vec<u8>,
        dropped: Arc<AtomicBool>,
    }
    impl Drop for Watched {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::SeqCst);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_send_keeps_its_bytes_until_ucx_completes_it() {
        let Some((a, b)) = linked("shm,self") else {
            return;
        };
        let dropped = Arc::new(AtomicBool::new(false));
        let len = 16 << 20;
        let w = Watched {
            bytes: (0..len).map(|i| i as u8).collect(),
            dropped: dropped.clone(),
        };
        let ptr = w.bytes.as_ptr();
        // SAFETY: `w` owns the bytes and is kept with the request.
        unsafe { a.send_kept(5, ptr, len, Box::new(w)) }.unwrap();
        // A rendezvous send cannot complete before the receiver posts.
        assert!(!dropped.load(Ordering::SeqCst));
        assert_eq!(a.in_flight(), 1);
        let mut dest = vec![0u8; len];
        let dptr = dest.as_mut_ptr();
        // SAFETY: `dest`'s heap bytes move with it into the request.
        let pending = unsafe { b.recv(5, dptr, len, Box::new(dest)) }.unwrap();
        let (keep, got) = pending.await.unwrap();
        assert_eq!(got, len);
        let dest = keep.downcast::<Vec<u8>>().unwrap();
        assert!(dest.iter().enumerate().all(|(i, &x)| x == i as u8));
        // The sender's progress task completes the send and lets it go.
        while !dropped.load(Ordering::SeqCst) {
            tokio::task::yield_now().await;
        }
        assert_eq!(a.in_flight(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_send_ucx_completes_at_once_leaves_its_bytes_free_and_one_it_keeps_takes_them() {
        for tls in ["shm,self", "tcp"] {
            let Some((a, b)) = linked(tls) else {
                return;
            };
            // Small (eager): on shared memory UCX copies the bytes within
            // the call, so the buffer is overwritten at once and the
            // receiver still gets what was sent. Over tcp the first sends
            // may wait for the connection, and then the bytes go with them.
            let mut small: Vec<u8> = (0..200).map(|i| (i % 251) as u8).collect();
            let ptr = small.as_ptr();
            let mut kept = 0;
            // SAFETY: `keep` takes the Vec, whose heap bytes do not move.
            let done = unsafe {
                a.send_or_keep(21, ptr, 200, || {
                    kept += 1;
                    Box::new(std::mem::take(&mut small))
                })
            }
            .unwrap();
            if tls.starts_with("shm") {
                assert!(
                    done,
                    "a 200-byte send over shared memory was not completed at once"
                );
            }
            assert_eq!(kept, usize::from(!done), "UCX_TLS={tls}");
            small.fill(0xFF);
            let kept_before = kept;
            // Large (rendezvous): it cannot finish before the receiver
            // posts, so its bytes go with the send.
            let len = 4 << 20;
            let mut large: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let ptr = large.as_ptr();
            // SAFETY: `keep` takes the Vec, whose heap bytes do not move.
            let done = unsafe {
                a.send_or_keep(22, ptr, len, || {
                    kept += 1;
                    Box::new(std::mem::take(&mut large))
                })
            }
            .unwrap();
            assert!(!done, "UCX_TLS={tls}: a rendezvous send completed at once");
            assert_eq!((kept - kept_before, large.len()), (1, 0), "UCX_TLS={tls}");
            assert!(
                a.in_flight() >= 1,
                "UCX_TLS={tls}: the kept send is not in flight"
            );
            for (tag, n) in [(21u64, 200usize), (22, len)] {
                let mut dest = vec![0u8; n];
                let dptr = dest.as_mut_ptr();
                // SAFETY: `dest`'s heap bytes move with it into the request.
                let pending = unsafe { b.recv(tag, dptr, n, Box::new(dest)) }.unwrap();
                let (keep, got) = pending.await.unwrap();
                assert_eq!(got, n, "UCX_TLS={tls}: tag {tag}");
                let dest = keep.downcast::<Vec<u8>>().unwrap();
                assert!(
                    dest.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8),
                    "UCX_TLS={tls}: tag {tag}: the bytes differ"
                );
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_link_moving_bulk_data_spins_longer_until_it_has_been_quiet_a_while() {
        let spin = Duration::from_micros(50);
        let Some((a, b)) = linked_spinning("shm,self", spin) else {
            return;
        };
        let streaming = spin * STREAMING_SPIN_FACTOR;
        assert_eq!(a.shared.spin_budget(), spin);
        // Short messages leave the budget alone.
        let small = vec![1u8; STREAMING_BYTES - 1];
        let ptr = small.as_ptr();
        // SAFETY: the Vec owns the bytes and is kept with the request.
        unsafe { a.send_kept(1, ptr, small.len(), Box::new(small)) }.unwrap();
        let mut dest = vec![0u8; STREAMING_BYTES - 1];
        let dptr = dest.as_mut_ptr();
        // SAFETY: `dest`'s heap bytes move with it into the request.
        let pending = unsafe { b.recv(1, dptr, STREAMING_BYTES - 1, Box::new(dest)) }.unwrap();
        assert_eq!(pending.await.unwrap().1, STREAMING_BYTES - 1);
        assert_eq!(a.shared.spin_budget(), spin);
        assert_eq!(b.shared.spin_budget(), spin);
        // A long send marks the sender, a long receive the receiver.
        let big = vec![2u8; STREAMING_BYTES];
        let ptr = big.as_ptr();
        // SAFETY: as above.
        unsafe { a.send_kept(2, ptr, big.len(), Box::new(big)) }.unwrap();
        let sent_at = a.shared.now();
        assert_eq!(a.shared.spin_budget_at(sent_at), streaming);
        assert_eq!(b.shared.spin_budget(), spin);
        let mut dest = vec![0u8; STREAMING_BYTES];
        let dptr = dest.as_mut_ptr();
        // SAFETY: as above.
        let pending = unsafe { b.recv(2, dptr, STREAMING_BYTES, Box::new(dest)) }.unwrap();
        let received_at = b.shared.now();
        assert_eq!(b.shared.spin_budget_at(received_at), streaming);
        assert_eq!(pending.await.unwrap().1, STREAMING_BYTES);
        // Until STREAMING_FOR has passed since the last long one was
        // posted.
        let later = STREAMING_FOR.as_nanos() as u64;
        for link in [&a, &b] {
            let posted = link.shared.streamed_at.load(Ordering::Relaxed);
            assert_eq!(link.shared.spin_budget_at(posted + later - 1), streaming);
            assert_eq!(link.shared.spin_budget_at(posted + later), spin);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_progress_task_arms_the_worker_only_while_a_send_is_unfinished() {
        let Some((a, b)) = linked_spinning("shm,self", Duration::ZERO) else {
            return;
        };
        // Nothing posted: nobody needs UCX's events, so no peer is asked to
        // signal this side.
        assert!(!a.needs_events() && !b.needs_events());
        // A rendezvous send stays unfinished until the receiver posts.
        let len = 4 << 20;
        let bytes = vec![9u8; len];
        let ptr = bytes.as_ptr();
        // SAFETY: the Vec owns the bytes and is kept with the request.
        unsafe { a.send_kept(7, ptr, len, Box::new(bytes)) }.unwrap();
        assert!(a.needs_events());
        // A receive that is posted but not awaited needs nothing yet.
        let mut dest = vec![0u8; len];
        let dptr = dest.as_mut_ptr();
        // SAFETY: `dest`'s heap bytes move with it into the request.
        let mut pending = unsafe { b.recv(7, dptr, len, Box::new(dest)) }.unwrap();
        let (keep, got) = (&mut pending).await.unwrap();
        assert_eq!(got, len);
        assert!(keep.downcast::<Vec<u8>>().unwrap().iter().all(|&x| x == 9));
        // The sender's progress task finishes the send; then it disarms.
        while a.in_flight() > 0 {
            tokio::task::yield_now().await;
        }
        assert!(!a.needs_events());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_writer_waiting_for_room_sleeps_until_a_send_finishes() {
        let Some((a, b)) = linked_spinning("tcp", Duration::ZERO) else {
            return;
        };
        let len = 4 << 20;
        let bytes = vec![3u8; len];
        let ptr = bytes.as_ptr();
        // SAFETY: the Vec owns the bytes and is kept with the request.
        unsafe { a.send_kept(11, ptr, len, Box::new(bytes)) }.unwrap();
        // The rendezvous send cannot finish before the receiver posts: a
        // writer that wants none in flight waits, with its waker kept for
        // the sweep.
        let waiting =
            std::future::poll_fn(|cx| Poll::Ready(a.poll_in_flight_at_most(cx, 0).is_pending()))
                .await;
        assert!(waiting, "a send finished before its receiver posted");
        let room = tokio::spawn({
            let a = a.clone();
            async move { std::future::poll_fn(|cx| a.poll_in_flight_at_most(cx, 0)).await }
        });
        let mut dest = vec![0u8; len];
        let dptr = dest.as_mut_ptr();
        // SAFETY: `dest`'s heap bytes move with it into the request.
        let pending = unsafe { b.recv(11, dptr, len, Box::new(dest)) }.unwrap();
        let (_, got) = pending.await.unwrap();
        assert_eq!(got, len);
        tokio::time::timeout(Duration::from_secs(30), room)
            .await
            .expect("the writer was never woken once its send finished")
            .unwrap()
            .unwrap();
        assert_eq!(a.in_flight(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_receive_asleep_before_its_message_is_sent_wakes_on_the_event_fd_itself() {
        for tls in ["shm,self", "tcp"] {
            // No backstop: only the worker's event fd can end the sleep.
            let Some((a, b)) = linked_asleep(tls) else {
                return;
            };
            for (tag, len) in [(1u64, 8usize), (2, 4 << 20)] {
                let mut dest = vec![0u8; len];
                let dptr = dest.as_mut_ptr();
                // SAFETY: `dest`'s heap bytes move with it into the request.
                let mut pending = unsafe { b.recv(tag, dptr, len, Box::new(dest)) }.unwrap();
                // One poll: nothing has been sent, so the task goes to sleep
                // on the armed worker's event fd. The progress task is not
                // involved: it watches unfinished sends only.
                let first = std::future::poll_fn(|cx| {
                    std::task::Poll::Ready(pending.poll_done(cx).is_pending())
                })
                .await;
                assert!(first, "{tls}: a receive completed before its send");
                assert!(
                    !b.needs_events(),
                    "{tls}: a sleeping receive made the progress task watch"
                );
                let bytes: Vec<u8> = (0..len).map(|i| i as u8).collect();
                let ptr = bytes.as_ptr();
                // SAFETY: the Vec owns the bytes and is kept with the request.
                unsafe { a.send_kept(tag, ptr, len, Box::new(bytes)) }.unwrap();
                let (keep, got) = tokio::time::timeout(Duration::from_secs(30), &mut pending)
                    .await
                    .unwrap_or_else(|_| {
                        panic!("{tls}: a sleeping receive of {len} bytes was never woken")
                    })
                    .unwrap();
                assert_eq!(got, len);
                let dest = keep.downcast::<Vec<u8>>().unwrap();
                assert!(dest.iter().enumerate().all(|(i, &x)| x == i as u8));
            }
        }
    }

    /// Records the thread of each wake-up and tells a waiting test.
    #[derive(Default)]
    struct WakeLog {
        wakes: std::sync::Mutex<Vec<std::thread::ThreadId>>,
        woken: tokio::sync::Notify,
    }

    impl WakeLog {
        /// Wake-ups so far.
        fn count(&self) -> usize {
            self.wakes.lock().unwrap().len()
        }
        /// Wake-ups after the first `from` made on this thread.
        fn on_this_thread_since(&self, from: usize) -> usize {
            let me = std::thread::current().id();
            self.wakes.lock().unwrap()[from..]
                .iter()
                .filter(|t| **t == me)
                .count()
        }
    }

    impl std::task::Wake for WakeLog {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.wakes.lock().unwrap().push(std::thread::current().id());
            self.woken.notify_one();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_receive_woken_from_its_sleep_does_not_wake_itself_again_as_it_completes() {
        for tls in ["shm,self", "tcp"] {
            // No backstop: only the worker's event fd can end the sleep.
            let Some((a, b)) = linked_asleep(tls) else {
                return;
            };
            let mut dest = vec![0u8; 8];
            let dptr = dest.as_mut_ptr();
            // SAFETY: `dest`'s heap bytes move with it into the request.
            let mut pending = unsafe { b.recv(5, dptr, 8, Box::new(dest)) }.unwrap();
            let counter = Arc::new(WakeLog::default());
            let waker = std::task::Waker::from(counter.clone());
            let mut cx = std::task::Context::from_waker(&waker);
            assert!(
                pending.poll_done(&mut cx).is_pending(),
                "{tls}: a receive completed before its send"
            );
            let bytes = vec![7u8; 8];
            let ptr = bytes.as_ptr();
            // SAFETY: the Vec owns the bytes and is kept with the request.
            unsafe { a.send_kept(5, ptr, 8, Box::new(bytes)) }.unwrap();
            // Each wake-up (the event fd; over tcp first for UCX's own
            // connection set-up) leads to a poll, which progresses the
            // worker. The poll that completes the receive must not wake the
            // task that is polling it: tokio would queue that task again and
            // wake another worker thread for it. Such a wake-up happens in
            // the poll's own progress call, on this thread; the progress
            // task's one progress call at its start, if it comes late, may
            // complete the receive too, but on a runtime thread.
            let got = tokio::time::timeout(Duration::from_secs(30), async {
                loop {
                    counter.woken.notified().await;
                    let before = counter.count();
                    if let Poll::Ready(done) = pending.poll_done(&mut cx) {
                        break (done, counter.on_this_thread_since(before));
                    }
                }
            })
            .await;
            let (done, woken_by_itself) =
                got.unwrap_or_else(|_| panic!("{tls}: the sleeping receive never completed"));
            assert_eq!(done.unwrap().1, 8);
            assert_eq!(
                woken_by_itself, 0,
                "{tls}: the receive woke its own task as it completed"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_receive_asleep_when_its_peer_goes_away_fails_with_the_links_failure() {
        // No backstop: the event fd alone must bring the failure.
        let Some((a, b)) = linked_asleep("tcp") else {
            return;
        };
        a_sleeping_receive_fails_when_its_peer_goes_away(a, b).await;
    }

    /// Posts a receive on `b`, checks that it sleeps, drops `a` (its
    /// worker, and with it its TCP connections) and checks that the
    /// receive fails with the link's failure.
    async fn a_sleeping_receive_fails_when_its_peer_goes_away(a: UcxLink, b: UcxLink) {
        let mut dest = vec![0u8; 64];
        let dptr = dest.as_mut_ptr();
        // SAFETY: `dest`'s heap bytes move with it into the request.
        let mut pending = unsafe { b.recv(3, dptr, 64, Box::new(dest)) }.unwrap();
        let first =
            std::future::poll_fn(|cx| Poll::Ready(pending.poll_done(cx).is_pending())).await;
        assert!(first, "a receive completed with nothing sent");
        drop(a);
        let outcome = tokio::time::timeout(Duration::from_secs(30), &mut pending)
            .await
            .expect("a sleeping receive never learned that its peer went away");
        let Err(err) = outcome else {
            panic!("a receive from a peer that went away succeeded");
        };
        let text = err.to_string();
        assert!(
            text.contains("UCX endpoint failed") || text.contains("UCX receive failed"),
            "{text}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_receive_is_cancelled_and_its_buffer_kept_until_then() {
        let Some((a, b)) = linked("tcp") else {
            return;
        };
        let dropped = Arc::new(AtomicBool::new(false));
        let mut w = Watched {
            bytes: vec![0u8; 64],
            dropped: dropped.clone(),
        };
        let ptr = w.bytes.as_mut_ptr();
        // SAFETY: `w` owns the bytes and moves into the request.
        let pending = unsafe { b.recv(9, ptr, 64, Box::new(w)) }.unwrap();
        drop(pending);
        // Cancelled: the buffer is released once UCX reported it done.
        while !dropped.load(Ordering::SeqCst) {
            tokio::task::yield_now().await;
        }
        // The message with that tag goes to the next receive, whole.
        let msg = vec![42u8; 64];
        let mptr = msg.as_ptr();
        // SAFETY: `msg` owns the bytes and is kept with the request.
        unsafe { a.send_kept(9, mptr, 64, Box::new(msg)) }.unwrap();
        let mut dest = vec![0u8; 64];
        let dptr = dest.as_mut_ptr();
        // SAFETY: as above.
        let (keep, got) = unsafe { b.recv(9, dptr, 64, Box::new(dest)) }
            .unwrap()
            .await
            .unwrap();
        assert_eq!(got, 64);
        assert_eq!(*keep.downcast::<Vec<u8>>().unwrap(), vec![42u8; 64]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn probes_cross_both_ways_and_a_missing_one_is_an_error() {
        let Some((a, b)) = linked("tcp") else {
            return;
        };
        let (x, y) = tokio::join!(
            a.probe(1, Duration::from_secs(30)),
            b.probe(2, Duration::from_secs(30))
        );
        assert_eq!((x, y), (Ok(()), Ok(())));
        // The peer sends no probe this time: the wait ends with the reason.
        let err = a.probe(3, Duration::from_millis(20)).await.unwrap_err();
        assert_eq!(err, "no probe from the peer within 20ms");
    }
}
