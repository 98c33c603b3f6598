//! An owned RRef's value: pending until its function finishes, then a
//! value or the function's error.

use std::time::{Duration, Instant};

use ferry_rpc::Value;
use parking_lot::{Condvar, Mutex};
use tokio::sync::Notify;

use crate::wait;

/// The state of an owned value.
#[derive(Debug, Clone)]
pub(crate) enum SlotState {
    Pending,
    Ready(Value),
    Failed(String),
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
    pub(crate) fn set(&self, outcome: Result<Value, String>) {
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
