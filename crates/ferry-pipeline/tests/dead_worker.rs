//! A worker killed with SIGKILL in the middle of a step: the step fails
//! with an error naming it, dropping the pipeline returns, and graceful
//! shutdown on the driver and on the surviving worker ends with
//! `RpcError::Absent` naming the dead worker (found through its closed
//! connection, not after a timeout), whether the workers call shutdown
//! after the step failed or, as PyTorch workers do, at once (so the kill
//! happens inside their shutdown). The kill happens inside the stage's
//! forward, so it is always mid-step; the testkit's deadline is the hang
//! guard, and the short `shutdown_timeout` keeps even a fallback quick.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::time::Duration;

use common::*;
use ferry_pipeline::{Pipeline, PipelineError, Stage, StageFn};
use ferry_rpc::{Absence, BoxError, RpcError, RpcOptions};
use ferry_schedule::ScheduleKind;
use ferry_tch::Tensor;
use serde::{Deserialize, Serialize};

/// Graceful shutdown's bound without progress in this test.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// The key the driver sets once the step has failed.
const STEP_FAILED: &str = "test/step_failed";

/// A block whose process kills itself with SIGKILL in its `kill_at`th
/// forward (counted from 0).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct KillerArgs {
    block: BlockArgs,
    kill_at: usize,
}

struct Killer {
    block: Block,
    kill_at: usize,
    forwards: usize,
}

impl Stage for Killer {
    type Input = Tensor;
    type Output = Tensor;
    fn forward(&mut self, x: Tensor) -> Result<Tensor, BoxError> {
        if self.forwards == self.kill_at {
            // SAFETY: getpid and kill have no preconditions.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
        self.forwards += 1;
        Ok(Tensor::from(self.block.apply(&x)))
    }
    fn parameters(&self) -> Vec<tch::Tensor> {
        self.block.parameters()
    }
}

const KILLER: StageFn<KillerArgs, Killer> = StageFn::new("killer");

/// Starts this process's worker with the test stages, the killer among them.
fn start_worker(rank: u32) {
    let mut stages = stages();
    stages.add(KILLER, |args: KillerArgs| {
        Ok::<_, BoxError>(Killer {
            block: Block::new(args.block),
            kill_at: args.kill_at,
            forwards: 0,
        })
    });
    let mut options = RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .shutdown_timeout(SHUTDOWN_TIMEOUT);
    ferry_pipeline::install(&mut options, stages);
    ferry::init_rpc(options).unwrap();
}

/// Graceful shutdown, which must fail naming the dead worker: prints
/// `SHUTDOWN=<workers>/<how>`.
fn shut_down_naming_the_dead() {
    match ferry::shutdown() {
        Err(RpcError::Absent { workers, how }) => {
            let how = match how {
                Absence::Gone => "gone".to_string(),
                Absence::Reported { by } => format!("reported by {by}"),
                Absence::Silent { after } => format!("silent for {after:?}"),
            };
            println!("SHUTDOWN={}/{how}", workers.join(","));
        }
        other => panic!("shutdown should name the dead worker: {other:?}"),
    }
}

/// Runs the driver's side: a pipeline whose stage 1 (worker 2) is killed
/// in its second forward, the step, the drop, then graceful shutdown.
fn drive() {
    let agent = ferry_rpc::agent().unwrap();
    // The driver holds no stage: stage 0 on worker 1, stage 1 on worker 2.
    let args = block_args(2);
    let mut pipeline = Pipeline::builder()
        .stage(1u32, BLOCK, args[0])
        .stage(
            2u32,
            KILLER,
            KillerArgs {
                block: args[1],
                kill_at: 1,
            },
        )
        .schedule(ScheduleKind::OneFOneB)
        .microbatches(4)
        .loss(MSE_MEAN)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let (x, y) = batch(0, 8);
    let err = pipeline.step(&x, &y).unwrap_err();
    assert!(
        matches!(&err, PipelineError::Worker { worker, stages, .. } if worker == "worker2" && stages == &[1]),
        "{err}"
    );
    println!("STEP={err}");
    // Destroying the ranks: worker 2 refuses at once.
    drop(pipeline);
    agent
        .block_on(agent.store().set(STEP_FAILED, Vec::new()))
        .unwrap();
    shut_down_naming_the_dead();
}

/// In the parent: worker 2 was killed, the step named it, and both
/// survivors' shutdowns named it, found through its closed connection.
fn check(outputs: &[ferry_testkit::Output]) {
    assert!(
        outputs[2].status.contains("SIGKILL"),
        "worker 2 should have been killed: {}\n{}",
        outputs[2].status,
        outputs[2].stderr
    );
    let step = outputs[0].values("STEP");
    assert_eq!(step.len(), 1, "{}", outputs[0].stdout);
    assert!(step[0].starts_with("worker worker2 "), "{step:?}");
    for (rank, o) in outputs.iter().enumerate().take(2) {
        assert!(
            o.success,
            "rank {rank} ({})\n--- stdout ---\n{}\n--- stderr ---\n{}",
            o.status, o.stdout, o.stderr
        );
        let shutdown = o.values("SHUTDOWN");
        assert_eq!(shutdown.len(), 1, "rank {rank}: {}", o.stdout);
        eprintln!("rank {rank}: shutdown found {}", shutdown[0]);
        let (workers, how) = shutdown[0].split_once('/').unwrap();
        assert_eq!(workers, "worker2", "rank {rank}");
        // Through the closed connection (here or on the other survivor).
        assert!(
            how == "gone" || how.starts_with("reported by worker"),
            "rank {rank}: {how}"
        );
    }
}

#[test]
fn a_worker_killed_mid_step_is_named_by_the_step_and_by_every_survivors_shutdown() {
    let test = "a_worker_killed_mid_step_is_named_by_the_step_and_by_every_survivors_shutdown";
    let Some(outputs) = ferry_testkit::world(test, 3, |rank| {
        start_worker(rank);
        let agent = ferry_rpc::agent().unwrap();
        match rank {
            0 => drive(),
            1 => {
                // Shuts down once the step has failed.
                agent
                    .block_on(
                        agent
                            .store()
                            .wait(&[STEP_FAILED.to_string()], Duration::from_secs(120)),
                    )
                    .unwrap();
                shut_down_naming_the_dead();
            }
            _ => loop {
                // Killed inside the stage's forward.
                std::thread::park();
            },
        }
    }) else {
        return;
    };
    check(&outputs);
}

#[test]
fn workers_already_in_shutdown_when_one_is_killed_name_it() {
    let test = "workers_already_in_shutdown_when_one_is_killed_name_it";
    let Some(outputs) = ferry_testkit::world(test, 3, |rank| {
        start_worker(rank);
        if rank == 0 {
            drive();
        } else {
            // As PyTorch workers do: shutdown at once, serving the driver
            // meanwhile. Worker 2 is killed inside it, serving a forward.
            shut_down_naming_the_dead();
        }
    }) else {
        return;
    };
    check(&outputs);
}
