//! [`RRef<T>`]: a handle to a value that lives on one worker (its owner).

use std::any::type_name;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use ferry_rpc::{RpcError, Value, WorkerInfo};
use ferry_wire::payload;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::context::RRefContext;
use crate::error::RRefError;
use crate::message::{RRefMessage, RRefWire, ToHereReply, RREF_SERVICE};
use crate::protocol::{Holder, RRefId, WorkerId};
use crate::slot::SlotState;

/// One local reference to an RRef: the owner's value or a user's fork.
/// Dropping the last clone of an [`RRef`] drops it, which tells the
/// protocol (and, for a user, eventually the owner).
struct Handle {
    ctx: Arc<RRefContext>,
    holder: Holder,
    rref_id: RRefId,
    owner: WorkerId,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.ctx.drop_handle(self.holder);
    }
}

/// A remote reference to a value of type `T` held by its owner worker.
///
/// Made by [`remote`](crate::RemoteExt::remote) (the value is the result of a function
/// run on the owner) or by [`RRef::new`] (owned by the caller). Cloning is
/// cheap and shares the handle. An `RRef` can travel inside the arguments
/// and results of `rpc_sync`, `rpc_async` and `remote`, also nested in
/// containers or in other RRefs' values; the protocol keeps the value on
/// the owner exactly as long as some worker can still reach it.
pub struct RRef<T> {
    handle: Arc<Handle>,
    _value: PhantomData<fn() -> T>,
}

impl<T> Clone for RRef<T> {
    fn clone(&self) -> Self {
        Self {
            handle: self.handle.clone(),
            _value: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for RRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RRef")
            .field("id", &self.handle.rref_id)
            .field("owner", &self.handle.owner)
            .field("type", &type_name::<T>())
            .finish()
    }
}

impl<T> RRef<T> {
    pub(crate) fn from_parts(
        ctx: Arc<RRefContext>,
        rref_id: RRefId,
        holder: Holder,
        owner: WorkerId,
    ) -> Self {
        Self {
            handle: Arc::new(Handle {
                ctx,
                holder,
                rref_id,
                owner,
            }),
            _value: PhantomData,
        }
    }

    /// The RRef's globally unique id.
    pub fn id(&self) -> RRefId {
        self.handle.rref_id
    }

    /// The owner's rank.
    pub fn owner(&self) -> WorkerId {
        self.handle.owner
    }

    /// The owner's name.
    pub fn owner_name(&self) -> String {
        self.handle.ctx.worker_name(self.handle.owner)
    }

    /// The owner's worker info.
    pub fn owner_info(&self) -> Result<WorkerInfo, RRefError> {
        let agent = self.agent()?;
        Ok(agent.get_worker_info(self.handle.owner)?)
    }

    /// Whether this worker owns the value.
    pub fn is_owner(&self) -> bool {
        matches!(self.handle.holder, Holder::Owner(_))
    }

    /// Whether the owner has confirmed this user (always true on the owner).
    pub fn confirmed_by_owner(&self) -> bool {
        self.handle.ctx.is_confirmed(self.handle.holder)
    }

    pub(crate) fn agent(&self) -> Result<ferry_rpc::Agent, RRefError> {
        self.handle.ctx.agent().ok_or(RRefError::ShutDown {
            rref_id: self.handle.rref_id,
        })
    }

