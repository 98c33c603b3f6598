//! The duration-aware simulator against closed forms under equal costs,
//! against the unit-step simulator, and on hand-written schedules.
//!
//! Costs are stated per test: `Costs::uniform(F, B, I, W)`, zero latency
//! and free bandwidth unless said otherwise.

use std::collections::HashMap;

use ferry_schedule::{
    add_send_recv, simulate_timed, simulate_unit_steps, Action, Costs, Placement, Schedule,
    ScheduleKind, TimedError, TimedRun,
};

/// (ranks, microbatches) shapes for the closed forms.
const SHAPES: [(usize, usize); 7] = [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (8, 16), (8, 32)];

fn run(kind: ScheduleKind, p: usize, per_rank: usize, m: usize, costs: &Costs) -> TimedRun {
    let compute = kind.generate(p, per_rank, m).expect("generates");
    let placement = kind
        .placement()
        .stage_to_rank(p * per_rank, p)
        .expect("placement");
    simulate_timed(&compute, &placement, costs)
        .unwrap_or_else(|e| panic!("{kind} p={p} m={m}: {e}"))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

fn schedule(rows: &[&[&str]]) -> Schedule {
    Schedule::new(
        rows.iter()
            .map(|row| {
                row.iter()
                    .map(|a| Action::parse_slot(a).expect("action"))
                    .collect()
            })
            .collect(),
    )
}

/// GPipe and 1F1B: makespan (m + p - 1)(F + B) and bubble
/// (p - 1) / (m + p - 1), exactly, on every rank, for F = B = 1 and for
/// F = 1, B = 2.
#[test]
fn gpipe_and_1f1b_bubble_is_the_closed_form() {
    for (f, b) in [(1.0, 1.0), (1.0, 2.0)] {
        let costs = Costs::uniform(f, b, 1.0, 1.0);
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            for (p, m) in SHAPES {
                let r = run(kind, p, 1, m, &costs);
                let expected = (p - 1) as f64 / (m + p - 1) as f64;
                let makespan = (m + p - 1) as f64 * (f + b);
                assert!(
                    close(r.makespan, makespan),
                    "{kind} p={p} m={m} F={f} B={b}: {}",
                    r.makespan
                );
                assert!(
                    close(r.bubble(), expected),
                    "{kind} p={p} m={m}: {}",
                    r.bubble()
                );
                for (rank, stats) in r.ranks.iter().enumerate() {
                    assert!(close(stats.busy, m as f64 * (f + b)), "rank {rank}");
                    assert!(
                        close(stats.bubble, expected),
                        "{kind} rank {rank}: {}",
                        stats.bubble
                    );
                }
            }
        }
    }
}

/// 1F1B keeps at most p activations live (rank r: min(m, p - r)); GPipe
/// keeps all m on every rank.
#[test]
fn one_f_one_b_peak_activations_stay_under_p_while_gpipe_holds_m() {
    let costs = Costs::uniform(1.0, 2.0, 1.0, 1.0);
    for (p, m) in SHAPES {
        let one = run(ScheduleKind::OneFOneB, p, 1, m, &costs);
        assert!(one.peak_activations() <= p, "p={p} m={m}");
        for (rank, stats) in one.ranks.iter().enumerate() {
            assert_eq!(
                stats.peak_activations,
                m.min(p - rank),
                "1F1B p={p} m={m} rank {rank}"
            );
        }
        let gpipe = run(ScheduleKind::GPipe, p, 1, m, &costs);
        for stats in &gpipe.ranks {
            assert_eq!(stats.peak_activations, m, "GPipe p={p} m={m}");
        }
    }
}

