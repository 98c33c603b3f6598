//! `ferry._ferry.autograd`, the compiled half of `ferry.autograd`:
//! `torch.distributed.autograd` over ferry-autograd's contexts, send and
//! recv functions and FAST-mode engine, on the same libtorch graph that
//! Python's `torch` builds.
//!
//! - A context ([`ContextHandle`]) is a ferry-autograd [`ContextGuard`]
//!   held by the Python thread that opened it: while it lives, the thread
//!   is inside the context, so every call it makes carries the context's
//!   id, and every tensor that requires grad goes out as the very tensor
//!   Python holds ([`crate::tensor::from_python`]), recorded as a send
//!   function. A callee runs the Python function inside the caller's
//!   context (ferry-autograd's interceptor enters it around the function
//!   body), so nested calls and returned tensors are recorded too.
//! - A tensor received in a context is the recv function's leaf that
//!   ferry-autograd made of it (it requires grad), handed to Python as it
//!   is: what Python computes from it is in its graph.
//! - `backward` hands Python's roots (the same tensors) to
//!   ferry-autograd's engine with the GIL released: libtorch's engine runs
//!   the local graph (Python nodes take the GIL themselves), and gradients
//!   of recv leaves go back to their senders' send functions.
//! - `get_gradients` wraps each leaf back into its Python object: the
//!   one Python holds, as `THPVariable_Wrap` finds it from the tensor.

use ferry::autograd::ContextGuard;
use ferry::tensor::tch;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::error::Error;
use crate::tensor::{self, Identity};

/// A distributed autograd context opened by this thread (PyTorch's
/// `dist_autograd.context()`, whose `__enter__` it backs): the thread is
/// inside it until its `release`, which releases it on every
/// worker that took part.
///
/// It belongs to the thread that opened it (the context is that thread's
/// current one), hence `unsendable`: PyO3 refuses its use on another
/// thread.
#[pyclass(name = "ContextHandle", module = "ferry._ferry.autograd", unsendable)]
pub struct ContextHandle {
    id: u64,
    guard: Option<ContextGuard>,
}

#[pymethods]
impl ContextHandle {
    /// Opens a new context on this thread. Raises `RuntimeError` when the
    /// thread is inside one already (contexts do not nest) or no RPC agent
    /// runs.
    #[new]
    fn new() -> Result<Self, Error> {
        let guard = ferry::autograd::context()?;
        Ok(ContextHandle {
            id: guard.id(),
            guard: Some(guard),
        })
    }

    /// The context id, unique across the group.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }

    /// Whether the context is still open here.
    #[getter]
    fn open(&self) -> bool {
        self.guard.is_some()
    }

    /// Leaves and releases the context (here and, by messages, on every
    /// worker it reached). A second call does nothing.
    fn release(&mut self) {
        self.guard.take();
    }

    fn __repr__(&self) -> String {
        let state = if self.guard.is_some() {
            "open"
        } else {
            "released"
        };
        format!("ContextHandle(id={}, {state})", self.id)
    }
}

/// A context id from Python: an int (anything with `__index__`); one that
/// no context can have (negative, or past 64 bits) is PyTorch's unknown
/// context error, as for any id that names no context.
fn context_id_of(id: &Bound<'_, PyAny>) -> PyResult<u64> {
    let id: i128 = id.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "incompatible function arguments: a context id is an int, not {}",
            id.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    u64::try_from(id).map_err(|_| {
        PyRuntimeError::new_err(format!("Could not find autograd context with id: {id}"))
    })
}

