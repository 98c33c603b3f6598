//! UCX requests: where their callbacks report, what an unfinished one
//! owns, and how UCX's pointer-or-status returns read.

use std::any::Any;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicI8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

use crate::ucx::sys;

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
    pub(super) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }
    pub(super) fn result(&self) -> (sys::ucs_status_t, usize) {
        (
            self.status.load(Ordering::Relaxed),
            self.len.load(Ordering::Relaxed),
        )
    }
    pub(super) fn lock_waker(&self) -> MutexGuard<'_, Option<Waker>> {
        self.waker.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Forgets the registered waker, for a task that is awake and about to
    /// progress the worker itself: a completion its own progress call
    /// causes must not wake it again. Such a self-wake makes tokio queue
    /// the task once more and wake another worker thread, which then
    /// often takes the task over, moving the connection's reader between
    /// the runtime's threads.
    pub(super) fn unregister(&self) {
        self.lock_waker().take();
    }
    /// Makes `waker` the one [`complete`](Self::complete) wakes (kept when
    /// it already wakes the same task).
    pub(super) fn register(&self, waker: &Waker) {
        let mut slot = self.lock_waker();
        if !slot.as_ref().is_some_and(|w| w.will_wake(waker)) {
            *slot = Some(waker.clone());
        }
    }
}

pub(super) unsafe extern "C" fn recv_done(
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

/// A request UCX has not completed, with what it owns.
pub(super) struct Inflight {
    pub(super) request: *mut c_void,
    /// `None`: a send posted without a callback, checked with
    /// `ucp_request_check_status`.
    pub(super) completion: Option<Arc<Completion>>,
    /// What UCX reads or writes, dropped only once the request is done.
    pub(super) _keep: Box<dyn Any + Send>,
}

pub(super) fn is_request(ptr: *mut c_void) -> bool {
    // UCS_PTR_IS_ERR: addresses from (uintptr_t)UCS_ERR_LAST up are status
    // codes; null is UCS_OK.
    !ptr.is_null() && (ptr as usize) < (sys::UCS_ERR_LAST as isize) as usize
}

pub(super) fn ptr_status(ptr: *mut c_void) -> sys::ucs_status_t {
    if ptr.is_null() {
        sys::UCS_OK
    } else {
        ptr as isize as sys::ucs_status_t
    }
}

pub(super) fn is_error_ptr(ptr: *mut c_void) -> bool {
    !ptr.is_null() && !is_request(ptr)
}

pub(super) fn contig() -> sys::ucp_datatype_t {
    // ucp_dt_make_contig(1): (1 << UCP_DATATYPE_SHIFT) | UCP_DATATYPE_CONTIG.
    ((1u64) << sys::UCP_DATATYPE_SHIFT) | sys::UCP_DATATYPE_CONTIG as u64
}
