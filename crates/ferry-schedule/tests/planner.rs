//! The planner: every generator at every stages-per-rank, simulated with
//! durations and ranked by makespan within a memory limit.

use ferry_schedule::{plan, plan_table, Costs, PlanRequest, PlanRow, PlanStats, ScheduleKind};

fn costs(text: &str) -> Costs {
    text.parse().expect("costs")
}

fn stats(rows: &[PlanRow], kind: ScheduleKind, per_rank: usize) -> &PlanStats {
    let row = rows
        .iter()
        .find(|r| r.schedule == kind && r.stages_per_rank == per_rank)
        .unwrap_or_else(|| panic!("{kind} x{per_rank} missing"));
    row.outcome
        .as_ref()
        .unwrap_or_else(|e| panic!("{kind} x{per_rank}: {e}"))
}

/// Every generator appears at every stages-per-rank asked for: built and
/// simulated, or with the generator's own error text.
#[test]
fn every_generator_at_every_stages_per_rank_is_a_row() {
    let rows = plan(&PlanRequest::new(4, 8, 100.0, Costs::default()));
    assert_eq!(rows.len(), ScheduleKind::ALL.len() * 2);
    for kind in ScheduleKind::ALL {
        for per_rank in [1, 2] {
            let row = rows
                .iter()
                .find(|r| r.schedule == kind && r.stages_per_rank == per_rank)
                .expect("row");
            match (&row.outcome, kind.generate(4, per_rank, 8)) {
                (Ok(_), Ok(_)) => {}
                (Err(reason), Err(e)) => assert_eq!(reason, &e.to_string()),
                (outcome, generated) => {
                    panic!("{kind} x{per_rank}: {outcome:?} vs {:?}", generated.err())
                }
            }
        }
    }
    let gpipe2 = rows
        .iter()
        .find(|r| r.schedule == ScheduleKind::GPipe && r.stages_per_rank == 2)
        .expect("row");
    assert_eq!(
        gpipe2.outcome,
        Err(
            "ScheduleGPipe is a single-stage schedule: it runs exactly 1 stage per rank, got 2"
                .into()
        )
    );
}

/// Rows are sorted: those that fit by makespan, then those over the
/// limit by makespan, then those that cannot be built.
#[test]
fn rows_are_sorted_fits_first_then_by_makespan() {
    for memory in [3.0, 6.0, 100.0] {
        let rows = plan(&PlanRequest::new(
            4,
            8,
            memory,
            costs("F=1,B=2,I=1,W=1,latency=0.1"),
        ));
        let key = |r: &PlanRow| match &r.outcome {
            Ok(s) => (if s.fits { 0 } else { 1 }, s.makespan),
            Err(_) => (2, f64::INFINITY),
        };
        for pair in rows.windows(2) {
            let (a, b) = (key(&pair[0]), key(&pair[1]));
            assert!(
                a.0 < b.0 || (a.0 == b.0 && a.1 <= b.1),
                "memory {memory}: {a:?} before {b:?}"
            );
        }
        for row in &rows {
            if let Ok(s) = &row.outcome {
                assert_eq!(s.fits, s.peak_activations <= memory, "{row:?}");
            }
        }
    }
}

/// With a tight limit GPipe (m activations) is over it, 1F1B (p) fits.
#[test]
fn a_tight_memory_limit_excludes_gpipe() {
    let rows = plan(&PlanRequest::new(4, 8, 6.0, costs("F=1,B=2,I=1,W=1")));
    let gpipe = stats(&rows, ScheduleKind::GPipe, 1);
    assert_eq!(gpipe.peak_activations, 8.0);
    assert!(!gpipe.fits);
    let one = stats(&rows, ScheduleKind::OneFOneB, 1);
    assert_eq!(one.peak_activations, 4.0);
    assert!(one.fits);
    let first_over = rows
        .iter()
        .position(|r| r.outcome.as_ref().is_ok_and(|s| !s.fits))
        .expect("some are over");
    let gpipe_at = rows
        .iter()
        .position(|r| r.schedule == ScheduleKind::GPipe && r.stages_per_rank == 1)
        .expect("gpipe");
    assert!(gpipe_at >= first_over);
    // With room for every microbatch, GPipe fits too.
    let rows = plan(&PlanRequest::new(4, 8, 8.0, costs("F=1,B=2,I=1,W=1")));
    assert!(stats(&rows, ScheduleKind::GPipe, 1).fits);
}