    /// Fetches the value from its owner as the type called `type_name`
    /// there, decoded by `decode` from the value's payload and tensors
    /// (with the agent current): `to_here` for a type named at compile time
    /// or, for [`DynRRef`](crate::DynRRef), at run time.
    pub(crate) fn fetch_as<V, F>(
        &self,
        agent: &ferry_rpc::Agent,
        timeout: Duration,
        type_name: String,
        decode: F,
    ) -> Result<impl std::future::Future<Output = Result<V, RRefError>> + Send + 'static, RRefError>
    where
        V: 'static,
        F: FnOnce(
                &[u8],
                Vec<ferry_wire::payload::IncomingTensor>,
            ) -> Result<V, ferry_wire::WireError>
            + Send
            + 'static,
    {
        self.check_created()?;
        let h = &self.handle;
        let request = RRefMessage::ToHere {
            rref_id: h.rref_id,
            type_name: type_name.clone(),
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        };
        let message = payload::encode(&request).map_err(|e| RRefError::Codec(e.to_string()))?;
        let reply = agent.call_service(h.owner, RREF_SERVICE, message, timeout);
        let (rref_id, owner) = (h.rref_id, self.owner_name());
        let handle = self.handle.clone();
        let agent = agent.clone();
        let holder = h.holder;
        Ok(async move {
            let ctx = handle.ctx.clone();
            let outcome = tokio::select! {
                r = reply => r,
                () = ctx.creation_failure(holder) => {
                    return Err(ctx.creation_failed(holder, rref_id, handle.owner));
                }
            };
            let result = match outcome {
                Ok(msg) => to_here_reply(&agent, msg, rref_id, owner, timeout, &type_name, decode),
                Err(RpcError::Timeout { after, .. }) => Err(RRefError::Timeout {
                    rref_id,
                    owner,
                    after,
                }),
                Err(e) => Err(e.into()),
            };
            // The handle lives until the reply has arrived.
            drop(handle);
            result
        })
    }

    /// Forks the RRef into the message being encoded, as an RRef to the
    /// type called `type_name` (see `Serialize`).
    pub(crate) fn serialize_as<S: Serializer>(
        &self,
        type_name: &str,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        let h = &self.handle;
        if !ferry_rpc::watch::is_encoding_message() {
            let e = RRefError::OutsideMessage { rref_id: h.rref_id };
            return Err(payload::custom_ser_error::<S::Error>(e.to_string()));
        }
        let fork = h
            .ctx
            .fork(h.holder, h.rref_id, h.owner)
            .map_err(|e| payload::custom_ser_error::<S::Error>(e.to_string()))?;
        h.ctx.watch_fork(fork);
        RRefWire {
            fork,
            type_name: type_name.to_string(),
        }
        .serialize(serializer)
    }

    /// Receives an RRef from a message being decoded, whatever its value's
    /// type: the handle and the name of the type it was sent as. In a
    /// function's arguments, the function runs once the owner has
    /// confirmed this user (as PyTorch's callee waits for its pending users
    /// before running the function).
    pub(crate) fn deserialize_any<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<(Self, String), D::Error> {
        let wire = RRefWire::deserialize(deserializer)?;
        let ctx =
            RRefContext::current().map_err(|e| payload::custom_error::<D::Error>(e.to_string()))?;
        let holder = ctx.receive(wire.fork);
        let rref = RRef::from_parts(ctx, wire.fork.rref_id, holder, wire.fork.owner);
        if !rref.confirmed_by_owner() {
            let handle = rref.handle.clone();
            ferry_rpc::watch::before_run(Box::pin(async move {
                let h = &handle;
                h.ctx
                    .confirmed(h.holder, h.rref_id, h.owner)
                    .await
                    .map_err(|e| e.to_string())
            }));
        }
        Ok((rref, wire.type_name))
    }

    fn check_created(&self) -> Result<(), RRefError> {
        if self.handle.ctx.has_failed(self.handle.holder) {
            return Err(self.handle.ctx.creation_failed(
                self.handle.holder,
                self.handle.rref_id,
                self.handle.owner,
            ));
        }
        Ok(())
    }
}

impl<T: Send + 'static> RRef<T> {
    /// The owner's stored value, once the function creating it has run (up
    /// to the agent's default timeout). Elsewhere: an error naming the RRef
    /// and its owner.
    fn owned_value(&self) -> Result<Value, RRefError> {
        let ctx = &self.handle.ctx;
        let id = self.handle.rref_id;
        if !self.is_owner() {
            return Err(RRefError::NotOwner {
                rref_id: id,
                worker: ctx.worker_name(ctx.me()),
                owner: self.owner_name(),
            });
        }
        let agent = self.agent()?;
        let timeout = agent.rpc_timeout();
        // The `remote` call creating the value may still be on its way
        // (it travels as a service message, and this handle may have
        // arrived first in a function call): wait for the slot too.
        let slot =
            match ctx.slot(id) {
                Some(slot) => slot,
                None => agent.block_on(ctx.slot_async(id, timeout)).ok_or_else(|| {
                    RRefError::Timeout {
                        rref_id: id,
                        owner: self.owner_name(),
                        after: timeout,
                    }
                })?,
            };
        match slot.wait(timeout) {
            SlotState::Ready(v) => Ok(v),
            SlotState::Failed(failure) => Err(RRefError::ValueFailed {
                rref_id: id,
                owner: self.owner_name(),
                message: failure.message,
                omitted_bytes: failure.omitted_bytes,
            }),
            SlotState::Pending => Err(RRefError::Timeout {
                rref_id: id,
                owner: self.owner_name(),
                after: timeout,
            }),
        }
    }

