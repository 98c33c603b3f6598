//! The agent's calls: issuing them (the calls [`Call`](crate::Call)
//! starts, service messages), entering
//! them in the pending-call table ([`crate::pending`]) and completing them
//! with their reply, their timeout or their connection's failure; the
//! timer task that expires them.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_transport::{IncomingMessage, OutgoingMessage};
use ferry_wire::payload::{self, Encoded};
use ferry_wire::{Flags, MessageKind};
use serde::Serialize;
use tracing::{debug, warn};

use crate::call::{CallSlot, RawFuture, RpcFuture};
use crate::functions::Signature;
use crate::outbox::SendError;
use crate::pending::{self, Dropped, Replied};
use crate::protocol::{CallHeader, Extension, ServiceHeader};
use crate::service::OutgoingCall;
use crate::watch;
use crate::{RpcError, WorkerInfo, WorkerRef};

use super::{Agent, Inner};

impl Agent {
    /// Starts a call whose caller's signature is `signature`.
    pub(crate) fn call_signed<R, A: Serialize>(
        &self,
        to: WorkerRef,
        function: &str,
        signature: Signature,
        args: A,
        timeout: Duration,
    ) -> RpcFuture<R> {
        match self
            .inner
            .start_call(to, function, signature.id(), &args, timeout)
        {
            Ok((slot, worker)) => RpcFuture::new(slot, worker, function.to_string(), signature)
                .with_agent(self.downgrade()),
            Err(e) => RpcFuture::failed(e, function, signature),
        }
    }

    /// Sends a message of a service kind to the service registered for it
    /// on `to`, and returns its reply as a raw message.
    pub fn call_service(
        &self,
        to: impl Into<WorkerRef>,
        kind: MessageKind,
        message: Encoded,
        timeout: Duration,
    ) -> RawFuture {
        let inner = &self.inner;
        let sig = Signature::of::<(), ()>();
        let result = (|| {
            if !kind.is_service() {
                return Err(RpcError::Config(format!("{kind} is not a service kind")));
            }
            let rank = inner.resolve(&to.into())?;
            // Named as the service registered here for `kind` calls itself
            // (every worker registers the same ones), for interceptors and
            // errors: a timeout names "rref", not a number.
            let name = match inner.services.get(&kind) {
                Some(service) => service.name().to_string(),
                None => format!("service {}", kind.0),
            };
            let header = ServiceHeader {
                extensions: inner.intercept_send(rank, &name, &message.tensors),
            };
            let mut payload = Vec::with_capacity(8 + message.payload.len());
            payload::encode_into(&header, &mut payload).map_err(|e| RpcError::Codec {
                action: "encode the service header",
                function: name.clone(),
                message: e.to_string(),
            })?;
            payload.extend_from_slice(&message.payload);
            let slot = inner.send_request(rank, kind, &name, payload, message.tensors, timeout)?;
            Ok((slot, inner.workers[rank as usize].name.clone(), name))
        })();
        match result {
            Ok((slot, worker, name)) => RawFuture(RpcFuture::new(slot, worker, name, sig)),
            Err(e) => RawFuture(RpcFuture::failed(e, "service", sig)),
        }
    }
}

impl Inner {
    /// Encodes a call of `function` with `args` (its watches attached to
    /// the call, or settled at once if it never leaves) and sends it to `to`.
    pub(crate) fn start_call<A: Serialize + ?Sized>(
        self: &Arc<Self>,
        to: WorkerRef,
        function: &str,
        signature: crate::SignatureId,
        args: &A,
        timeout: Duration,
    ) -> Result<(Arc<CallSlot>, String), RpcError> {
        self.running()?;
        let rank = self.resolve(&to)?;
        let mut header = CallHeader {
            function: function.to_string(),
            signature,
            extensions: Vec::new(),
        };
        let codec = |e: ferry_wire::WireError| RpcError::Codec {
            action: "encode the arguments",
            function: function.to_string(),
            message: e.to_string(),
        };
        let mut args_payload = Vec::with_capacity(64);
        // Layers that fork state into the arguments (RRefs) learn how the
        // call ends; a call that never leaves undoes it now.
        let (tensors, watches) =
            watch::encoding_message(|| payload::encode_into(args, &mut args_payload));
        let sent = (|| {
            let tensors = tensors.map_err(codec)?;
            header.extensions = self.intercept_send(rank, function, &tensors);
            let mut payload_bytes = Vec::with_capacity(32 + function.len() + args_payload.len());
            payload::encode_into(&header, &mut payload_bytes).map_err(codec)?;
            payload_bytes.extend_from_slice(&args_payload);
            self.send_request(
                rank,
                MessageKind::REQUEST,
                function,
                payload_bytes,
                tensors,
                timeout,
            )
        })();
        match sent {
            Ok(slot) => {
                slot.watch(watches);
                Ok((slot, self.workers[rank as usize].name.clone()))
            }
            Err(e) => {
                watches.settle(watch::Delivery::NotDecoded);
                Err(e)
            }
        }
    }

    /// Runs the interceptors over a call about to leave; returns what they attach.
    pub(super) fn intercept_send(
        &self,
        rank: u32,
        function: &str,
        tensors: &[Arc<dyn ferry_wire::OutgoingTensor>],
    ) -> Vec<Extension> {
        let mut extensions: Vec<Extension> = Vec::new();
        let mut call = OutgoingCall {
            to: &self.workers[rank as usize],
            function,
            tensors,
            extensions: &mut extensions,
        };
        for i in &self.interceptors {
            i.on_send(&mut call);
        }
        extensions
    }

