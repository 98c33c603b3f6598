//! Posting sends and receives on a connected link.

use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use super::pending::Pending;
use super::request::{contig, is_error_ptr, ptr_status, recv_done, Completion, Inflight};
use super::shared::State;
use super::{UcxLink, PROBE_TAG};
use crate::ucx::{status_text, sys};
use crate::{channel, TransportError};

impl UcxLink {
    /// Why the link failed, if it did.
    pub(crate) fn failure(&self) -> Option<TransportError> {
        self.shared.failure()
    }

    pub(super) fn error(&self, what: &str, status: sys::ucs_status_t) -> TransportError {
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
    pub(super) fn needs_events(&self) -> bool {
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
