//! A failed step names what failed, exactly: a panic in a stage's forward
//! or in the loss is the same `Stage` error as a returned one (the worker
//! stays usable for a rebuilt pipeline), a backward that libtorch refuses
//! names its backward action, and a stage that stalls is named by the
//! `Timeout` of the action that waited for it.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::sync::{Condvar, Mutex};
use std::time::Duration;

use common::*;
use ferry_pipeline::{Awaited, LossFn, Pipeline, PipelineError, Stage, StageFn, Stages};
use ferry_rpc::{BoxError, Function, RpcOptions};
use ferry_schedule::ScheduleKind;
use ferry_tch::Tensor;
use serde::{Deserialize, Serialize};
use tch::Reduction;

/// What a [`Faulty`] block does wrong.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum Fault {
    /// Panics at this forward (counted across steps).
    PanicAt(usize),
    /// Modifies a tensor its backward needs, in place, so that libtorch
    /// refuses the backward.
    BreakBackward,
    /// Blocks this forward until [`RELEASE`] is called.
    StallAt(usize),
}

/// A test block with a fault.
struct Faulty {
    block: Block,
    fault: Fault,
    forwards: usize,
}

impl Stage for Faulty {
    type Input = Tensor;
    type Output = Tensor;
    fn forward(&mut self, x: Tensor) -> Result<Tensor, BoxError> {
        let n = self.forwards;
        self.forwards += 1;
        match self.fault {
            Fault::PanicAt(at) if at == n => panic!("injected panic at forward {n}"),
            Fault::StallAt(at) if at == n => gate_wait(),
            Fault::BreakBackward => {
                // sigmoid saves its output for the backward; changing it in
                // place makes the backward fail in libtorch.
                let mut y = self.block.apply(&x).sigmoid();
                let _ = y.f_add_scalar_(1.0)?;
                return Ok(Tensor::from(y));
            }
            _ => {}
        }
        Ok(Tensor::from(self.block.apply(&x)))
    }
    fn parameters(&self) -> Vec<tch::Tensor> {
        self.block.parameters()
    }
}

const FAULTY: StageFn<(BlockArgs, Fault), Faulty> = StageFn::new("faulty");

/// A mean-squared loss that panics when the target's first value is
/// [`PANIC_MARK`].
const PANICKY_LOSS: LossFn<Tensor> = LossFn::new("panicky_loss");
const PANIC_MARK: f64 = 1234.0;

/// Opens the gate a stalled forward waits at.
const RELEASE: Function<(), ()> = Function::new("blame_release");

static GATE: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());

fn gate_wait() {
    let (open, changed) = &GATE;
    let mut open = open.lock().unwrap();
    while !*open {
        open = changed.wait(open).unwrap();
    }
}

fn gate_open() {
    let (open, changed) = &GATE;
    *open.lock().unwrap() = true;
    changed.notify_all();
}

fn start_blame(rank: u32) {
    let mut stages: Stages = stages();
    stages.add(FAULTY, |(args, fault): (BlockArgs, Fault)| {
        Ok::<_, BoxError>(Faulty {
            block: Block::new(args),
            fault,
            forwards: 0,
        })
    });
    stages.add_loss(PANICKY_LOSS, |out: Tensor, target: Tensor| {
        if target.double_value(&[0, 0]) == PANIC_MARK {
            panic!("injected panic in the loss");
        }
        Ok::<_, BoxError>(out.mse_loss(&target, Reduction::Mean))
    });
    let mut options = RpcOptions::from_env(format!("worker{rank}")).unwrap();
    options.functions.add(RELEASE, |()| gate_open());
    ferry_pipeline::install(&mut options, stages);
    ferry::init_rpc(options).unwrap();
}

