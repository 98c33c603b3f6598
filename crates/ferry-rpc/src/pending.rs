//! The table of calls awaiting their replies, as a pure state machine: it
//! takes `now` and events in (a call issued, a reply read, a connection
//! failed, the timer fired) and returns what became of each call (it
//! completes: [`Replied`]; it fails: [`Failed`]) or of each reply. No clock, no tasks, no locks: the agent's calls shell
//! (`calls.rs`) keeps it under a lock, completes the callers' slots and
//! runs the timer task that [`PendingCalls::timer`] asks for.
//!
//! - **Matching.** A reply completes a call only if it came from the
//!   call's callee, on the connection the request went out on: request ids
//!   are guessable, so an id alone proves nothing. Any other reply is
//!   dropped with a reason ([`Dropped`]) the shell logs.
//! - **Deadlines.** A call with a timeout ends at its deadline, whichever
//!   comes first: [`tick`](PendingCalls::tick) at or after it, or its reply
//!   read at or after it (the outcome does not depend on when the timer
//!   task runs).
//! - **Exactly once.** Every call leaves the table once, with one outcome;
//!   anything about it afterwards (a duplicated or late reply) is dropped.
//! - **Ids.** Request ids count up from 1, wrap past `u64::MAX` back to 1,
//!   and skip ids still in use: no two calls in the table share an id.

use std::collections::hash_map::Entry;
use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// A call in the table. `T` is what the shell completes (the caller's slot).
#[derive(Debug)]
pub(crate) struct Call<T> {
    /// The request id.
    pub(crate) id: u64,
    /// The caller's slot.
    pub(crate) slot: T,
    /// The callee: only its reply completes the call.
    pub(crate) to: u32,
    /// The connection the request went out on: only a reply on it
    /// completes the call.
    pub(crate) conn: u64,
    /// The function (or service) called, for errors.
    pub(crate) function: String,
    /// The call's timeout (`None`: it waits as long as its connection lives).
    pub(crate) timeout: Option<Duration>,
    deadline: Option<Instant>,
}

/// What [`PendingCalls::issue`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Issued {
    /// The call's request id.
    pub(crate) id: u64,
    /// The call's deadline is earlier than the one the timer waits for:
    /// wake the timer so that it waits for [`PendingCalls::timer`].
    pub(crate) wake_timer: bool,
}

/// How a call ended without its reply.
#[derive(Debug)]
pub(crate) enum Failed<T> {
    /// The call's deadline passed before its reply came.
    TimedOut(Call<T>),
    /// The call's connection failed while it waited (the callee may or may
    /// not have served it).
    Unreachable {
        /// The call.
        call: Call<T>,
        /// Why the connection failed.
        reason: String,
    },
}

/// What a reply did.
#[derive(Debug)]
pub(crate) enum Replied<T> {
    /// It answers this call: complete the call with it.
    Complete(Call<T>),
    /// It was read at or after its call's deadline: the call timed out.
    Late(Failed<T>),
    /// It answers no call: dropped.
    Dropped(Dropped),
}

/// Why a reply was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dropped {
    /// No call waits for this id: it was answered already, timed out,
    /// failed with its connection, or never was (harmless: debug only).
    NoCall,
    /// A call with this id waits, but for a reply from `callee` on another
    /// connection: someone else's frame (a forged reply is one; the shell
    /// warns, rate-limited).
    Foreign {
        /// The callee of the waiting call.
        callee: u32,
    },
}

/// The pending-call table.
#[derive(Debug)]
pub(crate) struct PendingCalls<T> {
    calls: HashMap<u64, Call<T>>,
    /// Calls with a deadline, earliest first.
    deadlines: BTreeSet<(Instant, u64)>,
    next_id: u64,
    /// When the timer wakes next (`None`: it waits to be woken). A new
    /// deadline wakes it only if earlier; a tick re-arms it for the
    /// earliest deadline left. A call that completes leaves it armed for
    /// its old deadline (the tick then finds nothing to expire), so
    /// back-to-back calls do not wake it at all.
    timer: Option<Instant>,
}

impl<T> Default for PendingCalls<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> PendingCalls<T> {
    /// An empty table; the first call gets id 1.
    pub(crate) fn new() -> Self {
        Self::starting_at(1)
    }