    fn wrong_type(&self, value: &Value) -> RRefError {
        RRefError::WrongType {
            rref_id: self.handle.rref_id,
            owner: self.owner_name(),
            expected: type_name::<T>().into(),
            actual: value.type_name().into(),
        }
    }

    /// Runs `f` on the value, on the owner only, without sharing it with
    /// other threads: for values that are `Send` but not `Sync` (a
    /// `tch::Tensor` inside `ferry_tch::Tensor`, a `RefCell`), where
    /// [`local_value`](Self::local_value) is not available. Calls on one
    /// value, and encoding it for `to_here`, take turns. Blocks and fails
    /// as `local_value` does.
    pub fn with_local_value<R>(&self, f: impl FnOnce(&T) -> R) -> Result<R, RRefError> {
        let value = self.owned_value()?;
        value.with(f).ok_or_else(|| self.wrong_type(&value))
    }
}

impl<T: Send + Sync + 'static> RRef<T> {
    /// The value, on the owner only; blocks until the function creating it
    /// has run (up to the agent's default timeout). Elsewhere: an error
    /// naming the RRef and its owner. Needs `T: Sync`, since the `Arc` may
    /// go to other threads; see [`with_local_value`](Self::with_local_value)
    /// otherwise.
    pub fn local_value(&self) -> Result<Arc<T>, RRefError> {
        let value = self.owned_value()?;
        value.downcast::<T>().ok_or_else(|| self.wrong_type(&value))
    }
}

impl<T: Serialize + Send + 'static> RRef<T> {
    /// A new RRef owned by this worker, holding `value`.
    pub fn new(value: T) -> Result<Self, RRefError> {
        let ctx = RRefContext::current()?;
        let owner = ctx.me();
        let id = ctx.create_local(Value::new(value));
        Ok(Self::from_parts(ctx, id, Holder::Owner(id), owner))
    }
}

impl<T: DeserializeOwned + 'static> RRef<T> {
    /// Fetches a copy of the value from the owner, waiting until it exists,
    /// with the agent's default timeout (PyTorch's `to_here()`); another
    /// limit: `rref.timeout(limit).to_here()` ([`timeout`](Self::timeout)).
    pub fn to_here(&self) -> Result<T, RRefError> {
        self.timeout_or_default(None).to_here()
    }

    /// [`to_here`](Self::to_here) for async code: awaits the reply instead
    /// of blocking the thread.
    pub async fn to_here_async(&self) -> Result<T, RRefError> {
        self.timeout_or_default(None).to_here_async().await
    }

    /// The fetch of the value with a time limit of its own (zero: none),
    /// as `timeout` in PyTorch's `to_here(timeout)`:
    /// `rref.timeout(limit).to_here()`. (The proxies take theirs the same
    /// way: `rref.rpc_sync().timeout(limit)`.)
    pub fn timeout(&self, timeout: Duration) -> ToHere<'_, T> {
        self.timeout_or_default(Some(timeout))
    }

    fn timeout_or_default(&self, timeout: Option<Duration>) -> ToHere<'_, T> {
        ToHere {
            rref: self,
            timeout,
        }
    }

    fn fetch(
        &self,
        agent: &ferry_rpc::Agent,
        timeout: Duration,
    ) -> Result<impl std::future::Future<Output = Result<T, RRefError>> + Send + 'static, RRefError>
    {
        self.fetch_as(
            agent,
            timeout,
            type_name::<T>().to_string(),
            |bytes, tensors| payload::decode::<T>(bytes, tensors),
        )
    }

    /// A proxy that runs methods of the value on its owner with `rpc_sync`.
    pub fn rpc_sync(&self) -> crate::proxy::RpcSyncProxy<'_, T> {
        crate::proxy::RpcSyncProxy::new(self)
    }

    /// A proxy that runs methods of the value on its owner with `rpc_async`.
    pub fn rpc_async(&self) -> crate::proxy::RpcAsyncProxy<'_, T> {
        crate::proxy::RpcAsyncProxy::new(self)
    }

    /// A proxy that runs methods of the value on its owner with `remote`,
    /// leaving each result there as a new RRef.
    pub fn remote(&self) -> crate::proxy::RemoteProxy<'_, T> {
        crate::proxy::RemoteProxy::new(self)
    }
}

