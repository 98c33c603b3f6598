//! `torch.Tensor` to and from libtorch tensors through the C++ shim
//! (`csrc/python_tensor.cpp`), as PyTorch's C++ extensions convert them:
//! no byte is copied either way.
//!
//! A tensor going out is taken as a detached alias of the Python tensor
//! (same storage and view, a `TensorImpl` of its own): the channel may
//! hold it until the receiver has read it, and dropping it then, on any
//! thread, needs no GIL. A tensor coming in is the fresh libtorch tensor
//! the receiver allocated, handed to Python as it is.

use std::ffi::{c_char, c_void, CStr};

use ferry::tensor::tch;
use pyo3::prelude::*;

use crate::error::Error;

extern "C" {
    fn ferry_py_is_tensor(obj: *mut pyo3::ffi::PyObject) -> i32;
    fn ferry_py_unpack(obj: *mut pyo3::ffi::PyObject, err: *mut c_char, len: usize) -> *mut c_void;
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

/// The libtorch tensor of the `torch.Tensor` `obj`: a detached alias
/// sharing its storage and view (see the module's doc).
pub fn from_python(obj: &Bound<'_, PyAny>) -> Result<tch::Tensor, Error> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `obj` is a live Python object and the GIL is held; the shim
    // writes at most ERR_LEN bytes, NUL-ended, into `err`.
    let ptr = unsafe { ferry_py_unpack(obj.as_ptr(), err.as_mut_ptr().cast(), ERR_LEN) };
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
