//! PyTorch 2.13's own schedules (written by `tests/golden/gen.py` with the
//! real `torch.distributed.pipelining`) read and write back byte for byte,
//! and the generators equal them: the tables for the multi-stage
//! schedules, the order PyTorch's runtime executes for GPipe and 1F1B.

use std::path::Path;

use ferry_schedule::{Schedule, ScheduleKind};

fn golden_files() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .expect("tests/golden exists")
        .filter_map(|entry| {
            let path = entry.expect("readable entry").path();
            (path.extension()? == "csv").then(|| {
                let text = std::fs::read_to_string(&path).expect("readable golden file");
                (
                    path.file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                    text,
                )
            })
        })
        .collect();
    files.sort();
    files
}

#[test]
fn pytorch_csv_round_trips_byte_for_byte() {
    let files = golden_files();
    assert!(files.len() >= 50, "only {} golden files", files.len());
    let mut compound = 0;
    for (name, text) in files {
        let schedule = Schedule::from_csv(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!schedule.ranks.is_empty(), "{name}");
        compound += schedule
            .ranks
            .iter()
            .flatten()
            .flatten()
            .filter(|a| a.is_compound())
            .count();
        assert_eq!(schedule.to_csv(), text, "{name}");
    }
    // DualPipeV's tables carry OVERLAP_F_B actions.
    assert!(compound > 0);
}

fn kind_of(prefix: &str) -> Option<ScheduleKind> {
    Some(match prefix {
        "gpipe" => ScheduleKind::GPipe,
        "1f1b" => ScheduleKind::OneFOneB,
        "interleaved1f1b" => ScheduleKind::Interleaved1F1B,
        "loopedbfs" => ScheduleKind::LoopedBfs,
        "interleavedzb" => ScheduleKind::InterleavedZeroBubble,
        "zbv" => ScheduleKind::ZbvZeroBubble,
        "dualpipev" => ScheduleKind::DualPipeV,
        _ => return None,
    })
}

/// Parses `<schedule>_r<ranks>_s<per rank>_m<microbatches>.csv`.
fn shape_of(name: &str) -> (&str, usize, usize, usize) {
    let stem = name.trim_end_matches(".csv");
    let parts: Vec<&str> = stem.split('_').collect();
    let num = |p: &str| p[1..].parse::<usize>().expect("numeric shape");
    (parts[0], num(parts[1]), num(parts[2]), num(parts[3]))
}

#[test]
fn generators_match_pytorch_slot_for_slot() {
    let mut compared = 0;
    for (name, text) in golden_files() {
        let (prefix, ranks, per_rank, micro) = shape_of(&name);
        let Some(kind) = kind_of(prefix) else {
            continue;
        };
        let ours = kind
            .generate(ranks, per_rank, micro)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(ours.to_csv(), text, "{name}");
        compared += 1;
    }
    assert!(compared >= 50, "compared only {compared}");
}

#[test]
fn generators_reject_what_pytorch_rejects() {
    let rejected = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/rejected.txt"),
    )
    .expect("rejected.txt");
    let mut checked = 0;
    for line in rejected.lines().filter(|l| !l.starts_with('#')) {
        let (shape, _) = line.split_once(':').expect("shape: error");
        let (prefix, ranks, per_rank, micro) = shape_of(shape);
        let Some(kind) = kind_of(prefix) else {
            continue;
        };
        let err = kind.generate(ranks, per_rank, micro).expect_err(line);
        if line.contains("must be greater than or equal") {
            assert!(
                err.to_string().contains("must be greater than or equal"),
                "{err}"
            );
        }
        checked += 1;
    }
    assert!(checked > 0);
}
