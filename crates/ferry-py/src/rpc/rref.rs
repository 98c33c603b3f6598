//! The methods of an RRef handle ([`PyRRef`]), which `ferry.rpc.RRef`
//! wraps: they block with the GIL released.

use ferry::RRef;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::error::Error;
use crate::pickle;
use crate::rpc::call::{local_value, timeout_of};
use crate::wire::{PyObj, PyRRef};

/// Methods that lock the RRef layer's tables release the GIL first: no
/// thread ever waits for one while holding the other.
#[pymethods]
impl PyRRef {
    /// A new RRef owned by this worker, holding `object` (PyTorch's
    /// `RRef(value)`).
    #[staticmethod]
    fn local(object: Py<PyAny>) -> Result<PyRRef, Error> {
        Ok(PyRRef {
            rref: RRef::new(local_value(object))?,
        })
    }

    /// The owner's name.
    fn owner_name(&self, py: Python<'_>) -> String {
        py.detach(|| self.rref.owner_name())
    }

    /// The owner's rank.
    fn owner_id(&self) -> u32 {
        self.rref.owner()
    }

    /// Whether this worker owns the value.
    fn is_owner(&self) -> bool {
        self.rref.is_owner()
    }

    /// Whether the owner has confirmed this user (always true on the owner).
    fn confirmed_by_owner(&self, py: Python<'_>) -> bool {
        py.detach(|| self.rref.confirmed_by_owner())
    }

    /// The RRef's id, as text (`RRef(owner:n)`).
    fn rref_id(&self) -> String {
        self.rref.id().to_string()
    }

    /// `(raised, object)`: the value on its owner, once the function
    /// creating it has run (waiting up to the agent's default timeout).
    fn local_value<'py>(&self, py: Python<'py>) -> Result<(bool, Py<PyAny>), Error> {
        let value = py.detach(|| self.rref.local_value())?;
        match &*value {
            PyObj::Live { object, raised } => Ok((*raised, object.clone_ref(py))),
            PyObj::Wire { .. } => Err(Error::Argument(
                "this RRef's value arrived pickled and was never unpickled on its owner".into(),
            )),
        }
    }

    /// `(raised, bytes, tensors, rrefs)`: a copy of the value fetched from
    /// its owner by the RRef protocol, with the timeout in seconds
    /// (negative: the agent's default; 0: none).
    #[pyo3(signature = (timeout))]
    fn to_here<'py>(&self, py: Python<'py>, timeout: f64) -> Result<Bound<'py, PyTuple>, Error> {
        let timeout = timeout_of(timeout)?;
        let rref = &self.rref;
        let value = py.detach(|| match timeout {
            Some(t) => rref.timeout(t).to_here(),
            None => rref.to_here(),
        })?;
        match value {
            PyObj::Wire { pickled, raised } => pickle::reply_tuple(py, raised, pickled),
            PyObj::Live { .. } => Err(Error::Argument(
                "to_here() of an RRef's live value: call local_value() on its owner".into(),
            )),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let owner = self.owner_name(py);
        format!("RRefHandle({}, owner={owner})", self.rref.id())
    }
}
