//! Deterministic tests of the termination detection: a simulated group of
//! workers and store, run in many interleavings, with calls that are
//! served late, lost with their connection, never delivered, refused at
//! send, or come from outside the group.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::{Action, Counts, Input, Termination};

const TIMEOUT: Duration = Duration::from_secs(20);

struct Worker {
    machine: Termination,
    counts: Counts,
    active: u64,
    queue: Vec<Action>,
    result: Option<Result<(), String>>,
    /// Round records this worker wrote.
    rounds: u64,
}

/// A group of `n` simulated workers and their store. Time moves only when
/// no worker can go on, to the earliest deadline.
struct Sim {
    now: Instant,
    store: BTreeMap<String, Vec<u8>>,
    workers: Vec<Worker>,
    rng: u64,
    /// Most keys the store held at once.
    peak_keys: usize,
}

impl Sim {
    fn new(n: usize, seed: u64) -> Sim {
        let now = Instant::now();
        let names: Vec<String> = (0..n).map(|r| format!("worker{r}")).collect();
        let workers = (0..n)
            .map(|r| {
                let mut machine = Termination::new("join", r as u32, names.clone(), TIMEOUT);
                let queue = machine.start(now);
                Worker {
                    machine,
                    counts: Counts::zero(n),
                    active: 0,
                    queue,
                    result: None,
                    rounds: 0,
                }
            })
            .collect();
        Sim {
            now,
            store: BTreeMap::new(),
            workers,
            rng: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            peak_keys: 0,
        }
    }

    fn random(&mut self, below: usize) -> usize {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % below as u64) as usize
    }

    /// Runs the worker's non-waiting actions; returns the input its wait
    /// yields now, if it yields one.
    fn try_step(&mut self, w: usize) -> bool {
        let n = self.workers.len();
        loop {
            if self.workers[w].result.is_some() {
                return false;
            }
            let Some(action) = self.workers[w].queue.first().cloned() else {
                return false;
            };
            let input = match action {
                Action::Delete(keys) => {
                    for k in keys {
                        self.store.remove(&k);
                    }
                    None
                }
                Action::Set { key, value } => {
                    if key.split('/').count() == 3 && !key.contains("wake") && !key.contains("exit")
                    {
                        self.workers[w].rounds += 1;
                    }
                    self.store.insert(key, value);
                    self.peak_keys = self.peak_keys.max(self.store.len());
                    None
                }
                Action::Done => {
                    self.workers[w].result = Some(Ok(()));
                    return true;
                }
                Action::Fail(why) => {
                    self.workers[w].result = Some(Err(why));
                    return true;
                }
                Action::WaitIdle { .. } => {
                    if self.workers[w].active != 0 {
                        return false;
                    }
                    Some(Input::Idle(self.workers[w].counts.clone()))
                }
                Action::Collect { keys, .. } => {
                    if !keys.iter().all(|k| self.store.contains_key(k)) {
                        return false;
                    }
                    Some(Input::Records(
                        keys.iter().map(|k| self.store[k].clone()).collect(),
                    ))
                }
                Action::AwaitChange { since, wake, .. } => {
                    if self.workers[w].counts != since {
                        Some(Input::Changed { own: true })
                    } else if self.store.contains_key(&wake) {
                        Some(Input::Changed { own: false })
                    } else {
                        return false;
                    }
                }
            };
            self.workers[w].queue.remove(0);
            if let Some(input) = input {
                let now = self.now;
                let next = self.workers[w].machine.step(now, input);
                assert!(!next.is_empty() || n == 0);
                self.workers[w].queue = next;
                return true;
            }
        }
    }

    /// Moves time to the earliest deadline a worker waits for and expires it.
    fn expire(&mut self) -> bool {
        let deadline = |a: &Action| match a {
            Action::WaitIdle { deadline }
            | Action::Collect { deadline, .. }
            | Action::AwaitChange { deadline, .. } => Some(*deadline),
            _ => None,
        };
        let Some((w, at)) = self
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.result.is_none())
            .filter_map(|(i, w)| w.queue.first().and_then(deadline).map(|d| (i, d)))
            .min_by_key(|(_, d)| *d)
        else {
            return false;
        };
        self.now = self.now.max(at);
        let action = self.workers[w].queue.remove(0);
        let input = match action {
            Action::WaitIdle { .. } => Input::Busy {
                active: self.workers[w].active,
            },
            Action::Collect { keys, .. } => Input::Missing(
                keys.iter()
                    .enumerate()
                    .filter(|(_, k)| !self.store.contains_key(*k))
                    .map(|(r, _)| r as u32)
                    .collect(),
            ),
            _ => Input::Quiet,
        };
        let now = self.now;
        self.workers[w].queue = self.workers[w].machine.step(now, input);
        true
    }

    /// Runs until every worker has a result. `on_stall` may change the
    /// world when no worker can go on (return true if it did).
    fn run(&mut self, mut on_stall: impl FnMut(&mut Sim) -> bool) {
        for _ in 0..100_000 {
            if self.workers.iter().all(|w| w.result.is_some()) {
                return;
            }
            let ready: Vec<usize> = (0..self.workers.len()).collect();
            let start = self.random(ready.len());
            let progressed = (0..ready.len()).any(|i| self.try_step((start + i) % ready.len()));
            if !progressed && !on_stall(self) && !self.expire() {
                panic!("the simulation is stuck");
            }
        }
        panic!("the simulation did not end");
    }

    fn results(&self) -> Vec<Result<(), String>> {
        self.workers
            .iter()
            .map(|w| w.result.clone().unwrap())
            .collect()
    }

    fn all_done(&self) -> bool {
        self.results().iter().all(Result::is_ok)
    }
}

