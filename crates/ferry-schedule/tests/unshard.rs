//! UNSHARD/RESHARD insertion against PyTorch's `_add_unshard_reshard`
//! (`tests/golden/unshard/`, written by `tests/golden/gen.py`), and its
//! invariants on every generated schedule.

use std::collections::BTreeSet;
use std::num::NonZeroUsize;
use std::path::Path;

use ferry_schedule::{
    add_send_recv, add_unshard_reshard, simulate_unit_steps, validate, Action, ActionKind,
    Schedule, ScheduleKind, DEFAULT_MAX_ACTIVE_STAGES,
};

fn window(k: usize) -> NonZeroUsize {
    NonZeroUsize::new(k).expect("non-zero")
}

fn read(path: &Path) -> Schedule {
    let text = std::fs::read_to_string(path).expect("readable fixture");
    Schedule::from_csv(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn matches_pytorch_add_unshard_reshard() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/unshard");
    let mut inputs: Vec<String> = std::fs::read_dir(&dir)
        .expect("unshard fixtures")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".csv") && !n.contains("_a"))
        .collect();
    inputs.sort();
    assert!(inputs.len() >= 10, "{inputs:?}");
    let mut compared = 0;
    for name in &inputs {
        let input = read(&dir.join(name));
        let shape = name.trim_end_matches(".csv");
        for k in 1..=3 {
            let expected = std::fs::read_to_string(dir.join(format!("{shape}_a{k}.csv")))
                .expect("output fixture");
            let ours = add_unshard_reshard(&input, window(k));
            assert_eq!(ours.to_csv(), expected, "{shape}, max_active_stages {k}");
            compared += 1;
        }
    }
    assert!(compared >= 30, "{compared}");
}

#[test]
fn generators_give_pytorch_inputs_for_the_fixture_shapes() {
    // The fixtures' inputs are PyTorch's own tables; Ferry's generators
    // give the same ones, so the pass lowers Ferry's schedules alike.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/unshard");
    for (kind, name, ranks, per_rank, micro) in [
        (ScheduleKind::GPipe, "gpipe", 2, 1, 4),
        (ScheduleKind::Interleaved1F1B, "interleaved1f1b", 2, 2, 4),
        (ScheduleKind::ZbvZeroBubble, "zbv", 4, 2, 8),
        (ScheduleKind::DualPipeV, "dualpipev", 2, 2, 4),
    ] {
        let shape = format!("{name}_r{ranks}_s{per_rank}_m{micro}");
        let theirs = read(&dir.join(format!("{shape}.csv")));
        let ours = kind.generate(ranks, per_rank, micro).expect("generates");
        let strip = |s: &Schedule| -> Vec<Vec<Action>> {
            s.ranks
                .iter()
                .map(|r| r.iter().flatten().cloned().collect())
                .collect()
        };
        assert_eq!(strip(&ours), strip(&theirs), "{shape}");
    }
}

#[test]
fn small_cases_by_hand() {
    let s = Schedule::from_csv("0F0,,2F0,0F1,2B0,0B0\r\n").expect("parses");
    // Window 1: every change of stage reshards the old one first.
    assert_eq!(
        add_unshard_reshard(&s, window(1)).to_csv(),
        "0UNSHARD,0F0,0RESHARD,2UNSHARD,2F0,2RESHARD,0UNSHARD,0F1,0RESHARD,\
         2UNSHARD,2B0,2RESHARD,0UNSHARD,0B0,0RESHARD\r\n"
    );
    // Window 2: both stay gathered; stage 2 is prefetched before 0F0.
    assert_eq!(
        add_unshard_reshard(&s, window(2)).to_csv(),
        "0UNSHARD,2UNSHARD,0F0,2F0,0F1,2B0,2RESHARD,0B0,0RESHARD\r\n"
    );
    assert_eq!(DEFAULT_MAX_ACTIVE_STAGES.get(), 3);
    assert_eq!(
        add_unshard_reshard(&Schedule::new(vec![vec![], vec![None]]), window(3)),
        Schedule::new(vec![vec![], vec![]])
    );
}

/// Checks on one rank's lowered list that a stage computes only while
/// gathered, UNSHARD and RESHARD alternate, and at most `limit` stages
/// are gathered at once.
fn check_gathered(row: &[Option<Action>], limit: usize) -> Result<(), String> {
    let mut gathered = BTreeSet::new();
    for action in row.iter().flatten() {
        match action.kind() {
            ActionKind::Unshard => {
                if !gathered.insert(action.stage()) {
                    return Err(format!("{action}: already gathered"));
                }
                if gathered.len() > limit {
                    return Err(format!("{action}: {gathered:?} gathered"));
                }
            }
            ActionKind::Reshard => {
                let was_gathered = gathered.remove(&action.stage());
                if !was_gathered {
                    return Err(format!("{action}: not gathered"));
                }
            }
            kind if kind.is_compute() || kind == ActionKind::ReduceGrad => {
                let subs = action.sub_actions();
                let leaves = if subs.is_empty() {
                    std::slice::from_ref(action)
                } else {
                    subs
                };
                for leaf in leaves {
                    if !gathered.contains(&leaf.stage()) {
                        return Err(format!("{action}: stage {} not gathered", leaf.stage()));
                    }
                }
            }
            _ => {}
        }
    }
    if gathered.is_empty() {
        Ok(())
    } else {
        Err(format!("{gathered:?} still gathered at the end"))
    }
}

#[test]
fn every_generated_schedule_unshards_lowers_and_simulates() {
    let mut checked = 0;
    for kind in ScheduleKind::ALL {
        for ranks in [2, 3, 4] {
            for per_rank in [1, 2, 3] {
                for micro in [2, 4, 8] {
                    let Ok(compute) = kind.generate(ranks, per_rank, micro) else {
                        continue;
                    };
                    let placement = kind
                        .placement()
                        .stage_to_rank(ranks * per_rank, ranks)
                        .expect("placement");
                    for k in 1..=3 {
                        let shape = format!("{kind} {ranks}x{per_rank} m{micro} window {k}");
                        let fsdp = add_unshard_reshard(&compute, window(k));
                        // An OVERLAP_F_B may hold one stage more than the window.
                        let limit = if kind == ScheduleKind::DualPipeV {
                            k + 1
                        } else {
                            k
                        };
                        for (rank, row) in fsdp.ranks.iter().enumerate() {
                            check_gathered(row, limit)
                                .unwrap_or_else(|e| panic!("{shape} rank {rank}: {e}"));
                        }
                        let lowered = add_send_recv(&fsdp, &placement)
                            .unwrap_or_else(|e| panic!("{shape}: {e}"));
                        validate(&lowered, micro).unwrap_or_else(|e| panic!("{shape}: {e}"));
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
    }
    assert!(checked >= 100, "{checked}");
}
