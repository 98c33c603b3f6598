//! Where values sent to a rank's stages wait until the action that needs
//! them runs: activations (forward) and gradients (backward), keyed by
//! step, stage, direction and microbatch.
//!
//! Receives are in effect posted as soon as the pipeline exists: a sender
//! pushes its value whenever its schedule sends it, and the value waits
//! here; a compute action waits only for its own input, so communication
//! overlaps computation. Waits end with the value, at a deadline, or when
//! the step is aborted.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use ferry_transport::spin::spin_until;
use parking_lot::{Condvar, Mutex};

/// How many finished and aborted steps a mailbox remembers, to drop their
/// late values.
const KEPT_STEPS: usize = 64;

/// Which way a value goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub(crate) enum Direction {
    /// An activation, to the next stage.
    Forward,
    /// A gradient, to the previous stage.
    Backward,
}

/// The address of one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub step: u64,
    pub stage: usize,
    pub direction: Direction,
    pub microbatch: usize,
}

/// Why a wait ended without its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WaitError {
    /// The step was aborted, with the reason.
    Aborted(String),
    /// Nothing arrived within the wait's time limit.
    TimedOut(Duration),
}

/// Why a value was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PutError {
    /// A value for this key is already waiting.
    Duplicate,
}

struct State<V> {
    values: HashMap<Key, V>,
    /// Steps aborted, with the reason; values for them are dropped.
    aborted: HashMap<u64, String>,
    /// Steps finished: late values for them are dropped.
    finished: BTreeSet<u64>,
}

impl<V> State<V> {
    /// What a wait for `key` ends with now, if anything: the abort of its
    /// step, or its value (taken out).
    fn take_now(&mut self, key: Key) -> Option<Result<V, WaitError>> {
        if let Some(reason) = self.aborted.get(&key.step) {
            return Some(Err(WaitError::Aborted(reason.clone())));
        }
        self.values.remove(&key).map(Ok)
    }
}

/// Values waiting for their actions.
pub(crate) struct Mailbox<V> {
    state: Mutex<State<V>>,
    arrived: Condvar,
}

impl<V> Default for Mailbox<V> {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                values: HashMap::new(),
                aborted: HashMap::new(),
                finished: BTreeSet::new(),
            }),
            arrived: Condvar::new(),
        }
    }
}

impl<V> Mailbox<V> {
    /// Leaves `value` for the action that takes `key`. A value for an
    /// aborted or finished step is dropped (`Ok(false)`).
    pub(crate) fn put(&self, key: Key, value: V) -> Result<bool, PutError> {
        let mut state = self.state.lock();
        if state.aborted.contains_key(&key.step) || state.finished.contains(&key.step) {
            return Ok(false);
        }
        if state.values.contains_key(&key) {
            return Err(PutError::Duplicate);
        }
        state.values.insert(key, value);
        drop(state);
        self.arrived.notify_all();
        Ok(true)
    }

    /// Takes the value for `key`, waiting for it up to `limit`: first by
    /// polling for up to `spin` ([`Mailbox::poll_for`]), then asleep.
    pub(crate) fn take(&self, key: Key, limit: Duration, spin: Duration) -> Result<V, WaitError> {
        let deadline = Instant::now() + limit;
        if let Some(taken) = self.poll_for(key, spin.min(limit)) {
            return taken;
        }
        let mut state = self.state.lock();
        loop {
            if let Some(taken) = State::take_now(&mut state, key) {
                return taken;
            }
            if self.arrived.wait_until(&mut state, deadline).timed_out() {
                return match state.values.remove(&key) {
                    Some(value) => Ok(value),
                    None => Err(WaitError::TimedOut(limit)),
                };
            }
        }
    }

