//! `remote` through a call handle (a typed [`Function`] declaration, a
//! function named at run time, either with options), and the schema of an
//! [`RRef`].

use ferry_rpc::schema::{Schema, Shape};
use ferry_rpc::{Arg, ByName, Call, CallOptions, Function, Ret, WorkerRef};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{RRef, RRefError};

/// `remote` for a call handle: runs the function on another worker and
/// returns at once an [`RRef`] to its result, which stays there. Bring it
/// into scope (`use ferry_rref::RemoteExt;`) to call it on a typed
/// [`Function`] declaration, a [`ByName`] handle, or either with options
/// ([`Call`]: `ADD.timeout(d).remote(to, args)`), as `rpc_sync` and
/// `rpc_async` are called.
///
/// The creation times out after the call's timeout (the agent's default
/// unless set): if the owner has not run the function within it, the
/// RRef's creation counts as failed.
///
/// ```no_run
/// use std::time::Duration;
/// use ferry_rpc::Function;
/// use ferry_rref::{RRef, RemoteExt};
///
/// pub const ADD: Function<(i64, i64), i64> = Function::new("add");
///
/// # fn main() -> Result<(), ferry_rpc::BoxError> {
/// // Through the process's agent (started with `ferry::init_rpc`).
/// let sum: RRef<i64> = ADD.remote(1, (2, 3))?;
/// assert_eq!(sum.to_here()?, 5);
/// let later: RRef<i64> = ADD.timeout(Duration::from_secs(5)).remote("worker2", (4, 5))?;
/// // By name, the types given where the RRef is declared.
/// let named: RRef<i64> = ferry_rpc::by_name("add").remote(1, (6i64, 7i64))?;
/// # let _ = (later, named);
/// # Ok(()) }
/// ```
pub trait RemoteExt<A, R> {
    /// Runs the function on worker `to` (a rank or a name) with `args`.
    fn remote(&self, to: impl Into<WorkerRef>, args: A) -> Result<RRef<R>, RRefError>;
}

/// Starts `remote` of `name` with `signature` and `options`.
fn start_remote<A, R>(
    options: &CallOptions,
    to: WorkerRef,
    name: &str,
    signature: ferry_rpc::Signature,
    args: A,
) -> Result<RRef<R>, RRefError>
where
    A: Serialize,
    R: Serialize + DeserializeOwned + Send + 'static,
{
    let (agent, timeout) = options.agent_and_timeout()?;
    crate::remote_signed(&agent, to, name, signature, args, timeout)
}

impl<A: Arg, R: Ret> RemoteExt<A, R> for Function<A, R> {
    fn remote(&self, to: impl Into<WorkerRef>, args: A) -> Result<RRef<R>, RRefError> {
        let options = CallOptions::default();
        start_remote(&options, to.into(), self.name(), self.signature(), args)
    }
}

impl<A: Arg, R: Ret> RemoteExt<A, R> for Call<Function<A, R>> {
    fn remote(&self, to: impl Into<WorkerRef>, args: A) -> Result<RRef<R>, RRefError> {
        let function = self.handle();
        start_remote(
            self.options(),
            to.into(),
            function.name(),
            function.signature(),
            args,
        )
    }
}

impl<A, R> RemoteExt<A, R> for ByName<'_>
where
    A: Serialize,
    R: Serialize + DeserializeOwned + Send + 'static,
{
    fn remote(&self, to: impl Into<WorkerRef>, args: A) -> Result<RRef<R>, RRefError> {
        let options = CallOptions::default();
        let signature = ferry_rpc::Signature::of::<A, R>();
        start_remote(&options, to.into(), self.name(), signature, args)
    }
}

impl<A, R> RemoteExt<A, R> for Call<ByName<'_>>
where
    A: Serialize,
    R: Serialize + DeserializeOwned + Send + 'static,
{
    fn remote(&self, to: impl Into<WorkerRef>, args: A) -> Result<RRef<R>, RRefError> {
        let signature = ferry_rpc::Signature::of::<A, R>();
        start_remote(
            self.options(),
            to.into(),
            self.handle().name(),
            signature,
            args,
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
