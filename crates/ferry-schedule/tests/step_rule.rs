//! `add_send_recv` and `simulate_unit_steps` skip the ranks that wait (they
//! run in time proportional to the number of actions). These tests hold
//! them to the plain rule they implement, written here the direct way
//! (every rank looked at in every round and every step, done actions in
//! hash sets, as PyTorch's `_add_send_recv` and `_simulate_comms_compute`
//! do): the same lowered schedule, the same timeline, the same error, on
//! every published schedule and on random schedules (malformed ones
//! included: deadlocks, stuck lowering, actions on foreign ranks, duplicate
//! actions, compound actions, receives without a sender).

use std::collections::{HashSet, VecDeque};

use ferry_schedule::{
    add_send_recv, simulate_unit_steps, Action, ActionKind, Deadlock, LowerError, Schedule,
    ScheduleKind,
};
use proptest::prelude::*;

/// The direct rule of `add_send_recv`.
fn lower_directly(compute: &Schedule, stage_to_rank: &[usize]) -> Result<Schedule, LowerError> {
    let stages = stage_to_rank.len();
    for (rank, row) in compute.ranks.iter().enumerate() {
        for action in row.iter().flatten() {
            for leaf in leaves(action) {
                if leaf.stage() >= stages {
                    return Err(LowerError::UnknownStage {
                        rank,
                        action: action.clone(),
                        stage: leaf.stage(),
                        stages,
                    });
                }
            }
        }
    }
    let ranks = compute.ranks.len();
    let mut queues: Vec<VecDeque<Option<Action>>> = compute
        .ranks
        .iter()
        .map(|r| r.iter().cloned().collect())
        .collect();
    let mut out: Vec<Vec<Option<Action>>> = vec![Vec::new(); ranks];
    let mut done: Vec<HashSet<Action>> = vec![HashSet::new(); ranks];
    let has = |set: &HashSet<Action>, s: usize, k: ActionKind, mb: Option<usize>| {
        set.contains(&Action::new(s, k, mb))
    };
    let ready = |a: &Action, set: &HashSet<Action>| {
        let (stage, mb) = (a.stage(), a.microbatch());
        match a.kind() {
            ActionKind::Forward if stage > 0 => {
                has(set, stage, ActionKind::RecvF, mb)
                    || has(set, stage - 1, ActionKind::Forward, mb)
            }
            ActionKind::BackwardInput | ActionKind::FullBackward if stage + 1 < stages => {
                has(set, stage, ActionKind::RecvB, mb)
                    || has(set, stage + 1, ActionKind::BackwardInput, mb)
                    || has(set, stage + 1, ActionKind::FullBackward, mb)
            }
            _ => true,
        }
    };
    while queues.iter().any(|q| !q.is_empty()) {
        let mut progress = false;
        for rank in 0..ranks {
            let Some(front) = queues[rank].front() else {
                continue;
            };
            if let Some(action) = front {
                if !leaves(action).iter().all(|a| ready(a, &done[rank])) {
                    continue;
                }
                let action = action.clone();
                out[rank].push(Some(action.clone()));
                for leaf in leaves(&action) {
                    done[rank].insert(leaf.clone());
                    let (stage, mb) = (leaf.stage(), leaf.microbatch());
                    let comms = match leaf.kind() {
                        ActionKind::Forward if stage + 1 < stages => {
                            Some((stage + 1, ActionKind::SendF, ActionKind::RecvF))
                        }
                        ActionKind::BackwardInput | ActionKind::FullBackward if stage > 0 => {
                            Some((stage - 1, ActionKind::SendB, ActionKind::RecvB))
                        }
                        _ => None,
                    };
                    if let Some((next, send, recv)) = comms {
                        let to = stage_to_rank[next];
                        if to != stage_to_rank[stage] {
                            let (send, recv) =
                                (Action::new(stage, send, mb), Action::new(next, recv, mb));
                            out[rank].push(Some(send.clone()));
                            done[rank].insert(send);
                            out[to].push(Some(recv.clone()));
                            done[to].insert(recv);
                        }
                    }
                }
            }
            queues[rank].pop_front();
            progress = true;
        }
        if !progress {
            let waiting = queues
                .iter()
                .enumerate()
                .filter_map(|(r, q)| Some((r, q.front()?.clone()?)))
                .collect();
            return Err(LowerError::Stuck { waiting });
        }
    }
    Ok(Schedule::new(out))
}

