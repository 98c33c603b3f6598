//! The connection's progress task.

use std::sync::Arc;

use super::shared::Shared;
use crate::ucx::sys;

/// The progress task, until the last handle of the link is gone:
/// progress; then, while a send is unfinished ([`State::needs_events`]),
/// spin on progress while UCX keeps moving it, then arm the worker and
/// sleep on its event fd, bounded by the backstop
/// timer (one timer, reset rather than created anew each time);
/// otherwise sleep until a send is unfinished ([`Shared::wanted`]), with
/// no timer. Nothing needs this task then: a waiting receive progresses
/// the worker itself. A timer there would wake a runtime thread every
/// backstop for nothing, and that thread would then hold tokio's I/O
/// driver and take over the receive its events woke, moving a
/// connection's reader between the runtime's threads.
///
/// [`State::needs_events`]: super::State::needs_events
pub(super) async fn drive(shared: Arc<Shared>) {
    let api = shared.api;
    let backstop = tokio::time::sleep(shared.backstop);
    tokio::pin!(backstop);
    loop {
        // While sends are unfinished and UCX keeps moving them, poll them
        // the way a waiting receive polls (for at most the spin time since
        // the last progress) rather than sleep on the fd between their
        // fragments: a rendezvous over TCP moves its data as the socket
        // drains, and a wake-up per fragment would pace the transfer.
        if shared.lock().needs_events() {
            shared.spin(|state, _| {
                shared.sweep(state);
                !state.needs_events()
            });
        }
        let armed = {
            let mut state = shared.lock();
            shared.progress(&mut state);
            if state.needs_events() {
                // SAFETY: a live worker, under the lock.
                let status = unsafe { api.ucp_worker_arm(state.worker) };
                Some(status == sys::UCS_OK)
            } else {
                None
            }
        };
        if armed == Some(false) {
            // Events are pending (UCS_ERR_BUSY): progress again, letting
            // other tasks run in between.
            tokio::task::yield_now().await;
            continue;
        }
        let Some(fd) = shared.efd.as_ref() else {
            return;
        };
        if armed.is_none() {
            // Nothing unfinished: until a send is (no timer, see above).
            tokio::select! {
                _ = shared.wanted.notified() => continue,
                _ = shared.stop.notified() => return,
            }
        }
        backstop
            .as_mut()
            .reset(tokio::time::Instant::now() + shared.backstop);
        tokio::select! {
            ready = fd.readable() => {
                if let Ok(mut guard) = ready {
                    guard.clear_ready();
                }
            }
            _ = &mut backstop => {}
            _ = shared.stop.notified() => return,
        }
    }
}
