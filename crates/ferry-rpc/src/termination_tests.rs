//! Deterministic tests of the termination detection: a simulated group of
//! workers and store, run in many interleavings, with calls that are
//! served late, lost with their connection, never delivered, refused at
//! send, or come from outside the group, and with workers that are killed
//! (before or during shutdown), silent, or late. A worker that is done
//! stops, as a real one does: the others then see it gone.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::{decode_abort, encode_abort, Action, Counts, Failure, How, Input, Termination};

const TIMEOUT: Duration = Duration::from_secs(20);

struct Worker {
    machine: Termination,
    counts: Counts,
    active: u64,
    queue: Vec<Action>,
    result: Option<Result<(), Failure>>,
    /// Round records this worker wrote.
    rounds: u64,
    /// Its process is gone: its connections closed and its address
    /// refuses new ones (the shell reports it as [`Input::Gone`]).
    gone: bool,
    /// Started its shutdown (a worker that is not started only serves).
    started: bool,
    /// The abort record it was told of (the shell tells it once).
    told_abort: bool,
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
                    gone: false,
                    started: true,
                    told_abort: false,
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

    /// Kills worker `w` (it stops where it is); `seen` makes the others'
    /// shells see it gone, else it is only silent.
    fn kill(&mut self, w: usize, seen: bool) {
        self.workers[w].result = Some(Err(Failure::Other("killed".into())));
        self.workers[w].gone = seen;
    }

    /// Starts worker `w` late: it did not call shutdown until now.
    fn start_late(&mut self, w: usize) {
        let now = self.now;
        self.workers[w].queue = self.workers[w].machine.start(now);
        self.workers[w].started = true;
    }

    /// The peers of `w` that are gone, among `ranks` where given with
    /// their keys: those whose key is missing.
    fn gone_for(&self, w: usize, keys: Option<(&[String], &[u32])>) -> Vec<u32> {
        // A worker that gave up said so before it stopped.
        let gone = |r: usize| {
            r != w && self.workers[r].gone && !self.store.contains_key(&format!("join/over/{r}"))
        };
        match keys {
            None => (0..self.workers.len())
                .filter(|&r| gone(r))
                .map(|r| r as u32)
                .collect(),
            Some((keys, ranks)) => keys
                .iter()
                .zip(ranks)
                .filter(|(k, &r)| gone(r as usize) && !self.store.contains_key(*k))
                .map(|(_, &r)| r)
                .collect(),
        }
    }

    /// The abort record, if `w` has not been told of it yet.
    fn abort_for(&self, w: usize) -> Option<Vec<u8>> {
        if self.workers[w].told_abort {
            return None;
        }
        self.store.get("join/abort").cloned()
    }

    /// What a wait of `w` may yield now, besides its own outcome: a gone
    /// peer or the abort record (the shell races them).
    fn interrupts(&self, w: usize, keys: Option<(&[String], &[u32])>) -> Vec<Input> {
        let mut inputs = Vec::new();
        let gone = self.gone_for(w, keys);
        let abort = self.abort_for(w);
        // The shell reads the abort record before it reports a gone peer.
        if !gone.is_empty() && abort.is_none() {
            inputs.push(Input::Gone(gone));
        }
        if let Some(record) = abort {
            inputs.push(Input::Aborted(record));
        }
        inputs
    }

    /// One of `ready`, at random.
    fn pick(&mut self, mut ready: Vec<Input>) -> Option<Input> {
        if ready.is_empty() {
            return None;
        }
        let i = self.random(ready.len());
        Some(ready.swap_remove(i))
    }

