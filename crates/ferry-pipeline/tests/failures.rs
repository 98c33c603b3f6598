//! Failures end a step with a typed error naming the stage, the worker, the
//! action and the microbatch; no worker is left waiting; bad input is
//! refused before anything runs; a pipeline can be dropped and built again.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::time::Duration;

use common::*;
use ferry_pipeline::{Pipeline, PipelineError, PipelineHost};
use ferry_schedule::ScheduleKind;

/// This worker's pipeline layer.
fn host() -> std::sync::Arc<PipelineHost> {
    ferry_rpc::agent().unwrap().layer::<PipelineHost>().unwrap()
}

#[test]
fn a_failing_stage_ends_the_step_with_an_error_naming_it_and_the_pipeline_builds_again() {
    let test =
        "a_failing_stage_ends_the_step_with_an_error_naming_it_and_the_pipeline_builds_again";
    let Some(outputs) = ferry_testkit::world_ok(test, 2, |rank| {
        start(rank);
        if rank == 0 {
            let mut args = block_args(4);
            // Stage 3 (worker 1) fails at its second forward: microbatch 1.
            args[3].fail_at_forward = Some(1);
            for kind in [
                ScheduleKind::Interleaved1F1B,
                ScheduleKind::InterleavedZeroBubble,
            ] {
                let mut pipeline = pipeline(&[0, 1, 0, 1], &args, kind, 4, false).unwrap();
                let (x, y) = batch(0, 8);
                let err = pipeline.step(&x, &y).unwrap_err();
                match &err {
                    PipelineError::Stage {
                        stage,
                        worker,
                        action,
                        microbatch,
                        message,
                    } => {
                        assert_eq!(
                            (*stage, worker.as_str(), action.as_str(), *microbatch),
                            (3, "worker1", "3F1", Some(1)),
                            "{err}"
                        );
                        assert!(message.contains("injected failure at forward 1"), "{err}");
                    }
                    other => panic!("{other}"),
                }
                assert_eq!(
                    err.to_string(),
                    "stage 3 on worker worker1 failed at action 3F1 (microbatch 1): forward failed: injected failure at forward 1"
                );
                // The next step of the same pipeline runs: the stage fails no more.
                pipeline.zero_grad().unwrap();
                let out = pipeline.step(&x, &y).unwrap();
                assert!(out.losses.iter().all(|l| l.is_finite()));
                drop(pipeline);
                // Built again from scratch, it trains.
                let mut again =
                    common::pipeline(&[0, 1, 0, 1], &block_args(4), kind, 4, false).unwrap();
                again.step(&x, &y).unwrap();
                println!("RECOVERED={kind:?}");
            }
        }
        // Every rank of every pipeline this worker held is gone.
        let host = host();
        ferry_rpc::shutdown().unwrap();
        assert_eq!(host.live_ranks(), 0);
    }) else {
        return;
    };
    assert_eq!(outputs[0].values("RECOVERED").len(), 2);
}

#[test]
fn a_worker_that_dies_ends_the_step_within_the_timeout() {
    let test = "a_worker_that_dies_ends_the_step_within_the_timeout";
    ferry_testkit::world_ok(test, 3, |rank| {
        start(rank);
        if rank == 0 {
            // Worker 0 drives only; stages on workers 1 and 2, and worker 2
            // exits in its second forward.
            let mut args = block_args(2);
            args[1].exit_at_forward = Some(1);
            let mut builder = Pipeline::builder();
            for (w, a) in [1u32, 2].iter().zip(&args) {
                builder = builder.stage(*w, BLOCK, *a);
            }
            let mut pipeline = builder
                .schedule(ScheduleKind::OneFOneB)
                .microbatches(4)
                .loss(MSE_MEAN)
                .timeout(Duration::from_secs(20))
                .build()
                .unwrap();
            let (x, y) = batch(0, 8);
            let err = pipeline.step(&x, &y).unwrap_err();
            assert!(
                matches!(&err, PipelineError::Worker { worker, stages, .. } if worker == "worker2" && stages == &[1]),
                "{err}"
            );
            // Worker 1 was released: it answers at once.
            drop(pipeline);
            let mut other = Pipeline::builder()
                .stage(1, BLOCK, BlockArgs::new(1, true))
                .stage(1, BLOCK, BlockArgs::new(2, false))
                .schedule(ScheduleKind::LoopedBfs)
                .microbatches(2)
                .loss(MSE_MEAN)
                .build()
                .unwrap();
            other.step(&x, &y).unwrap();
            drop(other);
            tell_bystander_done();
            ferry_rpc::shutdown_now().unwrap();
        } else if rank == 1 {
            wait_until_done();
            ferry_rpc::shutdown_now().unwrap();
        } else {
            // Exits inside the stage's forward.
            std::thread::park();
        }
    });
}

fn tell_bystander_done() {
    let agent = ferry_rpc::agent().unwrap();
    agent
        .block_on(agent.store().set("test/done", Vec::new()))
        .unwrap();
}

fn wait_until_done() {
    let agent = ferry_rpc::agent().unwrap();
    let _ = agent.block_on(
        agent
            .store()
            .wait(&["test/done".to_string()], Duration::from_secs(120)),
    );
}

