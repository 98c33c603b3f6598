//! Termination detection for graceful shutdown, as a pure state machine:
//! it takes this worker's counts and the records read from the store in,
//! and returns the actions to perform (write, wait for and read, delete
//! keys; wait until this worker is idle or its counts change). The I/O
//! shell is `join.rs`.
//!
//! Counts are kept per (caller, callee) pair. For each peer a worker
//! publishes the calls it sent there (a send that failed is not counted),
//! the calls it lost there (the connection failed with the call
//! outstanding: the callee may or may not have served it) and the calls
//! it served from there. The pair caller → callee is *balanced* when
//! `served + lost >= sent`. The group is done when every pair is balanced
//! and two consecutive rounds read the same counts (Mattern's
//! four-counter method, per pair). A callee serving more than its caller
//! sent (a process claiming to be a member of the group) cannot hold the
//! group up; calls from peers outside the group are refused by the agent
//! and never counted.
//!
//! A round that reads the same counts as the previous one but is not
//! balanced does not start another round at once: every worker waits
//! until its own counts change (it then writes the round's wake key) or
//! another worker's wake key appears. Every wait ends at the deadline,
//! `timeout` after the group last made progress (a round whose counts
//! differed from the previous one), with a [`Action::Fail`] naming what
//! was missing. Each worker deletes its own record two rounds back (every
//! worker has read it by then); rank 0 deletes the rest once every worker
//! has passed the final barrier.
//!
//! A worker that does not take part (killed, stopped, or silent) is
//! *absent*: the shell reports a peer whose connection closed and whose
//! address refuses a new one ([`Input::Gone`], at once), a wait for keys
//! reports ranks whose key did not come by the deadline
//! ([`Input::Missing`]). Either ends this worker's detection with
//! [`Failure::Absent`] naming them, and the group learns it through the
//! store: the worker writes the abort record (`phase/abort`: the absent
//! ranks and who found them) that every other worker's waits watch
//! ([`Input::Aborted`]), and every worker that gives up writes
//! `phase/over/{rank}`. Rank 0, which hosts the store, waits (at most
//! `timeout` more) for the `over` key of every worker that is not absent
//! before it fails, so that the others read the verdict before the store
//! goes away.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// One worker's counts, indexed by the peer's rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Counts {
    /// Calls sent to each peer (requests and service messages).
    pub(crate) sent: Vec<u64>,
    /// Calls to each peer that failed with their connection.
    pub(crate) lost: Vec<u64>,
    /// Calls from each peer that this worker finished serving.
    pub(crate) served: Vec<u64>,
}

impl Counts {
    /// All zero, for a group of `n`.
    pub(crate) fn zero(n: usize) -> Counts {
        Counts {
            sent: vec![0; n],
            lost: vec![0; n],
            served: vec![0; n],
        }
    }

    /// The store record: `rank:sent/lost/served` for each peer with a
    /// count that is not zero, by rank, `;`-separated (a worker that
    /// talks to few peers writes a short record, whatever the group's size).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut s = String::new();
        for p in 0..self.sent.len() {
            if self.sent[p] == 0 && self.lost[p] == 0 && self.served[p] == 0 {
                continue;
            }
            if !s.is_empty() {
                s.push(';');
            }
            let _ = write!(
                s,
                "{p}:{}/{}/{}",
                self.sent[p], self.lost[p], self.served[p]
            );
        }
        s.into_bytes()
    }

    /// Parses a record for a group of `n`: ranks below `n`, increasing,
    /// three counts each, no more lost than sent.
    pub(crate) fn decode(bytes: &[u8], n: usize) -> Option<Counts> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut counts = Counts::zero(n);
        if text.is_empty() {
            return Some(counts);
        }
        let mut next = 0usize;
        for entry in text.split(';') {
            let (rank, fields) = entry.split_once(':')?;
            let p: usize = rank.parse().ok()?;
            if p < next || p >= n {
                return None;
            }
            next = p + 1;
            let mut fields = fields.split('/');
            counts.sent[p] = fields.next()?.parse().ok()?;
            counts.lost[p] = fields.next()?.parse().ok()?;
            counts.served[p] = fields.next()?.parse().ok()?;
            if fields.next().is_some() || counts.lost[p] > counts.sent[p] {
                return None;
            }
        }
        Some(counts)
    }
}

