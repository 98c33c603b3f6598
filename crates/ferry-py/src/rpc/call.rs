//! The caller's side of `rpc_sync`, `rpc_async` and `remote`: Python's
//! side has pickled `(function, args, kwargs)` into its three parts; the
//! call goes out with the GIL released, and its outcome comes back as
//! `(raised, bytes, tensors, rrefs)` for Python's side to unpickle.

use std::time::Duration;

use ferry::rpc::WorkerRef;
use ferry::{RRef, RRefError, RemoteExt, RpcError, RpcFuture};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::error::Error;
use crate::pickle;
use crate::rpc::complete;
use crate::wire::{Pickled, PyObj, PyRRef, PyReply, CALL, REMOTE};

/// A timeout from Python, in seconds as PyTorch takes it: negative (its
/// `UNSET_RPC_TIMEOUT`, -1) for the agent's default (`None`), 0 for none
/// (`Duration::ZERO`, as in Ferry), else that long.
pub fn timeout_of(seconds: f64) -> Result<Option<Duration>, Error> {
    if seconds.is_nan() {
        return Err(Error::Argument(
            "timeout must be a number of seconds, not NaN".into(),
        ));
    }
    if seconds < 0.0 {
        return Ok(None);
    }
    Duration::try_from_secs_f64(seconds)
        .map(Some)
        .map_err(|e| Error::Argument(format!("timeout {seconds} s: {e}")))
}

/// The worker a Python `to` names: a `str` (name) or an `int` (rank).
pub fn worker_ref(to: &Bound<'_, PyAny>) -> Result<WorkerRef, Error> {
    if let Ok(name) = to.extract::<String>() {
        return Ok(WorkerRef::Name(name));
    }
    if let Ok(rank) = to.extract::<i128>() {
        return Ok(match u32::try_from(rank) {
            Ok(rank) => WorkerRef::Rank(rank),
            Err(_) => WorkerRef::OutOfRange(rank),
        });
    }
    Err(Error::Argument(format!(
        "a worker is named by its name (str), rank (int) or WorkerInfo, not {}",
        to.get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default()
    )))
}

/// [`CALL`] with `rpc_sync`, with the call's timeout or the agent's.
fn call_sync(to: WorkerRef, args: Pickled, timeout: Option<Duration>) -> Result<PyReply, RpcError> {
    match timeout {
        Some(t) => CALL.timeout(t).rpc_sync(to, args),
        None => CALL.rpc_sync(to, args),
    }
}

/// [`CALL`] with `rpc_async`, with the call's timeout or the agent's.
fn call_async(to: WorkerRef, args: Pickled, timeout: Option<Duration>) -> RpcFuture<PyReply> {
    match timeout {
        Some(t) => CALL.timeout(t).rpc_async(to, args),
        None => CALL.rpc_async(to, args),
    }
}

/// [`REMOTE`] with `remote`, with the call's timeout or the agent's.
fn call_remote(
    to: WorkerRef,
    args: Pickled,
    timeout: Option<Duration>,
) -> Result<RRef<PyObj>, RRefError> {
    match timeout {
        Some(t) => REMOTE.timeout(t).remote(to, args),
        None => REMOTE.remote(to, args),
    }
}

/// The reply as `(raised, bytes, tensors, rrefs)`.
fn reply_tuple(py: Python<'_>, reply: PyReply) -> Result<Bound<'_, PyTuple>, Error> {
    match reply {
        PyReply::Value(p) => pickle::reply_tuple(py, false, p),
        PyReply::Raised(p) => pickle::reply_tuple(py, true, p),
    }
}

/// Calls the pickled `(function, args, kwargs)` on worker `to` and waits
/// for its outcome, the GIL released meanwhile.
#[pyfunction]
#[pyo3(signature = (to, data, tensors, rrefs, timeout))]
pub fn rpc_sync<'py>(
    py: Python<'py>,
    to: &Bound<'py, PyAny>,
    data: &Bound<'py, PyBytes>,
    tensors: &Bound<'py, PyList>,
    rrefs: &Bound<'py, PyList>,
    timeout: f64,
) -> Result<Bound<'py, PyTuple>, Error> {
    let to = worker_ref(to)?;
    let args = pickle::from_parts(data, tensors, rrefs)?;
    let timeout = timeout_of(timeout)?;
    let reply = py.detach(|| call_sync(to, args, timeout))?;
    reply_tuple(py, reply)
}

/// Starts the pickled call on worker `to`; `on_done(reply, error)` gets
/// either `(raised, bytes, tensors, rrefs)` or the exception, on a thread
/// of ferry-py's own with the GIL held.
#[pyfunction]
#[pyo3(signature = (to, data, tensors, rrefs, timeout, on_done))]
pub fn rpc_async<'py>(
    py: Python<'py>,
    to: &Bound<'py, PyAny>,
    data: &Bound<'py, PyBytes>,
    tensors: &Bound<'py, PyList>,
    rrefs: &Bound<'py, PyList>,
    timeout: f64,
    on_done: Py<PyAny>,
) -> Result<(), Error> {
    let to = worker_ref(to)?;
    let args = pickle::from_parts(data, tensors, rrefs)?;
    let timeout = timeout_of(timeout)?;
    // Refused here, as PyTorch raises at once without an agent.
    ferry::rpc::agent()?;
    let future = py.detach(|| call_async(to, args, timeout));
    complete::spawn(future, move |py, outcome| {
        let on_done = on_done.bind(py);
        let delivered = match outcome.map_err(Error::from) {
            Ok(reply) => match reply_tuple(py, reply) {
                Ok(t) => on_done.call1((t, py.None())),
                Err(e) => on_done.call1((py.None(), PyErr::from(e).value(py))),
            },
            Err(e) => on_done.call1((py.None(), PyErr::from(e).value(py))),
        };
        delivered.map(drop)
    });
    Ok(())
}

/// Runs the pickled call on worker `to`, keeping its outcome there, and
/// returns at once the handle of the RRef to it.
#[pyfunction]
#[pyo3(signature = (to, data, tensors, rrefs, timeout))]
pub fn remote<'py>(
    py: Python<'py>,
    to: &Bound<'py, PyAny>,
    data: &Bound<'py, PyBytes>,
    tensors: &Bound<'py, PyList>,
    rrefs: &Bound<'py, PyList>,
    timeout: f64,
) -> Result<PyRRef, Error> {
    let to = worker_ref(to)?;
    let args: Pickled = pickle::from_parts(data, tensors, rrefs)?;
    let timeout = timeout_of(timeout)?;
    let rref = py.detach(|| call_remote(to, args, timeout))?;
    Ok(PyRRef { rref })
}

/// A Python object kept as the value of a new RRef owned by this worker.
pub fn local_value(object: Py<PyAny>) -> PyObj {
    PyObj::Live {
        object,
        raised: false,
    }
}