/// ZB-H1 (InterleavedZeroBubble, one stage per rank) with F = I = W = 1:
/// every rank is busy 3m and the makespan is 3m + p - 1, so the bubble is
/// exactly x / (1 + x) with x = (p - 1) / (3m), the paper's "about
/// (p - 1) / (3m)": it lies below x by at most x^2.
#[test]
fn zb_h1_bubble_is_about_p_minus_1_over_3m() {
    let costs = Costs::uniform(1.0, 2.0, 1.0, 1.0);
    for (p, m) in SHAPES {
        let r = run(ScheduleKind::InterleavedZeroBubble, p, 1, m, &costs);
        let x = (p - 1) as f64 / (3 * m) as f64;
        assert!(
            close(r.makespan, (3 * m + p - 1) as f64),
            "p={p} m={m}: {}",
            r.makespan
        );
        assert!(
            close(r.bubble(), x / (1.0 + x)),
            "p={p} m={m}: {}",
            r.bubble()
        );
        assert!(r.bubble() <= x && x - r.bubble() <= x * x, "p={p} m={m}");
        // And well below 1F1B's at the same shape.
        let one = (p - 1) as f64 / (m + p - 1) as f64;
        if p > 1 {
            assert!(r.bubble() < one, "p={p} m={m}");
        }
    }
}

/// ZBV with F = I = W = 1 per stage (two stages per rank): for
/// m >= 2p - 1 every rank is busy 6m and the makespan is 6m + p - 1, a
/// bubble of (p - 1) / (6m + p - 1) <= (p - 1) / (13p - 7) < 1/13, and
/// going to 0 as m grows; with fewer microbatches it is larger.
#[test]
fn zbv_bubble_is_close_to_zero_with_enough_microbatches() {
    let costs = Costs::uniform(1.0, 2.0, 1.0, 1.0);
    for (p, m) in SHAPES {
        if m < 2 * p - 1 {
            continue;
        }
        let r = run(ScheduleKind::ZbvZeroBubble, p, 2, m, &costs);
        let expected = (p - 1) as f64 / (6 * m + p - 1) as f64;
        assert!(
            close(r.makespan, (6 * m + p - 1) as f64),
            "p={p} m={m}: {}",
            r.makespan
        );
        assert!(close(r.bubble(), expected), "p={p} m={m}: {}", r.bubble());
        assert!(r.bubble() < 1.0 / 13.0, "p={p} m={m}");
    }
    let short = run(ScheduleKind::ZbvZeroBubble, 4, 2, 4, &costs);
    let enough = run(ScheduleKind::ZbvZeroBubble, 4, 2, 8, &costs);
    assert!(short.bubble() > enough.bubble());
}

/// The relation to the unit-step simulator. With every compute cost 1,
/// free per-stage actions and free comms, the timed simulator runs each
/// action as soon as possible, while the unit-step simulator's timeline
/// is one feasible execution with every action (comms included) taking a
/// step. So for every compute action: timed start <= its unit step, and
/// the timed makespan <= the unit-step count. The same holds against
/// PyTorch's lockstep compute-only tables (Interleaved1F1B, LoopedBFS,
/// InterleavedZeroBubble, ZBV: their columns are a lockstep execution),
/// and is an equality for the tight tables of LoopedBFS and
/// InterleavedZeroBubble.
#[test]
fn unit_costs_never_exceed_the_unit_step_simulator() {
    let costs = Costs::uniform(1.0, 1.0, 1.0, 1.0);
    for kind in ScheduleKind::ALL {
        for per_rank in [1, 2] {
            for (p, m) in [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8)] {
                let Ok(compute) = kind.generate(p, per_rank, m) else {
                    continue;
                };
                let placement = kind
                    .placement()
                    .stage_to_rank(p * per_rank, p)
                    .expect("placement");
                let lowered = add_send_recv(&compute, &placement).expect("lowers");
                let unit = simulate_unit_steps(&lowered, &placement).expect("simulates");
                let timed = simulate_timed(&lowered, &placement, &costs).expect("timed");
                let name = format!("{kind} p={p} x{per_rank} m={m}");
                let unit_step = steps_of(&unit.to_schedule());
                for (rank, action, start, _) in timed.actions() {
                    if action.kind().is_compute() {
                        let step = unit_step[&(rank, action.to_string())];
                        assert!(
                            start <= step as f64,
                            "{name}: {action} at {start} > unit step {step}"
                        );
                    }
                }
                let unit_steps = unit.steps();
                assert!(timed.makespan <= unit_steps as f64, "{name}");
                if matches!(
                    kind,
                    ScheduleKind::GPipe | ScheduleKind::OneFOneB | ScheduleKind::DualPipeV
                ) {
                    continue; // an order without idle slots, not lockstep columns
                }
                let column = steps_of(&compute);
                for (rank, action, start, _) in timed.actions() {
                    if action.kind().is_compute() {
                        let col = column[&(rank, action.to_string())];
                        assert!(
                            start <= col as f64,
                            "{name}: {action} at {start} > column {col}"
                        );
                    }
                }
                let columns = compute.ranks.iter().map(Vec::len).max().unwrap_or(0);
                assert!(timed.makespan <= columns as f64, "{name}");
                if matches!(
                    kind,
                    ScheduleKind::LoopedBfs | ScheduleKind::InterleavedZeroBubble
                ) {
                    assert_eq!(timed.makespan, columns as f64, "{name}");
                }
            }
        }
    }
}