fn leaves(action: &Action) -> Vec<&Action> {
    if action.sub_actions().is_empty() {
        vec![action]
    } else {
        action.sub_actions().iter().collect()
    }
}

/// The direct rule of `simulate_unit_steps`.
fn simulate_directly(lowered: &Schedule, stage_to_rank: &[usize]) -> Result<Schedule, Deadlock> {
    let ranks = lowered.ranks.len();
    let stages = stage_to_rank.len();
    let mut queues: Vec<VecDeque<Action>> = lowered
        .ranks
        .iter()
        .map(|row| row.iter().flatten().cloned().collect())
        .collect();
    let mut timeline: Vec<Vec<Option<Action>>> = vec![Vec::new(); ranks];
    let mut done: Vec<HashSet<Action>> = vec![HashSet::new(); ranks];
    fn ready(
        a: &Action,
        rank: usize,
        done: &[HashSet<Action>],
        map: &[usize],
        stages: usize,
    ) -> bool {
        if !a.sub_actions().is_empty() {
            return a
                .sub_actions()
                .iter()
                .all(|s| ready(s, rank, done, map, stages));
        }
        let (stage, mb) = (a.stage(), a.microbatch());
        let here = &done[rank];
        let has =
            |set: &HashSet<Action>, s: usize, k: ActionKind| set.contains(&Action::new(s, k, mb));
        let peer = |s: usize| map.get(s).and_then(|&r| done.get(r));
        match a.kind() {
            ActionKind::Forward => {
                stage == 0
                    || has(here, stage, ActionKind::RecvF)
                    || has(here, stage - 1, ActionKind::Forward)
            }
            ActionKind::BackwardInput | ActionKind::FullBackward => {
                stage + 1 >= stages
                    || has(here, stage, ActionKind::RecvB)
                    || has(here, stage + 1, ActionKind::BackwardInput)
                    || has(here, stage + 1, ActionKind::FullBackward)
            }
            ActionKind::SendF => has(here, stage, ActionKind::Forward),
            ActionKind::SendB => {
                has(here, stage, ActionKind::BackwardInput)
                    || has(here, stage, ActionKind::FullBackward)
            }
            ActionKind::RecvF => stage
                .checked_sub(1)
                .and_then(peer)
                .is_some_and(|p| has(p, stage - 1, ActionKind::SendF)),
            ActionKind::RecvB => {
                peer(stage + 1).is_some_and(|p| has(p, stage + 1, ActionKind::SendB))
            }
            _ => true,
        }
    }
    let record = |done: &mut HashSet<Action>, a: &Action| {
        for sub in a.sub_actions() {
            done.insert(sub.clone());
        }
        done.insert(a.clone());
    };
    let mut step = 0;
    while queues.iter().any(|q| !q.is_empty()) {
        let mut progress = false;
        let mut stalled = Vec::new();
        for rank in 0..ranks {
            let Some(action) = queues[rank].front() else {
                continue;
            };
            if ready(action, rank, &done, stage_to_rank, stages) {
                let action = queues[rank].pop_front().expect("front");
                record(&mut done[rank], &action);
                timeline[rank].push(Some(action));
                progress = true;
            } else {
                timeline[rank].push(None);
                stalled.push(rank);
            }
        }
        for rank in stalled {
            let Some(action) = queues[rank].front() else {
                continue;
            };
            if ready(action, rank, &done, stage_to_rank, stages) {
                let action = queues[rank].pop_front().expect("front");
                record(&mut done[rank], &action);
                if let Some(last) = timeline[rank].last_mut() {
                    *last = Some(action);
                }
            }
        }
        if !progress {
            let waiting = queues
                .iter()
                .enumerate()
                .filter_map(|(r, q)| Some((r, q.front()?.clone())))
                .collect();
            return Err(Deadlock { step, waiting });
        }
        step += 1;
    }
    Ok(Schedule::new(timeline))
}

