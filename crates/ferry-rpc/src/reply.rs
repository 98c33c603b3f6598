//! What a remote function's body returns: the result itself, a
//! `Result` of it, or a future of either ([`Reply`]), so that one
//! registration ([`Functions::add`](crate::Functions::add)) takes plain,
//! fallible and async bodies alike.

use std::future::Future;

use crate::boxed::BoxFuture;
use crate::fallible::{error_text, BoxError};

/// What a body registered for results of type `R` may return: `R` itself
/// (a plain body), `Result<R, E>` (a fallible one), or a future of either
/// (an async one), told apart by the marker `M`, which the compiler
/// infers ([`Plain`], [`Fallible`], [`Async`], [`AsyncFallible`]).
///
/// An `Err` reaches the caller as [`RpcError::Remote`](crate::RpcError::Remote)
/// with the error's text and its sources' (`"outer: cause: root cause"`):
/// `E` is any error that converts into a [`BoxError`] (`std::error::Error`
/// types, `String`, `&str`, `anyhow`'s error, `BoxError` itself, so that
/// a body uses `?` on errors of several kinds). To hand the caller the
/// error itself, declare it in the result: `Function<A, Result<R, MyError>>`,
/// whose plain bodies return `Result<R, MyError>`.
///
/// A plain or fallible body runs on the agent's blocking pool (it may block
/// and make nested `rpc_sync` calls; a panic becomes an error at the
/// caller); an async one runs as a task on the agent's runtime (it must
/// not block, and nests calls with `rpc_async(..).await`).
///
/// Implemented for every type in those four shapes; a layer that wraps
/// bodies implements it for its wrapper, delegating to the body's.
///
/// ```
/// use ferry_rpc::{BoxError, Function, Functions};
///
/// const ADD: Function<(i64, i64), i64> = Function::new("add");
/// const PARSE: Function<String, i64> = Function::new("parse");
/// const GREET: Function<String, String> = Function::new("greet");
///
/// let mut functions = Functions::new();
/// functions.add(ADD, |(a, b)| a + b); // Plain
/// functions.add(PARSE, |s: String| s.trim().parse::<i64>()); // Fallible
/// functions.add(GREET, |name: String| async move { // Async
///     format!("hello, {name}")
/// });
/// ```
#[diagnostic::on_unimplemented(
    message = "a body of a function returning `{R}` cannot return `{Self}`",
    label = "returns `{Self}`",
    note = "a body returns `{R}`, `Result<{R}, E>` with `E: Into<BoxError>`, or a future of either"
)]
pub trait Reply<R, M> {
    /// Whether the body is async: it then runs as a task on the agent's
    /// runtime rather than on its blocking pool.
    const ASYNC: bool;

    /// The body's outcome, ready or to be awaited, an error as its text.
    fn into_outcome(self) -> Outcome<R>;
}

/// A body's outcome as the agent runs it: what [`Reply::into_outcome`]
/// gives.
pub enum Outcome<R> {
    /// Ready: the result, or the error's text.
    Ready(Result<R, String>),
    /// To be awaited on the agent's runtime.
    Pending(BoxFuture<Result<R, String>>),
}

impl<R> std::fmt::Debug for Outcome<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Ready(Ok(_)) => f.write_str("Ready(Ok(..))"),
            Outcome::Ready(Err(e)) => write!(f, "Ready(Err({e:?}))"),
            Outcome::Pending(_) => f.write_str("Pending(..)"),
        }
    }
}

/// [`Reply`] marker: a body that returns its result.
#[derive(Debug)]
pub enum Plain {}

/// [`Reply`] marker: a body that returns `Result<R, E>`.
#[derive(Debug)]
pub enum Fallible {}

/// [`Reply`] marker: an async body whose future gives its result.
#[derive(Debug)]
pub enum Async {}

/// [`Reply`] marker: an async body whose future gives `Result<R, E>`.
#[derive(Debug)]
pub enum AsyncFallible {}

impl<R> Reply<R, Plain> for R {
    const ASYNC: bool = false;

    fn into_outcome(self) -> Outcome<R> {
        Outcome::Ready(Ok(self))
    }
}

impl<R, E: Into<BoxError>> Reply<R, Fallible> for Result<R, E> {
    const ASYNC: bool = false;

    fn into_outcome(self) -> Outcome<R> {
        Outcome::Ready(self.map_err(|e| error_text(&*e.into())))
    }
}

impl<R, F> Reply<R, Async> for F
where
    R: 'static,
    F: Future<Output = R> + Send + 'static,
{
    const ASYNC: bool = true;

    fn into_outcome(self) -> Outcome<R> {
        Outcome::Pending(Box::pin(async move { Ok(self.await) }))
    }
}

impl<R, E, F> Reply<R, AsyncFallible> for F
where
    R: 'static,
    E: Into<BoxError> + 'static,
    F: Future<Output = Result<R, E>> + Send + 'static,
{
    const ASYNC: bool = true;

    fn into_outcome(self) -> Outcome<R> {
        Outcome::Pending(Box::pin(async move {
            self.await.map_err(|e| error_text(&*e.into()))
        }))
    }
}

/// The markers of bodies that run on the agent's blocking pool ([`Plain`]
/// and [`Fallible`]): a layer that wraps bodies which must not be async
/// (because its wrapper blocks) bounds their marker with it.
pub trait Blocking {}

impl Blocking for Plain {}

impl Blocking for Fallible {}
