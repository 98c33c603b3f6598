//! An owned RRef's value: pending until its function finishes, then a
//! value or the function's error.

use std::time::{Duration, Instant};

use ferry_rpc::{RpcError, Value, MAX_ERROR_TEXT_BYTES};
use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::wait;

/// The state of an owned value.
#[derive(Debug, Clone)]
pub(crate) enum SlotState {
    Pending,
    Ready(Value),
    Failed(FailureText),
}

/// Why a value was not made: the error's text exactly as it was raised
/// (the function's own error, line breaks and all), at most
/// [`MAX_ERROR_TEXT_BYTES`], and how many bytes of it were left out.
/// Escaped only where it is shown ([`RRefError::ValueFailed`]'s `Display`).
///
/// [`RRefError::ValueFailed`]: crate::RRefError::ValueFailed
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct FailureText {
    pub(crate) message: String,
    pub(crate) omitted_bytes: u64,
}

impl FailureText {
    /// A text of this worker's own, cut to the bound if longer.
    pub(crate) fn new(message: String) -> Self {
        Self {
            message,
            omitted_bytes: 0,
        }
        .bounded()
    }

    /// The failure of the function creating a value: a function's error
    /// keeps the text it raised, any other error (no such function, a
    /// wrong signature) its own description.
    pub(crate) fn of(error: RpcError) -> Self {
        match error {
            RpcError::Remote {
                message,
                omitted_bytes,
                ..
            } => Self {
                message,
                omitted_bytes,
            }
            .bounded(),
            other => Self::new(other.to_string()),
        }
    }

    /// Cut to [`MAX_ERROR_TEXT_BYTES`] on a character boundary, the bytes
    /// cut counted: a text from a peer is not trusted to be bounded.
    pub(crate) fn bounded(mut self) -> Self {
        if self.message.len() > MAX_ERROR_TEXT_BYTES {
            let mut end = MAX_ERROR_TEXT_BYTES;
            while !self.message.is_char_boundary(end) {
                end -= 1;
            }
            let cut = (self.message.len() - end) as u64;
            self.message.truncate(end);
            self.omitted_bytes = self.omitted_bytes.saturating_add(cut);
        }
        self
    }
}

/// An owned value that threads and tasks can wait for.
#[derive(Debug)]
pub(crate) struct OwnerSlot {
    state: Mutex<SlotState>,
    cond: Condvar,
    notify: Notify,
}

impl OwnerSlot {
    pub(crate) fn pending() -> Self {
        Self {
            state: Mutex::new(SlotState::Pending),
            cond: Condvar::new(),
            notify: Notify::new(),
        }
    }

    pub(crate) fn ready(value: Value) -> Self {
        let slot = Self::pending();
        *slot.state.lock() = SlotState::Ready(value);
        slot
    }

    /// Sets the outcome (once; later calls are ignored).
    pub(crate) fn set(&self, outcome: Result<Value, FailureText>) {
        let mut state = self.state.lock();
        if matches!(*state, SlotState::Pending) {
            *state = match outcome {
                Ok(v) => SlotState::Ready(v),
                Err(e) => SlotState::Failed(e),
            };
        }
        drop(state);
        self.cond.notify_all();
        self.notify.notify_waiters();
    }

    /// Blocks until the outcome is known or `timeout` passes (zero: no limit).
    pub(crate) fn wait(&self, timeout: Duration) -> SlotState {
        let deadline = (!timeout.is_zero()).then(|| Instant::now() + timeout);
        let mut state = self.state.lock();
        while matches!(*state, SlotState::Pending) {
            match deadline {
                Some(d) => {
                    if self.cond.wait_until(&mut state, d).timed_out() {
                        break;
                    }
                }
                None => self.cond.wait(&mut state),
            }
        }
        state.clone()
    }

    /// Waits in async code until the outcome is known or `timeout` passes.
    pub(crate) async fn wait_async(&self, timeout: Duration) -> SlotState {
        let ready = || {
            let state = self.state.lock().clone();
            (!matches!(state, SlotState::Pending)).then_some(state)
        };
        wait::until_timeout(&self.notify, timeout, ready)
            .await
            .unwrap_or(SlotState::Pending)
    }
}
