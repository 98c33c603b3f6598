//! Calls and registrations whose types are known at run time only, for
//! bindings to other languages (ferry-py): the caller learned the
//! function's [`Description`](crate::describe::Description) from the callee
//! ([`DESCRIBE`](crate::describe::DESCRIBE)), encodes its arguments by the
//! described shape and decodes the raw reply the same way
//! ([`Agent::call_dynamic`]); a registration brings its own decoding and
//! declared shapes ([`Functions::add_dynamic`]).
//!
//! The callee's type check is the one typed calls get: a call carries the
//! signature the description gave, and a registration's shapes are
//! compared by their hash with its typed callers'.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use ferry_wire::payload::IncomingTensor;
use serde::Serialize;

use crate::call::{RawFuture, RpcFuture};
use crate::describe::{self, Description};
use crate::functions::{panic_message, Body, Function, Signature, SignatureSchema};
use crate::protocol::{Failure, FailureKind};
use crate::schema::Shape;
use crate::{watch, Agent, Functions, SignatureId, Value, WorkerRef};

/// What a dynamic call's errors show as its caller's signature (a
/// description gave the caller nothing else to write).
struct Described;

impl Agent {
    /// The description of the function registered on this worker under
    /// `name`: what [`DESCRIBE`](crate::describe::DESCRIBE) answers a peer.
    pub fn describe(&self, name: &str) -> Option<Description> {
        let function = self.inner.functions.get(name)?;
        describe::describe(name, &function.signature)
    }

    /// Starts a call of `function` on worker `to` that carries `signature`
    /// (from the callee's description) and the arguments `args` serialise
    /// to, with the call's `timeout` (`None`: the agent's default; zero:
    /// none). The reply comes back undecoded: [`RawFuture::wait`] gives the
    /// result's payload and tensors, for the caller to decode by the
    /// described result shape (`ferry_wire::payload::decode_seed`).
    pub fn call_dynamic<A: Serialize + ?Sized>(
        &self,
        to: impl Into<WorkerRef>,
        function: &str,
        signature: SignatureId,
        args: &A,
        timeout: Option<Duration>,
    ) -> RawFuture {
        let shown = Signature::of::<Described, Described>();
        let timeout = timeout.unwrap_or_else(|| self.rpc_timeout());
        RawFuture(
            match self
                .inner
                .start_call(to.into(), function, signature, args, timeout)
            {
                Ok((slot, worker)) => RpcFuture::new(slot, worker, function.to_string(), shown)
                    .with_agent(self.downgrade()),
                Err(e) => RpcFuture::failed(e, function, shown),
            },
        )
    }
}

impl Signature {
    /// The signature of a function whose shapes are known at run time
    /// only (declared in another language, made into `'static` shapes once
    /// per registration): typed, so typed callers whose declared shapes
    /// are the same are accepted. `args_type` and `result_type` stand for
    /// the type names.
    pub fn from_shapes(
        args_type: &'static str,
        result_type: &'static str,
        args: &'static Shape,
        result: &'static Shape,
    ) -> Signature {
        Signature {
            args: args_type,
            result: result_type,
            schema: Some(SignatureSchema {
                args,
                result,
                hash: crate::schema::hash_signature(args, result),
            }),
        }
    }
}

impl Functions {
    /// Registers a function whose types are known at run time only, under
    /// `name` with `signature` ([`Signature::from_shapes`]): `decode`
    /// reads the arguments from the payload and its tensors (inside the
    /// decoding of a call, so RRefs in them are received as in a typed
    /// one), then `body` runs on them and gives the result as a
    /// [`Value`]. Both run on the blocking pool; the body runs once RRefs
    /// in the arguments are confirmed, as a typed body does. An `Err` of
    /// `decode` reaches the caller as bad arguments, one of `body` (or a
    /// panic) as the function's failure, with its text.
    pub fn add_dynamic<A, D, B>(
        &mut self,
        name: &str,
        signature: Signature,
        decode: D,
        body: B,
    ) -> &mut Self
    where
        A: Send + 'static,
        D: Fn(&[u8], Vec<IncomingTensor>) -> Result<A, String> + Send + Sync + 'static,
        B: Fn(A) -> Result<Value, String> + Send + Sync + 'static,
    {
        let run = move |bytes: &[u8], tensors: Vec<IncomingTensor>| {
            let (args, before) = watch::decoding_arguments(|| {
                catch_unwind(AssertUnwindSafe(|| decode(bytes, tensors)))
                    .unwrap_or_else(|panic| Err(panic_message(&*panic)))
                    .map_err(|e| {
                        Failure::new(
                            FailureKind::BadArguments,
                            format!("cannot decode the arguments: {e}"),
                        )
                    })
            });
            let args = args?;
            if !before.is_empty() {
                before.block().map_err(Failure::failed)?;
            }
            match catch_unwind(AssertUnwindSafe(|| body(args))) {
                Ok(result) => result.map_err(Failure::failed),
                Err(panic) => Err(Failure::failed(panic_message(&*panic))),
            }
        };
        self.insert(
            name,
            Function {
                signature,
                body: Body::Blocking(Arc::new(run)),
            },
        )
    }
}

/// The functions every agent serves besides its own: [`DESCRIBE`](crate::describe::DESCRIBE).
pub(crate) fn with_builtins(mut functions: Functions) -> Functions {
    functions.add(describe::DESCRIBE, |name: String| {
        Agent::current().and_then(|agent| agent.describe(&name))
    });
    functions
}
