//! Deferred receives: the pass keeps every generated schedule runnable,
//! valid and in the same compute order with fewer outstanding receives,
//! and stops where a naive deferral would deadlock.

use ferry_schedule::{
    add_send_recv, check_deadlock, check_deadlock_with, defer_recvs, simulate_unit_steps, validate,
    Action, ActionKind, CommModel, DeadlockError, DeferOptions, Schedule, ScheduleKind,
};
use proptest::prelude::*;

fn csv(rows: &[&str]) -> Schedule {
    let text: String = rows.iter().map(|r| format!("{r}\r\n")).collect();
    Schedule::from_csv(&text).expect("parses")
}

fn is_recv(a: &Action) -> bool {
    matches!(a.kind(), ActionKind::RecvF | ActionKind::RecvB)
}

fn consumes(a: &Action, recv: &Action) -> bool {
    let subs = a.sub_actions();
    let leaves = if subs.is_empty() {
        std::slice::from_ref(a)
    } else {
        subs
    };
    leaves.iter().any(|l| {
        let kind = match recv.kind() {
            ActionKind::RecvF => l.kind() == ActionKind::Forward,
            _ => matches!(
                l.kind(),
                ActionKind::FullBackward | ActionKind::BackwardInput
            ),
        };
        kind && l.stage() == recv.stage() && l.microbatch() == recv.microbatch()
    })
}

/// Per step of a rank's list, the receives posted and not yet consumed:
/// (the most at once, the sum over the list).
fn outstanding(row: &[Option<Action>]) -> (usize, usize) {
    let mut open: Vec<&Action> = Vec::new();
    let (mut most, mut area) = (0, 0);
    for action in row.iter().flatten() {
        if is_recv(action) {
            open.push(action);
        } else {
            open.retain(|r| !consumes(action, r));
        }
        most = most.max(open.len());
        area += open.len();
    }
    (most, area)
}

fn without_recvs(s: &Schedule) -> Vec<Vec<Action>> {
    s.ranks
        .iter()
        .map(|r| {
            r.iter()
                .flatten()
                .filter(|a| !is_recv(a))
                .cloned()
                .collect()
        })
        .collect()
}

fn recvs_sorted(s: &Schedule) -> Vec<Vec<String>> {
    s.ranks
        .iter()
        .map(|r| {
            let mut v: Vec<String> = r
                .iter()
                .flatten()
                .filter(|a| is_recv(a))
                .map(Action::to_string)
                .collect();
            v.sort();
            v
        })
        .collect()
}

/// How many receives have more sends before them in `after` than in
/// `before`.
fn moved_past_sends(before: &Schedule, after: &Schedule) -> usize {
    let sends_before = |row: &[&Action], i: usize| {
        row[..i]
            .iter()
            .filter(|a| matches!(a.kind(), ActionKind::SendF | ActionKind::SendB))
            .count()
    };
    let mut moved = 0;
    for (old, new) in before.ranks.iter().zip(&after.ranks) {
        let old: Vec<&Action> = old.iter().flatten().collect();
        let new: Vec<&Action> = new.iter().flatten().collect();
        for (i, recv) in new.iter().enumerate().filter(|(_, a)| is_recv(a)) {
            let j = old.iter().position(|a| a == recv).expect("same receives");
            if sends_before(&new, i) > sends_before(&old, j) {
                moved += 1;
            }
        }
    }
    moved
}

