//! `torch.Tensor` to and from libtorch tensors through the C++ shim
//! (`csrc/python_tensor.cpp`), as PyTorch's C++ extensions convert them:
//! no byte is copied either way.
//!
//! A tensor going out is taken as a detached alias of the Python tensor
//! (same storage and view, a `TensorImpl` of its own): the channel may
//! hold it until the receiver has read it, and dropping it then, on any
//! thread, needs no GIL. Inside a distributed autograd context (one is
//! current on the thread: `ferry.autograd.context()`, or a call that
//! brought one) a tensor that requires grad goes out as itself instead
//! (unless grad mode is off, under `torch.no_grad()`),
//! the same `TensorImpl` Python holds, so that the send function
//! ferry-autograd records for it is part of the graph Python's `torch`
//! built, and gradients flow back into that graph. A tensor coming in is
//! the fresh libtorch tensor the receiver allocated (a leaf that requires
//! grad, with its recv function recorded, when it travelled in a
//! context), handed to Python as it is. A sparse COO tensor converts the
//! same way (an alias shares its indices and values); ferry-tch sends it
//! as those two and rebuilds it on arrival.

use std::ffi::{c_char, c_void, CStr};

use ferry::tensor::tch;
use pyo3::prelude::*;

use crate::error::Error;

extern "C" {
    fn ferry_py_is_tensor(obj: *mut pyo3::ffi::PyObject) -> i32;
    fn ferry_py_unpack(
        obj: *mut pyo3::ffi::PyObject,
        keep_identity: i32,
        err: *mut c_char,
        len: usize,
    ) -> *mut c_void;
    fn ferry_py_wrap(
        tensor: *const c_void,
        err: *mut c_char,
        len: usize,
    ) -> *mut pyo3::ffi::PyObject;
}

/// Room for the shim's error text.
const ERR_LEN: usize = 512;

fn shim_error(buf: &[u8; ERR_LEN]) -> String {
    CStr::from_bytes_until_nul(buf)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "tensor conversion failed".into())
}

/// Whether `obj` is a `torch.Tensor` (or a subclass of it).
pub fn is_tensor(obj: &Bound<'_, PyAny>) -> bool {
    // SAFETY: `obj` is a live Python object and the GIL is held (`Bound`).
    unsafe { ferry_py_is_tensor(obj.as_ptr()) != 0 }
}

/// Which libtorch tensor [`unpack`] makes of a Python tensor (the shim's
/// `keep_identity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Identity {
    /// A detached alias: the same storage and view, a `TensorImpl` of its
    /// own with no autograd history.
    Detached = 0,
    /// The tensor itself if it requires grad and grad mode is on (on this
    /// thread: not under `torch.no_grad()`), a detached alias otherwise.
    IfRequiresGrad = 1,
    /// The tensor itself (the same `TensorImpl`), always.
    Kept = 2,
}

/// The libtorch tensor of the `torch.Tensor` `obj` as it goes out in a
/// message: a detached alias sharing its storage and view, or, inside a
/// distributed autograd context, the tensor itself when it requires grad
/// and grad mode is on, as PyTorch records a send function only then (see
/// the module's doc).
pub fn from_python(obj: &Bound<'_, PyAny>) -> Result<tch::Tensor, Error> {
    let identity = if ferry::tensor::grad::current().is_some() {
        Identity::IfRequiresGrad
    } else {
        Identity::Detached
    };
    unpack(obj, identity)
}

/// The libtorch tensor of the `torch.Tensor` `obj`, as `identity` asks; no
/// byte is copied.
pub fn unpack(obj: &Bound<'_, PyAny>, identity: Identity) -> Result<tch::Tensor, Error> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `obj` is a live Python object and the GIL is held; the shim
    // writes at most ERR_LEN bytes, NUL-ended, into `err`.
    let ptr = unsafe {
        ferry_py_unpack(
            obj.as_ptr(),
            identity as i32,
            err.as_mut_ptr().cast(),
            ERR_LEN,
        )
    };
    if ptr.is_null() {
        return Err(Error::Tensor(shim_error(&err)));
    }
    // SAFETY: the shim returned a new `at::Tensor*`, which is what a
    // `tch::Tensor` owns (tch frees it with `delete`).
    Ok(unsafe { tch::Tensor::from_ptr(ptr.cast()) })
}

/// The `torch.Tensor` of `tensor` (the same tensor, no copy).
pub fn to_python<'py>(py: Python<'py>, tensor: &tch::Tensor) -> Result<Bound<'py, PyAny>, Error> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `tensor.as_ptr()` is a live `at::Tensor*` for the call, the
    // GIL is held (`py`), and the shim writes at most ERR_LEN bytes into
    // `err`.
    let obj = unsafe { ferry_py_wrap(tensor.as_ptr().cast(), err.as_mut_ptr().cast(), ERR_LEN) };
    if obj.is_null() {
        // THPVariable_Wrap may have set a Python error: take it if so.
        return Err(match PyErr::take(py) {
            Some(e) => Error::Python(e),
            None => Error::Tensor(shim_error(&err)),
        });
    }
    // SAFETY: the shim returned a new (owned) reference.
    Ok(unsafe { Bound::from_owned_ptr(py, obj) })
}
