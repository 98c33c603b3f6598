//! CSV import and export against bytes written by Python's `csv` module
//! (what PyTorch's `_dump_csv` uses).

use std::num::NonZeroUsize;

use ferry_schedule::{
    add_send_recv, add_unshard_reshard, defer_recvs, Action, ActionKind, CsvError, DeferOptions,
    Schedule, ScheduleKind,
};
use proptest::prelude::*;

#[test]
fn compute_only_matches_python_bytes() {
    // Written by `csv.writer` for [[0F0, None, 0B0], [None, 1F0, 1B0]].
    let bytes = "0F0,,0B0\r\n,1F0,1B0\r\n";
    let schedule = Schedule::from_csv(bytes).expect("parses");
    assert_eq!(schedule.ranks[0][1], None);
    assert_eq!(schedule.ranks[1][1], Some(Action::forward(1, 0)));
    assert_eq!(schedule.to_csv(), bytes);
}

#[test]
fn compute_comms_with_compound_and_per_stage_actions() {
    let bytes = "0UNSHARD,0F0,0SEND_F0,(0F1;3B0)OVERLAP_F_B,0REDUCE_GRAD\r\n1RECV_F0,1F0\r\n";
    let schedule = Schedule::from_csv(bytes).expect("parses");
    assert_eq!(
        schedule.ranks[0][0],
        Some(Action::per_stage(0, ActionKind::Unshard))
    );
    assert_eq!(
        schedule.ranks[0][3].as_ref().map(|a| a.sub_actions().len()),
        Some(2)
    );
    assert_eq!(schedule.to_csv(), bytes);
}

#[test]
fn python_quirks_single_empty_cell_and_empty_rows() {
    // csv.writer writes a row of one empty cell as `""`, an empty row as a
    // bare line end.
    let schedule = Schedule::new(vec![vec![None], vec![], vec![Some(Action::forward(0, 0))]]);
    assert_eq!(schedule.to_csv(), "\"\"\r\n\r\n0F0\r\n");
    assert_eq!(Schedule::from_csv(&schedule.to_csv()), Ok(schedule));
    // `\n` line ends and quoted cells read as Python's reader reads them.
    let read = Schedule::from_csv("\"0F0\",\n1F0").expect("parses");
    assert_eq!(
        read.ranks,
        vec![
            vec![Some(Action::forward(0, 0)), None],
            vec![Some(Action::forward(1, 0))]
        ]
    );
}

#[test]
fn bad_cells_name_rank_and_step() {
    let err = Schedule::from_csv("0F0,0F1\r\n1F0,,1Z0\r\n").expect_err("bad cell");
    assert!(
        matches!(
            err,
            CsvError::Action {
                rank: 1,
                step: 2,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("rank 1 (CSV row 2), step 2"),
        "{err}"
    );
    assert!(err.to_string().contains("\"1Z0\""), "{err}");
    assert_eq!(
        Schedule::from_csv("\"0F0"),
        Err(CsvError::UnclosedQuote { rank: 0 })
    );
    assert_eq!(
        Schedule::from_csv("\"0F0\"x"),
        Err(CsvError::AfterQuote { rank: 0, step: 0 })
    );
}

/// Any schedule a generator makes, in the `compute_only` form, lowered to
/// the `compute_comms` form, and with FSDP and deferred receives on top.
fn valid_schedules() -> impl Strategy<Value = Vec<Schedule>> {
    (
        prop::sample::select(ScheduleKind::ALL.to_vec()),
        1usize..6,
        1usize..4,
        1usize..10,
        1usize..4,
    )
        .prop_filter_map(
            "shape the schedule refuses",
            |(kind, ranks, per_rank, micro, window)| {
                let compute = kind.generate(ranks, per_rank, micro).ok()?;
                let placement = kind
                    .placement()
                    .stage_to_rank(ranks * per_rank, ranks)
                    .ok()?;
                let lowered = add_send_recv(&compute, &placement).ok()?;
                let window = NonZeroUsize::new(window)?;
                let fsdp =
                    add_send_recv(&add_unshard_reshard(&compute, window), &placement).ok()?;
                let deferred = defer_recvs(&lowered, &placement, DeferOptions::default()).ok()?;
                Some(vec![compute, lowered, fsdp, deferred])
            },
        )
}

proptest! {
    #[test]
    fn valid_schedules_round_trip(schedules in valid_schedules()) {
        for schedule in schedules {
            let csv = schedule.to_csv();
            let read = Schedule::from_csv(&csv);
            prop_assert_eq!(read.as_ref(), Ok(&schedule));
            // Byte for byte: writing what was read gives the same text.
            prop_assert_eq!(read.map(|s| s.to_csv()), Ok(csv));
        }
    }

    /// Text in CSV shape (cells that are actions, near-misses, quotes,
    /// blanks, every kind of line end) parses or not; what parses writes
    /// back to text that reads as the same schedule.
    #[test]
    fn parsed_csv_round_trips(
        text in "((\"?[0-9]{0,2}(F|B|I|W|SEND_F|RECV_B|UNSHARD|REDUCE_GRAD|OVERLAP_F_B)?[0-9]{0,2}\"?| |\\(0F1;1B0\\)OVERLAP_F_B|\"\")(,|\r\n|\n|\r)){0,12}"
    ) {
        if let Ok(schedule) = Schedule::from_csv(&text) {
            let csv = schedule.to_csv();
            prop_assert_eq!(Schedule::from_csv(&csv), Ok(schedule));
        }
    }
}