    /// Runs the worker's non-waiting actions; returns the input its wait
    /// yields now, if it yields one.
    fn try_step(&mut self, w: usize) -> bool {
        let n = self.workers.len();
        loop {
            if self.workers[w].result.is_some() || !self.workers[w].started {
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
                    let round = key
                        .split('/')
                        .nth(1)
                        .is_some_and(|r| r.parse::<u64>().is_ok());
                    if round {
                        self.workers[w].rounds += 1;
                    }
                    self.store.insert(key, value);
                    self.peak_keys = self.peak_keys.max(self.store.len());
                    None
                }
                Action::SetOnce { key, value } => {
                    self.store.entry(key).or_insert(value);
                    self.peak_keys = self.peak_keys.max(self.store.len());
                    None
                }
                Action::Done => {
                    self.workers[w].result = Some(Ok(()));
                    // Its agent stops: the others see it gone.
                    self.workers[w].gone = true;
                    return true;
                }
                Action::Fail(failure) => {
                    self.workers[w].result = Some(Err(failure));
                    self.workers[w].gone = true;
                    return true;
                }
                Action::WaitIdle { .. } => {
                    let mut ready = self.interrupts(w, None);
                    if self.workers[w].active == 0 {
                        ready.push(Input::Idle(self.workers[w].counts.clone()));
                    }
                    match self.pick(ready) {
                        Some(input) => Some(input),
                        None => return false,
                    }
                }
                Action::Collect { keys, ranks, .. } => {
                    let mut ready = self.interrupts(w, Some((&keys, &ranks)));
                    if keys.iter().all(|k| self.store.contains_key(k)) {
                        ready.push(Input::Records(
                            keys.iter().map(|k| self.store[k].clone()).collect(),
                        ));
                    }
                    match self.pick(ready) {
                        Some(input) => Some(input),
                        None => return false,
                    }
                }
                Action::AwaitChange { since, wake, .. } => {
                    let mut ready = self.interrupts(w, None);
                    if self.workers[w].counts != since {
                        ready.push(Input::Changed { own: true });
                    } else if self.store.contains_key(&wake) {
                        ready.push(Input::Changed { own: false });
                    }
                    match self.pick(ready) {
                        Some(input) => Some(input),
                        None => return false,
                    }
                }
            };
            self.workers[w].queue.remove(0);
            if let Some(input) = input {
                if matches!(input, Input::Aborted(_)) {
                    self.workers[w].told_abort = true;
                }
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
            .filter(|(_, w)| w.result.is_none() && w.started)
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
            Action::Collect { keys, ranks, .. } => Input::Missing(
                keys.iter()
                    .zip(&ranks)
                    .filter(|(k, _)| !self.store.contains_key(*k))
                    .map(|(_, &r)| r)
                    .collect(),
            ),
            _ => Input::Quiet,
        };
        let now = self.now;
        self.workers[w].queue = self.workers[w].machine.step(now, input);
        true
    }

    /// Runs until every started worker has a result. `on_stall` may
    /// change the world when no worker can go on (return true if it did).
    fn run(&mut self, mut on_stall: impl FnMut(&mut Sim) -> bool) {
        for _ in 0..100_000 {
            let n = self.workers.len();
            let start = self.random(n);
            if (0..n).any(|i| self.try_step((start + i) % n)) {
                continue;
            }
            if on_stall(self) {
                continue;
            }
            if self
                .workers
                .iter()
                .all(|w| w.result.is_some() || !w.started)
            {
                return;
            }
            if !self.expire() {
                panic!("the simulation is stuck");
            }
        }
        panic!("the simulation did not end");
    }

    fn results(&self) -> Vec<Result<(), Failure>> {
        self.workers
            .iter()
            .map(|w| w.result.clone().unwrap())
            .collect()
    }

