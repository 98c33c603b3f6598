//! Bounded polling before sleeping: how every side in Ferry that expects
//! an answer from another process on the same host within microseconds
//! waits (a shared-memory ring's reader or writer, a caller awaiting its
//! reply, a pipeline stage awaiting its input). It re-checks for a short
//! budget ([`SPIN_BUDGET`]), yielding the CPU between rounds, and only then
//! parks, so an answer that comes soon costs no wake-up on either side.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// How many times a side that finds what it waits for not there yet (a
/// ring's reader finding it empty, its writer full) re-checks, with [`std::hint::spin_loop`] in between, before
/// it looks at the clock and yields the CPU ([`SPIN_BUDGET`]).
pub const SPIN_ITERATIONS: u32 = 64;

/// How long, unless set otherwise
/// ([`ChannelConfig::spin`](crate::ChannelConfig::spin)), a side that
/// finds its ring empty (reader) or full (writer), or a caller that awaits
/// its reply, keeps re-checking before it announces that it is going to
/// sleep:
/// rounds of [`SPIN_ITERATIONS`] checks, the CPU yielded
/// ([`std::thread::yield_now`]) between rounds, so that a thread with work
/// to do on this core (often the one about to answer) runs first. Like
/// TensorPipe's busy-polling loop, bounded: a peer that answers within the
/// budget costs no eventfd wake-up on either side (on a small host a
/// wake-up costs about as much as the rest of an empty call's round trip),
/// and a quiet ring costs at most this much CPU before its side sleeps.
pub const SPIN_BUDGET: Duration = Duration::from_micros(50);

/// The most a shared-memory ring's reader spins while a [`ComputeBound`]
/// guard for [`HostCores::Scarce`] lives in its process.
pub const COMPUTE_BOUND_SPIN: Duration = Duration::from_micros(5);

/// How many [`ComputeBound`] guards for [`HostCores::Scarce`] are alive in
/// this process.
static COMPUTE_BOUND: AtomicUsize = AtomicUsize::new(0);
/// How many for [`HostCores::Spare`].
static SPARE_CORES: AtomicUsize = AtomicUsize::new(0);
/// How many [`AwaitingInput`] guards are alive in this process.
static AWAITING: AtomicUsize = AtomicUsize::new(0);
/// Readers asleep on their eventfd while a [`HostCores::Spare`] guard
/// lives, woken when an input comes to be awaited.
static SLEEPERS: Mutex<Vec<Waker>> = Mutex::new(Vec::new());

/// Whether the host has a core for every thread that a process computing
/// between its messages keeps busy, its readers included: what a
/// [`ComputeBound`] guard tells the readers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostCores {
    /// Fewer cores than busy threads (two processes on two cores, say): a
    /// spinning reader takes a core from a stage's compute or from the
    /// thread that is to take the message, so readers spin at most
    /// [`COMPUTE_BOUND_SPIN`] before they sleep.
    Scarce,
    /// A core for each: readers keep their own spin, and while an input is
    /// awaited in the process ([`awaiting_input`]) they keep polling their
    /// rings, so the awaited message costs no wake-up of its reader.
    Spare,
}

impl HostCores {
    /// [`HostCores::Spare`] when `cores` (the CPUs this process may run
    /// on) give each of `processes` processes on the host its
    /// `compute_threads`, a thread that waits for input and one that reads
    /// it; else [`HostCores::Scarce`].
    ///
    /// ```
    /// use ferry_transport::spin::HostCores;
    ///
    /// assert_eq!(HostCores::of(2, 2, 1), HostCores::Scarce);
    /// assert_eq!(HostCores::of(16, 2, 1), HostCores::Spare);
    /// assert_eq!(HostCores::of(16, 4, 4), HostCores::Scarce);
    /// ```
    pub fn of(cores: usize, processes: usize, compute_threads: usize) -> HostCores {
        let needed = processes
            .max(1)
            .saturating_mul(compute_threads.saturating_add(2));
        if cores >= needed {
            HostCores::Spare
        } else {
            HostCores::Scarce
        }
    }
}