fn steps_of(timeline: &Schedule) -> HashMap<(usize, String), usize> {
    let mut out = HashMap::new();
    for (rank, row) in timeline.ranks.iter().enumerate() {
        for (step, action) in row.iter().enumerate() {
            if let Some(action) = action {
                out.insert((rank, action.to_string()), step);
            }
        }
    }
    out
}

/// Comm latency L on every boundary widens GPipe (F = B = 1) by exactly
/// 2(p - 1)L: the first forward and the last backward each cross p - 1
/// boundaries; bytes over bandwidth count the same as latency, and a
/// single slow boundary widens it by twice its own cost.
#[test]
fn comm_latency_widens_the_makespan_by_the_crossings() {
    for (p, m) in SHAPES {
        let base = 2.0 * (m + p - 1) as f64;
        for latency in [0.25, 1.0, 3.0] {
            let costs = Costs::uniform(1.0, 1.0, 1.0, 1.0).with_latency(latency);
            let r = run(ScheduleKind::GPipe, p, 1, m, &costs);
            let expected = base + 2.0 * (p - 1) as f64 * latency;
            assert!(
                close(r.makespan, expected),
                "p={p} m={m} L={latency}: {}",
                r.makespan
            );
        }
        let mut costs = Costs::uniform(1.0, 1.0, 1.0, 1.0);
        costs.activation_bytes = 100.0;
        costs.link.bandwidth = 200.0; // 0.5 per transfer
        let r = run(ScheduleKind::GPipe, p, 1, m, &costs);
        assert!(close(r.makespan, base + (p - 1) as f64), "p={p} m={m}");
        let costs: Costs = "F=1,B=1,latency@0=2".parse().expect("costs");
        let r = run(ScheduleKind::GPipe, p, 1, m, &costs);
        assert!(close(r.makespan, base + 4.0), "p={p} m={m}: {}", r.makespan);
    }
}

/// Two stages on one rank hand over locally: latency does not apply to
/// them (the V placement's turn-around boundary on the last rank).
#[test]
fn local_handoffs_pay_no_latency() {
    let compute = schedule(&[&["0F0", "1F0", "1B0", "0B0"]]);
    let r = simulate_timed(
        &compute,
        &[0, 0],
        &Costs::uniform(1.0, 2.0, 1.0, 1.0).with_latency(5.0),
    )
    .expect("runs");
    assert_eq!(r.makespan, 6.0);
    assert_eq!(r.ranks[0].bubble, 0.0);
}

