//! Deadlock detection before running: hand-written deadlocking CSVs with
//! their error texts, and agreement with the unit-step simulator.

use ferry_schedule::{
    add_send_recv, check_deadlock, check_deadlock_with, defer_recvs, simulate_unit_steps, Action,
    ActionKind, CommModel, DeadlockError, DeferOptions, Schedule, ScheduleKind,
};
use proptest::prelude::*;

fn csv(rows: &[&str]) -> Schedule {
    let text: String = rows.iter().map(|r| format!("{r}\r\n")).collect();
    Schedule::from_csv(&text).expect("parses")
}

#[test]
fn swapped_send_and_receive_across_two_ranks() {
    // Rank 0 receives B1 before it sends F2; rank 1 receives F2 before it
    // sends B1.
    let lowered = csv(&[
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0F2,0SEND_F2,0B1,0RECV_B2,0B2",
        "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1RECV_F2,1B1,1SEND_B1,1F2,1B2,1SEND_B2",
    ]);
    let err = check_deadlock(&lowered, &[0, 1]).expect_err("deadlock");
    assert_eq!(
        err.to_string(),
        "deadlock: rank 0 waits at 0RECV_B1 for 1SEND_B1 on rank 1 (behind 1RECV_F2); \
         rank 1 waits at 1RECV_F2 for 0SEND_F2 on rank 0 (behind 0RECV_B1); \
         none of them can move"
    );
    let DeadlockError::Cycle { waits } = &err else {
        panic!("{err:?}")
    };
    assert_eq!((waits[0].rank, waits[0].step), (0, 6));
    assert_eq!((waits[1].rank, waits[1].step), (1, 6));
    // The simulator agrees that it cannot finish.
    assert!(simulate_unit_steps(&lowered, &[0, 1]).is_err());
}

#[test]
fn three_rank_cycle() {
    // Four stages on three ranks (stage 3 back on rank 0): each rank
    // receives its gradient before the rank it waits for can send.
    let lowered = csv(&[
        "0F0,0SEND_F0,3RECV_F0,3F0,0RECV_B0,3B0,3SEND_B0,0B0",
        "1RECV_F0,1F0,1SEND_F0,1RECV_B0,1B0,1SEND_B0",
        "2RECV_F0,2F0,2SEND_F0,2RECV_B0,2B0,2SEND_B0",
    ]);
    let err = check_deadlock(&lowered, &[0, 1, 2, 0]).expect_err("deadlock");
    assert_eq!(
        err.to_string(),
        "deadlock: rank 0 waits at 0RECV_B0 for 1SEND_B0 on rank 1 (behind 1RECV_B0); \
         rank 1 waits at 1RECV_B0 for 2SEND_B0 on rank 2 (behind 2RECV_B0); \
         rank 2 waits at 2RECV_B0 for 3SEND_B0 on rank 0 (behind 0RECV_B0); \
         none of them can move"
    );
    assert!(simulate_unit_steps(&lowered, &[0, 1, 2, 0]).is_err());
    // In the right order (stage 3's backward before stage 0's receive) it runs.
    let fixed = csv(&[
        "0F0,0SEND_F0,3RECV_F0,3F0,3B0,3SEND_B0,0RECV_B0,0B0",
        "1RECV_F0,1F0,1SEND_F0,1RECV_B0,1B0,1SEND_B0",
        "2RECV_F0,2F0,2SEND_F0,2RECV_B0,2B0,2SEND_B0",
    ]);
    assert_eq!(check_deadlock(&fixed, &[0, 1, 2, 0]), Ok(()));
}

#[test]
fn a_wait_outside_the_cycle_is_not_named() {
    // Rank 2 waits for rank 1, which is in a cycle with rank 0.
    let lowered = csv(&[
        "0RECV_B0,0F0,0SEND_F0,0B0",
        "1RECV_F0,1F0,1SEND_F0,1RECV_B0,1B0,1SEND_B0",
        "2RECV_F0,2F0,2B0,2SEND_B0",
    ]);
    let err = check_deadlock(&lowered, &[0, 1, 2]).expect_err("deadlock");
    let text = err.to_string();
    assert!(
        text.contains("rank 0 waits at 0RECV_B0 for 1SEND_B0 on rank 1 (behind 1RECV_F0)")
            && text.contains("rank 1 waits at 1RECV_F0 for 0SEND_F0 on rank 0 (behind 0RECV_B0)")
            && !text.contains("rank 2"),
        "{text}"
    );
}

