//! Method calls on an RRef's value, run on its owner: `rref.rpc_sync()`,
//! `rref.rpc_async()` and `rref.remote()`.
//!
//! A method is an ordinary remote function, registered typed with
//! [`MethodsExt::add_method`](crate::MethodsExt::add_method): it receives
//! the RRef (forked to the owner like any argument) and runs against the
//! owner's value, as PyTorch's proxies do. It has one name, as a function
//! has: the name it is registered under, which typed calls ([`Method`])
//! and calls by name (`rref.rpc_sync().call_by_name(..)`) both use. Write
//! it `"Type.method"` (`"Counter.add"`), as PyTorch's proxies call a
//! method by its class's qualified name (`MyClass.get_value`).

use std::marker::PhantomData;
use std::time::Duration;

use ferry_rpc::{by_name, Agent, Arg, Ret, RpcFuture, Schema};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::RRefError;
use crate::method::Method;
use crate::typed::RemoteExt;
use crate::RRef;

/// How a [`Proxy`] calls: blocking ([`Sync`](kind::Sync)), with a future
/// ([`Async`](kind::Async)) or leaving the result on the owner
/// ([`Remote`](kind::Remote)).
pub mod kind {
    /// `rref.rpc_sync()`: blocks for the result.
    #[derive(Debug)]
    pub enum Sync {}
    /// `rref.rpc_async()`: returns a future.
    #[derive(Debug)]
    pub enum Async {}
    /// `rref.remote()`: returns an RRef to the result.
    #[derive(Debug)]
    pub enum Remote {}
}

/// Runs methods of an RRef's value on its owner; `K` says how (see [`kind`]).
#[derive(Debug)]
pub struct Proxy<'a, T, K> {
    rref: &'a RRef<T>,
    timeout: Option<Duration>,
    _kind: PhantomData<K>,
}

/// Runs methods of an RRef's value on its owner, blocking for the result.
pub type RpcSyncProxy<'a, T> = Proxy<'a, T, kind::Sync>;
/// Runs methods of an RRef's value on its owner, returning futures.
pub type RpcAsyncProxy<'a, T> = Proxy<'a, T, kind::Async>;
/// Runs methods of an RRef's value on its owner with `remote`: each result
/// stays there as a new RRef.
pub type RemoteProxy<'a, T> = Proxy<'a, T, kind::Remote>;

impl<'a, T, K> Proxy<'a, T, K> {
    pub(crate) fn new(rref: &'a RRef<T>) -> Self {
        Self {
            rref,
            timeout: None,
            _kind: PhantomData,
        }
    }

    /// Sets the call's timeout (zero: none).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
}

impl<T: DeserializeOwned + 'static> Proxy<'_, T, kind::Sync> {
    /// Calls the typed `method` with `args` on the value's owner and waits
    /// for its result.
    pub fn call<A, R>(&self, method: Method<T, A, R>, args: A) -> Result<R, RRefError>
    where
        T: Schema,
        A: Arg,
        R: Ret,
    {
        self.as_async()
            .call(method, args)
            .wait()
            .map_err(RRefError::Rpc)
    }

    /// Calls the method registered as `method` (`"Counter.add"`: the name
    /// of a typed [`Method`]) with
    /// `args` on the value's owner, and waits for its result (dynamic use;
    /// the types are checked at run time). A name the owner does not
    /// serve fails with an error naming it.
    pub fn call_by_name<R: DeserializeOwned, A: Serialize>(
        &self,
        method: &str,
        args: A,
    ) -> Result<R, RRefError> {
        self.as_async()
            .call_by_name(method, args)
            .wait()
            .map_err(RRefError::Rpc)
    }

    fn as_async(&self) -> Proxy<'_, T, kind::Async> {
        Proxy {
            rref: self.rref,
            timeout: self.timeout,
            _kind: PhantomData,
        }
    }
}

impl<T: DeserializeOwned + 'static> Proxy<'_, T, kind::Async> {
    /// Calls the typed `method` with `args` on the value's owner; the future
    /// gives its result.
    pub fn call<A, R>(&self, method: Method<T, A, R>, args: A) -> RpcFuture<R>
    where
        T: Schema,
        A: Arg,
        R: Ret,
    {
        let function = method.function();
        let args = (self.rref.clone(), args);
        let owner = self.rref.owner();
        match (crate::agent_of(self.rref), self.timeout) {
            (Ok(agent), Some(t)) => function.agent(&agent).timeout(t).rpc_async(owner, args),
            (Ok(agent), None) => function.agent(&agent).rpc_async(owner, args),
            // Shut down: the process-level call fails with the right error.
            (Err(_), _) => function.rpc_async(owner, args),
        }
    }

    /// Calls the method registered as `method` (`"Counter.add"`, as for
    /// [`RpcSyncProxy`]'s `call_by_name`); the future gives its
    /// result (dynamic use).
    pub fn call_by_name<R: DeserializeOwned, A: Serialize>(
        &self,
        method: &str,
        args: A,
    ) -> RpcFuture<R> {
        let owner = self.rref.owner();
        let args = (self.rref.clone(), args);
        let method = by_name(method);
        match (crate::agent_of(self.rref), self.timeout) {
            (Ok(agent), Some(t)) => method.agent(&agent).timeout(t).rpc_async(owner, args),
            (Ok(agent), None) => method.agent(&agent).rpc_async(owner, args),
            // Shut down: the process-level call fails with the right error.
            (Err(_), _) => method.rpc_async(owner, args),
        }
    }
}

impl<T: DeserializeOwned + 'static> Proxy<'_, T, kind::Remote> {
    /// Calls the typed `method` with `args` on the value's owner; returns
    /// at once an RRef to its result, which stays there.
    pub fn call<A, R>(&self, method: Method<T, A, R>, args: A) -> Result<RRef<R>, RRefError>
    where
        T: Schema,
        A: Arg,
        R: Ret,
    {
        let (agent, timeout) = self.agent_and_timeout()?;
        let args = (self.rref.clone(), args);
        method
            .function()
            .agent(&agent)
            .timeout(timeout)
            .remote(self.rref.owner(), args)
    }

    /// Calls the method registered as `method` (`"Counter.add"`, as for
    /// [`RpcSyncProxy`]'s `call_by_name`) on the owner; returns the
    /// result's RRef at once (dynamic use).
    pub fn call_by_name<R, A>(&self, method: &str, args: A) -> Result<RRef<R>, RRefError>
    where
        R: Serialize + DeserializeOwned + Send + 'static,
        A: Serialize,
    {
        let (agent, timeout) = self.agent_and_timeout()?;
        let args = (self.rref.clone(), args);
        by_name(method)
            .agent(&agent)
            .timeout(timeout)
            .remote(self.rref.owner(), args)
    }

    /// The RRef's agent, and this proxy's timeout or that agent's default.
    fn agent_and_timeout(&self) -> Result<(Agent, Duration), RRefError> {
        let agent = crate::agent_of(self.rref)?;
        let timeout = self.timeout.unwrap_or_else(|| agent.rpc_timeout());
        Ok((agent, timeout))
    }
}