const SEEDS: u64 = 64;

#[test]
fn an_idle_group_is_done_in_two_rounds_and_leaves_no_keys() {
    for seed in 0..SEEDS {
        let mut sim = Sim::new(4, seed);
        sim.run(|_| false);
        assert!(sim.all_done(), "{:?}", sim.results());
        assert!(sim.workers.iter().all(|w| w.rounds == 2));
        assert!(sim.store.is_empty(), "{:?}", sim.store.keys());
    }
}

#[test]
fn served_calls_balance_and_a_send_that_failed_is_not_counted() {
    for seed in 0..SEEDS {
        let mut sim = Sim::new(3, seed);
        // 0 sent 5 calls to 1, all served; a sixth failed to send and was
        // not counted; 2 called itself.
        sim.workers[0].counts.sent[1] = 5;
        sim.workers[1].counts.served[0] = 5;
        sim.workers[2].counts.sent[2] = 1;
        sim.workers[2].counts.served[2] = 1;
        sim.run(|_| false);
        assert!(sim.all_done(), "{:?}", sim.results());
    }
}

#[test]
fn a_call_lost_with_its_connection_does_not_hold_the_group() {
    for seed in 0..SEEDS {
        let mut sim = Sim::new(3, seed);
        sim.workers[0].counts.sent[2] = 2;
        sim.workers[0].counts.lost[2] = 1;
        sim.workers[2].counts.served[0] = 1;
        sim.run(|_| false);
        assert!(sim.all_done(), "{:?}", sim.results());
        // Also when the lost call had been served after all.
        let mut sim = Sim::new(3, seed);
        sim.workers[0].counts.sent[2] = 2;
        sim.workers[0].counts.lost[2] = 1;
        sim.workers[2].counts.served[0] = 2;
        sim.run(|_| false);
        assert!(sim.all_done(), "{:?}", sim.results());
    }
}

#[test]
fn calls_from_a_stranger_claiming_a_rank_do_not_hold_the_group() {
    for seed in 0..SEEDS {
        let mut sim = Sim::new(3, seed);
        // Worker 1 served 3 calls "from worker 0" that worker 0 never sent.
        sim.workers[0].counts.sent[1] = 1;
        sim.workers[1].counts.served[0] = 4;
        sim.run(|_| false);
        assert!(sim.all_done(), "{:?}", sim.results());
        assert!(sim.workers.iter().all(|w| w.rounds == 2));
    }
}

#[test]
fn a_call_that_never_arrives_fails_with_join_after_the_timeout_without_spinning() {
    for seed in 0..SEEDS {
        let mut sim = Sim::new(3, seed);
        // 0's call to 1 timed out at 0 and never reaches 1.
        sim.workers[0].counts.sent[1] = 1;
        let start = sim.now;
        sim.run(|_| false);
        for r in sim.results() {
            let e = r.unwrap_err();
            assert!(e.starts_with("calls never served"), "{e}");
            assert!(
                e.contains("\"worker0\" sent 1 calls to \"worker1\" (0 lost with their connection), which served 0"),
                "{e}"
            );
        }
        assert!(sim.now.duration_since(start) <= TIMEOUT);
        // Two rounds to see it is stable, then each worker waits for a
        // change instead of starting rounds.
        assert!(sim.workers.iter().all(|w| w.rounds == 2));
        // Nothing older than the last two rounds is left.
        assert!(sim.peak_keys <= 2 * 3 + 1, "{}", sim.peak_keys);
    }
}

