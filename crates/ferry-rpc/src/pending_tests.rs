//! Deterministic tests of the pending-call table: replies reordered,
//! duplicated, dropped, forged from another connection or callee, or read
//! after the deadline; connections failing with calls waiting; ids
//! wrapping; and a simulation mixing all of them in many interleavings.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::{Call, Dropped, Failed, Issued, PendingCalls, Replied};

const SEC: Duration = Duration::from_secs(1);

/// The slot of the tests: the call's own number.
type Table = PendingCalls<u32>;

fn completed(outcome: Replied<u32>) -> u32 {
    match outcome {
        Replied::Complete(call) => call.slot,
        other => panic!("expected a completion, got {other:?}"),
    }
}

fn dropped(outcome: Replied<u32>) -> Dropped {
    match outcome {
        Replied::Dropped(reason) => reason,
        other => panic!("expected a dropped reply, got {other:?}"),
    }
}

#[test]
fn reordered_replies_complete_each_its_own_call() {
    let t0 = Instant::now();
    let mut table = Table::new();
    let ids: Vec<u64> = (0..10)
        .map(|n| table.issue(t0, 1, 7, "f", 10 * SEC, n).id)
        .collect();
    assert_eq!(ids, (1..=10).collect::<Vec<u64>>(), "ids count up from 1");
    for (n, &id) in ids.iter().enumerate().rev() {
        assert_eq!(completed(table.reply(t0 + SEC, 7, 1, id)), n as u32);
    }
    assert_eq!(table.len(), 0);
    // The timer finds nothing left to expire.
    assert!(table.tick(t0 + 100 * SEC).is_empty());
    assert_eq!(table.timer(), None);
}

#[test]
fn a_duplicated_reply_is_dropped() {
    let t0 = Instant::now();
    let mut table = Table::new();
    let Issued { id, .. } = table.issue(t0, 1, 7, "f", 10 * SEC, 0);
    assert_eq!(completed(table.reply(t0, 7, 1, id)), 0);
    assert_eq!(dropped(table.reply(t0, 7, 1, id)), Dropped::NoCall);
}

#[test]
fn a_call_whose_reply_is_lost_times_out_at_its_deadline_and_not_before() {
    let t0 = Instant::now();
    let mut table = Table::new();
    let issued = table.issue(t0, 1, 7, "f", 5 * SEC, 0);
    assert!(issued.wake_timer);
    assert_eq!(table.timer(), Some(t0 + 5 * SEC));
    assert!(table.tick(t0 + 4 * SEC).is_empty());
    assert_eq!(table.len(), 1);
    let expired = table.tick(t0 + 5 * SEC);
    assert!(
        matches!(&expired[..], [Failed::TimedOut(c)] if c.id == issued.id && c.timeout == Some(5 * SEC)),
        "{expired:?}"
    );
    assert_eq!(table.timer(), None);
    // The reply, once it comes, answers nothing.
    assert_eq!(
        dropped(table.reply(t0 + 6 * SEC, 7, 1, issued.id)),
        Dropped::NoCall
    );
}

#[test]
fn a_reply_read_at_or_after_the_deadline_times_the_call_out() {
    let t0 = Instant::now();
    let mut table = Table::new();
    let a = table.issue(t0, 1, 7, "f", 5 * SEC, 0).id;
    let b = table.issue(t0, 1, 7, "f", 5 * SEC, 1).id;
    // The timer has not run yet; the deadline decides all the same.
    assert!(
        matches!(table.reply(t0 + 5 * SEC, 7, 1, a), Replied::Late(Failed::TimedOut(c)) if c.slot == 0)
    );
    assert!(
        matches!(table.reply(t0 + 9 * SEC, 7, 1, b), Replied::Late(Failed::TimedOut(c)) if c.slot == 1)
    );
    assert!(table.tick(t0 + 10 * SEC).is_empty(), "timed out twice");
}

#[test]
fn replies_from_another_connection_or_callee_are_foreign_and_leave_the_call_waiting() {
    let t0 = Instant::now();
    let mut table = Table::new();
    let id = table.issue(t0, 1, 7, "f", 10 * SEC, 0).id;
    // From the callee, on another connection (one it accepted, say).
    assert_eq!(
        dropped(table.reply(t0, 8, 1, id)),
        Dropped::Foreign { callee: 1 }
    );
    // From another worker, on the call's connection number (it cannot be,
    // but the table does not trust the shell's bookkeeping either).
    assert_eq!(
        dropped(table.reply(t0, 7, 2, id)),
        Dropped::Foreign { callee: 1 }
    );
    // From another worker on its own connection.
    assert_eq!(
        dropped(table.reply(t0, 9, 2, id)),
        Dropped::Foreign { callee: 1 }
    );
    assert_eq!(table.len(), 1);
    assert_eq!(completed(table.reply(t0, 7, 1, id)), 0);
}