#[test]
fn missing_send_is_named() {
    let lowered = csv(&["0F0", "1RECV_F0,1F0"]);
    let err = check_deadlock(&lowered, &[0, 1]).expect_err("no send");
    assert_eq!(
        err.to_string(),
        "rank 1, step 0: 1RECV_F0 waits for 0SEND_F0 on rank 0, which rank 0 never runs"
    );
    // The send is there, but on a rank that does not hold stage 0.
    let misplaced = csv(&["0F0", "1RECV_F0,1F0", "0SEND_F0"]);
    let err = check_deadlock(&misplaced, &[0, 1]).expect_err("no send");
    assert_eq!(
        err.to_string(),
        "rank 1, step 0: 1RECV_F0 waits for 0SEND_F0 on rank 0, which rank 0 never runs \
         (it is on rank 2, but stage 0 lives on rank 0)"
    );
    assert!(simulate_unit_steps(&lowered, &[0, 1]).is_err());
}

#[test]
fn local_misorder_and_bad_stages_are_named() {
    let err = check_deadlock(&csv(&["0SEND_F0,0F0", "1RECV_F0,1F0"]), &[0, 1])
        .expect_err("send before its forward");
    assert_eq!(
        err.to_string(),
        "rank 0, step 0: 0SEND_F0 waits for 0F0, which does not come before it on rank 0"
    );
    let err =
        check_deadlock(&csv(&[",1F0", "0F0"]), &[1, 0]).expect_err("forward without its input");
    assert_eq!(
        err.to_string(),
        "rank 0, step 1: 1F0 waits for 1RECV_F0 or 0F0, which does not come before it on rank 0"
    );
    let err = check_deadlock(&csv(&["0RECV_F0,0F0"]), &[0]).expect_err("nothing before stage 0");
    assert_eq!(
        err.to_string(),
        "rank 0, step 0: 0RECV_F0 receives from stage -1, which does not exist \
         (the placement has 1 stages)"
    );
    // A placement naming a rank the schedule has no list for.
    let err = check_deadlock(&csv(&["1RECV_F0,1F0"]), &[5, 0]).expect_err("rank 5");
    assert_eq!(
        err.to_string(),
        "rank 0, step 0: 1RECV_F0 waits for 0SEND_F0 on rank 5, which rank 5 never runs"
    );
    let rendezvous = check_deadlock_with(
        &csv(&["0F0,0SEND_F0", "1RECV_F0,1F0"]),
        &[0, 7],
        CommModel::Rendezvous,
    )
    .expect_err("rank 7");
    assert!(
        matches!(rendezvous, DeadlockError::NoRecv { peer: 7, .. }),
        "{rendezvous}"
    );
    let err = check_deadlock(&csv(&["0F0,5F0"]), &[0]).expect_err("stage 5");
    assert!(
        matches!(
            err,
            DeadlockError::UnknownStage {
                stage: 5,
                step: 1,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn rendezvous_sends_wait_for_their_receive() {
    // Each rank sends before it receives: fine when sends are buffered,
    // a deadlock when a send completes only with its receive.
    let lowered = csv(&[
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1",
        "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1",
    ]);
    assert_eq!(check_deadlock(&lowered, &[0, 1]), Ok(()));
    let err = check_deadlock_with(&lowered, &[0, 1], CommModel::Rendezvous)
        .expect_err("rendezvous deadlock");
    assert_eq!(
        err.to_string(),
        "deadlock: rank 0 waits at 0SEND_F1 for 1RECV_F1 on rank 1 (behind 1SEND_B0); \
         rank 1 waits at 1SEND_B0 for 0RECV_B0 on rank 0 (behind 0SEND_F1); \
         none of them can move"
    );
    // A send nobody receives blocks its rank for ever.
    let err = check_deadlock_with(&csv(&["0F0,0SEND_F0", ""]), &[0, 1], CommModel::Rendezvous)
        .expect_err("no receive");
    assert_eq!(
        err.to_string(),
        "rank 0, step 1: 0SEND_F0 waits for 1RECV_F0 on rank 1, which rank 1 never runs \
         (a rendezvous send completes only with its receive)"
    );
}

#[test]
fn every_lowered_schedule_is_deadlock_free_under_both_models() {
    let mut checked = 0;
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
                    for model in [CommModel::Buffered, CommModel::Rendezvous] {
                        check_deadlock_with(&lowered, &placement, model).unwrap_or_else(|e| {
                            panic!("{kind} {ranks}x{per_rank} m{micro} {model:?}: {e}")
                        });
                    }
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 30, "{checked}");
}

/// A small lowered schedule with a few neighbouring actions of its ranks'
/// lists swapped (some of which keep it runnable, some not).
fn shuffled() -> impl Strategy<Value = (Schedule, Vec<usize>)> {
    (
        prop::sample::select(vec![
            (ScheduleKind::OneFOneB, 2, 1, 2),
            (ScheduleKind::OneFOneB, 3, 1, 4),
            (ScheduleKind::Interleaved1F1B, 2, 2, 4),
            (ScheduleKind::ZbvZeroBubble, 2, 2, 2),
            (ScheduleKind::DualPipeV, 2, 2, 4),
        ]),
        prop::collection::vec((0usize..4, 0usize..64), 0..4),
    )
        .prop_map(|((kind, ranks, per_rank, micro), swaps)| {
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
            (lowered, placement)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The check says "deadlock" exactly when the simulator gets stuck.
    #[test]
    fn check_agrees_with_the_simulator((lowered, placement) in shuffled()) {
        let checked = check_deadlock(&lowered, &placement);
        let simulated = simulate_unit_steps(&lowered, &placement);
        prop_assert_eq!(checked.is_ok(), simulated.is_ok(), "{:?}", checked);
        // A rendezvous finishes only where buffered sends do.
        if check_deadlock_with(&lowered, &placement, CommModel::Rendezvous).is_ok() {
            prop_assert!(checked.is_ok());
        }
    }
}

/// Any list of actions on up to three ranks, over stages that a placement
/// of up to four stages names (and sometimes one it does not).
fn arbitrary_lowered() -> impl Strategy<Value = (Schedule, Vec<usize>)> {
    let kinds: Vec<ActionKind> = ActionKind::ALL
        .into_iter()
        .filter(|k| !k.is_compound())
        .collect();
    let simple =
        (0usize..5, prop::sample::select(kinds), 0usize..3).prop_map(|(stage, kind, mb)| {
            Action::new(stage, kind, kind.has_microbatch().then_some(mb))
        });
    let action = prop_oneof![
        6 => simple.clone(),
        1 => prop::collection::vec(simple, 0..3)
            .prop_map(|subs| Action::compound(ActionKind::OverlapFB, subs)),
    ];
    (
        prop::collection::vec(
            prop::collection::vec(prop::option::weighted(0.9, action), 0..10),
            1..4,
        ),
        prop::collection::vec(0usize..4, 0..5),
    )
        .prop_map(|(rows, placement)| (Schedule::new(rows), placement))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// On any input the check answers without panicking, agrees with the
    /// simulator where every stage is placed, and what it passes defers.
    #[test]
    fn any_schedule_checks_defers_and_agrees((lowered, placement) in arbitrary_lowered()) {
        let all_placed = lowered
            .ranks
            .iter()
            .flatten()
            .flatten()
            .flat_map(|a| std::iter::once(a).chain(a.sub_actions()))
            .all(|a| a.stage() < placement.len());
        let checked = check_deadlock(&lowered, &placement);
        let simulated = simulate_unit_steps(&lowered, &placement);
        if all_placed {
            prop_assert_eq!(checked.is_ok(), simulated.is_ok(), "{:?}", checked);
        } else {
            let unknown = matches!(checked, Err(DeadlockError::UnknownStage { .. }));
            prop_assert!(unknown, "{:?}", checked);
        }
        for model in [CommModel::Buffered, CommModel::Rendezvous] {
            let runs = check_deadlock_with(&lowered, &placement, model).is_ok();
            let deferred = defer_recvs(&lowered, &placement, DeferOptions { model, lead: 0 });
            prop_assert_eq!(deferred.is_ok(), runs);
            if let Ok(deferred) = deferred {
                prop_assert_eq!(check_deadlock_with(&deferred, &placement, model), Ok(()));
            }
        }
    }
}

/// A send or receive at the largest stage number is its own partner (the
/// other end would be past the numbers an action holds), not a panic.
#[test]
fn partner_at_the_largest_stage_is_itself() {
    let last = ferry_schedule::MAX_STAGE;
    for text in [format!("{last}SEND_F0"), format!("{last}RECV_B0")] {
        let action: Action = text.parse().expect("parses");
        assert_eq!(ferry_schedule::partner(&action), action, "{text}");
    }
    let recv: Action = format!("{last}RECV_F0").parse().expect("parses");
    assert_eq!(
        ferry_schedule::partner(&recv).to_string(),
        format!("{}SEND_F0", last - 1)
    );
}
