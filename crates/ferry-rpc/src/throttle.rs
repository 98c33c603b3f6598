//! Rate limiting of log lines a peer can trigger at will (a forged reply,
//! say): a few per window are written, the rest are counted and the count
//! goes out with the next line written.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// A log line's budget: at most `per_window` lines each `window`.
pub(crate) struct Throttle {
    per_window: u32,
    window: Duration,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Start of the current window (`None`: nothing logged yet).
    start: Option<Instant>,
    /// Lines written in the current window.
    written: u32,
    /// Lines suppressed since the last one written.
    suppressed: u64,
}

impl Throttle {
    /// A budget of `per_window` lines per `window`.
    pub(crate) const fn new(per_window: u32, window: Duration) -> Self {
        Self {
            per_window,
            window,
            state: Mutex::new(State {
                start: None,
                written: 0,
                suppressed: 0,
            }),
        }
    }

    /// Whether a line may be written at `now`: `Some(n)` when it may, `n`
    /// being the lines suppressed since the last one written; `None` when
    /// it is to be suppressed (and counted).
    pub(crate) fn allow(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock();
        let expired = s
            .start
            .is_none_or(|start| now.saturating_duration_since(start) >= self.window);
        if expired {
            s.start = Some(now);
            s.written = 0;
        }
        if s.written < self.per_window {
            s.written += 1;
            Some(std::mem::take(&mut s.suppressed))
        } else {
            s.suppressed += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_budget_per_window_and_counts_the_rest() {
        let t = Throttle::new(2, Duration::from_secs(1));
        let t0 = Instant::now();
        assert_eq!(t.allow(t0), Some(0));
        assert_eq!(t.allow(t0), Some(0));
        for _ in 0..5 {
            assert_eq!(t.allow(t0 + Duration::from_millis(500)), None);
        }
        // A new window: the first line reports what was suppressed.
        assert_eq!(t.allow(t0 + Duration::from_secs(1)), Some(5));
        assert_eq!(t.allow(t0 + Duration::from_secs(1)), Some(0));
        assert_eq!(t.allow(t0 + Duration::from_secs(1)), None);
        assert_eq!(t.allow(t0 + Duration::from_secs(5)), Some(1));
    }
}
