//! Outstanding calls: the slot a reply lands in, and the future a caller holds.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use ferry_transport::spin::spin_until;
use ferry_transport::IncomingMessage;
use ferry_wire::{payload, MessageKind};
use parking_lot::{Condvar, Mutex};
use serde::de::DeserializeOwned;

use crate::error::bound_text;
use crate::functions::Signature;
use crate::protocol::{Failure, FailureKind};
use crate::watch::{Delivery, Watches};
use crate::{RpcError, MAX_ERROR_TEXT_BYTES};

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

/// The pending result of a call's `rpc_async`
/// ([`Function::rpc_async`](crate::Function::rpc_async)): `.await`
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

/// The error a caller gets for a callee's failure reply. The callee's
/// texts are kept as they were raised (its error's `Display` escapes
/// them), cut to [`MAX_ERROR_TEXT_BYTES`] again here since a peer is not
/// trusted to have done so.
pub(crate) fn failure_to_error(
    failure: Failure,
    worker: &str,
    function: &str,
    signature: Signature,
) -> RpcError {
    let worker = worker.to_string();
    let function = function.to_string();
    let Failure {
        kind,
        mut message,
        mut expected,
        omitted,
        by_schema,
    } = failure;
    match kind {
        FailureKind::UnknownFunction => RpcError::UnknownFunction { worker, function },
        FailureKind::WrongType => {
            bound_text(&mut expected, MAX_ERROR_TEXT_BYTES);
            RpcError::WrongType {
                worker,
                function,
                expected,
                // Written as the callee wrote its own: as it compared them.
                got: signature.shown(by_schema),
                by_schema,
            }
        }
        FailureKind::BadArguments | FailureKind::Failed | FailureKind::BadRequest => {
            let cut = bound_text(&mut message, MAX_ERROR_TEXT_BYTES);
            RpcError::Remote {
                worker,
                function,
                message,
                omitted_bytes: omitted.saturating_add(cut),
            }
        }
    }
}

/// Waits for every future of `futures` and returns their results in the
/// same order, or the first error as soon as it arrives, without waiting
/// for the others (PyTorch's `torch.futures.wait_all`). The calls whose
/// futures are left behind are not cancelled: the callees still run them,
/// and graceful shutdown still waits for them.
///
/// It blocks the calling thread: call it from a thread (a blocking
/// function body, a user thread), not from an async task on the agent's
/// runtime, where each future is `.await`ed instead.
///
/// ```no_run
/// use ferry_rpc::Function;
///
/// const SQUARE: Function<i64, i64> = Function::new("square");
///
/// let pending: Vec<_> = (1..4).map(|rank| SQUARE.rpc_async(rank, i64::from(rank))).collect();
/// assert_eq!(ferry_rpc::wait_all(pending)?, [1, 4, 9]);
/// # Ok::<(), ferry_rpc::RpcError>(())
/// ```
pub fn wait_all<T: DeserializeOwned>(
    futures: impl IntoIterator<Item = RpcFuture<T>>,
) -> Result<Vec<T>, RpcError> {
    use futures::stream::{FuturesUnordered, StreamExt};

    // Polled as they complete, not in order, so that a failure behind a
    // call still running ends the wait at once.
    let mut pending: FuturesUnordered<_> = futures
        .into_iter()
        .enumerate()
        .map(|(i, future)| async move { (i, future.await) })
        .collect();
    let mut results: Vec<Option<T>> = std::iter::repeat_with(|| None)
        .take(pending.len())
        .collect();
    futures::executor::block_on(async {
        while let Some((i, result)) = pending.next().await {
            results[i] = Some(result?);
        }
        Ok::<(), RpcError>(())
    })?;
    Ok(results.into_iter().flatten().collect())
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

/// An undecoded reply: of a dynamic call ([`Agent::call_dynamic`](crate::Agent::call_dynamic)) or of a
/// service message ([`Agent::call_service`](crate::Agent::call_service)). Await it or
/// [`wait`](RawFuture::wait) for it, then decode it with
/// [`ferry_wire::payload::decode`]. Errors are the call's [`RpcError`]s,
/// as a typed call's.
#[derive(Debug)]
#[must_use = "a RawFuture does nothing until awaited or waited for"]
pub struct RawFuture(pub(crate) RpcFuture<()>);

impl RawFuture {
    /// Blocks the calling thread until the reply arrives.
    pub fn wait(self) -> Result<IncomingMessage, RpcError> {
        self.0.wait_raw()
    }

    /// Whether the outcome has arrived.
    pub fn is_done(&self) -> bool {
        self.0.is_done()
    }
}

impl std::future::Future for RawFuture {
    type Output = Result<IncomingMessage, RpcError>;
    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        self.get_mut().0.poll_raw(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote(failure: Failure) -> (String, u64, String) {
        let e = failure_to_error(failure, "worker1", "f", Signature::of::<(), ()>());
        let text = e.to_string();
        match e {
            RpcError::Remote {
                message,
                omitted_bytes,
                ..
            } => (message, omitted_bytes, text),
            other => panic!("{other}"),
        }
    }

    /// A callee's error text reaches the caller's error as raised; its
    /// `Display` shows it escaped.
    #[test]
    fn a_callees_error_text_is_kept_as_raised_and_displayed_escaped() {
        let text = "\nFirst line of error \n next line of error \n last line of error\u{1b}[2J";
        let (message, omitted, shown) = remote(Failure::failed(text.to_string()));
        assert_eq!((message.as_str(), omitted), (text, 0));
        assert_eq!(
            shown,
            r#"function "f" failed on worker "worker1": \nFirst line of error \n next line of error \n last line of error\u{1b}[2J"#
        );
    }

    /// A text over the limit is cut on a character boundary, by the callee
    /// and again by the caller, and the error says how much was left out.
    #[test]
    fn a_callees_error_text_is_bounded_with_the_bytes_left_out() {
        // "é" is two bytes: the limit falls inside one.
        let text = format!("a{}", "é".repeat(MAX_ERROR_TEXT_BYTES));
        let failure = Failure::failed(text.clone());
        assert_eq!(failure.message.len(), MAX_ERROR_TEXT_BYTES - 1);
        assert_eq!(failure.omitted, (text.len() - failure.message.len()) as u64);
        let (message, omitted, shown) = remote(failure);
        assert!(text.starts_with(&message));
        assert_eq!(message.len() as u64 + omitted, text.len() as u64);
        assert!(
            shown.ends_with(&format!("é…({omitted} more bytes)")),
            "{shown}"
        );

        // A peer that sends more than the limit is cut here too.
        let mut failure = Failure::failed(String::new());
        failure.message = "x".repeat(MAX_ERROR_TEXT_BYTES + 10);
        failure.omitted = 5;
        let (message, omitted, shown) = remote(failure);
        assert_eq!((message.len(), omitted), (MAX_ERROR_TEXT_BYTES, 15));
        assert!(shown.ends_with("x…(15 more bytes)"), "{shown}");
    }
}
