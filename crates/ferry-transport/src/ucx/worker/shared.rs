//! The state one connection's worker shares between its handles: the
//! worker and endpoint under a lock, progress, spinning and the in-flight
//! list.

use std::ffi::c_void;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::task::Waker;
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use super::request::{is_request, Completion, Inflight};
use super::{
    DRAIN, PROGRESS_CALLS_PER_ROUND, STREAMING_BYTES, STREAMING_FOR, STREAMING_SPIN_FACTOR,
};
use crate::spin::{spin_while_active_in_rounds, Check};
use crate::ucx::{exit, status_text, sys, Context};
use crate::{channel, TransportError};

/// A connection request UCX's listener handed over, not yet accepted or
/// rejected.
pub(super) struct ConnRequest(pub(super) sys::ucp_conn_request_h);

// SAFETY: a UCX handle, used only under the worker's state lock.
unsafe impl Send for ConnRequest {}

pub(super) unsafe extern "C" fn ep_failed(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    // SAFETY: `arg` is the `Shared` that owns the endpoint; the endpoint is
    // closed before the `Shared` is freed, and this runs inside progress,
    // under the state lock its owner holds.
    let shared = unsafe { &*(arg as *const Shared) };
    shared.fail(format!(
        "the UCX endpoint failed: {}",
        status_text(shared.api, status)
    ));
}

/// The worker's state, under the lock.
pub(super) struct State {
    pub(super) worker: sys::ucp_worker_h,
    pub(super) ep: sys::ucp_ep_h,
    /// The listener of a worker that waits for its peer's client-server
    /// connection ([`UcxWorker::listen`]); null otherwise.
    ///
    /// [`UcxWorker::listen`]: super::UcxWorker::listen
    pub(super) listener: sys::ucp_listener_h,
    pub(super) inflight: Vec<Inflight>,
    /// Completions tasks wait on, woken when the link fails.
    pub(super) waiters: Vec<Weak<Completion>>,
    /// A writer waiting for in-flight requests to finish
    /// ([`UcxLink::poll_in_flight_at_most`]), woken by the sweep that
    /// shortens the list (or by the link's failure).
    ///
    /// [`UcxLink::poll_in_flight_at_most`]: super::UcxLink::poll_in_flight_at_most
    pub(super) room: Option<Waker>,
}

// SAFETY: the worker is created `UCS_THREAD_MODE_SERIALIZED` and only used
// under the `Mutex` around this state; the raw pointers are UCX handles.
unsafe impl Send for State {}

/// What the link's handles and its progress task share: the worker's
/// state under a lock, the link's failure, and how long its waits spin and
/// sleep.
pub(crate) struct Shared {
    pub(super) api: &'static sys::Ucp,
    pub(super) state: Mutex<State>,
    pub(super) failed: Mutex<Option<String>>,
    pub(super) has_failed: AtomicBool,
    /// Connection requests the listener's callback put here.
    pub(super) requests: Mutex<Vec<ConnRequest>>,
    /// Senders waiting for the state lock (see [`Shared::lock_for_send`]).
    pub(super) senders: AtomicUsize,
    pub(super) stop: Notify,
    /// Tells the progress task that something now needs UCX's events (a
    /// send is in flight).
    pub(super) wanted: Notify,
    pub(super) efd: Option<AsyncFd<RawFd>>,
    pub(super) spin: Duration,
    /// When the link last posted a send or receive of at least
    /// [`STREAMING_BYTES`]: nanoseconds after `created`, plus one (zero:
    /// never). See [`Shared::spin_budget`].
    pub(super) streamed_at: AtomicU64,
    pub(super) created: Instant,
    /// How long a sleep on the event fd lasts at most ([`BACKSTOP`]).
    ///
    /// [`BACKSTOP`]: super::BACKSTOP
    pub(super) backstop: Duration,
    /// The peer's name, set when the endpoint connects.
    pub(super) peer: OnceLock<String>,
    pub(super) _context: Arc<Context>,
}

impl Shared {
    /// Nanoseconds since the link was created, plus one (so that zero
    /// means "never" in [`streamed_at`](Self::streamed_at)).
    pub(super) fn now(&self) -> u64 {
        u64::try_from(self.created.elapsed().as_nanos()).unwrap_or(u64::MAX - 1) + 1
    }

    /// Notes a send or receive of `len` bytes being posted: a long one
    /// marks the link as streaming.
    pub(super) fn posting(&self, len: usize) {
        if len >= STREAMING_BYTES {
            self.streamed_at.store(self.now(), Ordering::Relaxed);
        }
    }

    /// How long a wait spins after UCX last reported progress: the
    /// configured spin, or [`STREAMING_SPIN_FACTOR`] times it on a link
    /// that posted a send or receive of at least [`STREAMING_BYTES`] in
    /// the last [`STREAMING_FOR`].
    pub(super) fn spin_budget(&self) -> Duration {
        // A link that never streamed (small messages only) reads no clock.
        if self.streamed_at.load(Ordering::Relaxed) == 0 {
            return self.spin;
        }
        self.spin_budget_at(self.now())
    }

    /// [`spin_budget`](Self::spin_budget) at `now` (as [`now`](Self::now)
    /// counts).
    pub(super) fn spin_budget_at(&self, now: u64) -> Duration {
        let at = self.streamed_at.load(Ordering::Relaxed);
        let streaming = at != 0 && Duration::from_nanos(now.saturating_sub(at)) < STREAMING_FOR;
        if streaming {
            self.spin.saturating_mul(STREAMING_SPIN_FACTOR)
        } else {
            self.spin
        }
    }

    pub(super) fn peer(&self) -> &str {
        self.peer.get().map_or("", String::as_str)
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lock, for a send: a task spinning on progress (on another
    /// thread: the RPC caller sends from its own) leaves the lock alone
    /// while a sender waits for it, so the sender takes it at once instead
    /// of parking on it and being woken by a system call.
    pub(super) fn lock_for_send(&self) -> MutexGuard<'_, State> {
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

    pub(super) fn failure(&self) -> Option<TransportError> {
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
    pub(super) fn progress(&self, state: &mut State) {
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
    pub(super) fn spin(&self, mut done: impl FnMut(&mut State, bool) -> bool) -> bool {
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

    /// Frees the finished requests of the in-flight list, waking a writer
    /// waiting for room, and every waiter when the link failed.
    pub(super) fn sweep(&self, state: &mut State) {
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
    ///
    /// [`Pending::poll_done`]: super::Pending::poll_done
    pub(super) fn needs_events(&self) -> bool {
        !self.inflight.is_empty()
    }

    /// Adds an unfinished request; the first one wakes the progress task.
    pub(super) fn push_inflight(&mut self, shared: &Shared, inflight: Inflight) {
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

/// Destroys the listener, if any, rejecting the requests it handed over
/// (into `requests`) that were not accepted.
pub(super) fn close_listener(
    api: &sys::Ucp,
    state: &mut State,
    requests: &Mutex<Vec<ConnRequest>>,
) {
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