#[test]
fn bad_declarations_and_batches_are_refused_before_anything_runs() {
    let test = "bad_declarations_and_batches_are_refused_before_anything_runs";
    let Some(outputs) = ferry_testkit::world_ok(test, 2, |rank| {
        start(rank);
        if rank == 0 {
            let args = block_args(2);
            // 1F1B needs at least as many microbatches as stages.
            let err = pipeline(&[0, 1], &args, ScheduleKind::OneFOneB, 1, false).unwrap_err();
            assert!(matches!(err, PipelineError::Generate(_)), "{err}");
            // ZBV needs two stages per rank.
            let err = pipeline(&[0, 1], &args, ScheduleKind::ZbvZeroBubble, 4, false).unwrap_err();
            assert!(matches!(err, PipelineError::Generate(_)), "{err}");
            // A constructor nobody registered.
            let unknown: ferry_pipeline::StageFn<BlockArgs, Block> =
                ferry_pipeline::StageFn::new("no_such_stage");
            let err = Pipeline::builder()
                .stage(0, BLOCK, args[0])
                .stage(1, unknown, args[1])
                .microbatches(2)
                .loss(MSE_MEAN)
                .build()
                .err()
                .unwrap();
            match &err {
                PipelineError::NotRegistered { worker, what, name } => assert_eq!(
                    (worker.as_str(), *what, name.as_str()),
                    ("worker1", "stage constructor", "no_such_stage")
                ),
                other => panic!("{other}"),
            }
            // A loss function nobody registered.
            let err = Pipeline::builder()
                .stage(0, BLOCK, args[0])
                .stage(1, BLOCK, args[1])
                .microbatches(2)
                .loss(ferry_pipeline::LossFn::<ferry_tch::Tensor>::new(
                    "no_such_loss",
                ))
                .build()
                .err()
                .unwrap();
            match &err {
                PipelineError::NotRegistered { worker, what, name } => assert_eq!(
                    (worker.as_str(), *what, name.as_str()),
                    ("worker1", "loss function", "no_such_loss")
                ),
                other => panic!("{other}"),
            }
            // A constructor that fails: its error, as raised, with the stage.
            let err = Pipeline::builder()
                .stage(0, BLOCK, args[0])
                .stage(1, REFUSING, args[1])
                .microbatches(2)
                .loss(MSE_MEAN)
                .build()
                .err()
                .unwrap();
            assert_eq!(
                err.to_string(),
                format!(
                    "stage 1 (refusing_block) could not be built on worker worker1: refused seed {}",
                    args[1].seed
                )
            );
            assert!(
                matches!(err, PipelineError::Construct { stage: 1, .. }),
                "{err}"
            );
            // An optimizer its workers refuse (a negative learning rate).
            let err = Pipeline::builder()
                .stage(0, BLOCK, args[0])
                .stage(1, BLOCK, args[1])
                .microbatches(2)
                .loss(MSE_MEAN)
                .optimizer(ferry_autograd::optim::OptimizerKind::sgd(-1.0))
                .build()
                .err()
                .unwrap();
            match &err {
                PipelineError::Optimizer {
                    stage,
                    worker,
                    message,
                } => {
                    assert_eq!((*stage, worker.as_str()), (0, "worker0"), "{err}");
                    assert!(message.contains("lr"), "{err}");
                }
                other => panic!("{other}"),
            }
            // An unknown worker.
            let err = Pipeline::builder()
                .stage(0, BLOCK, args[0])
                .stage(7, BLOCK, args[1])
                .loss(MSE_MEAN)
                .build()
                .err()
                .unwrap();
            assert!(matches!(err, PipelineError::Rpc(_)), "{err}");
            // A batch shorter than the microbatch count: PyTorch refuses it
            // too (a microbatch would be empty).
            let mut p = pipeline(&[0, 1], &args, ScheduleKind::GPipe, 3, false).unwrap();
            let (x2, y2) = batch(0, 2);
            let err = p.step(&x2, &y2).unwrap_err();
            assert_eq!(
                err.to_string(),
                "cannot split the inputs into the microbatches: a tensor of shape [2, 8] has 2 \
                 along dimension 0, fewer than the 3 microbatches"
            );
            // Targets too short are refused too, and nothing ran: the next
            // good batch trains normally.
            let (x6, y6) = batch(0, 6);
            let err = p.step(&x6, &y2).unwrap_err();
            assert!(
                matches!(
                    err,
                    PipelineError::Split {
                        what: "the targets",
                        ..
                    }
                ),
                "{err}"
            );
            p.step(&x6, &y6).unwrap();
            // An optimizer step on a pipeline built without one.
            let plain = Pipeline::builder()
                .stage(0, BLOCK, args[0])
                .stage(1, BLOCK, args[1])
                .microbatches(2)
                .loss(MSE_MEAN)
                .build()
                .unwrap();
            let err = plain.optimizer_step().unwrap_err();
            assert!(matches!(err, PipelineError::Config(_)), "{err}");
            assert!(err.to_string().contains("without an optimizer"), "{err}");
            println!("REFUSED=ok");
        }
        // Every rank of every pipeline this worker held is gone.
        let host = host();
        ferry_rpc::shutdown().unwrap();
        assert_eq!(host.live_ranks(), 0);
    }) else {
        return;
    };
    assert_eq!(outputs[0].values("REFUSED"), ["ok"]);
}
