//! Typed remote functions: a [`Function`] handle declared once, in code
//! both sides share, through which functions are registered and called,
//! so that a wrong argument or result type does not compile.

use std::future::Future;
use std::marker::PhantomData;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::fallible::{error_text, BoxError};
use crate::functions::Signature;
use crate::schema::Schema;
use crate::{Agent, Functions, RpcError, RpcFuture, WorkerRef};

/// A remote function from `A` to `R`, declared by name: register it with
/// [`Functions::add`] (or [`add_fallible`](Functions::add_fallible),
/// [`add_async`](Functions::add_async)) and call it with
/// [`rpc_sync`](Self::rpc_sync) and [`rpc_async`](Self::rpc_async).
///
/// The types are checked twice: by the compiler, at both the registration
/// and every call; and at run time, by the callee, against the hash of the
/// types' declared [`Schema`] (their structure, not their
/// `std::any::type_name`), so that builds made with different compilers
/// call each other and a caller built from other declarations gets
/// [`RpcError::WrongType`] showing both signatures.
///
/// Several arguments travel as a tuple.
///
/// ```no_run
/// use ferry_rpc::{Function, Functions, RpcOptions};
///
/// pub const ADD: Function<(i64, i64), i64> = Function::new("add");
///
/// # fn main() -> Result<(), ferry_rpc::BoxError> {
/// let mut functions = Functions::new();
/// functions.add(ADD, |(a, b)| a + b);
/// let rank: u32 = std::env::var("RANK")?.parse()?;
/// ferry_rpc::init_rpc(RpcOptions::from_env(format!("worker{rank}"))?.functions(functions))?;
/// if rank == 0 {
///     assert_eq!(ADD.rpc_sync(1, (2, 3))?, 5);
///     let pending = ADD.rpc_async("worker1", (4, 5));
///     assert_eq!(pending.wait()?, 9);
/// }
/// ferry_rpc::shutdown()?;
/// # Ok(()) }
/// ```
///
/// A call with the wrong types is a compile error:
///
/// ```compile_fail
/// # use ferry_rpc::Function;
/// const ADD: Function<(i64, i64), i64> = Function::new("add");
/// let s: String = ADD.rpc_sync(1, (2, 3)).unwrap(); // the result is an i64
/// ```
pub struct Function<A, R> {
    name: &'static str,
    _types: PhantomData<fn(A) -> R>,
}

/// What a typed function's argument can be, named once for generic code:
/// anything that travels both ways (serialised by the caller, decoded by
/// the callee), has a [`Schema`] for its signature, and may move to
/// another thread. Blanket-implemented, so never implemented by hand.
///
/// A helper generic over calls names `A: Arg, R: Ret` instead of the
/// bounds they stand for (`Serialize + DeserializeOwned + Schema + Send +
/// 'static`), and can call, register and `remote` any [`Function<A, R>`]:
///
/// ```no_run
/// use ferry_rpc::{Arg, Function, Ret, RpcError};
///
/// /// Calls `function` on every worker of `ranks` with the same arguments.
/// fn call_each<A: Arg + Clone, R: Ret>(
///     function: Function<A, R>,
///     ranks: std::ops::Range<u32>,
///     args: A,
/// ) -> Result<Vec<R>, RpcError> {
///     let pending = ranks.map(|rank| function.rpc_async(rank, args.clone()));
///     ferry_rpc::wait_all(pending)
/// }
/// ```
pub trait Arg: Serialize + DeserializeOwned + Schema + Send + 'static {}

impl<T> Arg for T where T: Serialize + DeserializeOwned + Schema + Send + 'static {}

/// What a typed function's result can be, named once for generic code:
/// the same bounds as [`Arg`] (a result travels back, and `remote` keeps
/// it on the callee and serialises it again for `to_here`).
/// Blanket-implemented.
pub trait Ret: Serialize + DeserializeOwned + Schema + Send + 'static {}

impl<T> Ret for T where T: Serialize + DeserializeOwned + Schema + Send + 'static {}

impl<A, R> Function<A, R> {
    /// Declares the function registered under `name`.
    ///
    /// ```
    /// use ferry_rpc::Function;
    ///
    /// const GREET: Function<String, String> = Function::new("greet");
    /// assert_eq!(GREET.name(), "greet");
    /// ```
    pub const fn new(name: &'static str) -> Self {
        Self {
            name,
            _types: PhantomData,
        }
    }

    /// The name it is registered under.
    pub const fn name(&self) -> &'static str {
        self.name
    }
}