/// What the shell tells the machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Input {
    /// [`Action::WaitIdle`] ended: no call is outstanding here; these are
    /// this worker's counts now.
    Idle(Counts),
    /// [`Action::WaitIdle`] reached its deadline with `active` calls
    /// still outstanding here.
    Busy {
        /// Calls outstanding.
        active: u64,
    },
    /// [`Action::Collect`] ended: the value of every key, in order.
    Records(Vec<Vec<u8>>),
    /// [`Action::Collect`] reached its deadline; the ranks whose key was
    /// still missing.
    Missing(Vec<u32>),
    /// [`Action::AwaitChange`] ended: `own` if this worker's counts
    /// changed, else the wake key appeared.
    Changed {
        /// Whether it was this worker's own counts.
        own: bool,
    },
    /// [`Action::AwaitChange`] reached its deadline.
    Quiet,
    /// A store operation failed.
    StoreFailed(String),
    /// These peers are gone: their connection with this worker closed and
    /// a new one was refused, so they will write no key again, and they
    /// did not give up on their own (no `over` key; that one's own error
    /// explains it, and the others' deadlines end their waits). During an
    /// [`Action::Collect`] only the ranks among its `ranks` whose key is
    /// missing. Not reported while an abort record this worker was not
    /// told of exists: [`Input::Aborted`] then.
    Gone(Vec<u32>),
    /// The abort record (`phase/abort`) appeared or changed: another
    /// worker gave up on the group. Reported once per value.
    Aborted(Vec<u8>),
}

/// How workers were found absent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum How {
    /// Their connection closed and a new one was refused.
    Gone,
    /// Their key did not appear within the timeout.
    Silent {
        /// The timeout.
        after: Duration,
    },
    /// Worker `by` found them absent and wrote the abort record.
    Reported {
        /// Its rank.
        by: u32,
    },
}

/// Why the detection failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// These workers did not take part.
    Absent {
        /// Their ranks, increasing.
        ranks: Vec<u32>,
        /// How that was found.
        how: How,
    },
    /// Anything else (the text of [`crate::RpcError::Join`]).
    Other(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Absent { ranks, how } => write!(f, "ranks {ranks:?} absent ({how:?})"),
            Failure::Other(why) => f.write_str(why),
        }
    }
}

/// The abort record: `by:r,r,...` (the ranks increasing, none, or some).
pub(crate) fn encode_abort(by: u32, ranks: &[u32]) -> Vec<u8> {
    let list: Vec<String> = ranks.iter().map(u32::to_string).collect();
    format!("{by}:{}", list.join(",")).into_bytes()
}

/// Parses an abort record for a group of `n`: who wrote it, and the ranks
/// it names (below `n`, increasing, at least one).
pub(crate) fn decode_abort(bytes: &[u8], n: usize) -> Option<(u32, Vec<u32>)> {
    let text = std::str::from_utf8(bytes).ok()?;
    let (by, list) = text.split_once(':')?;
    let by: u32 = by.parse().ok()?;
    if by as usize >= n {
        return None;
    }
    let mut ranks = Vec::new();
    for r in list.split(',') {
        let r: u32 = r.parse().ok()?;
        if r as usize >= n || ranks.last().is_some_and(|&l| l >= r) {
            return None;
        }
        ranks.push(r);
    }
    Some((by, ranks))
}

/// What the machine asks the shell to do, in order. A batch ends with
/// one wait (whose outcome is the next [`Input`]), [`Action::Done`] or
/// [`Action::Fail`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    /// Delete these keys (a missing key is not an error).
    Delete(Vec<String>),
    /// Write `value` under `key`.
    Set {
        /// The key.
        key: String,
        /// The value.
        value: Vec<u8>,
    },
    /// Write `value` under `key` unless the key exists (the first
    /// verdict stays).
    SetOnce {
        /// The key.
        key: String,
        /// The value.
        value: Vec<u8>,
    },
    /// Wait until this worker has no call outstanding, at most until
    /// `deadline`; then [`Input::Idle`] or [`Input::Busy`].
    WaitIdle {
        /// The deadline.
        deadline: Instant,
    },
    /// Wait until every key exists, at most until `deadline`, and read
    /// them; then [`Input::Records`] or [`Input::Missing`]. Key `keys[i]`
    /// is written by rank `ranks[i]`.
    Collect {
        /// The keys.
        keys: Vec<String>,
        /// Who writes each key.
        ranks: Vec<u32>,
        /// The deadline.
        deadline: Instant,
    },
    /// Wait until this worker's counts differ from `since` or `wake`
    /// exists, at most until `deadline`; then [`Input::Changed`] or
    /// [`Input::Quiet`].
    AwaitChange {
        /// This worker's counts as published.
        since: Counts,
        /// The key another worker writes when its counts change.
        wake: String,
        /// The deadline.
        deadline: Instant,
    },
    /// The group is done.
    Done,
    /// Shutdown failed.
    Fail(Failure),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Waiting {
    Idle,
    Round,
    Change,
    Exit,
    /// Given up: writing the verdict, and on rank 0 waiting for these
    /// workers' `over` keys; then this failure.
    Leaving(Failure, Vec<u32>),
    Over,
}

