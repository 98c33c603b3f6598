//! UCX brought to rest before the process exits.
//!
//! UCX frees its global state in its libraries' ELF destructors, which
//! `exit` runs near its end (`_dl_fini`). A Ferry process may exit with
//! connections open: after `shutdown_now`, whose runtime drops them on its
//! own threads, or without shutting down at all. A thread that progresses
//! or destroys a worker beside or after those destructors uses freed
//! memory. Seen in CI and reproduced here, in processes whose tests had
//! passed: SIGSEGV in `ucs_async_context_cleanup` under
//! `ucp_worker_destroy` on a runtime thread while the main thread was
//! past `_dl_fini`, and "free(): corrupted unsorted chunks" followed by a
//! failed assertion in UCX's `vfs_obj.c` (SIGABRT).
//!
//! So when UCX first loads, an `atexit` handler is registered. Handlers
//! registered after program start run before `_dl_fini`. This one, under
//! the registry's lock:
//! 1. marks the process as exiting: a worker dropped after this is left
//!    as it is (the process is going away), and none is created;
//! 2. takes each live worker's lock for good, waiting for a call into UCX
//!    in progress to finish. A thread that wants that worker later waits
//!    on its lock until the process is gone.
//!
//! UCX's destructors then run with no thread inside UCX. The workers and
//! contexts are not destroyed: destroying a worker with requests still in
//! flight is what crashes (UCX's memory pool walks them).

use std::sync::{Mutex, MutexGuard, Weak};

/// What the exit handler does to a live worker.
pub(crate) trait Quiesce: Send + Sync {
    /// Locks the worker for good (the guard is leaked), waiting for a call
    /// into UCX that holds the lock to finish.
    fn quiesce(&self);
}

/// The workers that may be alive, and whether the process is exiting.
pub(crate) struct Registry {
    /// Set by the exit handler: drop no worker, create none.
    pub(crate) exiting: bool,
    workers: Vec<Weak<dyn Quiesce>>,
}

impl Registry {
    /// Registers a new worker (call while holding the lock it was created
    /// under).
    pub(crate) fn push(&mut self, worker: Weak<dyn Quiesce>) {
        self.workers.retain(|w| w.strong_count() > 0);
        self.workers.push(worker);
    }
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    exiting: false,
    workers: Vec::new(),
});

/// The registry, locked. Hold it while creating a worker until it is
/// registered, and while destroying one, so the exit handler sees every
/// worker and destroys none in the middle.
pub(crate) fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

/// Registers the exit handler (once per process; called when UCX loads).
pub(crate) fn register_handler() {
    // SAFETY: `at_exit` is an `extern "C"` function with no arguments that
    // does not unwind (it only takes locks and leaks their guards).
    let rc = unsafe { libc::atexit(at_exit) };
    if rc != 0 {
        tracing::warn!("could not register UCX's exit handler: UCX may crash at process exit");
    }
}

extern "C" fn at_exit() {
    let mut registry = registry();
    registry.exiting = true;
    for worker in registry.workers.iter().filter_map(Weak::upgrade) {
        worker.quiesce();
        // Not dropped here: the worker's lock is leaked.
        std::mem::forget(worker);
    }
}