/// Reads the owner's [`ToHereReply`] and, with a value, the value,
/// decoded by `decode`; `type_name` is the type asked for.
fn to_here_reply<V>(
    agent: &ferry_rpc::Agent,
    msg: ferry_transport::IncomingMessage,
    rref_id: RRefId,
    owner: String,
    timeout: Duration,
    type_name: &str,
    decode: impl FnOnce(
        &[u8],
        Vec<ferry_wire::payload::IncomingTensor>,
    ) -> Result<V, ferry_wire::WireError>,
) -> Result<V, RRefError> {
    let codec = |e: &dyn std::fmt::Display| {
        RRefError::Codec(format!("cannot decode the value of {rref_id}: {e}"))
    };
    let (reply, rest) =
        postcard::take_from_bytes::<ToHereReply>(&msg.payload).map_err(|e| codec(&e))?;
    match reply {
        ToHereReply::Value => {
            let offset = msg.payload.len() - rest.len();
            agent
                .enter(|| decode(&msg.payload[offset..], msg.tensors))
                .map_err(|e| codec(&e))
        }
        ToHereReply::Unknown => Err(RRefError::Unknown { rref_id, owner }),
        ToHereReply::NotYet => Err(RRefError::Timeout {
            rref_id,
            owner,
            after: timeout,
        }),
        ToHereReply::Failed(failure) => {
            // The owner's text, as raised there: bounded again here.
            let failure = failure.bounded();
            Err(RRefError::ValueFailed {
                rref_id,
                owner,
                message: failure.message,
                omitted_bytes: failure.omitted_bytes,
            })
        }
        ToHereReply::WrongType(actual) => Err(RRefError::WrongType {
            rref_id,
            owner,
            expected: type_name.to_string(),
            actual,
        }),
    }
}

impl<T> Serialize for RRef<T> {
    /// Forks the RRef into the message being encoded (refused outside one,
    /// with [`RRefError::OutsideMessage`]'s text); the fork is undone if the
    /// message never reaches its receiver's code.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.serialize_as(type_name::<T>(), serializer)
    }
}

impl<'de, T> Deserialize<'de> for RRef<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let (rref, sent_as) = RRef::<T>::deserialize_any(deserializer)?;
        if sent_as != type_name::<T>() {
            // Dropping the handle completes its bookkeeping.
            return Err(payload::custom_error::<D::Error>(format!(
                "expected an RRef<{}>, got an RRef<{}> ({})",
                type_name::<T>(),
                sent_as,
                rref.id()
            )));
        }
        Ok(rref)
    }
}

/// A fetch of an RRef's value with its options:
/// [`RRef::timeout`]`(limit)` then [`to_here`](Self::to_here) or
/// [`to_here_async`](Self::to_here_async).
#[must_use = "a ToHere does nothing until to_here or to_here_async"]
pub struct ToHere<'a, T> {
    rref: &'a RRef<T>,
    /// `None`: the agent's default.
    timeout: Option<Duration>,
}

impl<T: DeserializeOwned + 'static> ToHere<'_, T> {
    /// Fetches a copy of the value, blocking the thread.
    pub fn to_here(self) -> Result<T, RRefError> {
        let agent = self.rref.agent()?;
        let timeout = self.timeout.unwrap_or_else(|| agent.rpc_timeout());
        let future = self.rref.fetch(&agent, timeout)?;
        agent.block_on(future)
    }

    /// Fetches a copy of the value, awaiting the reply.
    pub async fn to_here_async(self) -> Result<T, RRefError> {
        let agent = self.rref.agent()?;
        let timeout = self.timeout.unwrap_or_else(|| agent.rpc_timeout());
        self.rref.fetch(&agent, timeout)?.await
    }
}

impl<T> std::fmt::Debug for ToHere<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToHere")
            .field("rref", &self.rref.id())
            .field("timeout", &self.timeout)
            .finish()
    }
}