/// OVERLAP_F_B costs the max of its forward and backward; its outputs
/// exist at its end; it holds both activations at its peak.
#[test]
fn overlap_costs_the_max_of_its_sub_actions() {
    let compute = schedule(&[&["0F0", "0F1", "(0F2;0B0)OVERLAP_F_B", "0B1", "0B2"]]);
    let r = simulate_timed(&compute, &[0], &Costs::uniform(1.0, 3.0, 1.0, 1.0)).expect("runs");
    let spans: Vec<(String, f64, f64)> = r
        .actions()
        .map(|(_, a, s, e)| (a.to_string(), s, e))
        .collect();
    assert_eq!(spans[2], ("(0F2;0B0)OVERLAP_F_B".to_owned(), 2.0, 5.0));
    assert_eq!(r.makespan, 11.0);
    assert_eq!(r.peak_activations(), 3);
}

/// I keeps the activation until W; B frees it at its end.
#[test]
fn activations_live_until_w_when_backward_is_split() {
    let split = schedule(&[&[
        "0F0", "0I0", "0F1", "0I1", "0F2", "0W0", "0W1", "0I2", "0W2",
    ]]);
    let r = simulate_timed(&split, &[0], &Costs::default()).expect("runs");
    assert_eq!(r.peak_activations(), 3);
    let merged = schedule(&[&["0F0", "0B0", "0F1", "0B1", "0F2", "0B2"]]);
    let r = simulate_timed(&merged, &[0], &Costs::default()).expect("runs");
    assert_eq!(r.peak_activations(), 1);
}

/// UNSHARD, RESHARD and REDUCE_GRAD take their configured costs (0 by
/// default) on the rank.
#[test]
fn per_stage_actions_take_their_costs() {
    let compute = schedule(&[&["0UNSHARD", "0F0", "0B0", "0REDUCE_GRAD", "0RESHARD"]]);
    let free = simulate_timed(&compute, &[0], &Costs::default()).expect("runs");
    assert_eq!(free.makespan, 3.0);
    let costs: Costs = "UNSHARD=0.5,RESHARD=0.25,REDUCE_GRAD=2"
        .parse()
        .expect("costs");
    let paid = simulate_timed(&compute, &[0], &costs).expect("runs");
    assert_eq!(paid.makespan, 5.75);
}

/// A consumer placed before its receive never starts: a typed error
/// names the waiting action and what it waits for.
#[test]
fn a_receive_after_its_consumer_is_reported_stuck() {
    let lowered = schedule(&[
        &["0F0", "0SEND_F0", "0RECV_B0", "0B0"],
        &["1F0", "1RECV_F0", "1B0", "1SEND_B0"],
    ]);
    let err = simulate_timed(&lowered, &[0, 1], &Costs::default()).expect_err("stuck");
    let TimedError::Stuck { waiting } = &err else {
        panic!("{err}")
    };
    assert_eq!(waiting.len(), 2, "{err}");
    assert_eq!(waiting[1].rank, 1);
    assert_eq!(waiting[1].action.to_string(), "1F0");
    let text = err.to_string();
    assert!(
        text.contains("rank 1 waits at 1F0 for 1RECV_F0 to be posted"),
        "{text}"
    );
    assert!(
        text.contains("rank 0 waits at 0B0 for 1SEND_B0 on rank 1"),
        "{text}"
    );
}

/// Two ranks each waiting on the other's later send: a deadlock.
#[test]
fn a_cycle_of_receives_is_a_deadlock() {
    let lowered = schedule(&[
        &["0RECV_B0", "0F0", "0SEND_F0", "0B0"],
        &["1RECV_F0", "1B0", "1F0", "1SEND_B0"],
    ]);
    let err = simulate_timed(&lowered, &[0, 1], &Costs::default()).expect_err("deadlock");
    let text = err.to_string();
    assert!(
        text.contains("rank 1 waits at 1B0 for 1F0 to end on rank 1"),
        "{text}"
    );
}

