//! The Baby process group in torchft's training loop, with a real
//! lighthouse and one manager per replica group: a Baby child killed
//! before a step's allreduce fails that allreduce on both replica groups,
//! both vote no, `should_commit` answers false, and the next quorum (a new
//! id, since commits failed) starts fresh children whose allreduce commits
//! the step, with bit-identical results. Nothing is left running.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{bounded, lighthouse_options, start_lighthouse, stop_lighthouse, stop_manager};
use ferry_ft::baby::{BabyOptions, BabyProcessGroup, ChildProgram};
use ferry_ft::manager::{Manager, ManagerClient, ManagerOptions, QuorumRequest};
use ferry_store::TcpStoreServer;
use rustix::process::{Pid, Signal};

const T: Duration = Duration::from_secs(30);
/// Steps to commit.
const STEPS: i64 = 3;
/// The step whose first attempt loses replica 0's child.
const FAULTY_STEP: i64 = 1;

/// One attempt at a step, as a replica group saw it.
#[derive(Debug, Clone, PartialEq)]
struct Attempt {
    step: i64,
    quorum_id: i64,
    child: Option<u32>,
    error: Option<String>,
    committed: bool,
    result: Vec<u32>,
}

async fn replica(index: u64, lighthouse: String) -> Vec<Attempt> {
    let replica_id = format!("baby_replica_{index}");
    let store = TcpStoreServer::bind(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let manager = Manager::bind(
        "127.0.0.1:0",
        ManagerOptions::new(&replica_id, &lighthouse, store.local_addr().to_string(), 1)
            .with_heartbeat_interval(Duration::from_millis(20))
            .with_connect_timeout(Duration::from_secs(5)),
    )
    .await
    .unwrap();
    let client = bounded("connect", ManagerClient::connect(manager.address()))
        .await
        .unwrap();
    let mut pg = BabyProcessGroup::new(
        BabyOptions::new(&replica_id)
            .with_timeout(Duration::from_secs(5))
            .with_watchdog_margin(Duration::from_millis(500))
            .with_child(ChildProgram::Program(
                env!("CARGO_BIN_EXE_ferry-ft-baby").into(),
            )),
    );
    let mut attempts = Vec::new();
    let mut step = 0;
    let mut commit_failures = 0;
    let mut faulted = false;
    while step < STEPS {
        let quorum = client
            .quorum(
                QuorumRequest {
                    commit_failures,
                    ..QuorumRequest::new(0, step)
                },
                T,
            )
            .await
            .unwrap();
        let mut error = pg.configure(&quorum).await.err().map(|e| e.to_string());
        if index == 0 && step == FAULTY_STEP && !faulted {
            faulted = true;
            let pid = pg.child_pid().unwrap();
            rustix::process::kill_process(Pid::from_raw(pid as i32).unwrap(), Signal::KILL)
                .unwrap();
        }
        // Every replica group contributes (step + 1) * (its index + 1).
        let mut grads: Vec<f32> = (0..1000)
            .map(|i| (step as f32 + 1.0) * (index as f32 + 1.0) + i as f32 * 1e-3)
            .collect();
        if error.is_none() {
            error = pg
                .allreduce_mean(&mut grads)
                .await
                .err()
                .map(|e| e.to_string());
        }
        // torchft's rule: an error in the process group is a no vote.
        let vote = error.is_none() && !pg.is_broken();
        let committed = client.should_commit(0, step, vote, T).await.unwrap();
        attempts.push(Attempt {
            step,
            quorum_id: quorum.quorum_id,
            child: pg.child_pid(),
            error,
            committed,
            result: grads.iter().map(|v| v.to_bits()).collect(),
        });
        if committed {
            step += 1;
            commit_failures = 0;
        } else {
            commit_failures += 1;
        }
    }
    pg.shutdown().await;
    drop(client);
    stop_manager(manager).await;
    attempts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_baby_group_failure_is_not_committed_and_the_next_quorum_recovers() {
    let lighthouse = start_lighthouse(lighthouse_options(2)).await;
    let address = format!("http://{}", lighthouse.local_addr());
    let (a, b) = bounded(
        "training",
        futures::future::join(replica(0, address.clone()), replica(1, address)),
    )
    .await;
    stop_lighthouse(lighthouse).await;
    for (index, attempts) in [&a, &b].into_iter().enumerate() {
        let at =
            |step: i64| -> Vec<&Attempt> { attempts.iter().filter(|x| x.step == step).collect() };
        // The faulty step: first attempt failed and was not committed...
        let faulty = at(FAULTY_STEP);
        assert!(faulty.len() >= 2, "replica {index}: {faulty:#?}");
        assert!(
            !faulty[0].committed && faulty[0].error.is_some(),
            "{faulty:#?}"
        );
        // ...the last one committed, in a later quorum, in a fresh child.
        let last = faulty.last().unwrap();
        assert!(last.committed && last.error.is_none(), "{faulty:#?}");
        assert!(last.quorum_id > faulty[0].quorum_id, "{faulty:#?}");
        assert_ne!(last.child, faulty[0].child, "{faulty:#?}");
        // Every step ends committed, and never with an error.
        for step in 0..STEPS {
            let committed: Vec<_> = at(step).into_iter().filter(|x| x.committed).collect();
            assert_eq!(committed.len(), 1, "replica {index} step {step}");
            assert!(committed[0].error.is_none());
        }
    }
    // Both replica groups committed the same bits.
    let committed = |attempts: &[Attempt]| -> Vec<Vec<u32>> {
        attempts
            .iter()
            .filter(|x| x.committed)
            .map(|x| x.result.clone())
            .collect()
    };
    assert_eq!(committed(&a), committed(&b));
    let me = std::process::id().to_string();
    let children: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{name}/stat")).ok()?;
            let ppid = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .to_owned();
            (ppid == me).then_some(stat)
        })
        .collect();
    assert!(children.is_empty(), "children left: {children:?}");
}
