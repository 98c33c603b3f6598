//! [`Pickled`] to and from the three parts Python's side
//! (`ferry.rpc._internal`) pickles into and out of: the pickle's bytes, the
//! list of tensors and the list of RRefs it refers to by index.

use ferry::tensor::Tensor;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::error::Error;

use crate::tensor;
use crate::wire::{PickleBytes, Pickled, PickledRRef, PyRRef, RustRRef, RustRRefWire};

/// The Python module that pickles and runs calls.
pub const INTERNAL: &str = "ferry.rpc._internal";

/// The three parts of a pickle as Python holds them.
pub type Parts<'py> = (Bound<'py, PyBytes>, Bound<'py, PyList>, Bound<'py, PyList>);

/// Takes Python's `(bytes, tensors, rrefs)` into a [`Pickled`]: every
/// tensor as a libtorch alias of it, every RRef (to a Python or a Rust
/// value) as a handle on the same reference.
pub fn from_parts(
    bytes: &Bound<'_, PyBytes>,
    tensors: &Bound<'_, PyList>,
    rrefs: &Bound<'_, PyList>,
) -> Result<Pickled, Error> {
    let tensors = tensors
        .iter()
        .map(|t| tensor::from_python(&t).map(Tensor::from))
        .collect::<Result<Vec<_>, _>>()?;
    let rrefs = rrefs
        .iter()
        .map(|r| {
            if let Ok(r) = r.cast::<PyRRef>() {
                return Ok(PickledRRef::Python(r.get().rref.clone()));
            }
            match r.cast::<RustRRef>() {
                Ok(r) => {
                    let r = r.get();
                    Ok(PickledRRef::Rust(RustRRefWire {
                        rref: r.rref.clone(),
                        shape: r.shape.clone(),
                        node: r.node,
                    }))
                }
                Err(_) => Err(Error::Argument(format!(
                    "{} in a pickle's RRefs",
                    r.get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_else(|_| "?".into())
                ))),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Pickled {
        bytes: PickleBytes(bytes.as_bytes().to_vec()),
        tensors,
        rrefs,
    })
}

/// Hands a [`Pickled`] to Python as `(bytes, tensors, rrefs)`: each
/// received tensor becomes a `torch.Tensor` on the same memory. It takes
/// the tensors by value and drops each libtorch handle as soon as Python
/// holds the tensor, with the GIL held: Python's object then owns it
/// alone, and nothing later needs the GIL to free it.
pub fn to_parts(py: Python<'_>, pickled: Pickled) -> Result<Parts<'_>, Error> {
    let bytes = PyBytes::new(py, &pickled.bytes.0);
    let tensors = PyList::empty(py);
    for t in pickled.tensors {
        tensors.append(tensor::to_python(py, &t)?)?;
    }
    let rrefs = PyList::empty(py);
    for rref in pickled.rrefs {
        match rref {
            PickledRRef::Python(rref) => rrefs.append(Bound::new(py, PyRRef { rref })?)?,
            PickledRRef::Rust(RustRRefWire { rref, shape, node }) => {
                rrefs.append(Bound::new(py, RustRRef { rref, shape, node })?)?
            }
        }
    }
    Ok((bytes, tensors, rrefs))
}

/// Reads the `(bytes, tensors, rrefs)` tuple a Python function returned.
pub fn from_tuple(parts: &Bound<'_, PyAny>) -> Result<Pickled, Error> {
    let (bytes, tensors, rrefs): Parts<'_> = parts.extract()?;
    from_parts(&bytes, &tensors, &rrefs)
}

/// Pickles `object` with `ferry.rpc._internal.dumps`, taking the GIL.
pub fn dumps_object(object: &Py<PyAny>) -> Result<Pickled, Error> {
    crate::gil::attach(|py| {
        static DUMPS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let parts = DUMPS
            .import(py, INTERNAL, "dumps")?
            .call1((object.bind(py),))?;
        from_tuple(&parts)
    })
}

/// `(raised, bytes, tensors, rrefs)`: what Python's side reads a reply from.
pub fn reply_tuple<'py>(
    py: Python<'py>,
    raised: bool,
    pickled: Pickled,
) -> Result<Bound<'py, PyTuple>, Error> {
    let (bytes, tensors, rrefs) = to_parts(py, pickled)?;
    Ok((raised, bytes, tensors, rrefs).into_pyobject(py)?)
}