/// One termination detection over the keys under `phase/`.
#[derive(Debug)]
pub(crate) struct Termination {
    phase: String,
    rank: u32,
    names: Vec<String>,
    timeout: Duration,
    deadline: Instant,
    round: u64,
    previous: Option<Vec<Counts>>,
    mine: Option<Counts>,
    waiting: Waiting,
}

impl Termination {
    /// A detection for worker `rank` of the group `names`, under `phase/`;
    /// it fails once the group has made no progress for `timeout`.
    pub(crate) fn new(phase: &str, rank: u32, names: Vec<String>, timeout: Duration) -> Self {
        Termination {
            phase: phase.to_string(),
            rank,
            names,
            timeout,
            deadline: Instant::now(),
            round: 0,
            previous: None,
            mine: None,
            waiting: Waiting::Over,
        }
    }

    /// The first actions.
    pub(crate) fn start(&mut self, now: Instant) -> Vec<Action> {
        self.deadline = now + self.timeout;
        self.waiting = Waiting::Idle;
        vec![Action::WaitIdle {
            deadline: self.deadline,
        }]
    }

    /// The round this worker is in.
    pub(crate) fn round(&self) -> u64 {
        self.round
    }

    fn key(&self, round: u64, rank: u32) -> String {
        format!("{}/{round}/{rank}", self.phase)
    }

    fn wake_key(&self, round: u64) -> String {
        format!("{}/wake/{round}", self.phase)
    }

    fn exit_key(&self, rank: u32) -> String {
        format!("{}/exit/{rank}", self.phase)
    }

    /// The key every worker's waits watch: written by a worker that found
    /// others absent.
    pub(crate) fn abort_key(&self) -> String {
        format!("{}/abort", self.phase)
    }

    /// The key a worker that gave up writes before it stops.
    pub(crate) fn over_key(&self, rank: u32) -> String {
        format!("{}/over/{rank}", self.phase)
    }

    fn all(&self, key: impl Fn(u32) -> String) -> Vec<String> {
        (0..self.names.len() as u32).map(key).collect()
    }

    fn all_ranks(&self) -> Vec<u32> {
        (0..self.names.len() as u32).collect()
    }

    /// A failure that the store itself caused (nothing more is written).
    fn fail(&mut self, why: String) -> Vec<Action> {
        self.waiting = Waiting::Over;
        vec![Action::Fail(Failure::Other(why))]
    }

    /// Gives up on the group with `failure`: writes the abort record when
    /// workers are absent (unless it came from one), then this worker's
    /// `over` key; rank 0 then waits, at most `timeout`, for the `over`
    /// key of every worker that is neither absent nor (when `others_wait`
    /// is false: they passed the final barrier) done.
    fn give_up(&mut self, now: Instant, failure: Failure, others_wait: bool) -> Vec<Action> {
        tracing::debug!(phase = %self.phase, round = self.round, %failure, "giving up on shutdown");
        let mut actions = Vec::new();
        let mut absent: &[u32] = &[];
        if let Failure::Absent { ranks, how } = &failure {
            absent = ranks;
            if !matches!(how, How::Reported { .. }) {
                actions.push(Action::SetOnce {
                    key: self.abort_key(),
                    value: encode_abort(self.rank, ranks),
                });
            }
        }
        if self.rank != 0 {
            actions.push(Action::Set {
                key: self.over_key(self.rank),
                value: Vec::new(),
            });
        }
        let ranks: Vec<u32> = (1..self.names.len() as u32)
            .filter(|r| others_wait && self.rank == 0 && !absent.contains(r))
            .collect();
        self.deadline = now + self.timeout;
        actions.extend(self.leave(failure, ranks));
        actions
    }

