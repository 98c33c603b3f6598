//! The callee's side: the two functions every Python worker registers.
//! Both run on the agent's blocking pool (plain bodies), so the GIL is
//! taken there, around the Python work alone, and never on the agent's
//! runtime: unpickling the call, running it, pickling its outcome.

use ferry::Functions;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::error::Error;
use crate::pickle::{self, INTERNAL};
use crate::wire::{Pickled, PyObj, PyReply, CALL, REMOTE};

/// The functions a Python worker serves: [`CALL`] and [`REMOTE`].
pub fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(CALL, |args: Pickled| -> Result<PyReply, Error> {
        call(args)
    });
    f.add(REMOTE, |args: Pickled| -> Result<PyObj, Error> {
        remote(args)
    });
    f
}

/// Runs `(function, args, kwargs)` and pickles its outcome
/// (`ferry.rpc._internal.run`: an exception is caught there and comes
/// back as PyTorch's `RemoteException` would).
fn call(args: Pickled) -> Result<PyReply, Error> {
    crate::gil::attach(|py| {
        let (bytes, tensors, rrefs) = pickle::to_parts(py, args)?;
        static RUN: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let run = RUN.import(py, INTERNAL, "run")?;
        let out = run.call1((bytes, tensors, rrefs))?;
        let (raised, parts): (bool, Bound<'_, PyAny>) = out.extract()?;
        let pickled = pickle::from_tuple(&parts)?;
        Ok(if raised {
            PyReply::Raised(pickled)
        } else {
            PyReply::Value(pickled)
        })
    })
}

/// Runs `(function, args, kwargs)` and keeps its outcome as the object
/// itself (`ferry.rpc._internal.run_object`), the value of the RRef that
/// `remote` made.
fn remote(args: Pickled) -> Result<PyObj, Error> {
    crate::gil::attach(|py| {
        let (bytes, tensors, rrefs) = pickle::to_parts(py, args)?;
        static RUN_OBJECT: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let out = RUN_OBJECT
            .import(py, INTERNAL, "run_object")?
            .call1((bytes, tensors, rrefs))?;
        let (raised, object): (bool, Py<PyAny>) = out.extract()?;
        Ok(PyObj::Live { object, raised })
    })
}
