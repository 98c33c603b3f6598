//! SEND/RECV insertion against PyTorch's `_add_send_recv` on its own
//! schedules (`tests/golden/comms/`, written by `tests/golden/gen.py`).

use std::path::Path;

use ferry_schedule::{
    add_send_recv, simulate_unit_steps, steps, LowerError, Schedule, ScheduleKind,
};

fn golden(dir: &str) -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .expect("golden dir")
        .filter_map(|e| {
            let path = e.expect("entry").path();
            (path.extension()? == "csv").then(|| {
                (
                    path.file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                    std::fs::read_to_string(&path).expect("readable"),
                )
            })
        })
        .collect();
    files.sort();
    files
}

fn kind_and_shape(name: &str) -> (ScheduleKind, usize, usize, usize) {
    let parts: Vec<&str> = name.trim_end_matches(".csv").split('_').collect();
    let kind = match parts[0] {
        "gpipe" => ScheduleKind::GPipe,
        "1f1b" => ScheduleKind::OneFOneB,
        "interleaved1f1b" => ScheduleKind::Interleaved1F1B,
        "loopedbfs" => ScheduleKind::LoopedBfs,
        "interleavedzb" => ScheduleKind::InterleavedZeroBubble,
        "zbv" => ScheduleKind::ZbvZeroBubble,
        "dualpipev" => ScheduleKind::DualPipeV,
        other => panic!("unknown schedule {other}"),
    };
    let num = |p: &str| p[1..].parse::<usize>().expect("number");
    (kind, num(parts[1]), num(parts[2]), num(parts[3]))
}

#[test]
fn lowering_matches_pytorch() {
    let files = golden("tests/golden/comms");
    assert!(files.len() >= 45, "{}", files.len());
    for (name, expected) in files {
        let (kind, ranks, per_rank, micro) = kind_and_shape(&name);
        let compute = kind.generate(ranks, per_rank, micro).expect("generates");
        let placement = kind
            .placement()
            .stage_to_rank(ranks * per_rank, ranks)
            .expect("placement");
        let lowered = add_send_recv(&compute, &placement).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(lowered.to_csv(), expected, "{name}");
    }
}

#[test]
fn pytorch_1f1b_table_is_stuck_as_in_pytorch() {
    // PyTorch's `Schedule1F1B._get_pipeline_order` tables (kept by gen.py
    // in `pytorch_table/`) start the last rank at F1: they cannot be
    // lowered, in PyTorch as here. Ferry generates the runtime order.
    let tables = golden("tests/golden/pytorch_table");
    let mut stuck = 0;
    for (name, text) in tables.iter().filter(|(n, _)| n.starts_with("1f1b")) {
        let (_, ranks, _, _) = kind_and_shape(name);
        let table = Schedule::from_csv(text).expect("parses");
        let placement: Vec<usize> = (0..ranks).collect();
        let err = add_send_recv(&table, &placement).expect_err(name);
        assert!(matches!(err, LowerError::Stuck { .. }), "{err:?}");
        assert!(
            err.to_string().contains("can't schedule sends/recvs"),
            "{err}"
        );
        stuck += 1;
    }
    assert_eq!(stuck, 5);
}

