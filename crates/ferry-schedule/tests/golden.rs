//! PyTorch 2.13's own schedules (written by `tests/golden/gen.py` with the
//! real `torch.distributed.pipelining`) read and write back byte for byte.

use std::path::Path;

use ferry_schedule::Schedule;

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
