//! The agent serving its peers: dispatching the messages a connection
//! reads (replies to the calls, requests to registered functions, service
//! messages to their service), running function bodies, and replying.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ferry_transport::{IncomingMessage, OutgoingMessage};
use ferry_wire::payload::{self, Encoded, IncomingTensor};
use ferry_wire::{Flags, MessageKind};
use tracing::{warn, Instrument};

use crate::current;
use crate::functions::{panic_message, Body, CallResult, Function, Signature};
use crate::inline;
use crate::outbox::{Outbox, SendError};
use crate::protocol::{CallHeader, Extension, Failure, FailureKind, ServiceHeader};
use crate::scope::{Scoped, Scopes};
use crate::service::IncomingCall;
use crate::watch;
use crate::{RpcError, Value, WorkerInfo};

use super::{Agent, Inner};

impl Agent {
    /// Runs the registered function `function` on this worker, as a call
    /// from another worker would run it (blocking pool or task, panics
    /// caught), and returns its result as a [`Value`]. `signature` is the
    /// caller's [`Signature::id`]; `args` its encoded arguments.
    ///
    /// This is how a layer keeps a result on this worker instead of
    /// replying with it (an RRef's owner runs `remote` calls this way).
    pub fn run_function(
        &self,
        function: &str,
        signature: crate::SignatureId,
        args: Vec<u8>,
        tensors: Vec<IncomingTensor>,
    ) -> crate::boxed::BoxFuture<Result<Value, RpcError>> {
        let inner = &self.inner;
        let worker = inner.me.name.clone();
        let name = function.to_string();
        let to_error = move |failure: Failure| {
            crate::call::failure_to_error(failure, &worker, &name, Signature::of::<(), ()>())
        };
        let body = match inner.lookup(function, signature) {
            Ok(f) => f.body,
            Err(failure) => {
                let e = to_error(failure);
                return Box::pin(async move { Err(e) });
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        inner.run_body(body, args, 0, tensors, Scopes::current(), move |result| {
            let _ = tx.send(result);
        });
        Box::pin(async move {
            match rx.await {
                Ok(result) => result.map_err(to_error),
                Err(_) => Err(RpcError::NotInitialized),
            }
        })
    }
}

impl Inner {
    /// Runs the interceptors over a call that arrived; returns the scopes
    /// it is to run in.
    pub(super) fn intercept_receive(
        &self,
        from: &WorkerInfo,
        function: &str,
        service: bool,
        tensors: &[IncomingTensor],
        extensions: &[Extension],
    ) -> Scopes {
        if self.interceptors.is_empty() {
            return Scopes::default();
        }
        let call = IncomingCall {
            from,
            function,
            service,
            tensors,
            extensions,
        };
        Scopes::new(
            self.interceptors
                .iter()
                .filter_map(|i| i.on_receive(&call))
                .collect(),
        )
    }

    /// Handles one message read on connection `conn` from `peer`: a reply
    /// goes to the calls, a request or a service message is served.
    /// Returns whether it left a task queued on this runtime (a woken
    /// caller, a body or handler that has to wait).
    pub(super) fn on_message(
        self: &Arc<Self>,
        peer: &WorkerInfo,
        conn: u64,
        msg: IncomingMessage,
        outbox: &Outbox,
    ) -> bool {
        let kind = msg.header.kind;
        if msg.header.flags.contains(Flags::REPLY) {
            self.on_reply(peer, conn, msg)
        } else if kind == MessageKind::REQUEST {
            self.active.fetch_add(1, Ordering::SeqCst);
            self.serve_request(peer, msg, outbox.clone())
        } else if kind.is_service() {
            self.active.fetch_add(1, Ordering::SeqCst);
            self.serve_service(peer.clone(), msg, outbox.clone())
        } else {
            warn!(peer = %peer.name, %kind, "ignoring an unexpected message");
            false
        }
    }

    /// Sends the reply to a call from `caller` and counts the call served.
    pub(super) fn reply(
        &self,
        caller: &WorkerInfo,
        outbox: &Outbox,
        request_id: u64,
        result: Result<Encoded, Failure>,
    ) {
        let (kind, encoded) = match result {
            Ok(e) => (MessageKind::RESPONSE, e),
            Err(f) => (MessageKind::ERROR, payload::encode(&f).unwrap_or_default()),
        };
        let mut sent = outbox.send(OutgoingMessage {
            kind,
            flags: Flags::REPLY,
            request_id,
            payload: encoded.payload,
            tensors: encoded.tensors,
        });
        match &sent {
            Err(SendError::TooLarge(e)) => {
                sent = outbox.send(self.result_too_large(caller, request_id, e));
            }
            Err(SendError::NoChannel(e)) => {
                sent = outbox.send(error_reply(
                    request_id,
                    Failure::failed(format!("the result was not sent: {e}")),
                ));
            }
            _ => {}
        }
        if let Err(SendError::Write(e)) = sent {
            warn!(request_id, error = %e, "cannot send a reply");
        }
        self.tally.served(caller.id);
        self.call_done();
    }

    /// Runs a request's function; returns whether it left a task queued.
    pub(super) fn serve_request(
        self: &Arc<Self>,
        from: &WorkerInfo,
        msg: IncomingMessage,
        outbox: Outbox,
    ) -> bool {
        let id = msg.header.request_id;
        let (header, rest) = match split_header::<CallHeader>(&msg.payload, "call") {
            Ok(split) => split,
            Err(failure) => {
                self.reply(from, &outbox, id, Err(failure));
                return false;
            }
        };
        let function = match self.lookup(&header.function, header.signature) {
            Ok(f) => f,
            Err(failure) => {
                self.reply(from, &outbox, id, Err(failure));
                return false;
            }
        };
        let scopes = self.intercept_receive(
            from,
            &header.function,
            false,
            &msg.tensors,
            &header.extensions,
        );
        let IncomingMessage {
            payload, tensors, ..
        } = msg;
        let inner = self.clone();
        let caller = from.clone();
        self.run_body(
            function.body.clone(),
            payload,
            rest,
            tensors,
            scopes,
            move |result| {
                let (encoded, watches) = watch::encoding_message(|| {
                    result.and_then(|v| {
                        v.encode()
                            .map_err(|e| Failure::failed(format!("cannot encode the result: {e}")))
                    })
                });
                // A result over the caller's limits is never sent either.
                let encoded = encoded.and_then(|e| match outbox.check(&e.payload, &e.tensors) {
                    Ok(()) => Ok(e),
                    Err(too_large) => Err(result_too_large(&caller, &too_large)),
                });
                // A result that did not encode is never sent.
                watches.settle(match encoded {
                    Ok(_) => watch::Delivery::Decoded,
                    Err(_) => watch::Delivery::NotDecoded,
                });
                inner.reply(&caller, &outbox, id, encoded);
            },
        )
    }

    /// Runs a function body the way its registration asks (blocking pool or
    /// task), with this agent as the current one, then hands the outcome to
    /// `done`. Returns whether it left a task queued on this runtime.
    pub(super) fn run_body(
        self: &Arc<Self>,
        body: Body,
        payload: Vec<u8>,
        offset: usize,
        tensors: Vec<IncomingTensor>,
        scopes: Scopes,
        done: impl FnOnce(CallResult) + Send + 'static,
    ) -> bool {
        let agent = Agent {
            inner: self.clone(),
        };
        match body {
            Body::Blocking(f) => {
                self.bodies.spawn(Box::new(move || {
                    current::enter(&agent, || {
                        scopes.run(|| {
                            let result = f(&payload[offset..], tensors);
                            done(result)
                        })
                    })
                }));
                false
            }
            Body::Async(f) => {
                let fut = current::enter(&agent, || scopes.run(|| f(&payload[offset..], tensors)));
                let fut = std::panic::AssertUnwindSafe(Scoped {
                    scopes: scopes.clone(),
                    future: Box::pin(fut),
                });
                let span = self.span.clone();
                // A body that is ready at once (most are) answers without a
                // trip through the scheduler; one that waits continues as a task.
                !inline::run_or_spawn(
                    &self.handle,
                    Box::pin(
                        async move {
                            let result = match futures::FutureExt::catch_unwind(fut).await {
                                Ok(r) => r,
                                Err(panic) => Err(Failure::failed(panic_message(&*panic))),
                            };
                            current::enter(&agent, || scopes.run(|| done(result)));
                        }
                        .instrument(span),
                    ),
                )
            }
        }
    }

    /// The registered function `name`, if it accepts the caller's signature.
    pub(super) fn lookup(
        &self,
        name: &str,
        signature: crate::SignatureId,
    ) -> Result<Function, Failure> {
        let Some(function) = self.functions.get(name) else {
            return Err(Failure::new(FailureKind::UnknownFunction, String::new()));
        };
        if !function.signature.accepts(&signature) {
            // Written as it was compared: by shapes if both sides are typed.
            let by_schema = function.signature.schema.is_some() && signature.schema.is_some();
            return Err(Failure::wrong_type(
                function.signature.shown(by_schema),
                by_schema,
            ));
        }
        Ok(function.into_owned())
    }

    /// Hands a service message to its service; returns whether it left a
    /// task queued. The handler's future is polled here first, like an
    /// async body, and continues as a task only if it has to wait.
    pub(super) fn serve_service(
        self: &Arc<Self>,
        from: WorkerInfo,
        msg: IncomingMessage,
        outbox: Outbox,
    ) -> bool {
        let id = msg.header.request_id;
        let kind = msg.header.kind;
        let Some(service) = self.services.get(&kind).cloned() else {
            self.reply(
                &from,
                &outbox,
                id,
                Err(Failure::new(FailureKind::UnknownFunction, String::new())),
            );
            return false;
        };
        let (header, offset) = match split_header::<ServiceHeader>(&msg.payload, "service") {
            Ok(split) => split,
            Err(failure) => {
                self.reply(&from, &outbox, id, Err(failure));
                return false;
            }
        };
        let scopes = self.intercept_receive(
            &from,
            service.name(),
            true,
            &msg.tensors,
            &header.extensions,
        );
        let mut msg = msg;
        msg.payload.drain(..offset);
        let inner = self.clone();
        let agent = Agent {
            inner: self.clone(),
        };
        let caller = from.clone();
        let handled = current::enter(&agent, || scopes.run(|| service.handle(from, msg)));
        let handled = Scoped {
            scopes,
            future: Box::pin(handled),
        };
        !inline::run_or_spawn(
            &self.handle,
            Box::pin(
                async move {
                    let result = handled.await.map_err(Failure::failed);
                    inner.reply(&caller, &outbox, id, result);
                }
                .instrument(self.span.clone()),
            ),
        )
    }

    /// The error reply that replaces a reply over the caller's limits.
    pub(super) fn result_too_large(
        &self,
        caller: &WorkerInfo,
        request_id: u64,
        e: &ferry_wire::WireError,
    ) -> OutgoingMessage {
        OutgoingMessage {
            kind: MessageKind::ERROR,
            flags: Flags::REPLY,
            request_id,
            payload: payload::encode(&result_too_large(caller, e))
                .unwrap_or_default()
                .payload,
            tensors: Vec::new(),
        }
    }
}

/// An error reply carrying `failure`.
pub(super) fn error_reply(request_id: u64, failure: Failure) -> OutgoingMessage {
    OutgoingMessage {
        kind: MessageKind::ERROR,
        flags: Flags::REPLY,
        request_id,
        payload: payload::encode(&failure).unwrap_or_default().payload,
        tensors: Vec::new(),
    }
}

/// The failure that replaces a result over the caller's limits.
fn result_too_large(caller: &WorkerInfo, e: &ferry_wire::WireError) -> Failure {
    Failure::failed(format!(
        "the result was not sent: worker {:?} would refuse it ({e})",
        caller.name
    ))
}

/// The postcard header `H` at the start of a payload, and the offset of
/// what follows it; a `BadRequest` failure naming the `what` header if it
/// does not decode.
fn split_header<H: serde::de::DeserializeOwned>(
    payload: &[u8],
    what: &str,
) -> Result<(H, usize), Failure> {
    postcard::take_from_bytes::<H>(payload)
        .map(|(header, rest)| (header, payload.len() - rest.len()))
        .map_err(|e| {
            Failure::new(
                FailureKind::BadRequest,
                format!("malformed {what} header: {e}"),
            )
        })
}
