//! [`DynRRef`]: an RRef whose value's type is known at run time only, by
//! the name its owner's registration gives it, for bindings to other
//! languages (a Python worker holding an RRef to a Rust value).

use std::sync::Arc;
use std::time::Duration;

use ferry_rpc::describe::Description;
use ferry_rpc::{Agent, CallOptions, WorkerRef};
use ferry_wire::payload::IncomingTensor;
use ferry_wire::WireError;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{Caller, RRef, RRefError, RRefId};

/// The value type a [`DynRRef`]'s inner handle is declared with; nothing
/// of that type exists.
enum Untyped {}

/// A remote reference to a value whose type the holder knows by its
/// `std::any::type_name` on the owner only: what `remote` of a function
/// described at run time
/// ([`Description`](ferry_rpc::describe::Description)) returns, and what a
/// value decoded by a described shape holds where the shape has an
/// `RRef<T>`.
///
/// It follows the RRef protocol as [`RRef`] does (the same handle: the
/// owner keeps the value while any worker can reach it); its value is
/// fetched as the type it was created as ([`to_here_with`](Self::to_here_with))
/// and it travels as an RRef to that type, so a function on another worker
/// taking an `RRef<T>` of that `T` receives it.
#[derive(Clone)]
pub struct DynRRef {
    rref: RRef<Untyped>,
    type_name: Arc<str>,
}

impl std::fmt::Debug for DynRRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynRRef")
            .field("id", &self.rref.id())
            .field("owner", &self.rref.owner())
            .field("type", &self.type_name)
            .finish()
    }
}

impl DynRRef {
    /// Runs the function `function` describes on worker `to` with `args`
    /// (encoded in its argument layout) and returns at once an RRef to its
    /// result, which stays there, as
    /// [`RemoteExt::remote`](crate::RemoteExt::remote) does: the call
    /// carries the described signature, and the RRef's value is of the
    /// described result type. `options` give the agent and the creation's
    /// timeout.
    pub fn remote<A: Serialize + ?Sized>(
        options: &CallOptions,
        to: impl Into<WorkerRef>,
        function: &Description,
        args: &A,
    ) -> Result<DynRRef, RRefError> {
        let (agent, timeout) = options.agent_and_timeout()?;
        let caller = Caller {
            signature: function.signature,
            shown: function.signature_text(),
            names: format!("fn({}) -> {}", function.args_type, function.result_type),
        };
        let (ctx, rref_id, holder, owner) = crate::remote_with(
            &agent,
            to.into(),
            &function.function,
            &caller,
            args,
            timeout,
        )?;
        Ok(DynRRef {
            rref: RRef::from_parts(ctx, rref_id, holder, owner),
            type_name: function.result_type.as_str().into(),
        })
    }

    /// The RRef's globally unique id.
    pub fn id(&self) -> RRefId {
        self.rref.id()
    }

    /// The owner's rank.
    pub fn owner(&self) -> u32 {
        self.rref.owner()
    }

    /// The owner's name.
    pub fn owner_name(&self) -> String {
        self.rref.owner_name()
    }

    /// Whether this worker owns the value.
    pub fn is_owner(&self) -> bool {
        self.rref.is_owner()
    }

    /// Whether the owner has confirmed this user (always true on the owner).
    pub fn confirmed_by_owner(&self) -> bool {
        self.rref.confirmed_by_owner()
    }

    /// `std::any::type_name` of the value's type on its owner.
    pub fn type_name(&self) -> &str {
        &self.type_name
    }

    /// Fetches a copy of the value from the owner, waiting until it exists
    /// (up to `timeout`; `None`: the agent's default), and decodes it with
    /// `decode` from its payload and tensors, as `to_here` does for a type
    /// known at compile time. Blocks the thread.
    pub fn to_here_with<V, F>(&self, timeout: Option<Duration>, decode: F) -> Result<V, RRefError>
    where
        V: Send + 'static,
        F: FnOnce(&[u8], Vec<IncomingTensor>) -> Result<V, WireError> + Send + 'static,
    {
        let agent: Agent = self.rref.agent()?;
        let timeout = timeout.unwrap_or_else(|| agent.rpc_timeout());
        let future = self
            .rref
            .fetch_as(&agent, timeout, self.type_name.to_string(), decode)?;
        agent.block_on(future)
    }
}

impl Serialize for DynRRef {
    /// Forks the RRef into the message being encoded, as an RRef to its
    /// value's type (see [`RRef`]'s).
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.rref.serialize_as(&self.type_name, serializer)
    }
}

impl<'de> Deserialize<'de> for DynRRef {
    /// Receives an RRef to a value of any type, keeping the type's name.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let (rref, type_name) = RRef::<Untyped>::deserialize_any(deserializer)?;
        Ok(DynRRef {
            rref,
            type_name: type_name.into(),
        })
    }
}