#[test]
fn a_failed_connection_ends_its_calls_only() {
    let t0 = Instant::now();
    let mut table = Table::new();
    let on_7: Vec<u64> = (0..3)
        .map(|n| table.issue(t0, 1, 7, "f", 10 * SEC, n).id)
        .collect();
    let on_8 = table.issue(t0, 2, 8, "g", Duration::ZERO, 3).id;
    let mut failed: Vec<(u64, String)> = table
        .connection_failed(7, "reset by peer")
        .into_iter()
        .map(|o| match o {
            Failed::Unreachable { call, reason } => (call.id, reason),
            other => panic!("{other:?}"),
        })
        .collect();
    failed.sort();
    assert_eq!(
        failed,
        on_7.iter()
            .map(|&id| (id, "reset by peer".to_string()))
            .collect::<Vec<_>>()
    );
    // Their deadlines went with them; their replies answer nothing.
    assert!(table.tick(t0 + 100 * SEC).is_empty());
    assert_eq!(dropped(table.reply(t0, 7, 1, on_7[0])), Dropped::NoCall);
    assert!(table.connection_failed(7, "again").is_empty());
    assert_eq!(completed(table.reply(t0, 8, 2, on_8)), 3);
}

#[test]
fn calls_without_a_timeout_never_time_out() {
    let t0 = Instant::now();
    let mut table = Table::new();
    let issued = table.issue(t0, 1, 7, "f", Duration::ZERO, 0);
    assert!(!issued.wake_timer);
    assert_eq!(table.timer(), None);
    assert!(table.tick(t0 + 1_000_000 * SEC).is_empty());
    assert!(matches!(
        table.reply(t0 + 1_000_000 * SEC, 7, 1, issued.id),
        Replied::Complete(c) if c.timeout.is_none()
    ));
}