    /// An empty table whose first call gets `id` (or the next one that is
    /// not 0).
    pub(crate) fn starting_at(id: u64) -> Self {
        Self {
            calls: HashMap::new(),
            deadlines: BTreeSet::new(),
            next_id: id,
            timer: None,
        }
    }

    /// Enters a call to `to` whose request goes out on connection `conn`
    /// at `now`, ending after `timeout` (zero: no timeout).
    pub(crate) fn issue(
        &mut self,
        now: Instant,
        to: u32,
        conn: u64,
        function: &str,
        timeout: Duration,
        slot: T,
    ) -> Issued {
        let (timeout, deadline) = if timeout.is_zero() {
            (None, None)
        } else {
            (Some(timeout), now.checked_add(timeout))
        };
        let id = loop {
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1);
            if id == 0 {
                continue;
            }
            if let Entry::Vacant(entry) = self.calls.entry(id) {
                entry.insert(Call {
                    id,
                    slot,
                    to,
                    conn,
                    function: function.to_string(),
                    timeout,
                    deadline,
                });
                break id;
            }
        };
        let mut wake_timer = false;
        if let Some(at) = deadline {
            self.deadlines.insert((at, id));
            if self.timer.is_none_or(|armed| at < armed) {
                self.timer = Some(at);
                wake_timer = true;
            }
        }
        Issued { id, wake_timer }
    }

    /// A reply with request id `id` was read at `now` from worker `from`
    /// on connection `conn`.
    pub(crate) fn reply(&mut self, now: Instant, conn: u64, from: u32, id: u64) -> Replied<T> {
        let Some(call) = self.calls.get(&id) else {
            return Replied::Dropped(Dropped::NoCall);
        };
        if call.conn != conn || call.to != from {
            return Replied::Dropped(Dropped::Foreign { callee: call.to });
        }
        match self.remove(id) {
            Some(call) if call.deadline.is_some_and(|at| at <= now) => {
                Replied::Late(Failed::TimedOut(call))
            }
            Some(call) => Replied::Complete(call),
            None => Replied::Dropped(Dropped::NoCall),
        }
    }

    /// Connection `conn` failed: every call whose request went out on it
    /// ends [`Unreachable`](Failed::Unreachable).
    pub(crate) fn connection_failed(&mut self, conn: u64, reason: &str) -> Vec<Failed<T>> {
        let ids: Vec<u64> = self
            .calls
            .values()
            .filter(|c| c.conn == conn)
            .map(|c| c.id)
            .collect();
        ids.into_iter()
            .filter_map(|id| self.remove(id))
            .map(|call| Failed::Unreachable {
                call,
                reason: reason.to_string(),
            })
            .collect()
    }

    /// The timer fired at `now`: every call whose deadline is at or before
    /// it ends [`TimedOut`](Failed::TimedOut), earliest first, and the
    /// timer is armed for the earliest deadline left.
    pub(crate) fn tick(&mut self, now: Instant) -> Vec<Failed<T>> {
        let mut expired = Vec::new();
        while let Some(&(at, id)) = self.deadlines.first() {
            if at > now {
                break;
            }
            self.deadlines.pop_first();
            if let Some(call) = self.calls.remove(&id) {
                expired.push(Failed::TimedOut(call));
            }
        }
        self.timer = self.deadlines.first().map(|&(at, _)| at);
        expired
    }

    /// When the timer should fire next (`None`: not until a call with a
    /// timeout is issued).
    pub(crate) fn timer(&self) -> Option<Instant> {
        self.timer
    }

    /// Takes call `id` out of the table without an outcome: its request
    /// was never sent (the shell fails it with the reason it knows).
    pub(crate) fn cancel(&mut self, id: u64) -> Option<Call<T>> {
        self.remove(id)
    }

    /// Empties the table (the agent stops); the calls, in no order.
    pub(crate) fn drain(&mut self) -> Vec<Call<T>> {
        self.deadlines.clear();
        self.timer = None;
        self.calls.drain().map(|(_, c)| c).collect()
    }

    /// How many calls wait.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.calls.len()
    }

    fn remove(&mut self, id: u64) -> Option<Call<T>> {
        let call = self.calls.remove(&id)?;
        if let Some(at) = call.deadline {
            self.deadlines.remove(&(at, id));
        }
        Some(call)
    }
}

#[cfg(test)]
#[path = "pending_tests.rs"]
mod tests;
