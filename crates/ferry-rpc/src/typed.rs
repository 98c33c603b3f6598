//! Typed remote functions: a [`Function`] handle declared once, in code
//! both sides share, through which functions are registered and called,
//! so that a wrong argument or result type does not compile.

use std::marker::PhantomData;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::functions::Signature;
use crate::reply::Reply;
use crate::schema::Schema;
use crate::Functions;

/// A remote function from `A` to `R`, declared by name: register it with
/// [`Functions::add`] (its body plain, fallible or async) and call it with
/// [`rpc_sync`](Self::rpc_sync) and [`rpc_async`](Self::rpc_async) (and,
/// with the RRef layer, `remote`); a call's options go on the call:
/// `ADD.timeout(d).rpc_sync(..)`, `ADD.agent(&agent).rpc_async(..)`
/// ([`Call`](crate::Call)).
///
/// The types are checked twice: by the compiler, at both the registration
/// and every call; and at run time, by the callee, against the hash of the
/// types' declared [`Schema`] (their structure, not their
/// `std::any::type_name`), so that builds made with different compilers
/// call each other and a caller built from other declarations gets
/// [`RpcError::WrongType`](crate::RpcError::WrongType) showing both signatures.
///
/// Several arguments travel as a tuple.
///
/// ```no_run
/// use ferry_rpc::{Agent, Function, Functions, RpcOptions};
///
/// pub const ADD: Function<(i64, i64), i64> = Function::new("add");
///
/// # fn main() -> Result<(), ferry_rpc::BoxError> {
/// let mut functions = Functions::new();
/// functions.add(ADD, |(a, b)| a + b);
/// let rank: u32 = std::env::var("RANK")?.parse()?;
/// let options = RpcOptions::from_env(format!("worker{rank}"))?.functions(functions);
/// // The agent alone; with the facade, `ferry::init_rpc(options)` starts
/// // the worker, and calls need no `.agent(..)`.
/// let agent = Agent::start(options)?;
/// if rank == 0 {
///     assert_eq!(ADD.agent(&agent).rpc_sync(1, (2, 3))?, 5);
///     let pending = ADD.agent(&agent).rpc_async("worker1", (4, 5));
///     assert_eq!(pending.wait()?, 9);
/// }
/// agent.shutdown()?;
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
    /// Registers `body` as the typed function `function`. The body returns
    /// `R` (plain), `Result<R, E>` (fallible: an `Err` reaches the caller
    /// as [`RpcError::Remote`](crate::RpcError::Remote) with its text and its sources'), or a future
    /// of either (async), as [`Reply`] explains: a plain or fallible body
    /// runs on the blocking pool (a panic becomes an error at the caller),
    /// an async one as a task on the agent's runtime.
    ///
    /// ```
    /// use ferry_rpc::{BoxError, Function, Functions};
    ///
    /// const ADD: Function<(i64, i64), i64> = Function::new("add");
    /// const PARSE: Function<String, i64> = Function::new("parse");
    /// const GREET: Function<String, String> = Function::new("greet");
    ///
    /// let mut functions = Functions::new();
    /// functions.add(ADD, |(a, b)| a + b);
    /// functions.add(PARSE, |s: String| -> Result<i64, BoxError> {
    ///     let n: i64 = s.trim().parse()?; // a ParseIntError
    ///     if n < 0 {
    ///         return Err("negative".into());
    ///     }
    ///     Ok(n)
    /// });
    /// functions.add(GREET, |name: String| async move {
    ///     Ok::<_, BoxError>(format!("hello, {name}"))
    /// });
    /// assert!(functions.contains("add"));
    /// ```
    ///
    /// A body of the wrong type is a compile error:
    ///
    /// ```compile_fail
    /// # use ferry_rpc::{Function, Functions};
    /// const ADD: Function<(i64, i64), i64> = Function::new("add");
    /// Functions::new().add(ADD, |(a, b)| format!("{a}{b}")); // not an i64
    /// ```
    pub fn add<A, R, F, O, M>(&mut self, function: Function<A, R>, body: F) -> &mut Self
    where
        A: Arg,
        R: Ret,
        F: Fn(A) -> O + Send + Sync + 'static,
        O: Reply<R, M>,
    {
        self.insert_body(function.name, function.signature(), body)
    }
}
