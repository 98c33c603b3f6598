//! Outstanding calls: the slot a reply lands in, and the future a caller holds.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use ferry_transport::shm::spin_until;
use ferry_transport::IncomingMessage;
use ferry_wire::{payload, MessageKind, PeerText};
use parking_lot::{Condvar, Mutex};
use serde::de::DeserializeOwned;

use crate::functions::Signature;
use crate::protocol::{Failure, FailureKind};
use crate::watch::{Delivery, Watches};
use crate::RpcError;

/// Most characters of a callee's error text an error shows (the rest is
/// cut, with a note of how much; see [`PeerText`]).
pub const MAX_ERROR_TEXT_CHARS: usize = 4096;

/// Where the outcome of one call lands: completed exactly once, by the
/// reply, the timeout timer, a lost connection or shutdown.
pub(crate) struct CallSlot {
    state: Mutex<SlotState>,
    done: Condvar,
    /// Set once `state` is `Done`: what a waiting thread spins on.
    completed: AtomicBool,
    /// How long a waiting thread spins on `completed` before it parks
    /// ([`ChannelConfig::spin`](ferry_transport::ChannelConfig::spin)).
    spin: Duration,
    /// Whether `watches` holds any (read and written under `state`'s lock).
    watched: AtomicBool,
    /// Told how the call ended before its caller is (see [`crate::watch`]).
    watches: Mutex<Watches>,
}

enum SlotState {
    Waiting(Option<Waker>),
    Done(Result<IncomingMessage, RpcError>),
    Taken,
}

impl CallSlot {
    pub(crate) fn new(spin: Duration) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(SlotState::Waiting(None)),
            done: Condvar::new(),
            completed: AtomicBool::new(false),
            spin,
            watched: AtomicBool::new(false),
            watches: Mutex::new(Watches::default()),
        })
    }

    pub(crate) fn ready(result: Result<IncomingMessage, RpcError>) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(SlotState::Done(result)),
            done: Condvar::new(),
            completed: AtomicBool::new(true),
            spin: Duration::ZERO,
            watched: AtomicBool::new(false),
            watches: Mutex::new(Watches::default()),
        })
    }

    /// Completes the slot; a second completion is ignored. Returns whether
    /// it woke a task (a caller awaiting the future).
    pub(crate) fn complete(&self, result: Result<IncomingMessage, RpcError>) -> bool {
        let (waker, watched) = {
            let mut state = self.state.lock();
            match &mut *state {
                SlotState::Waiting(w) => {
                    let w = w.take();
                    let watched = self.watched.load(Ordering::Relaxed).then(|| {
                        let watches = std::mem::take(&mut *self.watches.lock());
                        (watches, delivery(&result))
                    });
                    *state = SlotState::Done(result);
                    (w, watched)
                }
                _ => return false,
            }
        };
        // The watches hear first, so a caller that sees the outcome sees
        // what they undid too.
        if let Some((watches, delivery)) = watched {
            watches.settle(delivery);
        }
        self.completed.store(true, Ordering::Release);
        self.done.notify_all();
        match waker {
            Some(w) => {
                w.wake();
                true
            }
            None => false,
        }
    }

    /// Attaches the watches of the call's message; settles them at once if
    /// the call has already ended.
    pub(crate) fn watch(&self, watches: Watches) {
        if watches.is_empty() {
            return;
        }
        let state = self.state.lock();
        let delivery = match &*state {
            SlotState::Waiting(_) => {
                *self.watches.lock() = watches;
                self.watched.store(true, Ordering::Relaxed);
                return;
            }
            SlotState::Done(result) => delivery(result),
            SlotState::Taken => Delivery::Unknown,
        };
        drop(state);
        watches.settle(delivery);
    }

    fn poll(&self, cx: &mut Context<'_>) -> Poll<Result<IncomingMessage, RpcError>> {
        let mut state = self.state.lock();
        match std::mem::replace(&mut *state, SlotState::Taken) {
            SlotState::Done(r) => Poll::Ready(r),
            SlotState::Waiting(_) => {
                *state = SlotState::Waiting(Some(cx.waker().clone()));
                Poll::Pending
            }
            SlotState::Taken => Poll::Ready(Err(RpcError::Config(
                "a call's future was polled after it completed".into(),
            ))),
        }
    }

    fn wait(&self) -> Result<IncomingMessage, RpcError> {
        self.spin_until_completed();
        let mut state = self.state.lock();
        loop {
            match std::mem::replace(&mut *state, SlotState::Taken) {
                SlotState::Done(r) => return r,
                SlotState::Taken => {
                    return Err(RpcError::Config("a call's result was taken twice".into()))
                }
                waiting @ SlotState::Waiting(_) => {
                    *state = waiting;
                    self.done.wait(&mut state);
                }
            }
        }
    }

    /// Re-checks for up to the slot's spin before the caller parks: a
    /// reply that comes within it costs no futex wake-up on either side.
    /// The CPU is yielded between rounds, so a thread with work to do on
    /// this core (the one delivering the reply, say) gets to run.
    fn spin_until_completed(&self) {
        spin_until(self.spin, || self.completed.load(Ordering::Acquire));
    }

    fn is_done(&self) -> bool {
        matches!(&*self.state.lock(), SlotState::Done(_))
    }
}