/// Four stages on workers 0, 1, 0, 1 (1, 0 for the V), the last one
/// faulty when `fault` is given.
fn faulty_pipeline(
    kind: ScheduleKind,
    fault: Option<Fault>,
    loss: LossFn<Tensor>,
) -> Pipeline<Tensor> {
    let workers: &[u32] = if kind == ScheduleKind::ZbvZeroBubble {
        &[0, 1, 1, 0]
    } else {
        &[0, 1, 0, 1]
    };
    let args = block_args(4);
    let mut builder = Pipeline::builder();
    for stage in 0..3 {
        builder = builder.stage(workers[stage], BLOCK, args[stage]);
    }
    let builder = match fault {
        Some(fault) => builder.stage(workers[3], FAULTY, (args[3], fault)),
        None => builder.stage(workers[3], BLOCK, args[3]),
    };
    builder
        .schedule(kind)
        .microbatches(4)
        .loss(loss)
        .build()
        .unwrap()
}

/// The `Stage` error's fields, or a panic naming what came instead.
fn stage_error(err: PipelineError) -> (usize, String, String, Option<usize>, String) {
    match err {
        PipelineError::Stage {
            stage,
            worker,
            action,
            microbatch,
            message,
        } => (stage, worker, action, microbatch, message),
        other => panic!("expected a Stage error, got {other:?}"),
    }
}

const SCHEDULES: [ScheduleKind; 3] = [
    ScheduleKind::Interleaved1F1B,
    ScheduleKind::InterleavedZeroBubble,
    ScheduleKind::ZbvZeroBubble,
];

#[test]
fn a_panic_in_a_forward_or_the_loss_is_a_stage_error_and_the_worker_stays_usable() {
    let test = "a_panic_in_a_forward_or_the_loss_is_a_stage_error_and_the_worker_stays_usable";
    let Some(outputs) = ferry_testkit::world_ok(test, 2, |rank| {
        start_blame(rank);
        if rank == 0 {
            let (x, y) = batch(0, 8);
            for kind in SCHEDULES {
                let last_worker = if kind == ScheduleKind::ZbvZeroBubble {
                    "worker0"
                } else {
                    "worker1"
                };
                // A panic in stage 3's forward of microbatch 1.
                let mut p = faulty_pipeline(kind, Some(Fault::PanicAt(1)), MSE_MEAN);
                let (stage, worker, action, mb, message) = stage_error(p.step(&x, &y).unwrap_err());
                assert_eq!(
                    (stage, worker.as_str(), action.as_str(), mb),
                    (3, last_worker, "3F1", Some(1)),
                    "{kind:?}"
                );
                assert_eq!(message, "forward panicked: injected panic at forward 1");
                drop(p);
                // A panic in the loss of microbatch 2.
                let mut p = faulty_pipeline(kind, None, PANICKY_LOSS);
                let marked = y.copy();
                let _ = marked.get(4).get(0).fill_(PANIC_MARK);
                let (stage, worker, action, mb, message) =
                    stage_error(p.step(&x, &marked).unwrap_err());
                assert_eq!(
                    (stage, worker.as_str(), action.as_str(), mb),
                    (3, last_worker, "3F2", Some(2)),
                    "{kind:?}"
                );
                assert_eq!(message, "the loss panicked: injected panic in the loss");
                // The same pipeline trains on good targets, and a rebuilt
                // one too: the workers are usable.
                p.step(&x, &y).unwrap();
                drop(p);
                let mut p = faulty_pipeline(kind, None, MSE_MEAN);
                assert!(p.step(&x, &y).unwrap().losses.iter().all(|l| l.is_finite()));
                println!("PANICS={kind:?}");
            }
        }
        ferry_rpc::shutdown().unwrap();
    }) else {
        return;
    };
    assert_eq!(outputs[0].values("PANICS").len(), SCHEDULES.len());
}