#[test]
fn published_schedules_lower_and_simulate_as_the_direct_rule() {
    let mut checked = 0;
    for kind in ScheduleKind::ALL {
        for (ranks, per_rank, micro) in [(2, 1, 4), (4, 2, 8), (4, 1, 8), (8, 2, 16), (3, 2, 12)] {
            let Ok(compute) = kind.generate(ranks, per_rank, micro) else {
                continue;
            };
            let placement = kind
                .placement()
                .stage_to_rank(ranks * per_rank, ranks)
                .expect("placement");
            let lowered = add_send_recv(&compute, &placement);
            assert_eq!(
                lowered,
                lower_directly(&compute, &placement),
                "{kind} {ranks}x{per_rank}x{micro}"
            );
            let lowered = lowered.expect("lowers");
            assert_eq!(
                simulate_unit_steps(&lowered, &placement).map(|t| t.to_schedule()),
                simulate_directly(&lowered, &placement),
                "{kind} {ranks}x{per_rank}x{micro}"
            );
            checked += 1;
        }
    }
    assert!(checked >= 25, "{checked}");
}

/// A random action on `stages` stages (one more for an unplaced stage) and
/// microbatches 0..3 (or the largest, to leave the dense tables), compound
/// OVERLAP_F_B included.
fn action(stages: usize) -> impl Strategy<Value = Action> {
    let simple = (
        0..=stages,
        proptest::sample::select(ActionKind::ALL.to_vec()),
        prop_oneof![
            8 => 0usize..3,
            1 => Just(ferry_schedule::MAX_MICROBATCH),
        ],
    )
        .prop_map(|(stage, kind, mb)| match kind {
            ActionKind::Unshard | ActionKind::Reshard | ActionKind::ReduceGrad => {
                Action::per_stage(stage, kind)
            }
            ActionKind::OverlapFB => Action::new(stage, ActionKind::Forward, Some(mb)),
            _ => Action::new(stage, kind, Some(mb)),
        });
    prop_oneof![
        6 => simple.clone(),
        1 => proptest::collection::vec(simple, 2..3)
            .prop_map(|subs| Action::compound(ActionKind::OverlapFB, subs)),
    ]
}

/// A random schedule on up to 4 ranks with its stage placement.
fn schedule() -> impl Strategy<Value = (Schedule, Vec<usize>)> {
    (1usize..=4, 1usize..=6).prop_flat_map(|(ranks, stages)| {
        let row =
            proptest::collection::vec(proptest::option::weighted(0.85, action(stages)), 0..10);
        (
            proptest::collection::vec(row, ranks),
            proptest::collection::vec(0..ranks, stages),
        )
            .prop_map(|(rows, placement)| (Schedule::new(rows), placement))
    })
}

/// A schedule that lowers (for the simulator to have work): forwards and
/// backwards of every stage of the placement, in a random order per rank.
fn lowerable() -> impl Strategy<Value = (Schedule, Vec<usize>)> {
    (1usize..=4, 1usize..=3, 1usize..=3).prop_flat_map(|(ranks, per_rank, micro)| {
        let stages = ranks * per_rank;
        let compute = ScheduleKind::LoopedBfs
            .generate(ranks, per_rank, micro)
            .expect("looped bfs takes any shape");
        let placement: Vec<usize> = (0..stages).map(|s| s % ranks).collect();
        let rows = compute.ranks.clone();
        rows.into_iter()
            .map(|row| Just(row).prop_shuffle())
            .collect::<Vec<_>>()
            .prop_map(move |rows| (Schedule::new(rows), placement.clone()))
    })
}

/// A lowerable schedule with some of its actions copied to other ranks
/// (and idle slots added), so that one receive is often posted twice, from
/// ranks in either order.
fn with_copies() -> impl Strategy<Value = (Schedule, Vec<usize>)> {
    lowerable().prop_flat_map(|(compute, placement)| {
        let ranks = compute.ranks.len();
        let copies = proptest::collection::vec(
            (
                0..ranks,
                0usize..64,
                0..ranks,
                0usize..64,
                proptest::bool::weighted(0.3),
            ),
            1..4,
        );
        (Just(compute), Just(placement), copies).prop_map(|(compute, placement, copies)| {
            let mut rows = compute.ranks;
            for (from, at, to, into, idle) in copies {
                let Some(action) = rows[from].get(at % rows[from].len().max(1)).cloned() else {
                    continue;
                };
                let into = into % (rows[to].len() + 1);
                rows[to].insert(into, action);
                if idle {
                    rows[to].insert(0, None);
                }
            }
            (Schedule::new(rows), placement)
        })
    })
}