/// When splitting the backward is free (I + W = B), a zero-bubble
/// schedule wins and ZB-H1 beats 1F1B; when the split doubles the
/// backward's cost (I = W = B), 1F1B beats ZB-H1.
#[test]
fn zero_bubble_wins_when_the_split_is_cheap() {
    let rows = plan(&PlanRequest::new(4, 8, 100.0, costs("F=1,B=2,I=1,W=1")));
    let best = rows[0].schedule;
    assert!(
        matches!(
            best,
            ScheduleKind::InterleavedZeroBubble
                | ScheduleKind::ZbvZeroBubble
                | ScheduleKind::DualPipeV
        ),
        "{best}\n{}",
        plan_table(&rows)
    );
    let zb = stats(&rows, ScheduleKind::InterleavedZeroBubble, 1).makespan;
    let one = stats(&rows, ScheduleKind::OneFOneB, 1).makespan;
    assert!(zb < one, "{zb} vs {one}");
    let rows = plan(&PlanRequest::new(4, 8, 100.0, costs("F=1,B=2,I=2,W=2")));
    let zb = stats(&rows, ScheduleKind::InterleavedZeroBubble, 1).makespan;
    let one = stats(&rows, ScheduleKind::OneFOneB, 1).makespan;
    assert!(one < zb, "{one} vs {zb}");
}

/// The model is held fixed: two stages per rank halve each stage's cost
/// and count each stage activation as half, so the busy work per rank is
/// the same and GPipe-shaped LoopedBFS at 1 stage per rank equals GPipe.
#[test]
fn stages_per_rank_split_the_model_not_double_it() {
    let rows = plan(&PlanRequest::new(4, 8, 100.0, costs("F=1,B=2")));
    let gpipe = stats(&rows, ScheduleKind::GPipe, 1);
    assert_eq!(gpipe.makespan, 33.0);
    // Interleaved at 2 stages per rank does the same work per rank
    // (8 x (1 + 2)) with a smaller bubble.
    let inter = stats(&rows, ScheduleKind::Interleaved1F1B, 2);
    let busy = inter.makespan * (1.0 - inter.bubble);
    assert!((busy - 24.0).abs() < 1e-9, "{busy}");
    assert!(inter.makespan < gpipe.makespan);
    assert_eq!(
        stats(&rows, ScheduleKind::LoopedBfs, 2).peak_activations,
        8.0
    );
}

/// A stages-per-rank list of the caller's, and a shape no generator can
/// build, give error rows rather than a failure.
#[test]
fn chosen_stages_per_rank_and_unbuildable_shapes() {
    let mut request = PlanRequest::new(4, 8, 6.0, Costs::default());
    request.stages_per_rank = vec![2];
    let rows = plan(&request);
    assert_eq!(rows.len(), ScheduleKind::ALL.len());
    assert!(rows.iter().all(|r| r.stages_per_rank == 2));
    let rows = plan(&PlanRequest::new(0, 8, 6.0, Costs::default()));
    assert!(rows.iter().all(|r| r.outcome.is_err()));
    let table = plan_table(&rows);
    assert!(
        table.contains("a schedule needs at least one rank"),
        "{table}"
    );
}

/// The table: a header, one line per row, the best first.
#[test]
fn the_table_lists_every_row_best_first() {
    let rows = plan(&PlanRequest::new(4, 8, 6.0, costs("F=1,B=2,I=1,W=1")));
    let table = plan_table(&rows);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), rows.len() + 1);
    assert!(lines[0].contains("makespan") && lines[0].contains("bubble"));
    assert!(lines[1].trim_start().starts_with("1  "), "{table}");
    assert!(lines[1].contains(rows[0].schedule.pytorch_name()));
    assert!(table.contains("over"));
    assert!(table.contains("requires exactly 2 stages per rank"));
}
