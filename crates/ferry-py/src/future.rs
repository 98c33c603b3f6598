//! Completing a `torch.futures.Future` with an error through the C++ shim
//! (`csrc/python_future.cpp`), as PyTorch's RPC futures hold one: the C++
//! future is marked failed, so `torch.futures.wait_all` stops at the first
//! error, and `wait()` / `value()` raise the very exception object, its
//! type kept.
//!
//! Python's `Future.set_exception` stores the exception as the future's
//! value instead (raised by an unwrap function on `wait()`), which
//! `wait_all` cannot tell from a result: it waits for every other future.

use std::ffi::{c_char, CStr};

use pyo3::prelude::*;

use crate::error::Error;

extern "C" {
    fn ferry_py_future_set_error(
        fut: *mut pyo3::ffi::PyObject,
        exc: *mut pyo3::ffi::PyObject,
        err: *mut c_char,
        len: usize,
    ) -> i32;
}

/// Room for the shim's error text.
const ERR_LEN: usize = 512;

/// Marks the `torch.futures.Future` `fut` completed with the exception
/// instance `exc`; its callbacks run here, with the GIL released. Fails
/// (an [`Error::Future`]) when `fut` is not a torch future or is done
/// already, or `exc` is not an exception.
pub fn set_error(fut: &Bound<'_, PyAny>, exc: &Bound<'_, PyAny>) -> Result<(), Error> {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: both objects are live and the GIL is held (`Bound`); the
    // shim writes at most ERR_LEN bytes, NUL-ended, into `err`, and
    // restores the GIL before it returns.
    let rc = unsafe {
        ferry_py_future_set_error(fut.as_ptr(), exc.as_ptr(), err.as_mut_ptr().cast(), ERR_LEN)
    };
    if rc == 0 {
        return Ok(());
    }
    Err(Error::Future(
        CStr::from_bytes_until_nul(&err)
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "set_future_error failed".into()),
    ))
}

/// `set_future_error(fut, exc)`: completes the `torch.futures.Future`
/// `fut` with the exception `exc` (see the module's doc).
#[pyfunction]
pub fn set_future_error(fut: &Bound<'_, PyAny>, exc: &Bound<'_, PyAny>) -> Result<(), Error> {
    set_error(fut, exc)
}
