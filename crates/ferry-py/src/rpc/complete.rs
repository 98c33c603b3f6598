//! Completing Python futures: a small tokio runtime of ferry-py's own
//! awaits the calls of `rpc_async`, and hands each outcome to its Python
//! callback on that runtime's blocking pool, the only place the GIL is
//! taken. It lives as long as the process, so an outcome is delivered
//! even while the agent shuts down.

use std::future::Future;
use std::sync::OnceLock;

use pyo3::prelude::*;
use tracing::warn;

/// How long a callback thread of [`runtime`] waits for work before it
/// ends (leaving its Python thread state to the interpreter, as CPython
/// does for any thread that ends holding one): in practice, never.
const KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// ferry-py's runtime: one worker thread awaiting calls, and a blocking
/// pool (threads made on demand, reused while busy ones wait) for the
/// Python callbacks, which may block (a callback may wait for another
/// future). Its threads stay for [`KEEP_ALIVE`] without work and keep
/// their Python thread state ([`crate::gil::long_lived`]): making one per
/// callback cost 4 µs.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ferry-py")
            .thread_keep_alive(KEEP_ALIVE)
            .on_thread_start(crate::gil::long_lived)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("cannot start ferry-py's runtime: {e}"))
    })
}

/// Awaits `call`, then runs `deliver` with its outcome on the blocking
/// pool with the GIL held. A `deliver` that raises has its exception
/// reported as unraisable (as Python reports an exception in a callback).
pub fn spawn<T, F>(call: F, deliver: impl FnOnce(Python<'_>, T) -> PyResult<()> + Send + 'static)
where
    T: Send + 'static,
    F: Future<Output = T> + Send + 'static,
{
    let rt = runtime();
    rt.spawn(async move {
        let outcome = call.await;
        let done = tokio::task::spawn_blocking(move || {
            crate::gil::attach(|py| {
                if let Err(e) = deliver(py, outcome) {
                    e.write_unraisable(py, None);
                }
            })
        });
        if let Err(e) = done.await {
            warn!("a Python future's callback did not finish: {e}");
        }
    });
}