#[test]
fn every_generated_schedule_defers_safely() {
    let mut checked = 0;
    let (mut area_before, mut area_after) = (0, 0);
    // Schedules where deferring every receive to its consumer (right
    // under buffered sends) deadlocks under a rendezvous, and receives
    // the rendezvous rule still moves past a send.
    let (mut naive_deadlocks, mut past_sends) = (0, 0);
    for kind in ScheduleKind::ALL {
        for ranks in [2, 3, 4] {
            for per_rank in [1, 2] {
                for micro in [2, 4, 8] {
                    let Ok(compute) = kind.generate(ranks, per_rank, micro) else {
                        continue;
                    };
                    let placement = kind
                        .placement()
                        .stage_to_rank(ranks * per_rank, ranks)
                        .expect("placement");
                    let lowered = add_send_recv(&compute, &placement).expect("lowers");
                    let naive = DeferOptions {
                        model: CommModel::Buffered,
                        lead: 0,
                    };
                    let naive = defer_recvs(&lowered, &placement, naive).expect("defers");
                    if check_deadlock_with(&naive, &placement, CommModel::Rendezvous).is_err() {
                        naive_deadlocks += 1;
                    }
                    let ours =
                        defer_recvs(&lowered, &placement, DeferOptions::default()).expect("defers");
                    past_sends += moved_past_sends(&lowered, &ours);
                    for model in [CommModel::Buffered, CommModel::Rendezvous] {
                        for lead in [0, 2] {
                            let shape =
                                format!("{kind} {ranks}x{per_rank} m{micro} {model:?} lead {lead}");
                            let deferred =
                                defer_recvs(&lowered, &placement, DeferOptions { model, lead })
                                    .unwrap_or_else(|e| panic!("{shape}: {e}"));
                            check_deadlock_with(&deferred, &placement, model)
                                .unwrap_or_else(|e| panic!("{shape}: {e}"));
                            check_deadlock(&deferred, &placement)
                                .unwrap_or_else(|e| panic!("{shape}: {e}"));
                            simulate_unit_steps(&deferred, &placement)
                                .unwrap_or_else(|e| panic!("{shape}: {e}"));
                            validate(&deferred, micro).unwrap_or_else(|e| panic!("{shape}: {e}"));
                            assert_eq!(
                                without_recvs(&deferred),
                                without_recvs(&lowered),
                                "{shape}"
                            );
                            assert_eq!(recvs_sorted(&deferred), recvs_sorted(&lowered), "{shape}");
                            for (rank, (new, old)) in
                                deferred.ranks.iter().zip(&lowered.ranks).enumerate()
                            {
                                let (new_most, new_area) = outstanding(new);
                                let (old_most, old_area) = outstanding(old);
                                assert!(
                                    new_most <= old_most && new_area <= old_area,
                                    "{shape} rank {rank}: {new_most}/{new_area} > {old_most}/{old_area}"
                                );
                                if lead == 0 {
                                    area_before += old_area;
                                    area_after += new_area;
                                }
                                // Each receive still comes before its consumer.
                                let row: Vec<&Action> = new.iter().flatten().collect();
                                for (i, r) in row.iter().enumerate().filter(|(_, a)| is_recv(a)) {
                                    let before = row[..i].iter().any(|a| consumes(a, r));
                                    assert!(!before, "{shape} rank {rank}: {r} after its consumer");
                                }
                            }
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(checked >= 100, "{checked}");
    assert!(naive_deadlocks >= 10, "{naive_deadlocks}");
    assert!(past_sends >= 10, "{past_sends}");
    assert!(
        area_after * 2 < area_before,
        "receives outstanding: {area_after} after, {area_before} before"
    );
}

#[test]
fn buffered_sends_let_every_receive_reach_its_consumer() {
    let kind = ScheduleKind::Interleaved1F1B;
    let placement = kind.placement().stage_to_rank(8, 4).expect("placement");
    let lowered =
        add_send_recv(&kind.generate(4, 2, 8).expect("generates"), &placement).expect("lowers");
    for lead in [0, 1, 3] {
        let options = DeferOptions {
            model: CommModel::Buffered,
            lead,
        };
        let deferred = defer_recvs(&lowered, &placement, options).expect("defers");
        for row in &deferred.ranks {
            let row: Vec<&Action> = row.iter().flatten().collect();
            for (i, recv) in row.iter().enumerate().filter(|(_, a)| is_recv(a)) {
                let consumer = i + row[i..]
                    .iter()
                    .position(|a| consumes(a, recv))
                    .expect("consumed");
                // At most `lead` actions between them, besides other
                // receives of the same consumer.
                let between = row[i + 1..consumer]
                    .iter()
                    .filter(|a| !(is_recv(a) && consumes(row[consumer], a)))
                    .count();
                assert!(between <= lead, "lead {lead}: {recv} is {between} ahead");
            }
        }
    }
}

/// 1F1B-like on two ranks, two microbatches: receives as `add_send_recv`
/// posts them (early), safe under both models.
fn early() -> Schedule {
    csv(&[
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1",
        "1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1B1,1SEND_B1",
    ])
}

#[test]
fn naive_deferral_deadlocks_where_the_rule_stops() {
    let placement = [0, 1];
    let lowered = early();
    assert_eq!(
        check_deadlock_with(&lowered, &placement, CommModel::Rendezvous),
        Ok(())
    );
    // Naive deferral puts 1RECV_F1 right before 1F1, behind 1SEND_B0
    // (PyTorch's rank-parity rule does the same: rank 1 > rank 0, so its
    // send to rank 0 flushes nothing). Rank 0 sends F1 before it receives
    // B0, rank 1 sends B0 before it receives F1: under a rendezvous each
    // waits for the other.
    let naive = csv(&[
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1",
        "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1",
    ]);
    let err = check_deadlock_with(&naive, &placement, CommModel::Rendezvous)
        .expect_err("naive deferral deadlocks");
    assert!(
        matches!(&err, DeadlockError::Cycle { waits } if waits.len() == 2),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("rank 1 waits at 1SEND_B0 for 0RECV_B0 on rank 0 (behind 0SEND_F1)"),
        "{err}"
    );
    // The rule moves 1RECV_F1 past the backward but not past 1SEND_B0:
    // that send meets 0RECV_B0, which rank 0 reaches only after 0SEND_F1,
    // the very send 1RECV_F1 pairs with.
    let ours = defer_recvs(&lowered, &placement, DeferOptions::default()).expect("defers");
    assert_eq!(
        ours.to_csv(),
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\r\n\
         1RECV_F0,1F0,1B0,1RECV_F1,1SEND_B0,1F1,1B1,1SEND_B1\r\n"
    );
    assert_eq!(
        check_deadlock_with(&ours, &placement, CommModel::Rendezvous),
        Ok(())
    );
    // With buffered sends the naive order is safe, and the rule gives it.
    let buffered = DeferOptions {
        model: CommModel::Buffered,
        lead: 0,
    };
    assert_eq!(
        defer_recvs(&lowered, &placement, buffered),
        Ok(naive.clone())
    );
    assert_eq!(check_deadlock(&naive, &placement), Ok(()));
}

#[test]
fn deadlocking_input_and_unconsumed_receives() {
    let stuck = csv(&["0RECV_B0,0F0,0SEND_F0,0B0", "1RECV_F0,1F0,1B0,1SEND_B0"]);
    let err = defer_recvs(&stuck, &[0, 1], DeferOptions::default()).expect_err("deadlocks");
    assert!(matches!(err, DeadlockError::Cycle { .. }), "{err}");
    // A receive that no compute on its rank consumes stays where it is.
    let unconsumed = csv(&["0F0,0SEND_F0", "1RECV_F0,1UNSHARD,1RESHARD"]);
    assert_eq!(
        defer_recvs(&unconsumed, &[0, 1], DeferOptions::default()),
        Ok(unconsumed.clone())
    );
}

/// A small lowered schedule with a few neighbouring actions of its ranks'
/// lists swapped, and a communication model.
fn perturbed() -> impl Strategy<Value = (Schedule, Vec<usize>, CommModel)> {
    (
        prop::sample::select(vec![
            (ScheduleKind::OneFOneB, 3, 1, 4),
            (ScheduleKind::Interleaved1F1B, 2, 2, 4),
            (ScheduleKind::InterleavedZeroBubble, 3, 2, 3),
            (ScheduleKind::ZbvZeroBubble, 2, 2, 4),
            (ScheduleKind::DualPipeV, 2, 2, 4),
        ]),
        prop::collection::vec((0usize..4, 0usize..128), 0..3),
        prop::sample::select(vec![CommModel::Buffered, CommModel::Rendezvous]),
    )
        .prop_map(|((kind, ranks, per_rank, micro), swaps, model)| {
            let placement = kind
                .placement()
                .stage_to_rank(ranks * per_rank, ranks)
                .expect("placement");
            let compute = kind.generate(ranks, per_rank, micro).expect("generates");
            let mut lowered = add_send_recv(&compute, &placement).expect("lowers");
            for (rank, at) in swaps {
                let row = &mut lowered.ranks[rank % ranks];
                let at = at % (row.len() - 1);
                row.swap(at, at + 1);
            }
            (lowered, placement, model)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, max_global_rejects: 8192, ..ProptestConfig::default() })]

    /// Whatever runnable order the ranks start from, deferral keeps it
    /// runnable under the same model, with the other actions in place.
    #[test]
    fn deferral_keeps_any_runnable_schedule_runnable((lowered, placement, model) in perturbed()) {
        prop_assume!(check_deadlock_with(&lowered, &placement, model).is_ok());
        let deferred = defer_recvs(&lowered, &placement, DeferOptions { model, lead: 0 })
            .expect("a runnable schedule defers");
        prop_assert_eq!(check_deadlock_with(&deferred, &placement, model), Ok(()));
        prop_assert_eq!(without_recvs(&deferred), without_recvs(&lowered));
        prop_assert_eq!(recvs_sorted(&deferred), recvs_sorted(&lowered));
    }
}
