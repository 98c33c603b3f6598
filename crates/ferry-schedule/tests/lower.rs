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
    let failed = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/comms/failed.txt"),
    )
    .expect("failed.txt");
    for line in failed.lines() {
        let (shape, _) = line.split_once(':').expect("shape");
        let (kind, ranks, per_rank, micro) = kind_and_shape(shape);
        let compute = kind.generate(ranks, per_rank, micro).expect("generates");
        let placement: Vec<usize> = (0..ranks).collect();
        let err = add_send_recv(&compute, &placement).expect_err(shape);
        assert!(matches!(err, LowerError::Stuck { .. }), "{err:?}");
        assert!(
            err.to_string().contains("can't schedule sends/recvs"),
            "{err}"
        );
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
        assert_eq!(steps(&timeline), expected, "{shape}");
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
        let timeline = simulate_unit_steps(&lowered, &placement).expect("finishes");
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
