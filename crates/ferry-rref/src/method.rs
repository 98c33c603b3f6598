//! Typed methods of an RRef's value: a [`Method`] declared once, in code
//! both sides share, registered on the owner's functions with
//! [`MethodsExt`] and called through an RRef's proxies
//! (`rref.rpc_sync().call(METHOD, args)`), so that a wrong value type,
//! argument or result does not compile.

use std::marker::PhantomData;

use ferry_rpc::reply::{Blocking, Outcome, Reply};
use ferry_rpc::{Arg, BoxError, Function, Functions, Ret, Schema};

use crate::RRef;

/// A method of values of type `T`, from `A` to `R`, declared by name. It
/// runs on the value's owner against the value itself (`&T`), as the
/// methods PyTorch's `rref.rpc_sync().method(..)` proxies call.
///
/// On the wire a method is the typed function `Function<(RRef<T>, A), R>`
/// named `name`: the RRef travels (forked to the owner like any argument)
/// and the owner looks its value up. A method has one name, the one it is
/// registered under and called by, typed or by name: write it
/// `"Type.method"` (`"Counter.add"`), as PyTorch's proxies call a method
/// by its class's qualified name, so that two types' methods do not
/// collide. `rref.rpc_sync().call_by_name("Counter.add", args)` calls the
/// method registered with [`MethodsExt::add_method`] under that name (the
/// types then checked at run time, by their names).
///
/// ```no_run
/// use std::sync::atomic::{AtomicI64, Ordering};
/// use ferry_rpc::{Agent, Function, Functions, RpcOptions, Schema};
/// use ferry_rref::{Method, MethodsExt, RRef, RemoteExt};
///
/// #[derive(Default, serde::Serialize, serde::Deserialize, Schema)]
/// pub struct Counter { total: AtomicI64 }
///
/// impl Counter {
///     pub const NEW: Function<i64, Counter> = Function::new("Counter.new");
///     pub const ADD: Method<Counter, i64, i64> = Method::new("Counter.add");
/// }
///
/// # fn main() -> Result<(), ferry_rpc::BoxError> {
/// let mut functions = Functions::new();
/// functions.add(Counter::NEW, |start| Counter { total: AtomicI64::new(start) });
/// functions.add_method(Counter::ADD, |c: &Counter, n| c.total.fetch_add(n, Ordering::SeqCst) + n);
/// let rank: u32 = std::env::var("RANK")?.parse()?;
/// let mut options = RpcOptions::from_env(format!("worker{rank}"))?.functions(functions);
/// ferry_rref::install(&mut options);
/// let agent = Agent::start(options)?; // with the facade: ferry::init_rpc
/// if rank == 0 {
///     let counter: RRef<Counter> = Counter::NEW.agent(&agent).remote(1, 10)?;
///     assert_eq!(counter.rpc_sync().call(Counter::ADD, 5)?, 15);
///     let later = counter.rpc_async().call(Counter::ADD, 1);
///     assert_eq!(later.wait()?, 16);
///     let total: RRef<i64> = counter.remote().call(Counter::ADD, 0)?;
///     assert_eq!(total.to_here()?, 16);
/// }
/// agent.shutdown()?;
/// # Ok(()) }
/// ```
///
/// Calling a method of another type is a compile error:
///
/// ```compile_fail
/// # use ferry_rref::{Method, RRef};
/// const LEN: Method<String, (), usize> = Method::new("String.len");
/// fn call(r: &RRef<i64>) { let _ = r.rpc_sync().call(LEN, ()); }
/// ```
pub struct Method<T, A, R> {
    name: &'static str,
    _types: PhantomData<fn(&T, A) -> R>,
}

impl<T, A, R> Method<T, A, R> {
    /// Declares the method registered under `name`.
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

    /// The typed function it travels as: the RRef and the arguments in, the
    /// result out.
    ///
    /// ```
    /// use ferry_rref::Method;
    ///
    /// const ADD: Method<i64, i64, i64> = Method::new("Counter.add");
    /// assert_eq!(ADD.function().name(), "Counter.add");
    /// assert_eq!(ADD.function().signature().to_string(), "fn((RRef<i64>, i64)) -> i64");
    /// ```
    pub const fn function(&self) -> Function<(RRef<T>, A), R> {
        Function::new(self.name)
    }
}

impl<T, A, R> Clone for Method<T, A, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T, A, R> Copy for Method<T, A, R> {}

impl<T, A, R> std::fmt::Debug for Method<T, A, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Method({:?})", self.name)
    }
}

/// Registers typed [`Method`]s on a [`Functions`] registry (bring it into
/// scope: `use ferry_rref::MethodsExt;`).
pub trait MethodsExt {
    /// Registers `body` as `method`, under [`Method::name`]
    /// (`"Type.method"`): it runs on the owner of the RRef the caller
    /// holds, against its value, on the blocking pool. It returns `R` or
    /// `Result<R, E>`, as a function's body does ([`Reply`]: an `Err`
    /// reaches the caller as [`RpcError::Remote`](ferry_rpc::RpcError::Remote)
    /// with its text and its sources'); it cannot be async. The typed
    /// `method` calls it, and so does `call_by_name` with that name. Called
    /// on a worker that is not the owner, the caller gets
    /// [`RRefError::NotOwner`](crate::RRefError::NotOwner)'s text.
    ///
    /// ```
    /// use ferry_rpc::Functions;
    /// use ferry_rref::{Method, MethodsExt};
    ///
    /// const LEN: Method<String, (), usize> = Method::new("String.len");
    /// const CHAR: Method<String, usize, char> = Method::new("String.char");
    ///
    /// let mut functions = Functions::new();
    /// functions
    ///     .add_method(LEN, |s: &String, ()| s.len())
    ///     .add_method(CHAR, |s: &String, i| s.chars().nth(i).ok_or("out of range"));
    /// assert!(functions.contains("String.char"));
    /// ```
    fn add_method<T, A, R, F, O, M>(&mut self, method: Method<T, A, R>, body: F) -> &mut Self
    where
        T: Schema + Send + Sync + 'static,
        A: Arg,
        R: Ret,
        F: Fn(&T, A) -> O + Send + Sync + 'static,
        O: Reply<R, M>,
        M: Blocking;
}

impl MethodsExt for Functions {
    fn add_method<T, A, R, F, O, M>(&mut self, method: Method<T, A, R>, body: F) -> &mut Self
    where
        T: Schema + Send + Sync + 'static,
        A: Arg,
        R: Ret,
        F: Fn(&T, A) -> O + Send + Sync + 'static,
        O: Reply<R, M>,
        M: Blocking,
    {
        self.add(
            method.function(),
            move |(rref, args): (RRef<T>, A)| -> Result<R, BoxError> {
                let value = rref.local_value()?;
                match body(&value, args).into_outcome() {
                    Outcome::Ready(result) => result.map_err(Into::into),
                    // Not for a `Blocking` marker's reply.
                    Outcome::Pending(_) => Err("a method's body cannot be async".into()),
                }
            },
        )
    }
}