#[test]
fn the_timer_is_woken_only_for_an_earlier_deadline_and_rearmed_by_a_tick() {
    let t0 = Instant::now();
    let mut table = Table::new();
    assert!(table.issue(t0, 1, 7, "f", 10 * SEC, 0).wake_timer);
    assert!(!table.issue(t0, 1, 7, "f", 20 * SEC, 1).wake_timer);
    assert!(table.issue(t0, 1, 7, "f", 5 * SEC, 2).wake_timer);
    assert_eq!(table.timer(), Some(t0 + 5 * SEC));
    // Completing the earliest call leaves the timer armed for it: the
    // tick then finds nothing and re-arms for the next deadline.
    assert_eq!(completed(table.reply(t0, 7, 1, 3)), 2);
    assert_eq!(table.timer(), Some(t0 + 5 * SEC));
    assert!(table.tick(t0 + 5 * SEC).is_empty());
    assert_eq!(table.timer(), Some(t0 + 10 * SEC));
    let expired = table.tick(t0 + 30 * SEC);
    let order: Vec<u32> = expired
        .into_iter()
        .map(|o| match o {
            Failed::TimedOut(c) => c.slot,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(order, [0, 1], "earliest deadline first");
    assert_eq!(table.timer(), None);
}

#[test]
fn a_cancelled_call_leaves_no_deadline_behind() {
    let t0 = Instant::now();
    let mut table = Table::new();
    let id = table.issue(t0, 1, 7, "f", 5 * SEC, 0).id;
    assert_eq!(table.cancel(id).map(|c| c.slot), Some(0));
    assert!(table.cancel(id).is_none());
    assert!(table.tick(t0 + 10 * SEC).is_empty());
    assert_eq!(dropped(table.reply(t0, 7, 1, id)), Dropped::NoCall);
}

#[test]
fn draining_takes_every_call_and_disarms_the_timer() {
    let t0 = Instant::now();
    let mut table = Table::new();
    for n in 0..4 {
        table.issue(t0, n, u64::from(n), "f", SEC * n, n);
    }
    let mut slots: Vec<u32> = table.drain().into_iter().map(|c| c.slot).collect();
    slots.sort_unstable();
    assert_eq!(slots, [0, 1, 2, 3]);
    assert_eq!(table.timer(), None);
    assert!(table.tick(t0 + 10 * SEC).is_empty());
}

#[test]
fn ids_wrap_past_the_largest_skipping_zero_and_ids_in_use() {
    let t0 = Instant::now();
    let mut table = Table::starting_at(u64::MAX - 1);
    let a = table.issue(t0, 1, 7, "f", SEC, 0).id;
    let b = table.issue(t0, 1, 7, "f", SEC, 1).id;
    let c = table.issue(t0, 1, 7, "f", SEC, 2).id;
    assert_eq!((a, b, c), (u64::MAX - 1, u64::MAX, 1));
    // The counter goes on after the wrap.
    let d = table.issue(t0, 1, 7, "f", SEC, 3).id;
    assert_eq!(d, 2);
    let mut table2 = Table::starting_at(u64::MAX);
    let x = table2.issue(t0, 1, 7, "f", SEC, 0).id;
    let y = table2.issue(t0, 1, 7, "f", SEC, 1).id;
    assert_eq!((x, y), (u64::MAX, 1));
    // Wrap onto ids still in use: they are skipped.
    let mut table3 = Table::starting_at(1);
    let first: Vec<u64> = (0..3)
        .map(|n| table3.issue(t0, 1, 7, "f", SEC, n).id)
        .collect();
    assert_eq!(first, [1, 2, 3]);
    table3.next_id = u64::MAX;
    let wrapped: Vec<u64> = (3..6)
        .map(|n| table3.issue(t0, 1, 7, "f", SEC, n).id)
        .collect();
    assert_eq!(
        wrapped,
        [u64::MAX, 4, 5],
        "0 and the waiting 1, 2, 3 skipped"
    );
    // Each reply still finds its own call.
    for (n, &id) in first.iter().chain(&wrapped).enumerate() {
        assert_eq!(completed(table3.reply(t0, 7, 1, id)), n as u32);
    }
}

/// How the simulation's network treats a reply.
#[derive(Debug, Clone, Copy)]
enum Fate {
    Delivered,
    Duplicated,
    Lost,
    /// Its connection fails before it arrives.
    ConnectionFails,
}

/// A call of the simulation: id, callee, connection, deadline, its reply's fate.
type SimCall = (u64, u32, u64, Option<Instant>, Fate);

/// What the simulation saw become of each call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ended {
    Completed,
    TimedOut,
    Unreachable,
}

/// The call a reply ended, and how.
fn replied(r: Replied<usize>) -> Option<(Call<usize>, Ended)> {
    match r {
        Replied::Complete(c) => Some((c, Ended::Completed)),
        Replied::Late(f) => Some(failed(f)),
        Replied::Dropped(_) => None,
    }
}

/// The call that failed, and how.
fn failed(f: Failed<usize>) -> (Call<usize>, Ended) {
    match f {
        Failed::TimedOut(c) => (c, Ended::TimedOut),
        Failed::Unreachable { call, .. } => (call, Ended::Unreachable),
    }
}

fn random(rng: &mut u64, below: u64) -> u64 {
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    *rng % below
}

/// Many calls to three callees over connections that fail, with replies
/// delivered in random order, duplicated, lost, forged (another worker or
/// connection replaying a real id) and late, time moving in random steps:
/// every call ends exactly once; it completes only by its own callee's
/// reply on its own connection before its deadline; it times out only at
/// or after its deadline; the table ends empty.
#[test]
fn every_call_ends_exactly_once_in_any_interleaving() {
    let mut seen = BTreeMap::new();
    for seed in 1..=200u64 {
        let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let t0 = Instant::now();
        let mut now = t0;
        let mut table = PendingCalls::<usize>::starting_at(u64::MAX - 20);
        // Per call: (id, callee, conn, deadline, fate).
        let mut calls: Vec<SimCall> = Vec::new();
        // Events still to happen: (call index, forged?).
        let mut events: Vec<(usize, bool)> = Vec::new();
        let mut ended: BTreeMap<usize, Ended> = BTreeMap::new();
        let mut conns = [1u64, 2, 3];
        let mut next_conn = 4;
        let settle = |outcome: Option<(Call<usize>, Ended)>,
                      now: Instant,
                      calls: &[SimCall],
                      ended: &mut BTreeMap<usize, Ended>| {
            let Some((call, how)) = outcome else {
                return;
            };
            let (id, to, conn, deadline, _) = calls[call.slot];
            assert_eq!((call.id, call.to, call.conn), (id, to, conn));
            match how {
                Ended::TimedOut => assert!(deadline.is_some_and(|d| d <= now), "seed {seed}"),
                Ended::Completed => assert!(deadline.is_none_or(|d| d > now), "seed {seed}"),
                Ended::Unreachable => {}
            }
            assert!(
                ended.insert(call.slot, how).is_none(),
                "seed {seed}: call {} ended twice",
                call.slot
            );
        };
        for n in 0..60usize {
            let to = random(&mut rng, 3) as u32;
            let conn = conns[to as usize];
            let timeout = match random(&mut rng, 3) {
                0 => Duration::ZERO,
                k => SEC * (k as u32) * 3,
            };
            let issued = table.issue(now, to, conn, "f", timeout, n);
            // No call still waiting has the new call's id.
            assert!(
                calls
                    .iter()
                    .enumerate()
                    .all(|(i, c)| c.0 != issued.id || ended.contains_key(&i)),
                "seed {seed}: id {} given twice",
                issued.id
            );
            let fate = match random(&mut rng, 8) {
                0 => Fate::Duplicated,
                1 => Fate::Lost,
                2 => Fate::ConnectionFails,
                _ => Fate::Delivered,
            };
            calls.push((
                issued.id,
                to,
                conn,
                (!timeout.is_zero()).then(|| now + timeout),
                fate,
            ));
            events.push((n, false));
            if random(&mut rng, 4) == 0 {
                events.push((n, true));
            }
            // Deliver some of what is in flight, in random order.
            while !events.is_empty() && random(&mut rng, 3) != 0 {
                let (i, forged) =
                    events.swap_remove(random(&mut rng, events.len() as u64) as usize);
                let (id, to, conn, _, fate) = calls[i];
                if forged {
                    let (from, on) = if random(&mut rng, 2) == 0 {
                        ((to + 1) % 3, conn)
                    } else {
                        (to, conn + 1000)
                    };
                    let outcome = table.reply(now, on, from, id);
                    assert!(
                        matches!(outcome, Replied::Dropped(_)),
                        "seed {seed}: {outcome:?}"
                    );
                    continue;
                }
                match fate {
                    Fate::Lost => {}
                    Fate::Delivered => settle(
                        replied(table.reply(now, conn, to, id)),
                        now,
                        &calls,
                        &mut ended,
                    ),
                    Fate::Duplicated => {
                        settle(
                            replied(table.reply(now, conn, to, id)),
                            now,
                            &calls,
                            &mut ended,
                        );
                        let again = table.reply(now, conn, to, id);
                        assert!(
                            matches!(again, Replied::Dropped(_)),
                            "seed {seed}: {again:?}"
                        );
                    }
                    Fate::ConnectionFails => {
                        for o in table.connection_failed(conn, "closed") {
                            settle(Some(failed(o)), now, &calls, &mut ended);
                        }
                        if conns[to as usize] == conn {
                            conns[to as usize] = next_conn;
                            next_conn += 1;
                        }
                    }
                }
            }
            now += SEC * random(&mut rng, 3) as u32;
            if table.timer().is_some_and(|at| at <= now) || random(&mut rng, 4) == 0 {
                for o in table.tick(now) {
                    settle(Some(failed(o)), now, &calls, &mut ended);
                }
            }
        }
        // What is still in flight arrives, then time runs out.
        for (i, forged) in std::mem::take(&mut events) {
            let (id, to, conn, _, fate) = calls[i];
            if !forged && !matches!(fate, Fate::Lost) {
                settle(
                    replied(table.reply(now, conn, to, id)),
                    now,
                    &calls,
                    &mut ended,
                );
            }
        }
        now += SEC * 100;
        for o in table.tick(now) {
            settle(Some(failed(o)), now, &calls, &mut ended);
        }
        for conn in 1..next_conn {
            for o in table.connection_failed(conn, "closed") {
                settle(Some(failed(o)), now, &calls, &mut ended);
            }
        }
        assert_eq!(table.len(), 0, "seed {seed}");
        assert_eq!(ended.len(), calls.len(), "seed {seed}: a call never ended");
        for how in ended.into_values() {
            *seen.entry(how).or_insert(0u32) += 1;
        }
    }
    // The seeds reach every ending.
    assert_eq!(seen.len(), 3, "{seen:?}");
}
