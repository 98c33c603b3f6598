//! The `train_pipeline` example's model and pictures on a real pipeline:
//! for both of the example's schedules, a few steps on 2 workers train
//! exactly like the example's one-process run, and a traced step draws
//! (every compute action of every rank in the measured timeline, the
//! simulation of the same costs, the SVG of both, the terminal picture).
//! The pictures' own unit tests run here too.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs, dead_code)]

#[path = "../examples/train_pipeline/model.rs"]
mod model;
#[path = "../examples/train_pipeline/picture.rs"]
mod picture;

use ferry_pipeline::Pipeline;
use ferry_rpc::RpcOptions;
use ferry_schedule::ScheduleKind;
use model::{block_args, train_in_one_process, Task, BLOCK, MSE};

const STEPS: usize = 3;
const STAGES: usize = 4;

fn check(kind: ScheduleKind) {
    let args = block_args(STAGES, 32, 2);
    let task = Task::new(32, 16);
    let mut want = Vec::new();
    train_in_one_process(&args, &task, STEPS, |_, loss, _| want.push(loss)).unwrap();

    let placement = kind.placement().stage_to_rank(STAGES, 2).unwrap();
    let mut builder = Pipeline::builder();
    for (a, rank) in args.iter().zip(&placement) {
        builder = builder.stage(*rank as u32, BLOCK, *a);
    }
    let mut pipeline = builder
        .schedule(kind)
        .microbatches(4)
        .loss(MSE)
        .optimizer(model::optimizer())
        .build()
        .unwrap();
    let mut timeline = None;
    for (step, want) in want.iter().enumerate() {
        let (x, y) = task.batch(step);
        pipeline.set_trace(step + 1 == STEPS);
        let out = pipeline.step(&x, &y).unwrap();
        pipeline.optimizer_step().unwrap();
        pipeline.zero_grad().unwrap();
        let got = out.losses.iter().sum::<f64>() / out.losses.len() as f64;
        assert!(
            (got - want).abs() <= 4e-5 + 1e-5 * want.abs(),
            "{kind}: step {step}: pipeline loss {got}, one process {want}"
        );
        timeline = out.timeline.or(timeline);
    }
    let timeline = timeline.expect("the last step was traced");
    let measured = timeline.timed_run();
    // Every compute action of every rank has its measured span.
    for (rank, row) in pipeline.schedule().ranks.iter().enumerate() {
        let compute = row
            .iter()
            .flatten()
            .filter(|a| a.kind().is_compute())
            .count();
        let spanned = measured
            .actions()
            .filter(|(r, a, _, _)| *r == rank && a.kind().is_compute())
            .count();
        assert_eq!(spanned, compute, "{kind}: rank {rank}");
    }
    let simulated = timeline.simulated(pipeline.stage_to_rank()).unwrap();
    assert!(simulated.makespan > 0.0 && measured.makespan > 0.0);
    let svg = picture::side_by_side(measured, &simulated, ["measured", "simulated"]);
    assert_eq!(svg.matches("<svg ").count(), 3, "{kind}");
    let axis = measured.makespan.max(simulated.makespan);
    let text = picture::text(measured, axis, 60, false);
    assert_eq!(text.lines().count(), 2, "{kind}: {text}");
    assert!(
        text.contains('F') && (text.contains('B') || text.contains('W')),
        "{kind}: {text}"
    );
    println!("CHECKED={kind}");
}

#[test]
fn the_examples_model_trains_like_one_process_and_its_traced_step_draws() {
    let Some(outputs) = ferry_testkit::world_ok(
        "the_examples_model_trains_like_one_process_and_its_traced_step_draws",
        2,
        |rank| {
            let mut options = RpcOptions::from_env(format!("worker{rank}")).unwrap();
            ferry_pipeline::install(&mut options, model::stages());
            ferry::init_rpc(options).unwrap();
            if rank == 0 {
                check(ScheduleKind::Interleaved1F1B);
                check(ScheduleKind::ZbvZeroBubble);
            }
            ferry_rpc::shutdown().unwrap();
        },
    ) else {
        return;
    };
    assert_eq!(
        outputs[0].values("CHECKED"),
        ["ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"]
    );
}