#[test]
fn a_receive_posted_twice_is_placed_by_its_first_post() {
    // Stage 0 on rank 0, stage 1 on rank 1; rank 2 also runs 0F0 (a
    // foreign stage), in round 0, and rank 0 in round 2: both post
    // 1RECV_F0 to rank 1, which runs 1F0 after the first post (rank 2's),
    // in round 1, before the second.
    let compute = Schedule::from_csv(",,0F0\r\n1F0\r\n0F0\r\n").expect("parses");
    let placement = [0, 1];
    let lowered = add_send_recv(&compute, &placement);
    assert_eq!(lowered, lower_directly(&compute, &placement));
    let lowered = lowered.expect("lowers");
    assert_eq!(
        lowered.to_csv(),
        "0F0,0SEND_F0\r\n1RECV_F0,1F0,1RECV_F0\r\n0F0,0SEND_F0\r\n"
    );
}

/// [`lowerable`] with microbatch `m` renumbered `m * spread + offset`:
/// few actions with large numbers, so that the tables numbering (stage,
/// microbatch) pairs grow while lowering and simulating.
fn spread_out() -> impl Strategy<Value = (Schedule, Vec<usize>)> {
    (lowerable(), 1usize..40, 0usize..20).prop_map(|((compute, placement), spread, offset)| {
        let rows = compute
            .ranks
            .iter()
            .map(|row| {
                row.iter()
                    .map(|slot| {
                        slot.as_ref().map(|a| match a.microbatch() {
                            Some(m) => Action::new(a.stage(), a.kind(), Some(m * spread + offset)),
                            None => a.clone(),
                        })
                    })
                    .collect()
            })
            .collect();
        (Schedule::new(rows), placement)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn copied_actions_lower_and_simulate_as_the_direct_rule((compute, placement) in with_copies()) {
        let lowered = add_send_recv(&compute, &placement);
        prop_assert_eq!(&lowered, &lower_directly(&compute, &placement));
        if let Ok(lowered) = lowered {
            prop_assert_eq!(simulate_unit_steps(&lowered, &placement).map(|t| t.to_schedule()), simulate_directly(&lowered, &placement));
        }
    }

    #[test]
    fn lowering_follows_the_direct_rule((compute, placement) in schedule()) {
        prop_assert_eq!(add_send_recv(&compute, &placement), lower_directly(&compute, &placement));
    }

    #[test]
    fn simulation_follows_the_direct_rule((lowered, placement) in schedule(), extra in 0usize..2) {
        // Sometimes a stage placed on a rank that does not exist.
        let mut placement = placement;
        if extra == 1 {
            placement.push(lowered.ranks.len() + 1);
        }
        prop_assert_eq!(simulate_unit_steps(&lowered, &placement).map(|t| t.to_schedule()), simulate_directly(&lowered, &placement));
    }

    #[test]
    fn shuffled_schedules_lower_and_simulate_as_the_direct_rule((compute, placement) in lowerable()) {
        let lowered = add_send_recv(&compute, &placement);
        prop_assert_eq!(&lowered, &lower_directly(&compute, &placement));
        if let Ok(lowered) = lowered {
            prop_assert_eq!(simulate_unit_steps(&lowered, &placement).map(|t| t.to_schedule()), simulate_directly(&lowered, &placement));
        }
    }

    #[test]
    fn spread_out_microbatches_lower_and_simulate_as_the_direct_rule((compute, placement) in spread_out()) {
        let lowered = add_send_recv(&compute, &placement);
        prop_assert_eq!(&lowered, &lower_directly(&compute, &placement));
        if let Ok(lowered) = lowered {
            prop_assert_eq!(simulate_unit_steps(&lowered, &placement).map(|t| t.to_schedule()), simulate_directly(&lowered, &placement));
        }
    }
}
