//! How a call is made, one way per kind of call: a handle (a typed
//! [`Function`], or a function named at run time, [`ByName`]) calls with
//! `rpc_sync(to, args)` or `rpc_async(to, args)` (and, with the RRef layer,
//! `remote(to, args)`); options go on the call, not in method names:
//! `handle.timeout(d)` or `handle.agent(&agent)` give a [`Call`], the
//! handle with its [`CallOptions`], which calls the same way.

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::functions::Signature;
use crate::typed::{Arg, Function, Ret};
use crate::{Agent, RpcError, RpcFuture, WorkerRef};

/// The options of one call, in the spirit of tarpc's call context: how
/// long it may take and which agent makes it. The default is the
/// process's agent with its default timeout.
///
/// Set them through [`Call`] (`ADD.timeout(d)`, `ADD.agent(&agent)`);
/// layers that make calls of their own read them here.
#[derive(Clone, Debug, Default)]
pub struct CallOptions {
    /// The call's timeout (zero: none); `None` takes the agent's default
    /// ([`Agent::rpc_timeout`]) when the call starts.
    pub timeout: Option<Duration>,
    /// The agent that makes the call; `None` takes the process's
    /// ([`agent`](crate::agent)), for code that holds an agent of its own
    /// (a layer, a test with several agents in one process, an embedder
    /// that started one with [`Agent::start`]).
    pub agent: Option<Agent>,
}

impl CallOptions {
    /// The agent and the timeout the call starts with: the given ones, or
    /// the process's agent and its default timeout. Fails with
    /// [`RpcError::NotInitialized`] without an agent.
    pub fn agent_and_timeout(&self) -> Result<(Agent, Duration), RpcError> {
        let agent = match &self.agent {
            Some(agent) => agent.clone(),
            None => crate::agent()?,
        };
        let timeout = self.timeout.unwrap_or_else(|| agent.rpc_timeout());
        Ok((agent, timeout))
    }
}

/// A call handle with its [`CallOptions`]: what `function.timeout(d)` and
/// `function.agent(&agent)` give. It calls as the handle does, and may
/// make any number of calls.
///
/// ```no_run
/// use std::time::Duration;
/// use ferry_rpc::Function;
///
/// const ADD: Function<(i64, i64), i64> = Function::new("add");
///
/// // The process's agent, its default timeout.
/// let sum = ADD.rpc_sync(1, (2, 3))?;
/// // The same call with a timeout of its own (zero: none).
/// let sum = ADD.timeout(Duration::from_secs(5)).rpc_sync(1, (2, 3))?;
/// // Through a given agent, to several workers.
/// let agent = ferry_rpc::agent()?;
/// let call = ADD.agent(&agent).timeout(Duration::from_millis(500));
/// let pending: Vec<_> = (1..4).map(|rank| call.rpc_async(rank, (rank, 1))).collect();
/// # Ok::<(), ferry_rpc::RpcError>(())
/// ```
///
/// With the wrong types it does not compile, as the handle does not:
///
/// ```compile_fail
/// # use ferry_rpc::Function;
/// # use std::time::Duration;
/// const ADD: Function<(i64, i64), i64> = Function::new("add");
/// let _ = ADD.timeout(Duration::from_secs(1)).rpc_sync(1, ("2", 3));
/// ```
#[derive(Clone, Debug)]
#[must_use = "a Call does nothing until rpc_sync, rpc_async or remote is called on it"]
pub struct Call<H> {
    handle: H,
    options: CallOptions,
}

impl<H> Call<H> {
    /// `handle` with the default options.
    pub(crate) fn new(handle: H) -> Self {
        Self {
            handle,
            options: CallOptions::default(),
        }
    }

    /// Sets the call's timeout (zero: none) instead of the agent's
    /// default.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.options.timeout = Some(timeout);
        self
    }

    /// Makes the call through `agent` instead of the process's.
    pub fn agent(mut self, agent: &Agent) -> Self {
        self.options.agent = Some(agent.clone());
        self
    }

    /// The handle it calls.
    pub fn handle(&self) -> &H {
        &self.handle
    }

    /// Its options.
    pub fn options(&self) -> &CallOptions {
        &self.options
    }

    /// Starts a call of `name` with `signature`.
    fn start<R, A: Serialize>(
        &self,
        to: WorkerRef,
        name: &str,
        signature: Signature,
        args: A,
    ) -> RpcFuture<R> {
        match self.options.agent_and_timeout() {
            Ok((agent, timeout)) => agent.call_signed(to, name, signature, args, timeout),
            Err(e) => RpcFuture::failed(e, name, signature),
        }
    }
}

impl<A: Arg, R: Ret> Call<Function<A, R>> {
    /// [`Function::rpc_sync`] with these options.
    pub fn rpc_sync(&self, to: impl Into<WorkerRef>, args: A) -> Result<R, RpcError> {
        self.rpc_async(to, args).wait()
    }

    /// [`Function::rpc_async`] with these options.
    pub fn rpc_async(&self, to: impl Into<WorkerRef>, args: A) -> RpcFuture<R> {
        let function = self.handle;
        self.start(to.into(), function.name(), function.signature(), args)
    }
}