    /// Registers a pending call and queues its request on the link to `rank`.
    pub(super) fn send_request(
        self: &Arc<Self>,
        rank: u32,
        kind: MessageKind,
        function: &str,
        payload: Vec<u8>,
        tensors: Vec<Arc<dyn ferry_wire::OutgoingTensor>>,
        timeout: Duration,
    ) -> Result<Arc<CallSlot>, RpcError> {
        self.running()?;
        let slot = CallSlot::new(self.endpoint.config.spin);
        let link = self.link(rank);
        self.active.fetch_add(1, Ordering::SeqCst);
        // Counted while the call is outstanding, so no shutdown round
        // reads a send half-done; a send that fails is taken back.
        self.tally.sending(rank);
        let issued = self.calls.lock().issue(
            Instant::now(),
            rank,
            link.conn,
            function,
            timeout,
            slot.clone(),
        );
        if issued.wake_timer {
            self.timer_wake.notify_one();
        }
        let id = issued.id;
        let message = OutgoingMessage {
            kind,
            flags: Flags::NONE,
            request_id: id,
            payload,
            tensors,
        };
        match link.outbox.send(message) {
            Ok(()) => {}
            Err(SendError::Closed) => {
                self.tally.not_sent(rank);
                self.fail_call(id, |worker| RpcError::PeerUnreachable {
                    worker,
                    reason: "its connection closed".into(),
                });
            }
            Err(SendError::Write(e)) => {
                // This request was not written; the others on the
                // connection may have been (they count as lost).
                self.tally.not_sent(rank);
                let reason = e.to_string();
                self.fail_call(id, |worker| RpcError::PeerUnreachable {
                    worker,
                    reason: reason.clone(),
                });
                self.fail_connection(link.conn, reason);
            }
            Err(SendError::TooLarge(e)) => {
                // Never sent: the call is forgotten, not counted as sent.
                self.tally.not_sent(rank);
                let cancelled = self.calls.lock().cancel(id);
                if cancelled.is_some() {
                    self.call_done();
                }
                let worker = self.workers[rank as usize].name.clone();
                return Err(RpcError::too_large(worker, function.to_string(), e));
            }
            Err(SendError::NoChannel(e)) => {
                // Never sent, like a message over the limits.
                self.tally.not_sent(rank);
                let cancelled = self.calls.lock().cancel(id);
                if cancelled.is_some() {
                    self.call_done();
                }
                return Err(RpcError::Transport(e.into()));
            }
        }
        Ok(slot)
    }

    /// A reply read on connection `conn` from `peer`: completes the call
    /// it answers if it came from that call's callee on the connection its
    /// request went out on (request ids are guessable, so an id alone
    /// proves nothing), else is dropped. Returns whether it woke a task.
    pub(super) fn on_reply(&self, peer: &WorkerInfo, conn: u64, msg: IncomingMessage) -> bool {
        let id = msg.header.request_id;
        let replied = self.calls.lock().reply(Instant::now(), conn, peer.id, id);
        match replied {
            Replied::Complete(p) => {
                let woke = p.slot.complete(Ok(msg));
                self.call_done();
                woke
            }
            Replied::Late(failed) => {
                debug!(peer = %peer.name, id, "a reply came after its call's deadline");
                self.fail(failed);
                false
            }
            Replied::Dropped(Dropped::NoCall) => {
                debug!(peer = %peer.name, id, "dropping a late reply");
                false
            }
            Replied::Dropped(Dropped::Foreign { callee: to }) => {
                if let Some(suppressed) = self.foreign_replies.allow(Instant::now()) {
                    warn!(
                        peer = %peer.name,
                        id,
                        callee = %self.workers[to as usize].name,
                        suppressed,
                        "dropping a reply that did not come from the callee on the \
                         connection its request went out on"
                    );
                }
                false
            }
        }
    }

    /// Completes a call that ended without its reply with its error.
    pub(super) fn fail(&self, failed: pending::Failed<Arc<CallSlot>>) {
        let (call, error) = match failed {
            pending::Failed::TimedOut(call) => {
                let error = RpcError::Timeout {
                    worker: self.workers[call.to as usize].name.clone(),
                    function: call.function.clone(),
                    after: call.timeout.unwrap_or_default(),
                };
                (call, error)
            }
            pending::Failed::Unreachable { call, reason } => {
                // Sent, and maybe served: shutdown counts it as lost.
                self.tally.lost(call.to);
                let worker = self.workers[call.to as usize].name.clone();
                (call, RpcError::PeerUnreachable { worker, reason })
            }
        };
        call.slot.complete(Err(error));
        self.call_done();
    }

    /// Fails call `id`, whose request was never sent, with `error`.
    pub(super) fn fail_call(&self, id: u64, error: impl FnOnce(String) -> RpcError) {
        let cancelled = self.calls.lock().cancel(id);
        if let Some(p) = cancelled {
            let worker = self.workers[p.to as usize].name.clone();
            p.slot.complete(Err(error(worker)));
            self.call_done();
        }
    }

    /// One outstanding call fewer; wakes those waiting for idleness at zero.
    pub(super) fn call_done(&self) {
        if self.active.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
    }

    /// Expires calls whose deadline passed and re-arms the timer.
    pub(super) fn expire(&self, now: Instant) {
        let expired = self.calls.lock().tick(now);
        for f in expired {
            self.fail(f);
        }
    }
}

/// The timer task: sleeps until the table's earliest deadline (or until
/// woken for an earlier one), then expires the calls due.
pub(super) async fn timer_loop(inner: Arc<Inner>) {
    loop {
        let armed = inner.calls.lock().timer();
        match armed {
            None => inner.timer_wake.notified().await,
            Some(at) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(at.into()) => {
                        inner.expire(Instant::now());
                    }
                    // An earlier deadline was armed.
                    _ = inner.timer_wake.notified() => {}
                }
            }
        }
    }
}