/// Says that this process computes between its messages (a pipeline stage
/// running a step, say), and whether its host has [`HostCores`] to spare,
/// until the guard is dropped.
///
/// A reader's spin pays off when the next message follows within it, as
/// the reply to a call does. Between a pipeline's stages the next message
/// comes an action later (hundreds of microseconds or more). Where cores
/// are [`Scarce`](HostCores::Scarce), the spin only takes CPU from the
/// stages' compute and from the thread that is to take the message, which
/// delays hand-offs between stages several-fold: readers spin at most
/// [`COMPUTE_BOUND_SPIN`]. Where they are [`Spare`](HostCores::Spare), the
/// waits are what costs: readers keep polling while the process awaits an
/// input ([`awaiting_input`]).
pub fn compute_bound(cores: HostCores) -> ComputeBound {
    guards(cores).fetch_add(1, Ordering::Relaxed);
    ComputeBound { cores }
}

/// The count of live [`ComputeBound`] guards for `cores`.
fn guards(cores: HostCores) -> &'static AtomicUsize {
    match cores {
        HostCores::Scarce => &COMPUTE_BOUND,
        HostCores::Spare => &SPARE_CORES,
    }
}

/// See [`compute_bound`].
#[must_use = "the readers' spin follows the guard only while it lives"]
#[derive(Debug)]
pub struct ComputeBound {
    cores: HostCores,
}

impl Drop for ComputeBound {
    fn drop(&mut self) {
        guards(self.cores).fetch_sub(1, Ordering::Relaxed);
    }
}

/// Says that a thread of this process is waiting for an input from
/// another process (a pipeline stage polling for its activation, say),
/// until the guard is dropped. Under a [`HostCores::Spare`] guard, the
/// readers asleep on their rings are woken and poll them, yielding to
/// their runtime between rounds, for as long as an input is awaited: the
/// message then costs no eventfd wake-up of its reader (on a virtual
/// machine, tens of microseconds). Otherwise the guard changes nothing.
pub fn awaiting_input() -> AwaitingInput {
    AWAITING.fetch_add(1, Ordering::SeqCst);
    if SPARE_CORES.load(Ordering::Relaxed) > 0 {
        let sleepers =
            std::mem::take(&mut *SLEEPERS.lock().unwrap_or_else(PoisonError::into_inner));
        for waker in sleepers {
            waker.wake();
        }
    }
    AwaitingInput { _private: () }
}

/// See [`awaiting_input`].
#[must_use = "the readers keep polling only while the guard lives"]
#[derive(Debug)]
pub struct AwaitingInput {
    _private: (),
}