    /// The failure of worker `w`.
    fn failure(&self, w: usize) -> Failure {
        match &self.workers[w].result {
            Some(Err(f)) => f.clone(),
            other => panic!("worker {w}: {other:?}"),
        }
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
        // A worker that gave up first and stopped does not make the
        // others name it: each finds the same unserved call.
        for r in 0..3 {
            let Failure::Other(e) = sim.failure(r) else {
                panic!("{:?}", sim.failure(r));
            };
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
        // Nothing older than the last two rounds is left (the `over` keys
        // of the two non-zero ranks aside).
        assert!(sim.peak_keys <= 2 * 3 + 1 + 2, "{}", sim.peak_keys);
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

/// The absent ranks of `failure`, and how they were found.
fn absent(failure: &Failure) -> (Vec<u32>, How) {
    match failure {
        Failure::Absent { ranks, how } => (ranks.clone(), how.clone()),
        Failure::Other(why) => panic!("not an absence: {why}"),
    }
}

#[test]
fn a_silent_worker_is_named_by_every_survivor_after_one_timeout() {
    for seed in 0..SEEDS {
        let mut sim = Sim::new(3, seed);
        // Worker 2 never comes, and nothing tells it is gone (a host
        // that does not answer).
        sim.kill(2, false);
        let start = sim.now;
        sim.run(|_| false);
        let mut silent = 0;
        for w in 0..2 {
            let (ranks, how) = absent(&sim.failure(w));
            assert_eq!(ranks, [2]);
            match how {
                How::Silent { after } => {
                    assert_eq!(after, TIMEOUT);
                    silent += 1;
                }
                How::Reported { by } => assert!(by < 2),
                How::Gone => panic!("worker 2 was never seen gone"),
            }
        }
        assert!(silent >= 1);
        // The first to find it tells the other at once: one timeout in all.
        assert_eq!(sim.now.duration_since(start), TIMEOUT);
    }
}

#[test]
fn a_killed_worker_is_named_gone_by_every_survivor_at_once() {
    for n in [2, 3, 5] {
        for seed in 0..SEEDS {
            let mut sim = Sim::new(n, seed);
            // The last worker was killed before shutdown: its connections
            // closed and its address refuses.
            sim.kill(n - 1, true);
            let start = sim.now;
            sim.run(|_| false);
            for w in 0..n - 1 {
                let (ranks, how) = absent(&sim.failure(w));
                assert_eq!(ranks, [n as u32 - 1], "worker {w}");
                assert!(
                    matches!(how, How::Gone | How::Reported { .. }),
                    "worker {w}: {how:?}"
                );
            }
            // No timeout ran out.
            assert_eq!(sim.now, start);
            // Every survivor but rank 0 said it is over, and rank 0 waited
            // for that before it stopped (its store with it).
            for w in 1..n - 1 {
                assert!(sim.store.contains_key(&format!("join/over/{w}")));
            }
        }
    }
}

#[test]
fn a_worker_killed_in_any_round_is_named_by_every_survivor() {
    for seed in 0..SEEDS {
        // Calls keep the group busy for a few rounds; worker 1 is killed
        // at the `kill_at`th stall, wherever it is.
        let kill_at = (seed % 6) as usize;
        let mut sim = Sim::new(4, seed);
        let mut stalls = 0;
        let start = sim.now;
        sim.run(|sim| {
            stalls += 1;
            if stalls == kill_at + 1 && sim.workers[1].result.is_none() {
                sim.kill(1, true);
                return true;
            }
            if stalls > 8 {
                return false;
            }
            // One more hop of a chain of calls: 0 -> 2 -> 3 -> 0 ...
            let from = [0, 2, 3][stalls % 3];
            let to = [2, 3, 0][stalls % 3];
            sim.workers[from].counts.sent[to] += 1;
            sim.workers[to].counts.served[from] += 1;
            true
        });
        if sim.workers[1].result != Some(Err(Failure::Other("killed".into()))) {
            // Worker 1 was done before its turn came: everyone was.
            assert!(sim.all_done(), "{:?}", sim.results());
            continue;
        }
        for w in [0, 2, 3] {
            match &sim.workers[w].result {
                // Done before worker 1 was killed (worker 1 too then).
                Some(Ok(())) => {}
                Some(Err(f)) => {
                    let (ranks, how) = absent(f);
                    assert_eq!(ranks, [1], "worker {w}");
                    assert!(matches!(how, How::Gone | How::Reported { .. }));
                }
                None => panic!("worker {w} did not end"),
            }
        }
        assert_eq!(sim.now, start);
    }
}

#[test]
fn rank_0_waits_for_a_late_survivor_to_learn_the_verdict() {
    for seed in 0..SEEDS {
        let mut sim = Sim::new(3, seed);
        sim.kill(2, true);
        // Worker 1 calls shutdown only once rank 0 has given up.
        sim.workers[1].started = false;
        sim.workers[1].queue.clear();
        let start = sim.now;
        let mut rank0_done_before = None;
        sim.run(|sim| {
            if sim.workers[1].started {
                return false;
            }
            rank0_done_before = Some(sim.workers[0].result.is_some());
            sim.start_late(1);
            true
        });
        // Rank 0 was still there (with the store) when worker 1 came.
        assert_eq!(rank0_done_before, Some(false));
        assert_eq!(absent(&sim.failure(0)), (vec![2], How::Gone));
        let (ranks, how) = absent(&sim.failure(1));
        assert_eq!(ranks, [2]);
        assert!(matches!(how, How::Gone | How::Reported { by: 0 }));
        assert_eq!(sim.now, start);
    }
}

#[test]
fn rank_0_waits_for_a_survivor_that_never_comes_one_timeout_at_most() {
    let mut sim = Sim::new(3, 1);
    sim.kill(2, true);
    sim.workers[1].started = false;
    sim.workers[1].queue.clear();
    let start = sim.now;
    sim.run(|_| false);
    assert_eq!(absent(&sim.failure(0)), (vec![2], How::Gone));
    assert_eq!(sim.now.duration_since(start), TIMEOUT);
}

#[test]
fn a_busy_worker_fails_after_the_timeout() {
    let mut sim = Sim::new(2, 1);
    sim.workers[1].active = 1;
    sim.run(|_| false);
    // Rank 0 finds worker 1 silent; worker 1 fails on its own count or
    // hears rank 0's verdict first.
    assert_eq!(
        absent(&sim.failure(0)),
        (vec![1], How::Silent { after: TIMEOUT })
    );
    match sim.failure(1) {
        Failure::Other(why) => {
            assert!(
                why.starts_with("1 calls still outstanding on this worker"),
                "{why}"
            )
        }
        other => assert_eq!(absent(&other), (vec![1], How::Reported { by: 0 })),
    }
}

#[test]
fn abort_records_round_trip_and_corrupt_ones_are_refused() {
    assert_eq!(encode_abort(0, &[2, 5]), b"0:2,5");
    assert_eq!(decode_abort(b"0:2,5", 6), Some((0, vec![2, 5])));
    assert_eq!(decode_abort(&encode_abort(3, &[1]), 4), Some((3, vec![1])));
    for bad in [
        &b"0:2,5"[..], // rank 5 outside a group of 5
        b"5:1",        // writer outside the group
        b"0:2,2",      // a rank twice
        b"0:3,2",      // not increasing
        b"0:",         // no rank
        b"0",          // no list
        b"x:1",        // not a number
        b"\xff:1",     // not UTF-8
    ] {
        assert_eq!(decode_abort(bad, 5), None, "{bad:?}");
    }
    // A worker that reads a corrupt one gives up with the record's name.
    let mut m = Termination::new("join", 1, vec!["a".into(), "b".into()], TIMEOUT);
    let now = Instant::now();
    m.start(now);
    let out = m.step(now, Input::Aborted(b"9:9".to_vec()));
    assert_eq!(
        out.last(),
        Some(&Action::Fail(Failure::Other(
            "corrupt shutdown record join/abort".into()
        )))
    );
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
            // Rank 0 waits for worker 1 to give up too, then fails.
            [Action::Collect { keys, .. }] => {
                assert_eq!(keys, &["join/over/1"]);
                let out = m.step(now, Input::Missing(vec![1]));
                assert_eq!(
                    out,
                    [Action::Fail(Failure::Other(
                        "corrupt shutdown record join/0/1".into()
                    ))]
                );
            }
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