impl<A: Schema, R: Schema> Function<A, R> {
    /// Its signature: the shapes of `A` and `R`.
    ///
    /// ```
    /// use ferry_rpc::Function;
    ///
    /// const ADD: Function<(i64, i64), i64> = Function::new("add");
    /// assert_eq!(ADD.signature().to_string(), "fn((i64, i64)) -> i64");
    /// ```
    pub fn signature(&self) -> Signature {
        Signature::typed::<A, R>()
    }
}

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
        self.rpc_async(to, args).wait()
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
        match crate::agent() {
            Ok(agent) => {
                let timeout = agent.rpc_timeout();
                self.rpc_async_with(&agent, to, args, timeout)
            }
            Err(e) => RpcFuture::failed(e, self.name, self.signature()),
        }
    }

    /// [`rpc_sync`](Self::rpc_sync) with a per-call timeout (zero: none).
    ///
    /// ```no_run
    /// # use ferry_rpc::Function;
    /// # use std::time::Duration;
    /// # const ADD: Function<(i64, i64), i64> = Function::new("add");
    /// let sum = ADD.rpc_sync_timeout("worker1", (2, 3), Duration::from_secs(5))?;
    /// # Ok::<(), ferry_rpc::RpcError>(())
    /// ```
    pub fn rpc_sync_timeout(
        &self,
        to: impl Into<WorkerRef>,
        args: A,
        timeout: Duration,
    ) -> Result<R, RpcError> {
        self.rpc_async_timeout(to, args, timeout).wait()
    }

    /// [`rpc_async`](Self::rpc_async) with a per-call timeout (zero: none).
    ///
    /// ```no_run
    /// # use ferry_rpc::Function;
    /// # use std::time::Duration;
    /// # const ADD: Function<(i64, i64), i64> = Function::new("add");
    /// let pending = ADD.rpc_async_timeout(1, (2, 3), Duration::from_millis(500));
    /// # Ok::<(), ferry_rpc::RpcError>(())
    /// ```
    pub fn rpc_async_timeout(
        &self,
        to: impl Into<WorkerRef>,
        args: A,
        timeout: Duration,
    ) -> RpcFuture<R> {
        match crate::agent() {
            Ok(agent) => self.rpc_async_with(&agent, to, args, timeout),
            Err(e) => RpcFuture::failed(e, self.name, self.signature()),
        }
    }

    /// [`rpc_async_timeout`](Self::rpc_async_timeout) through a given
    /// agent rather than the process's (for layers and tests that hold one).
    ///
    /// ```no_run
    /// # use ferry_rpc::Function;
    /// # const ADD: Function<(i64, i64), i64> = Function::new("add");
    /// let agent = ferry_rpc::agent()?;
    /// let sum = ADD.rpc_async_with(&agent, 1, (2, 3), agent.rpc_timeout()).wait()?;
    /// # Ok::<(), ferry_rpc::RpcError>(())
    /// ```
    pub fn rpc_async_with(
        &self,
        agent: &Agent,
        to: impl Into<WorkerRef>,
        args: A,
        timeout: Duration,
    ) -> RpcFuture<R> {
        agent.call_signed(to.into(), self.name, self.signature(), args, timeout)
    }
}

impl<A, R> Clone for Function<A, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<A, R> Copy for Function<A, R> {}

impl<A, R> std::fmt::Debug for Function<A, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Function")
            .field("name", &self.name)
            .field("args", &std::any::type_name::<A>())
            .field("result", &std::any::type_name::<R>())
            .finish()
    }
}

impl Functions {
    /// Registers `f` as the typed function `function`. It runs on the
    /// blocking pool; a panic becomes an error at the caller.
    ///
    /// ```
    /// use ferry_rpc::{Function, Functions};
    ///
    /// const ADD: Function<(i64, i64), i64> = Function::new("add");
    ///
    /// let mut functions = Functions::new();
    /// functions.add(ADD, |(a, b)| a + b);
    /// assert!(functions.contains("add"));
    /// ```
    pub fn add<A, R, F>(&mut self, function: Function<A, R>, f: F) -> &mut Self
    where
        A: Arg,
        R: Ret,
        F: Fn(A) -> R + Send + Sync + 'static,
    {
        self.add_fallible(function, move |a: A| {
            Ok::<R, std::convert::Infallible>(f(a))
        })
    }

    /// Registers `f`, which returns `Result<R, E>`, as the typed function
    /// `function`. `E` is any error (anything that converts into a
    /// [`BoxError`]: `std::error::Error` types, `String`, `&str`, `anyhow`'s
    /// error, [`BoxError`] itself, so that a body uses `?` on errors of
    /// several kinds): an `Err` reaches the caller as
    /// [`RpcError::Remote`] with the error's text and the texts of its
    /// sources (`"outer: cause: root cause"`).
    ///
    /// To hand the caller the error itself, declare it in the result:
    /// `Function<A, Result<R, MyError>>` with `MyError: Serialize + Schema`.
    ///
    /// ```
    /// use ferry_rpc::{BoxError, Function, Functions};
    ///
    /// const PARSE: Function<String, i64> = Function::new("parse");
    ///
    /// let mut functions = Functions::new();
    /// functions.add_fallible(PARSE, |s: String| -> Result<i64, BoxError> {
    ///     let n: i64 = s.trim().parse()?; // a ParseIntError
    ///     if n < 0 {
    ///         return Err("negative".into());
    ///     }
    ///     Ok(n)
    /// });
    /// ```
    pub fn add_fallible<A, R, E, F>(&mut self, function: Function<A, R>, f: F) -> &mut Self
    where
        A: Arg,
        R: Ret,
        E: Into<BoxError>,
        F: Fn(A) -> Result<R, E> + Send + Sync + 'static,
    {
        self.insert_fallible(function.name, function.signature(), move |a: A| {
            f(a).map_err(|e| error_text(&*e.into()))
        })
    }

    /// Registers an async `f` as the typed function `function`: it runs as
    /// a task on the agent's runtime, must not block, and makes nested
    /// calls with `rpc_async(..).await`. Its errors are as for
    /// [`add_fallible`](Self::add_fallible).
    ///
    /// ```
    /// use ferry_rpc::{BoxError, Function, Functions};
    ///
    /// const GREET: Function<String, String> = Function::new("greet");
    ///
    /// let mut functions = Functions::new();
    /// functions.add_async(GREET, |name: String| async move {
    ///     Ok::<_, BoxError>(format!("hello, {name}"))
    /// });
    /// ```
    pub fn add_async<A, R, E, F, Fut>(&mut self, function: Function<A, R>, f: F) -> &mut Self
    where
        A: Arg,
        R: Ret,
        E: Into<BoxError> + Send + 'static,
        F: Fn(A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
    {
        self.insert_async(function.name, function.signature(), move |a: A| {
            let fut = f(a);
            async move { fut.await.map_err(|e| error_text(&*e.into())) }
        })
    }
}