/// Bad input is refused with a typed error naming it.
#[test]
fn bad_input_gets_typed_errors() {
    let wrong_rank = schedule(&[&["1F0"], &["0F0"]]);
    let err = simulate_timed(&wrong_rank, &[0, 1], &Costs::default()).expect_err("wrong rank");
    assert!(
        matches!(
            err,
            TimedError::WrongRank {
                rank: 0,
                stage: 1,
                owner: 1,
                ..
            }
        ),
        "{err}"
    );
    let unknown = schedule(&[&["0F0", "5F0"]]);
    let err = simulate_timed(&unknown, &[0], &Costs::default()).expect_err("unknown stage");
    assert!(
        matches!(err, TimedError::UnknownStage { stage: 5, .. }),
        "{err}"
    );
    let twice = schedule(&[&["0F0", "0F0"]]);
    let err = simulate_timed(&twice, &[0], &Costs::default()).expect_err("twice");
    assert_eq!(err.to_string(), "rank 0: action 0F0 runs a second time");
    let mut negative = Costs::default();
    negative.stage.forward = -1.0;
    let err = simulate_timed(&twice, &[0], &negative).expect_err("negative");
    assert_eq!(err.to_string(), "cost F=-1: must be a finite number >= 0");
}

/// Idle slots in the input are skipped, and all-zero costs give a zero
/// makespan and no bubble rather than NaN.
#[test]
fn idle_slots_and_zero_costs() {
    let compute = schedule(&[&["", "0F0", "", "0B0"]]);
    let r = simulate_timed(&compute, &[0], &Costs::uniform(0.0, 0.0, 0.0, 0.0)).expect("runs");
    assert_eq!(r.makespan, 0.0);
    assert_eq!(r.bubble(), 0.0);
    assert_eq!(r.spans[0].len(), 2);
}

/// The costs text: defaults, B = I + W when only I/W are given, stage
/// and boundary overrides, and typed errors naming the bad item.
#[test]
fn costs_text_parses_and_names_bad_items() {
    let c: Costs = "F=2,I=1.5,W=0.5".parse().expect("costs");
    assert_eq!(c.stage(0).backward, 2.0);
    let c: Costs = "F=1,B=2,F@1=4,bandwidth@2=10,bytes=5"
        .parse()
        .expect("costs");
    assert_eq!(c.stage(1).forward, 4.0);
    assert_eq!(c.stage(1).backward, 2.0);
    assert_eq!(c.transfer(2), 0.5);
    assert_eq!(c.transfer(0), 0.0);
    for (text, error) in [
        ("F=x", "cost F=x: not a number"),
        ("F=1,Q=2", "cost Q=2: unknown key \"Q\"; expected F, B, I, W, UNSHARD, RESHARD, REDUCE_GRAD, latency, bandwidth or bytes"),
        ("F1", "cost F1: expected KEY=VALUE, e.g. F=1"),
        ("F=1,F=2", "cost F=2: F is given twice"),
        ("F@a=1", "cost F@a=1: \"a\" after @ is not a stage or boundary number"),
        ("bytes@1=1", "cost bytes@1=1: bytes takes no @N override"),
        ("B=-2", "cost B=-2: must be a finite number >= 0"),
        ("bandwidth=0", "cost bandwidth=0: bandwidth must be > 0"),
    ] {
        let err = text.parse::<Costs>().expect_err(text);
        assert_eq!(err.to_string(), error, "{text}");
    }
}