#[test]
fn a_backward_libtorch_refuses_names_its_backward_action() {
    let test = "a_backward_libtorch_refuses_names_its_backward_action";
    let Some(outputs) = ferry_testkit::world_ok(test, 2, |rank| {
        start_blame(rank);
        if rank == 0 {
            let (x, y) = batch(0, 8);
            for kind in SCHEDULES {
                let mut p = faulty_pipeline(kind, Some(Fault::BreakBackward), MSE_MEAN);
                let (stage, _, action, mb, message) = stage_error(p.step(&x, &y).unwrap_err());
                assert_eq!(stage, 3, "{kind:?}");
                assert!(
                    action.starts_with("3B") || action.starts_with("3I"),
                    "{kind:?}: {action}"
                );
                assert_eq!(mb, Some(0), "{kind:?}");
                assert!(message.starts_with("backward failed: "), "{message}");
                assert!(message.contains("inplace operation"), "{message}");
                println!("BACKWARD={kind:?}");
            }
        }
        ferry_rpc::shutdown().unwrap();
    }) else {
        return;
    };
    assert_eq!(outputs[0].values("BACKWARD").len(), SCHEDULES.len());
}

#[test]
fn a_stalled_stage_is_named_by_the_timeout_of_the_action_that_waited_for_it() {
    let test = "a_stalled_stage_is_named_by_the_timeout_of_the_action_that_waited_for_it";
    let Some(outputs) = ferry_testkit::world_ok(test, 2, |rank| {
        start_blame(rank);
        if rank == 0 {
            let args = block_args(2);
            let limit = Duration::from_secs(1);
            // Stage 1 (worker1) stalls in the forward of microbatch 1.
            let mut p = Pipeline::builder()
                .stage(0, BLOCK, args[0])
                .stage(1, FAULTY, (args[1], Fault::StallAt(1)))
                .schedule(ScheduleKind::GPipe)
                .microbatches(4)
                .loss(MSE_MEAN)
                .timeout(limit)
                .build()
                .unwrap();
            let (x, y) = batch(0, 8);
            let err = p.step(&x, &y).unwrap_err();
            RELEASE.rpc_sync(1, ()).unwrap();
            match &err {
                PipelineError::Timeout {
                    stage,
                    worker,
                    what,
                    microbatch,
                    action,
                    waiting_worker,
                    limit: waited,
                } => {
                    assert_eq!(
                        (
                            *stage,
                            worker.as_str(),
                            *what,
                            *microbatch,
                            action.as_str(),
                            waiting_worker.as_str(),
                            *waited
                        ),
                        (1, "worker1", Awaited::Gradient, 0, "0B0", "worker0", limit),
                        "{err}"
                    );
                }
                other => panic!("expected a Timeout, got {other:?}"),
            }
            assert_eq!(
                err.to_string(),
                "stage 1 on worker worker1 did not deliver the gradient of microbatch 0 within \
                 1s: action 0B0 on worker worker0 waited for it"
            );
            println!("BLAMED=ok");
        }
        ferry_rpc::shutdown().unwrap();
    }) else {
        return;
    };
    assert_eq!(outputs[0].values("BLAMED"), ["ok"]);
}

#[test]
fn a_pipeline_without_a_time_limit_waits_as_long_as_it_takes() {
    let test = "a_pipeline_without_a_time_limit_waits_as_long_as_it_takes";
    let Some(outputs) = ferry_testkit::world_ok(test, 2, |rank| {
        start_blame(rank);
        if rank == 0 {
            let args = block_args(4);
            // Zero is "no limit", as for an RPC timeout: every wait for a
            // value (there is one per microbatch and stage boundary) waits.
            let mut p = Pipeline::builder()
                .stage(0, BLOCK, args[0])
                .stage(1, BLOCK, args[1])
                .stage(0, BLOCK, args[2])
                .stage(1, BLOCK, args[3])
                .schedule(ScheduleKind::Interleaved1F1B)
                .microbatches(4)
                .loss(MSE_MEAN)
                .timeout(Duration::ZERO)
                .build()
                .unwrap();
            let (x, y) = batch(0, 8);
            let out = p.step(&x, &y).unwrap();
            assert_eq!(out.losses.len(), 4);
            drop(p);
            println!("UNLIMITED=ok");
        }
        ferry_rpc::shutdown().unwrap();
    }) else {
        return;
    };
    assert_eq!(outputs[0].values("UNLIMITED"), ["ok"]);
}
