//! A posted receive and how its task waits: a bounded spin, then a sleep
//! on the worker's event fd.

use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use super::request::{Completion, Inflight};
use super::shared::Shared;
use super::{UcxLink, ARM_TRIES};
use crate::ucx::sys;
use crate::{channel, TransportError};

/// A finished receive: its buffer (the `keep` it was posted with) and the
/// length UCX wrote.
pub(crate) type Received = (Box<dyn Any + Send>, usize);

/// A posted receive, owning its buffer until UCX is done with it.
pub(crate) struct Pending {
    pub(super) link: UcxLink,
    pub(super) request: *mut c_void,
    pub(super) completion: Option<Arc<Completion>>,
    pub(super) keep: Option<Box<dyn Any + Send>>,
    /// Whether this wait has spun already.
    pub(super) spun: bool,
    /// While the task sleeps: its wait for the worker's event fd.
    pub(super) sleep: Option<Sleep>,
}

/// A sleeping receive's wait: until the worker's event fd is readable (its
/// readiness then cleared, so the next wait waits for a new event) or the
/// backstop timer fires.
type Sleep = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

pub(super) fn sleep_on_fd(shared: Arc<Shared>) -> Sleep {
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
                if crate::spin::yield_once(cx).is_pending() {
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