    /// Polls for the value for `key` (or the abort of its step) for up to
    /// `spin`, the way the rings wait for their peer
    /// ([`spin_until`]: rounds of checks, the CPU yielded between them);
    /// `None` when neither came within it. A thread that polls keeps its core awake, so
    /// the thread that receives the value runs at once when it arrives: on
    /// a virtual machine an idle core sleeps, and waking it can take
    /// milliseconds.
    pub(crate) fn poll_for(&self, key: Key, spin: Duration) -> Option<Result<V, WaitError>> {
        if spin.is_zero() {
            return None;
        }
        let mut taken = State::take_now(&mut self.state.lock(), key);
        if taken.is_some() {
            return taken;
        }
        // The process's ring readers poll meanwhile if the host has the
        // cores for it.
        let _awaiting = ferry_transport::spin::awaiting_input();
        spin_until(spin, || {
            taken = State::take_now(&mut self.state.lock(), key);
            taken.is_some()
        });
        taken
    }

    /// Aborts `step`: its waits end with `reason`, its values are dropped.
    /// The first reason given is kept.
    pub(crate) fn abort(&self, step: u64, reason: &str) {
        let mut state = self.state.lock();
        state
            .aborted
            .entry(step)
            .or_insert_with(|| reason.to_owned());
        // Keep the record of recent steps only (a step's late values come
        // before the next steps are many).
        if state.aborted.len() > KEPT_STEPS {
            let oldest = state.aborted.keys().min().copied();
            if let Some(oldest) = oldest {
                state.aborted.remove(&oldest);
            }
        }
        state.values.retain(|k, _| k.step != step);
        drop(state);
        self.arrived.notify_all();
    }

    /// Marks `step` done: values still here for it (none, after a step that
    /// ran to the end) are dropped, and so are late ones. Returns how many
    /// were dropped.
    pub(crate) fn finish(&self, step: u64) -> usize {
        let mut state = self.state.lock();
        let before = state.values.len();
        state.values.retain(|k, _| k.step != step);
        state.finished.insert(step);
        // Keep the record of recent steps only.
        while state.finished.len() > KEPT_STEPS {
            state.finished.pop_first();
        }
        before - state.values.len()
    }

