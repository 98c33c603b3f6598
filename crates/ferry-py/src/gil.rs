//! Taking the GIL from a thread that may belong to a tokio runtime.

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
