//! SEND/RECV insertion against PyTorch's `_add_send_recv` on its own
//! schedules (`tests/golden/comms/`, written by `tests/golden/gen.py`).

use std::path::Path;

use ferry_schedule::{add_send_recv, LowerError, Schedule, ScheduleKind};

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