/// The pending result of [`rpc_async`](crate::Agent::rpc_async): `.await`
/// it in async code or [`wait`](RpcFuture::wait) for it from a thread.
///
/// Dropping it does not cancel the call: the callee still runs it, and
/// graceful shutdown still waits for it (fire-and-forget).
#[must_use = "an RpcFuture does nothing until awaited or waited for; drop it explicitly for fire-and-forget"]
pub struct RpcFuture<T> {
    slot: Arc<CallSlot>,
    worker: String,
    function: String,
    signature: Signature,
    /// The caller's agent: current while the reply decodes.
    agent: Option<crate::WeakAgent>,
    _result: PhantomData<fn() -> T>,
}

impl<T> RpcFuture<T> {
    pub(crate) fn new(
        slot: Arc<CallSlot>,
        worker: String,
        function: String,
        signature: Signature,
    ) -> Self {
        Self {
            slot,
            worker,
            function,
            signature,
            agent: None,
            _result: PhantomData,
        }
    }

    /// Sets the agent that is current while the reply decodes.
    pub(crate) fn with_agent(mut self, agent: crate::WeakAgent) -> Self {
        self.agent = Some(agent);
        self
    }

    fn decode<R: DeserializeOwned>(&self, msg: IncomingMessage) -> Result<R, RpcError> {
        match self.agent.as_ref().and_then(crate::WeakAgent::upgrade) {
            Some(agent) => agent.enter(|| decode_reply(&self.function, msg)),
            None => decode_reply(&self.function, msg),
        }
    }

    /// A future that has already failed.
    pub(crate) fn failed(error: RpcError, function: &str, signature: Signature) -> Self {
        Self::new(
            CallSlot::ready(Err(error)),
            String::new(),
            function.to_string(),
            signature,
        )
    }

    pub(crate) fn wait_raw(&self) -> Result<IncomingMessage, RpcError> {
        let r = self.slot.wait();
        self.finish_raw(r)
    }

