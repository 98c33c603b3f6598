//! Running a future on the spot: polled once on the current thread, and
//! handed to the agent's runtime only if it has to wait.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Waker};

use tokio::runtime::Handle;

/// Polls `future` once here, inside `runtime`'s context (so I/O and timers
/// it touches register with that runtime's reactor); if it is not done,
/// spawns it on `runtime`, whose task polls it again with its own waker.
/// Returns whether it finished here. Saves a trip through the scheduler
/// (often a thread hop) for the many futures that are ready at once.
pub(crate) fn run_or_spawn(
    runtime: &Handle,
    mut future: Pin<Box<dyn Future<Output = ()> + Send + 'static>>,
) -> bool {
    let _runtime = runtime.enter();
    if future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
        .is_ready()
    {
        return true;
    }
    runtime.spawn(future);
    false
}
