//! Taking the GIL from threads of Ferry's: without blocking a tokio
//! runtime, and keeping a body thread's Python thread state.

/// Runs `f` (which takes the GIL) so that it blocks no runtime: on a
/// worker thread of a multi-threaded tokio runtime inside
/// [`tokio::task::block_in_place`], which first hands the thread's other
/// tasks to another worker; anywhere else directly.
pub fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

thread_local! {
    /// Whether this thread keeps its Python thread state (see [`attach`]).
    static KEPT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Whether this thread lives as long as the process ([`long_lived`]).
    static LONG_LIVED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Says that this thread lives as long as the process, so that [`attach`]
/// keeps its Python thread state (the threads of
/// [`rpc::complete`](crate::rpc::complete)'s runtime).
pub fn long_lived() {
    LONG_LIVED.set(true);
}

/// [`Python::attach`](pyo3::Python::attach), keeping the thread's Python
/// thread state for the next time on an agent's body threads
/// ([`ferry::rpc::on_body_thread`]), which run most Python calls this
/// worker serves and live until the agent stops, and on [`long_lived`]
/// threads.
///
/// A thread Python did not start gets a thread state from its first
/// `PyGILState_Ensure`, and its matching `PyGILState_Release` destroys it:
/// the next attach makes a new one. Both cost about 4 µs together, a
/// sixth of an empty Python call's round trip. On a body thread one more
/// `PyGILState_Ensure`, never released, keeps the state (and releases the
/// GIL as usual when `f` returns); it is left to the interpreter when the
/// thread ends with its agent, as CPython leaves the states of threads
/// that end without releasing them.
pub fn attach<R>(f: impl for<'py> FnOnce(pyo3::Python<'py>) -> R) -> R {
    let keep = !KEPT.get()
        && (ferry::rpc::on_body_thread() || LONG_LIVED.get())
        // SAFETY: reads this thread's state pointer; needs no GIL.
        && unsafe { pyo3::ffi::PyGILState_GetThisThreadState() }.is_null();
    pyo3::Python::attach(|py| {
        if keep {
            // SAFETY: the GIL is held (`py`); this only counts one more
            // holder of the thread state made by `attach`'s own Ensure.
            unsafe { pyo3::ffi::PyGILState_Ensure() };
            KEPT.set(true);
        }
        f(py)
    })
}