/// Placement helper sanity: the V placement's run uses local handoffs on
/// the turn-around rank, so ZBV with latency pays fewer crossings than
/// 2 x (2p - 1) per microbatch would.
#[test]
fn v_placement_turn_around_is_local() {
    let placement = Placement::V.stage_to_rank(4, 2).expect("placement");
    assert_eq!(placement, vec![0, 1, 1, 0]);
    let costs = Costs::uniform(1.0, 2.0, 1.0, 1.0);
    let free = run(ScheduleKind::ZbvZeroBubble, 2, 2, 4, &costs);
    let slow = run(
        ScheduleKind::ZbvZeroBubble,
        2,
        2,
        4,
        &costs.clone().with_latency(0.5),
    );
    assert!(slow.makespan > free.makespan);
    let lowered = &slow.schedule;
    let recvs = lowered
        .ranks
        .iter()
        .flatten()
        .flatten()
        .filter(|a| a.kind().is_comm() && a.stage() == 2 && a.to_string().contains("RECV_F"))
        .count();
    assert_eq!(recvs, 0, "stage 1 -> 2 is on one rank");
}

/// A compute-only schedule is simulated as its `add_send_recv` lowering:
/// every compute action gets the same start and end, for every generator,
/// with latency, bandwidth and unequal costs.
#[test]
fn compute_only_runs_as_its_lowering() {
    let mut costs: Costs = "F=1,B=2.5,I=1.25,W=0.75,latency=0.3,latency@1=0.7,REDUCE_GRAD=0.5"
        .parse()
        .expect("costs");
    costs.activation_bytes = 10.0;
    costs.link.bandwidth = 40.0;
    for kind in ScheduleKind::ALL {
        for per_rank in [1, 2] {
            for (p, m) in [(2, 4), (4, 4), (4, 8), (3, 6)] {
                let Ok(compute) = kind.generate(p, per_rank, m) else {
                    continue;
                };
                let placement = kind
                    .placement()
                    .stage_to_rank(p * per_rank, p)
                    .expect("placement");
                let lowered = add_send_recv(&compute, &placement).expect("lowers");
                let direct = simulate_timed(&compute, &placement, &costs).expect("direct");
                let via = simulate_timed(&lowered, &placement, &costs).expect("lowered");
                let name = format!("{kind} p={p} x{per_rank} m={m}");
                assert_eq!(direct.makespan, via.makespan, "{name}");
                let times = |run: &TimedRun| -> Vec<(usize, String, f64, f64)> {
                    run.actions()
                        .filter(|(_, a, _, _)| !a.kind().is_comm())
                        .map(|(r, a, s, e)| (r, a.to_string(), s, e))
                        .collect()
                };
                assert_eq!(times(&direct), times(&via), "{name}");
                for (a, b) in direct.ranks.iter().zip(&via.ranks) {
                    assert_eq!(a, b, "{name}");
                }
            }
        }
    }
}

/// Huge microbatch numbers in a hand-written schedule cost memory in
/// proportion to the schedule, not to the numbers, and give the same
/// times as small ones.
#[test]
fn huge_microbatch_numbers_stay_cheap() {
    let big = ferry_schedule::MAX_MICROBATCH;
    let huge = format!("0F{big},0F7,0B{big},0B7\r\n1F{big},1F7,1B{big},1B7\r\n");
    let small = "0F0,0F1,0B0,0B1\r\n1F0,1F1,1B0,1B1\r\n";
    let costs = Costs::uniform(1.0, 2.0, 1.0, 1.0).with_latency(0.5);
    let huge =
        simulate_timed(&Schedule::from_csv(&huge).expect("csv"), &[0, 1], &costs).expect("runs");
    let small =
        simulate_timed(&Schedule::from_csv(small).expect("csv"), &[0, 1], &costs).expect("runs");
    assert_eq!(huge.makespan, small.makespan);
    assert_eq!(huge.spans, small.spans);
    // A stuck one still names what it waits for.
    let stuck = format!("0F{big},0B{big}\r\n1F{}\r\n", big - 1);
    let err = simulate_timed(&Schedule::from_csv(&stuck).expect("csv"), &[0, 1], &costs)
        .expect_err("stuck");
    assert!(
        err.to_string()
            .contains(&format!("1B{big} or 1I{big} to end on rank 1")),
        "{err}"
    );
}
