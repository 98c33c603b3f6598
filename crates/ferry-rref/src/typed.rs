//! `remote` through a typed [`Function`] declaration, and the schema of an
//! [`RRef`].

use std::time::Duration;

use ferry_rpc::schema::{Schema, Shape};
use ferry_rpc::{Agent, Arg, Function, Ret, WorkerRef};

use crate::{RRef, RRefError};

/// `remote` for a typed [`Function`]: runs it on another worker and
/// returns at once an [`RRef`] to its result, which stays there. Bring it
/// into scope (`use ferry_rref::RemoteExt;`) to call it on a declaration.
///
/// ```no_run
/// use ferry_rpc::{Function, Functions, RpcOptions};
/// use ferry_rref::{RRef, RemoteExt};
///
/// pub const ADD: Function<(i64, i64), i64> = Function::new("add");
///
/// # fn main() -> Result<(), ferry_rpc::BoxError> {
/// let mut functions = Functions::new();
/// functions.add(ADD, |(a, b)| a + b);
/// let rank: u32 = std::env::var("RANK")?.parse()?;
/// let mut options = RpcOptions::from_env(format!("worker{rank}"))?.functions(functions);
/// ferry_rref::install(&mut options);
/// ferry_rpc::init_rpc(options)?;
/// if rank == 0 {
///     let sum: RRef<i64> = ADD.remote(1, (2, 3))?;
///     assert_eq!(sum.to_here()?, 5);
/// }
/// ferry_rpc::shutdown()?;
/// # Ok(()) }
/// ```
pub trait RemoteExt<A, R> {
    /// Runs the function on worker `to` with the process's agent; the
    /// creation times out after the agent's default timeout.
    fn remote(&self, to: impl Into<WorkerRef>, args: A) -> Result<RRef<R>, RRefError>;

    /// [`remote`](Self::remote) with a creation timeout (zero: none).
    fn remote_timeout(
        &self,
        to: impl Into<WorkerRef>,
        args: A,
        timeout: Duration,
    ) -> Result<RRef<R>, RRefError>;

    /// [`remote_timeout`](Self::remote_timeout) through a given agent.
    fn remote_with(
        &self,
        agent: &Agent,
        to: impl Into<WorkerRef>,
        args: A,
        timeout: Duration,
    ) -> Result<RRef<R>, RRefError>;
}

impl<A: Arg, R: Ret> RemoteExt<A, R> for Function<A, R> {
    fn remote(&self, to: impl Into<WorkerRef>, args: A) -> Result<RRef<R>, RRefError> {
        let agent = ferry_rpc::agent()?;
        let timeout = agent.rpc_timeout();
        self.remote_with(&agent, to, args, timeout)
    }

    fn remote_timeout(
        &self,
        to: impl Into<WorkerRef>,
        args: A,
        timeout: Duration,
    ) -> Result<RRef<R>, RRefError> {
        let agent = ferry_rpc::agent()?;
        self.remote_with(&agent, to, args, timeout)
    }

    fn remote_with(
        &self,
        agent: &Agent,
        to: impl Into<WorkerRef>,
        args: A,
        timeout: Duration,
    ) -> Result<RRef<R>, RRefError> {
        crate::remote_signed(
            agent,
            to.into(),
            self.name(),
            self.signature(),
            args,
            timeout,
        )
    }
}

/// An RRef travels as a fork of its value's reference, whatever `T` is;
/// its shape names `T`'s, so that an `RRef<i64>` and an `RRef<String>`
/// differ.
///
/// ```
/// use ferry_rpc::Schema;
/// use ferry_rref::RRef;
///
/// assert_eq!(<RRef<(i64, String)>>::SHAPE.to_string(), "RRef<(i64, String)>");
/// ```
impl<T: Schema> Schema for RRef<T> {
    const SHAPE: &'static Shape = &Shape::Opaque {
        name: "RRef",
        params: &[T::SHAPE],
    };
}