    pub(crate) fn poll_raw(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<IncomingMessage, RpcError>> {
        match self.slot.poll(cx) {
            Poll::Ready(r) => Poll::Ready(self.finish_raw(r)),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Whether the outcome has arrived (a following `wait` will not block).
    pub fn is_done(&self) -> bool {
        self.slot.is_done()
    }

    /// The callee's name.
    pub fn worker(&self) -> &str {
        &self.worker
    }

    fn finish_raw(
        &self,
        r: Result<IncomingMessage, RpcError>,
    ) -> Result<IncomingMessage, RpcError> {
        let msg = r?;
        if msg.header.kind == MessageKind::ERROR {
            let failure: Failure =
                payload::decode(&msg.payload, Vec::new()).map_err(|e| RpcError::Codec {
                    action: "decode the error reply",
                    function: self.function.clone(),
                    message: e.to_string(),
                })?;
            return Err(failure_to_error(
                failure,
                &self.worker,
                &self.function,
                self.signature,
            ));
        }
        Ok(msg)
    }
}

impl<T: DeserializeOwned> RpcFuture<T> {
    /// Blocks the calling thread until the call completes.
    ///
    /// Do not call this from an async task on the agent's runtime (use
    /// `.await` there); blocking functions and user threads may.
    pub fn wait(self) -> Result<T, RpcError> {
        let msg = self.wait_raw()?;
        self.decode(msg)
    }
}

/// Decodes a successful reply's payload.
pub(crate) fn decode_reply<T: DeserializeOwned>(
    function: &str,
    msg: IncomingMessage,
) -> Result<T, RpcError> {
    payload::decode(&msg.payload, msg.tensors).map_err(|e| RpcError::Codec {
        action: "decode the result",
        function: function.to_string(),
        message: e.to_string(),
    })
}

/// Whether a call's receiver decoded its arguments, judging by its outcome.
fn delivery(result: &Result<IncomingMessage, RpcError>) -> Delivery {
    match result {
        Ok(msg) if msg.header.kind == MessageKind::ERROR => {
            match payload::decode::<Failure>(&msg.payload, Vec::new()).map(|f| f.kind) {
                Ok(
                    FailureKind::UnknownFunction | FailureKind::WrongType | FailureKind::BadRequest,
                ) => Delivery::NotDecoded,
                Ok(FailureKind::Failed) => Delivery::Decoded,
                Ok(FailureKind::BadArguments) | Err(_) => Delivery::Unknown,
            }
        }
        Ok(_) => Delivery::Decoded,
        // Kept back at the sender: the callee never saw it.
        Err(RpcError::TooLarge { .. }) => Delivery::NotDecoded,
        Err(_) => Delivery::Unknown,
    }
}

pub(crate) fn failure_to_error(
    failure: Failure,
    worker: &str,
    function: &str,
    signature: Signature,
) -> RpcError {
    let worker = worker.to_string();
    let function = function.to_string();
    // The callee's texts, escaped and bounded before they reach an error
    // message (and whatever logs it).
    let failure = Failure {
        message: PeerText::bounded(&failure.message, MAX_ERROR_TEXT_CHARS).to_string(),
        expected: PeerText::new(&failure.expected).to_string(),
        ..failure
    };
    match failure.kind {
        FailureKind::UnknownFunction => RpcError::UnknownFunction { worker, function },
        FailureKind::WrongType => RpcError::WrongType {
            worker,
            function,
            expected: failure.expected,
            got: signature.to_string(),
        },
        FailureKind::BadArguments | FailureKind::Failed | FailureKind::BadRequest => {
            RpcError::Remote {
                worker,
                function,
                message: failure.message,
            }
        }
    }
}

impl<T: DeserializeOwned> Future for RpcFuture<T> {
    type Output = Result<T, RpcError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match this.poll_raw(cx) {
            Poll::Ready(r) => Poll::Ready(r.and_then(|m| this.decode(m))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T> std::fmt::Debug for RpcFuture<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcFuture")
            .field("worker", &self.worker)
            .field("function", &self.function)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A callee's error text reaches the caller's error escaped and bounded.
    #[test]
    fn a_callees_error_text_is_escaped_and_bounded() {
        let text = format!("boom\n\u{1b}[2Jforged{}", "x".repeat(5000));
        let failure = Failure::failed(text.clone());
        let e = failure_to_error(failure, "worker1", "f", Signature::of::<(), ()>());
        let RpcError::Remote { message, .. } = &e else {
            panic!("{e}");
        };
        assert!(message.starts_with(r"boom\n\u{1b}[2Jforged"), "{message}");
        assert!(!message.contains('\n') && !message.contains('\u{1b}'));
        let kept: String = text.chars().take(MAX_ERROR_TEXT_CHARS).collect();
        assert!(message.ends_with(&format!("…({} more bytes)", text.len() - kept.len())));
    }
}
