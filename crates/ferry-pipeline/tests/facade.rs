//! The facade: `ferry::init_rpc` (feature `torch`) installs the pipeline
//! layer, so a driver that owns no stage needs no registry of its own, and
//! `ferry::pipeline` is this crate.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::*;
use ferry::pipeline::Pipeline;
use ferry_rpc::RpcOptions;
use ferry_schedule::ScheduleKind;

#[test]
fn a_driver_started_with_ferry_init_rpc_alone_drives_stages_on_other_workers() {
    let Some(outputs) = ferry_testkit::world_ok(
        "a_driver_started_with_ferry_init_rpc_alone_drives_stages_on_other_workers",
        3,
        |rank| {
            if rank == 0 {
                // No ferry_pipeline::install here: the facade installs the
                // layer (with no stage constructors).
                let options = RpcOptions::from_env("worker0").unwrap();
                ferry::init_rpc(options).unwrap();
                let agent = ferry_rpc::agent().unwrap();
                let host = agent.layer::<ferry::pipeline::PipelineHost>().unwrap();
                assert_eq!(host.live_ranks(), 0);
                let args = block_args(2);
                let mut pipeline = Pipeline::builder()
                    .stage(1, BLOCK, args[0])
                    .stage(2, BLOCK, args[1])
                    .schedule(ScheduleKind::OneFOneB)
                    .microbatches(2)
                    .loss(MSE_MEAN)
                    .build()
                    .unwrap();
                let (want, _) = reference(&args, 2, false, 1, 4);
                let (x, y) = batch(0, 4);
                let out = pipeline.step(&x, &y).unwrap();
                for (got, want) in out.losses.iter().zip(&want[0]) {
                    assert_close_f64(*got, *want, "loss");
                }
                println!("DROVE=1");
            } else {
                start(rank);
            }
            ferry_rpc::shutdown().unwrap();
        },
    ) else {
        return;
    };
    assert_eq!(outputs[0].values("DROVE"), ["1"]);
}