    /// The wait for the `over` keys of `ranks` (rank 0), or the failure.
    fn leave(&mut self, failure: Failure, ranks: Vec<u32>) -> Vec<Action> {
        if ranks.is_empty() {
            // A failed write of the verdict ends with this failure too.
            self.waiting = Waiting::Leaving(failure.clone(), ranks);
            return vec![Action::Fail(failure)];
        }
        let action = Action::Collect {
            keys: ranks.iter().map(|&r| self.over_key(r)).collect(),
            ranks: ranks.clone(),
            deadline: self.deadline,
        };
        self.waiting = Waiting::Leaving(failure, ranks);
        vec![action]
    }

    /// The next actions after `input`, at `now`.
    pub(crate) fn step(&mut self, now: Instant, input: Input) -> Vec<Action> {
        let n = self.names.len();
        let waiting = std::mem::replace(&mut self.waiting, Waiting::Over);
        match (waiting, input) {
            (Waiting::Over, _) => Vec::new(),
            (Waiting::Leaving(failure, mut ranks), Input::Gone(gone)) if !ranks.is_empty() => {
                // Rank 0 waits no longer for the `over` keys of the gone.
                ranks.retain(|r| !gone.contains(r));
                self.leave(failure, ranks)
            }
            (Waiting::Leaving(failure, ranks), Input::Aborted(_)) if !ranks.is_empty() => {
                // Another worker's verdict: rank 0 still waits for the rest.
                self.leave(failure, ranks)
            }
            (Waiting::Leaving(failure, _), _) => vec![Action::Fail(failure)],
            (_, Input::StoreFailed(e)) => self.fail(e),
            (waiting, Input::Gone(ranks)) => {
                let others_wait = waiting != Waiting::Exit;
                let failure = Failure::Absent {
                    ranks: sorted(ranks),
                    how: How::Gone,
                };
                self.give_up(now, failure, others_wait)
            }
            (waiting, Input::Aborted(record)) => match decode_abort(&record, n) {
                Some((by, ranks)) => {
                    let others_wait = waiting != Waiting::Exit;
                    let failure = Failure::Absent {
                        ranks,
                        how: How::Reported { by },
                    };
                    self.give_up(now, failure, others_wait)
                }
                None => {
                    let why = format!("corrupt shutdown record {}", self.abort_key());
                    self.give_up(now, Failure::Other(why), true)
                }
            },
            (Waiting::Idle, Input::Idle(counts)) => self.publish(counts),
            (Waiting::Idle, Input::Busy { active }) => {
                let why = format!(
                    "{active} calls still outstanding on this worker after {:?} of shutdown round {} without progress",
                    self.timeout, self.round
                );
                self.give_up(now, Failure::Other(why), true)
            }
            (Waiting::Round, Input::Records(records)) => self.on_records(now, records),
            (Waiting::Round, Input::Missing(ranks)) => {
                tracing::debug!(
                    workers = ?self.missing_names(&ranks),
                    round = self.round,
                    "workers did not reach the shutdown round"
                );
                let failure = Failure::Absent {
                    ranks: sorted(ranks),
                    how: How::Silent {
                        after: self.timeout,
                    },
                };
                self.give_up(now, failure, true)
            }
            (Waiting::Change, Input::Changed { own }) => {
                self.waiting = Waiting::Idle;
                let mut actions = Vec::new();
                if own {
                    actions.push(Action::Set {
                        key: self.wake_key(self.round),
                        value: Vec::new(),
                    });
                }
                actions.push(Action::WaitIdle {
                    deadline: self.deadline,
                });
                actions
            }
            (Waiting::Change, Input::Quiet) => {
                let why = self.unbalanced();
                self.give_up(now, Failure::Other(why), true)
            }
            (Waiting::Exit, Input::Records(_)) => {
                // Every worker has read the last rounds: rank 0 removes them.
                let last = self.round;
                let mut keys = self.all(|r| self.key(last, r));
                if last > 0 {
                    keys.extend(self.all(|r| self.key(last - 1, r)));
                }
                keys.push(self.wake_key(last));
                keys.push(self.wake_key(last + 1));
                keys.extend(self.all(|r| self.exit_key(r)));
                vec![Action::Delete(keys), Action::Done]
            }
            (Waiting::Exit, Input::Missing(ranks)) => {
                // The others passed the final barrier and are done.
                let failure = Failure::Absent {
                    ranks: sorted(ranks),
                    how: How::Silent {
                        after: self.timeout,
                    },
                };
                self.give_up(now, failure, false)
            }
            (waiting, input) => {
                let why =
                    format!("shutdown protocol error: {input:?} while waiting for {waiting:?}");
                self.fail(why)
            }
        }
    }

