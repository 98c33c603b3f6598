//! Backing off a TCP accept loop that keeps failing, with a rate-limited
//! warning: shared by every accept loop of the workspace (the store
//! server, the RPC agent, the process group and checkpoint servers).
//!
//! Out of file descriptors (`EMFILE`, `ENFILE`) or memory, `accept` fails
//! again at once for as long as the condition lasts; a loop that only
//! logs and retries spins a core and floods the log. [`AcceptBackoff`]
//! is a pure state machine (it takes `now` and returns what to do): the
//! pause after each failure doubles from [`FIRST_ACCEPT_PAUSE`] up to
//! [`MAX_ACCEPT_PAUSE`] for resource exhaustion, and a warning is issued
//! for the first failure of a streak and then at most once every
//! [`ACCEPT_WARN_EVERY`], counting the failures it did not report. A
//! successful accept ends the streak.

use std::io;
use std::time::{Duration, Instant};

/// The pause after the first failed accept of a streak.
pub const FIRST_ACCEPT_PAUSE: Duration = Duration::from_millis(10);
/// The longest pause between two accepts while they keep failing.
pub const MAX_ACCEPT_PAUSE: Duration = Duration::from_secs(1);
/// The least time between two warnings about failed accepts.
pub const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(10);

/// What to do after a failed accept: pause, and maybe warn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptAction {
    /// How long to wait before accepting again.
    pub pause: Duration,
    /// `Some(n)`: issue a warning now, reporting `n` failures since the
    /// last one (this one included). `None`: stay quiet.
    pub warn: Option<u64>,
}

/// The back-off state of one accept loop (see the [module](self) docs).
#[derive(Debug, Clone, Default)]
pub struct AcceptBackoff {
    /// The next pause; zero when no streak is under way.
    next_pause: Duration,
    /// When the last warning was issued.
    last_warning: Option<Instant>,
    /// Failures since the last warning.
    unreported: u64,
    /// Failures since this state was created.
    total_failures: u64,
}

/// Whether `e` means the process or system ran out of a resource, so
/// that the next accept would fail the same way at once.
pub fn is_resource_exhaustion(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

impl AcceptBackoff {
    /// A loop with no failure yet.
    pub fn new() -> AcceptBackoff {
        AcceptBackoff::default()
    }

    /// Records a failed accept at `now`. Resource exhaustion (see
    /// [`is_resource_exhaustion`]) doubles the pause up to
    /// [`MAX_ACCEPT_PAUSE`]; any other error (one connection that was
    /// reset before it was accepted) pauses [`FIRST_ACCEPT_PAUSE`].
    pub fn failed(&mut self, now: Instant, error: &io::Error) -> AcceptAction {
        self.total_failures += 1;
        self.unreported += 1;
        let pause = if is_resource_exhaustion(error) {
            let pause = self.next_pause.max(FIRST_ACCEPT_PAUSE);
            self.next_pause = (pause * 2).min(MAX_ACCEPT_PAUSE);
            pause
        } else {
            FIRST_ACCEPT_PAUSE
        };
        let due = self
            .last_warning
            .is_none_or(|at| now.saturating_duration_since(at) >= ACCEPT_WARN_EVERY);
        let warn = due.then(|| {
            self.last_warning = Some(now);
            std::mem::take(&mut self.unreported)
        });
        AcceptAction { pause, warn }
    }

    /// Records a successful accept: the next failure starts a new streak
    /// with the shortest pause (warnings stay rate-limited).
    pub fn succeeded(&mut self) {
        self.next_pause = Duration::ZERO;
    }

    /// Failed accepts since this state was created.
    pub fn failures(&self) -> u64 {
        self.total_failures
    }

    /// The I/O shell around [`failed`](Self::failed): records `error`,
    /// warns (naming the server, `what`) when due, then pauses.
    pub async fn pause_after(&mut self, what: &str, error: &io::Error) {
        let action = self.failed(Instant::now(), error);
        if let Some(failures) = action.warn {
            tracing::warn!(
                server = what,
                %error,
                failures,
                pause = ?action.pause,
                "accept failed; backing off (this warning is rate-limited)"
            );
        }
        tokio::time::sleep(action.pause).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emfile() -> io::Error {
        io::Error::from_raw_os_error(libc::EMFILE)
    }

    #[test]
    fn exhaustion_doubles_the_pause_up_to_the_cap_and_success_resets_it() {
        let mut b = AcceptBackoff::new();
        let now = Instant::now();
        let pauses: Vec<Duration> = (0..10).map(|_| b.failed(now, &emfile()).pause).collect();
        assert_eq!(pauses[0], FIRST_ACCEPT_PAUSE);
        assert_eq!(pauses[1], FIRST_ACCEPT_PAUSE * 2);
        assert!(pauses.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(*pauses.last().unwrap(), MAX_ACCEPT_PAUSE);
        b.succeeded();
        assert_eq!(b.failed(now, &emfile()).pause, FIRST_ACCEPT_PAUSE);
        assert_eq!(b.failures(), 11);
        let reset = io::Error::from(io::ErrorKind::ConnectionAborted);
        assert_eq!(b.failed(now, &reset).pause, FIRST_ACCEPT_PAUSE);
    }

    #[test]
    fn warnings_are_rate_limited_and_count_what_they_skipped() {
        let mut b = AcceptBackoff::new();
        let t0 = Instant::now();
        assert_eq!(b.failed(t0, &emfile()).warn, Some(1));
        let quiet = (1..1000)
            .map(|i| b.failed(t0 + Duration::from_millis(i), &emfile()).warn)
            .filter(Option::is_some)
            .count();
        assert_eq!(quiet, 0);
        assert_eq!(b.failed(t0 + ACCEPT_WARN_EVERY, &emfile()).warn, Some(1000));
    }
}