    /// Whether `step` was aborted, and why.
    pub(crate) fn aborted(&self, step: u64) -> Option<String> {
        self.state.lock().aborted.get(&step).cloned()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn key(step: u64, microbatch: usize) -> Key {
        Key {
            step,
            stage: 1,
            direction: Direction::Forward,
            microbatch,
        }
    }

    #[test]
    fn a_value_put_before_the_take_is_there_and_taken_once() {
        let mailbox = Mailbox::default();
        assert_eq!(mailbox.put(key(1, 0), "a"), Ok(true));
        assert_eq!(mailbox.put(key(1, 0), "b"), Err(PutError::Duplicate));
        assert_eq!(
            mailbox.take(key(1, 0), Duration::ZERO, Duration::ZERO),
            Ok("a")
        );
        assert_eq!(
            mailbox.take(key(1, 0), Duration::ZERO, Duration::ZERO),
            Err(WaitError::TimedOut(Duration::ZERO))
        );
    }

    #[test]
    fn a_take_waits_for_a_value_put_by_another_thread() {
        let mailbox = Arc::new(Mailbox::default());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let taker = {
            let mailbox = mailbox.clone();
            std::thread::spawn(move || {
                ready_tx.send(()).unwrap();
                mailbox.take(key(3, 2), Duration::from_secs(60), Duration::ZERO)
            })
        };
        ready_rx.recv().unwrap();
        // Out of order: other microbatches first.
        mailbox.put(key(3, 5), 5).unwrap();
        mailbox.put(key(3, 2), 2).unwrap();
        assert_eq!(taker.join().unwrap(), Ok(2));
        assert_eq!(
            mailbox.take(key(3, 5), Duration::ZERO, Duration::ZERO),
            Ok(5)
        );
    }

    #[test]
    fn an_abort_ends_waits_and_drops_the_steps_values() {
        let mailbox = Arc::new(Mailbox::default());
        mailbox.put(key(4, 1), 1).unwrap();
        mailbox.put(key(5, 1), 9).unwrap();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let taker = {
            let mailbox = mailbox.clone();
            std::thread::spawn(move || {
                ready_tx.send(()).unwrap();
                mailbox.take(key(4, 0), Duration::from_secs(60), Duration::ZERO)
            })
        };
        ready_rx.recv().unwrap();
        mailbox.abort(4, "stage 0 failed");
        mailbox.abort(4, "a later reason");
        assert_eq!(
            taker.join().unwrap(),
            Err(WaitError::Aborted("stage 0 failed".into()))
        );
        // The aborted step's value is gone, a late one is dropped, the next
        // step's value stays.
        assert_eq!(mailbox.put(key(4, 7), 7), Ok(false));
        assert_eq!(
            mailbox.take(key(5, 1), Duration::ZERO, Duration::ZERO),
            Ok(9)
        );
        assert_eq!(mailbox.aborted(4).as_deref(), Some("stage 0 failed"));
    }

    /// Longer than any test runs: a polling wait that returns got its
    /// answer by polling, not because its time ran out.
    const LONG: Duration = Duration::from_secs(3600);

    #[test]
    fn a_polling_wait_takes_a_value_put_while_it_polls() {
        let mailbox = Arc::new(Mailbox::default());
        // Nothing there and no time to poll: nothing, at once.
        assert!(mailbox.poll_for(key(6, 0), Duration::ZERO).is_none());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let poller = {
            let mailbox = mailbox.clone();
            std::thread::spawn(move || {
                ready_tx.send(()).unwrap();
                mailbox.poll_for(key(6, 0), LONG)
            })
        };
        ready_rx.recv().unwrap();
        mailbox.put(key(6, 1), 1).unwrap();
        mailbox.put(key(6, 0), 0).unwrap();
        assert_eq!(poller.join().unwrap(), Some(Ok(0)));
        // The other microbatch's value stays for its own take, which a
        // value already there serves without polling.
        assert_eq!(mailbox.take(key(6, 1), Duration::ZERO, LONG), Ok(1));
    }

    #[test]
    fn an_abort_ends_a_polling_wait() {
        let mailbox = Arc::new(Mailbox::<u8>::default());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let taker = {
            let mailbox = mailbox.clone();
            std::thread::spawn(move || {
                ready_tx.send(()).unwrap();
                mailbox.take(key(7, 0), LONG, LONG)
            })
        };
        ready_rx.recv().unwrap();
        mailbox.abort(7, "stage 2 failed");
        assert_eq!(
            taker.join().unwrap(),
            Err(WaitError::Aborted("stage 2 failed".into()))
        );
    }

    #[test]
    fn a_polling_wait_is_cut_to_the_waits_limit() {
        let mailbox = Mailbox::<u8>::default();
        // The poll is cut to the wait's limit: zero here, so no poll at all.
        assert_eq!(
            mailbox.take(key(8, 0), Duration::ZERO, LONG),
            Err(WaitError::TimedOut(Duration::ZERO))
        );
    }

    #[test]
    fn only_recent_steps_are_remembered() {
        let mailbox: Mailbox<u8> = Mailbox::default();
        for step in 0..(KEPT_STEPS as u64 + 10) {
            mailbox.abort(step, "failed");
            mailbox.finish(step + 1000);
        }
        let state = mailbox.state.lock();
        assert_eq!(state.aborted.len(), KEPT_STEPS);
        assert_eq!(state.finished.len(), KEPT_STEPS);
        assert!(state.aborted.contains_key(&(KEPT_STEPS as u64 + 9)));
        assert!(!state.aborted.contains_key(&0));
    }

    #[test]
    fn finishing_a_step_drops_late_values() {
        let mailbox = Mailbox::default();
        mailbox.put(key(1, 0), 0).unwrap();
        assert_eq!(mailbox.finish(1), 1);
        assert_eq!(mailbox.put(key(1, 1), 1), Ok(false));
        assert_eq!(mailbox.put(key(2, 1), 1), Ok(true));
    }
}