impl Drop for AwaitingInput {
    fn drop(&mut self) {
        AWAITING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The spin a ring's reader configured with `configured` uses now: at most
/// [`COMPUTE_BOUND_SPIN`] while a [`ComputeBound`] guard for
/// [`HostCores::Scarce`] lives.
pub fn reader_spin(configured: Duration) -> Duration {
    if COMPUTE_BOUND.load(Ordering::Relaxed) > 0 {
        configured.min(COMPUTE_BOUND_SPIN)
    } else {
        configured
    }
}

/// Whether a ring's reader that found its ring empty after its spin
/// should poll it again soon rather than sleep: an input is awaited in
/// this process, whose host has cores to spare ([`awaiting_input`]).
pub(crate) fn keep_polling() -> bool {
    AWAITING.load(Ordering::SeqCst) > 0 && SPARE_CORES.load(Ordering::Relaxed) > 0
}

/// Registers a reader about to sleep on its eventfd, to be woken when an
/// input comes to be awaited ([`awaiting_input`]); only under a
/// [`HostCores::Spare`] guard. Returns [`keep_polling`] as it stands once
/// registered, so an input awaited meanwhile is not missed.
pub(crate) fn sleep_until_awaited(waker: &Waker) -> bool {
    if SPARE_CORES.load(Ordering::Relaxed) == 0 {
        return false;
    }
    {
        let mut sleepers = SLEEPERS.lock().unwrap_or_else(PoisonError::into_inner);
        if !sleepers.iter().any(|w| w.will_wake(waker)) {
            sleepers.push(waker.clone());
        }
    }
    keep_polling()
}

/// Re-checks `ready()` for up to `budget` in rounds of [`SPIN_ITERATIONS`]
/// checks ([`std::hint::spin_loop`] in between), yielding the CPU between
/// rounds; `true` as soon as it holds. How any side that expects an
/// answer from another process within microseconds should wait before it
/// parks (the rings here, a caller waiting for its reply).
pub fn spin_until(budget: Duration, mut ready: impl FnMut() -> bool) -> bool {
    spin_while_active(budget, || {
        if ready() {
            Check::Ready
        } else {
            Check::Waiting
        }
    })
}

/// What one check of [`spin_while_active`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// What was waited for holds: stop.
    Ready,
    /// Not yet, but something moved (bytes of a transfer arrived): the
    /// idle time starts again.
    Progressed,
    /// Not yet, and nothing moved.
    Waiting,
}

/// As [`spin_until`], except that the budget is idle time: it starts
/// again after every round in which a check reported
/// [`Check::Progressed`], so a transfer whose bytes keep moving is polled
/// to its end and only a quiet wait gives up after `idle`. `true` as soon
/// as a check reports [`Check::Ready`]; a zero `idle` is one round.
pub fn spin_while_active(idle: Duration, check: impl FnMut() -> Check) -> bool {
    spin_while_active_in_rounds(idle, SPIN_ITERATIONS, check)
}

/// As [`spin_while_active`], with `checks` checks per round instead of
/// [`SPIN_ITERATIONS`]: fewer for a check that is expensive (a UCX
/// progress call), so the CPU is still yielded every few microseconds.
pub(crate) fn spin_while_active_in_rounds(
    idle: Duration,
    checks: u32,
    mut check: impl FnMut() -> Check,
) -> bool {
    let mut quiet_since = Instant::now();
    loop {
        let mut active = false;
        for _ in 0..checks {
            match check() {
                Check::Ready => return true,
                Check::Progressed => active = true,
                Check::Waiting => {}
            }
            std::hint::spin_loop();
        }
        if active {
            quiet_since = Instant::now();
        }
        if quiet_since.elapsed() >= idle {
            return check() == Check::Ready;
        }
        std::thread::yield_now();
    }
}

/// Yields to the tokio scheduler once: `Pending` the first time, with the
/// task woken after the worker has run what is queued, without waking
/// another worker thread (a self-wake would). How a reader lets the task
/// its last message woke run before it spins (`yield_before_spin`).
pub(crate) fn yield_once(cx: &mut Context<'_>) -> Poll<()> {
    std::pin::pin!(tokio::task::yield_now()).poll(cx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spin_lasts_while_checks_report_progress() {
        // An hour of idle budget: only the checks end this spin. Far more
        // checks than one round report progress before the last is ready.
        let mut checks = 0;
        let ready = spin_while_active(Duration::from_secs(3600), || {
            checks += 1;
            if checks == 10 * SPIN_ITERATIONS {
                Check::Ready
            } else {
                Check::Progressed
            }
        });
        assert!(ready);
        assert_eq!(checks, 10 * SPIN_ITERATIONS);
    }

    #[test]
    fn a_spin_with_no_idle_time_is_one_round_and_a_last_check() {
        let mut checks = 0;
        let ready = spin_while_active(Duration::ZERO, || {
            checks += 1;
            Check::Progressed
        });
        assert!(!ready);
        assert_eq!(checks, SPIN_ITERATIONS + 1);
        // spin_until keeps its meaning: ready on the last check counts.
        let mut checks = 0;
        assert!(spin_until(Duration::ZERO, || {
            checks += 1;
            checks > SPIN_ITERATIONS
        }));
    }

    #[test]
    fn a_round_has_as_many_checks_as_asked_for() {
        for per_round in [1, 4, 16] {
            let mut checks = 0;
            let ready = spin_while_active_in_rounds(Duration::ZERO, per_round, || {
                checks += 1;
                Check::Waiting
            });
            assert!(!ready);
            assert_eq!(checks, per_round + 1, "{per_round} per round");
        }
    }
}