#[test]
fn a_call_served_late_wakes_the_group_which_then_finishes() {
    for seed in 0..SEEDS {
        let mut sim = Sim::new(4, seed);
        sim.workers[3].counts.sent[2] = 1;
        let mut delivered = false;
        sim.run(|sim| {
            // Once everyone waits for a change, the late call is served
            // (and it makes a nested call, answered at once).
            let waiting = sim
                .workers
                .iter()
                .all(|w| matches!(w.queue.first(), Some(Action::AwaitChange { .. })));
            if delivered || !waiting {
                return false;
            }
            delivered = true;
            let callee = &mut sim.workers[2].counts;
            callee.served[3] += 1;
            callee.sent[0] += 1;
            sim.workers[0].counts.served[2] += 1;
            true
        });
        assert!(delivered);
        assert!(sim.all_done(), "{:?}", sim.results());
        assert!(sim.store.is_empty(), "{:?}", sim.store.keys());
    }
}

#[test]
fn a_long_run_of_rounds_keeps_the_store_small() {
    for seed in 0..8 {
        let mut sim = Sim::new(3, seed);
        let mut steps = 0;
        sim.run(|sim| {
            // A chain of 200 calls 0 -> 1 -> 2 -> 0 ..., one hop per stall.
            if steps == 200 {
                return false;
            }
            let from = steps % 3;
            let to = (from + 1) % 3;
            sim.workers[from].counts.sent[to] += 1;
            sim.workers[to].counts.served[from] += 1;
            steps += 1;
            true
        });
        assert!(sim.all_done(), "{:?}", sim.results());
        assert!(sim.peak_keys <= 2 * 3 + 3 + 1, "{}", sim.peak_keys);
        assert!(sim.store.is_empty(), "{:?}", sim.store.keys());
    }
}

#[test]
fn a_worker_that_never_arrives_is_named() {
    let mut sim = Sim::new(3, 1);
    sim.workers[2].result = Some(Err("absent".into()));
    sim.run(|_| false);
    for r in &sim.results()[..2] {
        let e = r.clone().unwrap_err();
        assert_eq!(
            e,
            format!("workers [\"worker2\"] did not reach shutdown round 0 within {TIMEOUT:?}")
        );
    }
}

#[test]
fn a_busy_worker_fails_after_the_timeout() {
    let mut sim = Sim::new(2, 1);
    sim.workers[1].active = 1;
    sim.run(|_| false);
    let results = sim.results();
    assert!(results[1]
        .clone()
        .unwrap_err()
        .starts_with("1 calls still outstanding on this worker"));
    assert!(results[0]
        .clone()
        .unwrap_err()
        .contains("did not reach shutdown round 0"));
}

#[test]
fn corrupt_and_forged_records_fail_cleanly() {
    for bad in [
        &b"2:1/0/1"[..],    // a rank outside the group of two
        b"1:1/0/1;0:0/0/1", // ranks not increasing
        b"0:1/0/1;0:1/0/1", // a rank twice
        b"0:x/0/1",         // not a number
        b"0:1/2/0",         // more lost than sent
        b"0:1/0/1/4",       // four fields
        b"0:1/0",           // two fields
        b"1/0/1",           // no rank
        b";",               // empty entries
        b"\xff\xfe",        // not UTF-8
        b"0:18446744073709551615/0/18446744073709551615;1:0/0/18446744073709551615",
    ] {
        let mut m = Termination::new("join", 0, vec!["a".into(), "b".into()], TIMEOUT);
        let now = Instant::now();
        m.start(now);
        m.step(now, Input::Idle(Counts::zero(2)));
        let good = Counts::zero(2).encode();
        let out = m.step(now, Input::Records(vec![good, bad.to_vec()]));
        match &out[..] {
            [Action::Fail(e)] => assert_eq!(e, "corrupt shutdown record join/0/1"),
            // Huge but well-formed counts parse; they must not overflow.
            [Action::WaitIdle { .. }] => assert!(bad.starts_with(b"0:1844")),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn records_round_trip() {
    let mut c = Counts::zero(3);
    c.sent = vec![1, 2, 3];
    c.lost = vec![0, 1, 2];
    c.served = vec![7, 0, u64::MAX];
    assert_eq!(Counts::decode(&c.encode(), 3), Some(c.clone()));
    // Rank 2 is outside a group of two.
    assert_eq!(Counts::decode(&c.encode(), 2), None);
    // Only peers with counts are written.
    let mut sparse = Counts::zero(1000);
    sparse.sent[917] = 4;
    sparse.served[3] = 2;
    assert_eq!(sparse.encode(), b"3:0/0/2;917:4/0/0");
    assert_eq!(Counts::decode(&sparse.encode(), 1000), Some(sparse));
    assert_eq!(Counts::decode(b"", 5), Some(Counts::zero(5)));
}