/// The roots as libtorch tensors: the very tensors Python holds.
fn roots_of(roots: &Bound<'_, PyAny>) -> Result<Vec<tch::Tensor>, Error> {
    let bad = |what: &str, obj: &Bound<'_, PyAny>| {
        Error::Argument(format!(
            "backward(): incompatible function arguments: {what}, not {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    };
    let items: Vec<Bound<'_, PyAny>> = if let Ok(list) = roots.cast::<PyList>() {
        list.iter().collect()
    } else if let Ok(tuple) = roots.cast::<PyTuple>() {
        tuple.iter().collect()
    } else {
        return Err(bad("roots must be a list of tensors", roots));
    };
    items
        .iter()
        .map(|t| {
            if tensor::is_tensor(t) {
                tensor::unpack(t, Identity::Kept)
            } else {
                Err(bad("every root must be a tensor", t))
            }
        })
        .collect()
}

/// Runs the distributed backward pass of context `context_id` from
/// `roots` (scalars that require grad, computed on this worker) and
/// returns once every worker that took part has finished; gradients
/// accumulate in the context (`get_gradients`), never in `.grad`. Without
/// `retain_graph`, the graph is freed and a second backward in the
/// context fails. The GIL is released while it runs.
#[pyfunction]
#[pyo3(signature = (context_id, roots, retain_graph=false))]
fn backward(
    py: Python<'_>,
    context_id: &Bound<'_, PyAny>,
    roots: &Bound<'_, PyAny>,
    retain_graph: bool,
) -> PyResult<()> {
    let context_id = context_id_of(context_id)?;
    let roots = roots_of(roots)?;
    // Moved in (tensors are `Send`, not `Sync`), and dropped there too.
    py.detach(move || ferry::autograd::backward(context_id, &roots, retain_graph))
        .map_err(Error::from)?;
    Ok(())
}

/// The gradients context `context_id` accumulated on this worker: a dict
/// from each leaf tensor (the very object Python holds, where it still
/// exists) to its gradient.
#[pyfunction]
fn get_gradients<'py>(
    py: Python<'py>,
    context_id: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyDict>> {
    let context_id = context_id_of(context_id)?;
    let grads = py
        .detach(|| ferry::autograd::get_gradients(context_id))
        .map_err(Error::from)?;
    let out = PyDict::new(py);
    for (leaf, grad) in grads.iter() {
        out.set_item(
            tensor::to_python(py, leaf).map_err(PyErr::from)?,
            tensor::to_python(py, grad).map_err(PyErr::from)?,
        )?;
    }
    // The libtorch handles go here, with the GIL held: Python's objects
    // (and the context) hold the tensors from now on.
    drop(grads);
    Ok(out)
}

/// The id of the context this thread is inside: one it opened, or, in a
/// function that an RPC made inside a context runs, the caller's. Raises
/// `RuntimeError` outside any context.
#[pyfunction]
fn current_context_id() -> Result<u64, Error> {
    Ok(ferry::autograd::current_context()?.id())
}

/// Whether context `context_id` lives on this worker.
#[pyfunction]
fn is_valid_context(context_id: &Bound<'_, PyAny>) -> PyResult<bool> {
    let Ok(context_id) = context_id_of(context_id) else {
        return Ok(false);
    };
    let ids = ferry::autograd::context_ids().map_err(Error::from)?;
    Ok(ids.contains(&context_id))
}

/// Ids of the contexts alive on this worker, in increasing order.
#[pyfunction]
fn context_ids() -> Result<Vec<u64>, Error> {
    Ok(ferry::autograd::context_ids()?)
}

/// Waits, with the GIL released, until no distributed autograd context
/// lives on this worker (every one it took part in was released here),
/// at most `timeout` seconds; whether none is left.
#[pyfunction]
fn wait_until_no_contexts(py: Python<'_>, timeout: f64) -> PyResult<bool> {
    let timeout = std::time::Duration::try_from_secs_f64(timeout)
        .map_err(|e| PyValueError::new_err(format!("timeout {timeout} s: {e}")))?;
    let agent = ferry::rpc::agent().map_err(Error::from)?;
    let container = ferry::autograd::container_of(&agent).map_err(Error::from)?;
    Ok(py.detach(move || container.wait_until_empty(timeout)))
}

/// What context `context_id` recorded on this worker, as
/// `(sends, recvs, known_workers)`: `sends` a list of `(message id,
/// tensor)` by message id (each tensor that left requiring grad, the very
/// object Python holds where it still exists), `recvs` a list of `(message
/// id, sender rank, leaf)` (each tensor that arrived in the context), and
/// the ranks of the workers it exchanged messages with.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn context_info<'py>(
    py: Python<'py>,
    context_id: &Bound<'py, PyAny>,
) -> PyResult<(
    Vec<(u64, Bound<'py, PyAny>)>,
    Vec<(u64, u32, Bound<'py, PyAny>)>,
    Vec<u32>,
)> {
    let context_id = context_id_of(context_id)?;
    let info = py
        .detach(|| ferry::autograd::context_info(context_id))
        .map_err(Error::from)?;
    let mut sends = Vec::with_capacity(info.sends.len());
    for (id, t) in &info.sends {
        sends.push((*id, tensor::to_python(py, t).map_err(PyErr::from)?));
    }
    let mut recvs = Vec::with_capacity(info.recvs.len());
    for (id, sender, t) in &info.recvs {
        recvs.push((*id, *sender, tensor::to_python(py, t).map_err(PyErr::from)?));
    }
    let known = info.known_workers.iter().copied().collect();
    // The libtorch handles go here, with the GIL held (as in get_gradients).
    drop(info);
    Ok((sends, recvs, known))
}

/// The largest context id this worker can hand out (PyTorch's
/// `_get_max_id()`).
#[pyfunction]
fn max_context_id() -> Result<u64, Error> {
    Ok(ferry::autograd::max_context_id()?)
}

/// Adds the submodule `autograd` to `parent`.
pub fn register(parent: &Bound<'_, PyModule>) -> PyResult<()> {
    let m = PyModule::new(parent.py(), "autograd")?;
    m.add_class::<ContextHandle>()?;
    m.add_function(wrap_pyfunction!(backward, &m)?)?;
    m.add_function(wrap_pyfunction!(get_gradients, &m)?)?;
    m.add_function(wrap_pyfunction!(current_context_id, &m)?)?;
    m.add_function(wrap_pyfunction!(is_valid_context, &m)?)?;
    m.add_function(wrap_pyfunction!(context_ids, &m)?)?;
    m.add_function(wrap_pyfunction!(wait_until_no_contexts, &m)?)?;
    m.add_function(wrap_pyfunction!(context_info, &m)?)?;
    m.add_function(wrap_pyfunction!(max_context_id, &m)?)?;
    parent.add_submodule(&m)
}