impl Call<ByName<'_>> {
    /// [`ByName::rpc_sync`] with these options.
    pub fn rpc_sync<R: DeserializeOwned, A: Serialize>(
        &self,
        to: impl Into<WorkerRef>,
        args: A,
    ) -> Result<R, RpcError> {
        self.rpc_async(to, args).wait()
    }

    /// [`ByName::rpc_async`] with these options.
    pub fn rpc_async<R: DeserializeOwned, A: Serialize>(
        &self,
        to: impl Into<WorkerRef>,
        args: A,
    ) -> RpcFuture<R> {
        self.start(to.into(), self.handle.name, Signature::of::<A, R>(), args)
    }
}

/// The calls of a typed function (declared in `typed.rs`).
impl<A: Arg, R: Ret> Function<A, R> {
    /// Calls the function on worker `to` (a rank or a name) with the
    /// process's agent and its default timeout, and blocks for the result.
    ///
    /// ```no_run
    /// # use ferry_rpc::Function;
    /// # const ADD: Function<(i64, i64), i64> = Function::new("add");
    /// let sum = ADD.rpc_sync(1, (2, 3))?;
    /// # Ok::<(), ferry_rpc::RpcError>(())
    /// ```
    pub fn rpc_sync(&self, to: impl Into<WorkerRef>, args: A) -> Result<R, RpcError> {
        Call::new(*self).rpc_sync(to, args)
    }

    /// Calls the function on worker `to` and returns at once a future of
    /// its result (`.await` it, or [`wait`](RpcFuture::wait) for it).
    ///
    /// ```no_run
    /// # use ferry_rpc::Function;
    /// # const ADD: Function<(i64, i64), i64> = Function::new("add");
    /// let pending: Vec<_> = (1..4).map(|rank| ADD.rpc_async(rank, (rank, 1))).collect();
    /// for p in pending {
    ///     p.wait()?;
    /// }
    /// # Ok::<(), ferry_rpc::RpcError>(())
    /// ```
    pub fn rpc_async(&self, to: impl Into<WorkerRef>, args: A) -> RpcFuture<R> {
        Call::new(*self).rpc_async(to, args)
    }

    /// A call of this function with a timeout of its own (zero: none)
    /// instead of the agent's default: `ADD.timeout(d).rpc_sync(to, args)`.
    ///
    /// ```no_run
    /// # use ferry_rpc::Function;
    /// # use std::time::Duration;
    /// # const ADD: Function<(i64, i64), i64> = Function::new("add");
    /// let sum = ADD.timeout(Duration::from_secs(5)).rpc_sync("worker1", (2, 3))?;
    /// # Ok::<(), ferry_rpc::RpcError>(())
    /// ```
    pub fn timeout(&self, timeout: Duration) -> Call<Self> {
        Call::new(*self).timeout(timeout)
    }

    /// A call of this function through `agent` instead of the process's
    /// (for layers, tests and embedders that hold one):
    /// `ADD.agent(&agent).rpc_async(to, args)`.
    ///
    /// ```no_run
    /// # use ferry_rpc::Function;
    /// # const ADD: Function<(i64, i64), i64> = Function::new("add");
    /// let agent = ferry_rpc::agent()?;
    /// let sum = ADD.agent(&agent).rpc_async(1, (2, 3)).wait()?;
    /// # Ok::<(), ferry_rpc::RpcError>(())
    /// ```
    pub fn agent(&self, agent: &Agent) -> Call<Self> {
        Call::new(*self).agent(agent)
    }
}

/// A remote function named at run time, for dynamic use (a name read from
/// a configuration, a tool that calls what it is told): the
/// [`Function`] handle's calls, with the argument and result types given
/// at each call and checked at run time only, by their type names, against
/// the callee's registration. `by_name("add").rpc_sync(to, args)` is
/// PyTorch's `rpc.rpc_sync(to, "add", args)`.
///
/// Prefer a typed [`Function`] declaration wherever the function is known
/// when the caller is compiled.
///
/// ```no_run
/// use std::time::Duration;
/// use ferry_rpc::by_name;
///
/// let name = std::env::var("FUNCTION")?;
/// let sum: i64 = by_name(&name).rpc_sync(1, (2i64, 3i64))?;
/// let later = by_name(&name).timeout(Duration::from_secs(5)).rpc_async::<i64, _>(1, (4i64, 5i64));
/// assert_eq!(later.wait()?, 9);
/// # let _ = sum;
/// # Ok::<(), ferry_rpc::BoxError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByName<'a> {
    name: &'a str,
}

/// The function registered as `name`, to call by name ([`ByName`]).
pub fn by_name(name: &str) -> ByName<'_> {
    ByName { name }
}

impl<'a> ByName<'a> {
    /// The name it calls.
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// Calls the function on worker `to` (a rank or a name) with the
    /// process's agent and its default timeout, and blocks for its result.
    pub fn rpc_sync<R: DeserializeOwned, A: Serialize>(
        &self,
        to: impl Into<WorkerRef>,
        args: A,
    ) -> Result<R, RpcError> {
        Call::new(*self).rpc_sync(to, args)
    }

    /// Calls the function on worker `to` and returns at once a future of
    /// its result.
    pub fn rpc_async<R: DeserializeOwned, A: Serialize>(
        &self,
        to: impl Into<WorkerRef>,
        args: A,
    ) -> RpcFuture<R> {
        Call::new(*self).rpc_async(to, args)
    }

    /// A call with a timeout of its own (zero: none).
    pub fn timeout(&self, timeout: Duration) -> Call<Self> {
        Call::new(*self).timeout(timeout)
    }

    /// A call through `agent` instead of the process's.
    pub fn agent(&self, agent: &Agent) -> Call<Self> {
        Call::new(*self).agent(agent)
    }
}
