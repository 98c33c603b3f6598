//! Waiting in async code for a condition that a [`Notify`] announces.

use std::time::Duration;

use tokio::sync::Notify;

/// Resolves with `check()`'s value once it returns `Some`, re-checking each
/// time `notify` wakes its waiters (registered before each check, so no
/// wake-up is missed).
pub(crate) async fn until<T>(notify: &Notify, mut check: impl FnMut() -> Option<T>) -> T {
    loop {
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if let Some(v) = check() {
            return v;
        }
        notified.await;
    }
}

/// [`until`], giving up after `timeout` (zero: never) with `None`.
pub(crate) async fn until_timeout<T>(
    notify: &Notify,
    timeout: Duration,
    check: impl FnMut() -> Option<T>,
) -> Option<T> {
    if timeout.is_zero() {
        return Some(until(notify, check).await);
    }
    tokio::time::timeout(timeout, until(notify, check))
        .await
        .ok()
}
