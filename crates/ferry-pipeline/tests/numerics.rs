//! Every schedule trains exactly like one process without pipelining:
//! losses and parameters after 3 optimizer steps at PyTorch's tolerance
//! (rtol 1e-5, atol 4e-5), for a mean loss with `scale_grads` and for a sum
//! loss without. Two workers on 127.0.0.1; worker 0 drives.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::*;
use ferry_pipeline::{HostCores, ScheduleSpec};
use ferry_schedule::{Schedule, ScheduleKind};

const STEPS: usize = 3;
const MICROBATCHES: usize = 4;

/// Trains `schedule` on workers 0 and 1 and compares with one process.
fn check(schedule: ScheduleSpec, stages: usize, workers: &[u32], sum: bool) {
    check_on(schedule, stages, workers, sum, None);
}

/// [`check`], with the hosts' cores said (`None`: each rank finds out).
fn check_on(
    schedule: ScheduleSpec,
    stages: usize,
    workers: &[u32],
    sum: bool,
    cores: Option<HostCores>,
) {
    let label = format!("{schedule:?} sum={sum} cores={cores:?}");
    let args = block_args(stages);
    let (want_losses, want_params) = reference(&args, MICROBATCHES, sum, STEPS, ROWS);
    let mut builder = builder(workers, &args, schedule, MICROBATCHES, sum);
    if let Some(cores) = cores {
        builder = builder.host_cores(cores);
    }
    let mut pipeline = builder.build().unwrap();
    for (step, want) in want_losses.iter().enumerate() {
        let (x, y) = batch(step as i64, ROWS);
        let out = pipeline
            .step(&x, &y)
            .unwrap_or_else(|e| panic!("{label}: step {step}: {e}"));
        assert_eq!(out.losses.len(), MICROBATCHES);
        for (mb, (got, want)) in out.losses.iter().zip(want).enumerate() {
            assert_close_f64(
                *got,
                *want,
                &format!("{label}: step {step} microbatch {mb} loss"),
            );
        }
        pipeline.optimizer_step().unwrap();
        pipeline.zero_grad().unwrap();
    }
    let params = pipeline.parameters().unwrap();
    for (stage, (got, want)) in params.iter().zip(&want_params).enumerate() {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_close(
                g,
                w,
                &format!("{label}: stage {stage} parameter {i} after {STEPS} steps"),
            );
        }
    }
    println!("CHECKED={label}");
}

const LOOP_2: &[u32] = &[0, 1];
const LOOP_4: &[u32] = &[0, 1, 0, 1];
const V_4: &[u32] = &[0, 1, 1, 0];

fn generated(sum: bool) {
    check(ScheduleKind::GPipe.into(), 2, LOOP_2, sum);
    check(ScheduleKind::OneFOneB.into(), 2, LOOP_2, sum);
    check(ScheduleKind::Interleaved1F1B.into(), 4, LOOP_4, sum);
    check(ScheduleKind::LoopedBfs.into(), 4, LOOP_4, sum);
    check(ScheduleKind::InterleavedZeroBubble.into(), 4, LOOP_4, sum);
    check(ScheduleKind::ZbvZeroBubble.into(), 4, V_4, sum);
    check(ScheduleKind::DualPipeV.into(), 4, V_4, sum);
}

#[test]
fn every_generated_schedule_matches_one_process_with_a_mean_loss() {
    let Some(outputs) = ferry_testkit::world_ok(
        "every_generated_schedule_matches_one_process_with_a_mean_loss",
        2,
        |rank| {
            start(rank);
            if rank == 0 {
                generated(false);
            }
            ferry_rpc::shutdown().unwrap();
        },
    ) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED").len(), 7);
}

#[test]
fn every_generated_schedule_matches_one_process_with_a_sum_loss() {
    let Some(outputs) = ferry_testkit::world_ok(
        "every_generated_schedule_matches_one_process_with_a_sum_loss",
        2,
        |rank| {
            start(rank);
            if rank == 0 {
                generated(true);
            }
            ferry_rpc::shutdown().unwrap();
        },
    ) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED").len(), 7);
}

/// Cores to spare or not, said rather than counted: the ring readers poll
/// while a stage awaits its input, or sleep soon. Training is the same.
/// The driver holds stages (its rank runs on its own thread) or none
/// (every rank is called).
#[test]
fn training_is_the_same_whether_readers_poll_or_sleep_and_wherever_the_driver_is() {
    let Some(outputs) = ferry_testkit::world_ok(
        "training_is_the_same_whether_readers_poll_or_sleep_and_wherever_the_driver_is",
        3,
        |rank| {
            start(rank);
            if rank == 0 {
                for cores in [HostCores::Spare, HostCores::Scarce] {
                    check_on(
                        ScheduleKind::Interleaved1F1B.into(),
                        4,
                        LOOP_4,
                        false,
                        Some(cores),
                    );
                    check_on(
                        ScheduleKind::ZbvZeroBubble.into(),
                        4,
                        &[1, 2, 2, 1],
                        true,
                        Some(cores),
                    );
                }
            }
            ferry_rpc::shutdown().unwrap();
        },
    ) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED").len(), 4);
}

/// A schedule written by hand in PyTorch's CSV form (compute only): 1F1B
/// with the second microbatch's forward moved early on rank 0, and the I/W
/// split on rank 1.
const CUSTOM_CSV: &str =
    "0F0,0F1,0F2,,0B0,0F3,0B1,0B2,0B3\n,1F0,1I0,1F1,1W0,1I1,1F2,1W1,1I2,1F3,1W2,1I3,1W3\n";

#[test]
fn a_custom_schedule_loaded_from_csv_matches_one_process() {
    let Some(outputs) = ferry_testkit::world_ok(
        "a_custom_schedule_loaded_from_csv_matches_one_process",
        2,
        |rank| {
            start(rank);
            if rank == 0 {
                for sum in [false, true] {
                    let schedule = Schedule::from_csv(CUSTOM_CSV).unwrap();
                    let spec = ScheduleSpec::Custom(schedule);
                    check(spec, 2, LOOP_2, sum);
                }
            }
            ferry_rpc::shutdown().unwrap();
        },
    ) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED").len(), 2);
}