#[test]
fn every_generated_schedule_lowers_validates_and_simulates() {
    let mut checked = 0;
    for kind in ScheduleKind::ALL {
        for ranks in [2, 3, 4] {
            for per_rank in [1, 2] {
                for micro in [2, 4, 6, 8] {
                    let Ok(compute) = kind.generate(ranks, per_rank, micro) else {
                        continue;
                    };
                    let shape = format!("{kind} {ranks}x{per_rank} m{micro}");
                    let placement = kind
                        .placement()
                        .stage_to_rank(ranks * per_rank, ranks)
                        .expect("placement");
                    ferry_schedule::validate(&compute, micro)
                        .unwrap_or_else(|e| panic!("{shape}: {e}"));
                    let lowered = add_send_recv(&compute, &placement)
                        .unwrap_or_else(|e| panic!("{shape}: {e}"));
                    ferry_schedule::validate(&lowered, micro)
                        .unwrap_or_else(|e| panic!("{shape} lowered: {e}"));
                    let timeline = simulate_unit_steps(&lowered, &placement)
                        .unwrap_or_else(|e| panic!("{shape}: {e}"))
                        .to_schedule();
                    let run = timeline.ranks.iter().flatten().flatten().count();
                    let given = lowered.ranks.iter().flatten().flatten().count();
                    assert_eq!(run, given, "{shape}: every action runs once");
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 40, "{checked}");
}

#[test]
fn one_f_one_b_keeps_at_most_p_minus_r_microbatches_in_flight() {
    // The runtime order: rank r runs min(M, p - r) warm-up forwards and
    // from then on never has more than p - r forwards without backward.
    for (ranks, micro) in [(2, 4), (4, 4), (4, 8)] {
        let ours = ScheduleKind::OneFOneB
            .generate(ranks, 1, micro)
            .expect("1f1b");
        for (rank, row) in ours.ranks.iter().enumerate() {
            let mut in_flight: usize = 0;
            let mut most = 0;
            for action in row.iter().flatten() {
                match action.kind() {
                    ferry_schedule::ActionKind::Forward => in_flight += 1,
                    ferry_schedule::ActionKind::FullBackward => in_flight -= 1,
                    _ => {}
                }
                most = most.max(in_flight);
            }
            assert_eq!(most, micro.min(ranks - rank), "{ranks}x{micro} rank {rank}");
            assert_eq!(in_flight, 0);
        }
    }
}

#[test]
fn unknown_stage_is_a_typed_error() {
    let compute = Schedule::from_csv("0F0,3F0\r\n").expect("parses");
    let err = add_send_recv(&compute, &[0, 0]).expect_err("stage 3 is not placed");
    assert!(
        matches!(err, LowerError::UnknownStage { stage: 3, .. }),
        "{err:?}"
    );
}

#[test]
fn simulated_steps_match_pytorch() {
    let steps_txt = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/comms/steps.txt"),
    )
    .expect("steps.txt");
    let mut checked = 0;
    for line in steps_txt.lines() {
        let (shape, expected) = line.split_once(' ').expect("shape steps");
        let expected: usize = expected.parse().expect("number");
        let (kind, ranks, per_rank, micro) = kind_and_shape(shape);
        let placement = kind
            .placement()
            .stage_to_rank(ranks * per_rank, ranks)
            .expect("placement");
        let compute = kind.generate(ranks, per_rank, micro).expect("generates");
        let lowered = add_send_recv(&compute, &placement).expect("lowers");
        let timeline =
            simulate_unit_steps(&lowered, &placement).unwrap_or_else(|e| panic!("{shape}: {e}"));
        assert_eq!(timeline.steps(), expected, "{shape}");
        assert_eq!(steps(&timeline.to_schedule()), expected, "{shape}");
        checked += 1;
    }
    assert!(checked >= 40, "{checked}");
    // PyTorch's test value: InterleavedZeroBubble, 2 ranks x 2 stages x 8.
    assert!(steps_txt.contains("interleavedzb_r2_s2_m8 113"));
}

#[test]
fn simulator_runs_what_pytorch_refuses() {
    // GPipe carries REDUCE_GRAD, DualPipeV carries OVERLAP_F_B.
    for (kind, per_rank) in [(ScheduleKind::GPipe, 1), (ScheduleKind::DualPipeV, 2)] {
        let placement = kind
            .placement()
            .stage_to_rank(2 * per_rank, 2)
            .expect("placement");
        let compute = kind.generate(2, per_rank, 4).expect("generates");
        let lowered = add_send_recv(&compute, &placement).expect("lowers");
        let timeline = simulate_unit_steps(&lowered, &placement)
            .expect("finishes")
            .to_schedule();
        let run: usize = timeline.ranks.iter().flatten().flatten().count();
        let given: usize = lowered.ranks.iter().flatten().flatten().count();
        assert_eq!(run, given, "{kind}: every action runs once");
    }
}

#[test]
fn deadlock_names_the_waiting_actions() {
    // Both ranks receive before they send: neither can move.
    let lowered = Schedule::from_csv("0RECV_B0,0F0,0SEND_F0\r\n1RECV_F0,1F0,1B0,1SEND_B0\r\n")
        .expect("parses");
    let err = simulate_unit_steps(&lowered, &[0, 1]).expect_err("deadlock");
    assert_eq!(err.step, 0);
    let text = err.to_string();
    assert!(
        text.contains("rank 0 waits at 0RECV_B0") && text.contains("rank 1 waits at 1RECV_F0"),
        "{text}"
    );
}

#[test]
fn merge_and_reduce_grad_passes() {
    let s = Schedule::from_csv("0F0,0I0,0W0,,0I1,1W1\r\n").expect("parses");
    let merged = ferry_schedule::merge_input_weight(&s);
    assert_eq!(merged.to_csv(), "0F0,0B0,,0I1,1W1\r\n");
    let with_reduce = ferry_schedule::add_reduce_grad(
        &Schedule::from_csv("0F0,0F1,,0B0,0I1,0W1\r\n").expect("parses"),
        2,
    );
    assert_eq!(with_reduce.to_csv(), "0F0,0F1,0B0,0I1,0W1,0REDUCE_GRAD\r\n");
}