    fn missing_names(&self, ranks: &[u32]) -> Vec<&str> {
        ranks
            .iter()
            .filter_map(|r| self.names.get(*r as usize).map(String::as_str))
            .collect()
    }

    fn publish(&mut self, counts: Counts) -> Vec<Action> {
        let r = self.round;
        let mut actions = Vec::new();
        // Every worker has read round r - 2 (it wrote round r - 1 after),
        // and has passed round r - 1's wake key.
        let mut old = Vec::new();
        if r >= 2 {
            old.push(self.key(r - 2, self.rank));
        }
        if r >= 1 && self.rank == 0 {
            old.push(self.wake_key(r - 1));
        }
        if !old.is_empty() {
            actions.push(Action::Delete(old));
        }
        actions.push(Action::Set {
            key: self.key(r, self.rank),
            value: counts.encode(),
        });
        actions.push(Action::Collect {
            keys: self.all(|k| self.key(r, k)),
            ranks: self.all_ranks(),
            deadline: self.deadline,
        });
        self.mine = Some(counts);
        self.waiting = Waiting::Round;
        actions
    }

    fn on_records(&mut self, now: Instant, records: Vec<Vec<u8>>) -> Vec<Action> {
        let n = self.names.len();
        let mut matrix = Vec::with_capacity(n);
        for (r, v) in records.iter().enumerate() {
            match Counts::decode(v, n) {
                Some(c) if r < n => matrix.push(c),
                _ => {
                    let why = format!("corrupt shutdown record {}", self.key(self.round, r as u32));
                    return self.give_up(now, Failure::Other(why), true);
                }
            }
        }
        if matrix.len() != n {
            let why = format!("{} shutdown records for {n} workers", matrix.len());
            return self.give_up(now, Failure::Other(why), true);
        }
        let stable = self.previous.as_ref() == Some(&matrix);
        if stable && balanced(&matrix) {
            self.waiting = Waiting::Exit;
            let mut actions = vec![Action::Set {
                key: self.exit_key(self.rank),
                value: Vec::new(),
            }];
            if self.rank == 0 {
                // Rank 0 hosts the store: it stops last.
                actions.push(Action::Collect {
                    keys: self.all(|r| self.exit_key(r)),
                    ranks: self.all_ranks(),
                    deadline: now + self.timeout,
                });
            } else {
                self.waiting = Waiting::Over;
                actions.push(Action::Done);
            }
            return actions;
        }
        self.round += 1;
        if stable {
            // Nothing moved and something is missing: wait for a change.
            self.waiting = Waiting::Change;
            return vec![Action::AwaitChange {
                since: self.mine.clone().unwrap_or_else(|| Counts::zero(n)),
                wake: self.wake_key(self.round),
                deadline: self.deadline,
            }];
        }
        self.deadline = now + self.timeout;
        self.previous = Some(matrix);
        self.waiting = Waiting::Idle;
        vec![Action::WaitIdle {
            deadline: self.deadline,
        }]
    }

    /// The pairs that are not balanced, for the error.
    fn unbalanced(&self) -> String {
        let mut pairs = Vec::new();
        if let Some(m) = &self.previous {
            for (caller, c) in m.iter().enumerate() {
                for (callee, callee_counts) in m.iter().enumerate() {
                    let served = callee_counts.served[caller];
                    if served.saturating_add(c.lost[callee]) < c.sent[callee] {
                        pairs.push(format!(
                            "{:?} sent {} calls to {:?} ({} lost with their connection), which served {}",
                            self.names[caller],
                            c.sent[callee],
                            self.names[callee],
                            c.lost[callee],
                            served
                        ));
                    }
                }
            }
        }
        format!(
            "calls never served after {:?} without progress: {}",
            self.timeout,
            pairs.join("; ")
        )
    }
}

/// `ranks` increasing, each once.
fn sorted(mut ranks: Vec<u32>) -> Vec<u32> {
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// Whether every pair caller → callee has `served + lost >= sent`.
fn balanced(matrix: &[Counts]) -> bool {
    matrix.iter().enumerate().all(|(caller, c)| {
        matrix
            .iter()
            .enumerate()
            .all(|(callee, d)| d.served[caller].saturating_add(c.lost[callee]) >= c.sent[callee])
    })
}

#[cfg(test)]
#[path = "termination_tests.rs"]
mod tests;
