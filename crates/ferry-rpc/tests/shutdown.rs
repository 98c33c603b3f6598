//! Graceful shutdown under attack and with a worker missing, across
//! worker processes on 127.0.0.1: a call from a stranger claiming a
//! member's rank, and a call the callee refuses for its size, used to
//! keep the group's counts apart for good (every rank looping through
//! shutdown rounds); a worker killed with SIGKILL, and one that never
//! calls shutdown. Each test is bounded by the testkit's deadline (the
//! hang guard) and by the workers' `shutdown_timeout`; none measures time.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use ferry_rpc::{Absence, Function, Functions, RpcError, RpcOptions};
use ferry_testkit::world_ok;
use ferry_transport::{Endpoint, OutgoingMessage, PeerConnection};
use ferry_wire::{Flags, MessageKind};

const LEN: Function<Vec<u8>, u64> = Function::new("len");
/// Kills the callee's process with SIGKILL while it serves the call.
const DIE: Function<(), ()> = Function::new("die");

fn options(rank: u32) -> RpcOptions {
    let mut f = Functions::new();
    f.add(LEN, |v| v.len() as u64);
    f.add(DIE, |()| {
        let me = rustix::process::getpid();
        rustix::process::kill_process(me, rustix::process::Signal::KILL).unwrap();
    });
    RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(f)
        .init_timeout(Duration::from_secs(20))
}

#[test]
fn a_strangers_call_does_not_hold_up_shutdown() {
    let outputs = world_ok("a_strangers_call_does_not_hold_up_shutdown", 3, |rank| {
        init_rpc(options(rank)).unwrap();
        let agent = ferry_rpc::agent().unwrap();
        if rank == 0 {
            // A process outside the group (this one's raw connection),
            // claiming to be worker2, sends worker1 a request.
            let addr = agent.worker_addr(1u32).unwrap();
            let reply = agent.block_on(async move {
                let mut conn = PeerConnection::connect(addr, &Endpoint::new("worker2", 2))
                    .await
                    .unwrap();
                let request = OutgoingMessage {
                    kind: MessageKind::REQUEST,
                    flags: Flags::NONE,
                    request_id: 7,
                    payload: vec![0xAB; 16],
                    tensors: Vec::new(),
                };
                conn.writer.write(&request).await.unwrap();
                tokio::time::timeout(Duration::from_secs(20), conn.reader.read())
                    .await
                    .unwrap()
                    .unwrap()
                    .unwrap()
            });
            // Worker1 served it (with an error: the payload is garbage).
            assert_eq!(reply.header.kind, MessageKind::ERROR);
            assert_eq!(reply.header.request_id, 7);
            let n: u64 = LEN.rpc_sync(1, vec![1u8; 3]).unwrap();
            assert_eq!(n, 3);
        }
        ferry_rpc::shutdown().unwrap();
        println!("SHUTDOWN=ok");
    });
    assert_all_shut_down(outputs);
}

/// In the parent: every rank's graceful shutdown returned `Ok`.
fn assert_all_shut_down(outputs: Option<Vec<ferry_testkit::Output>>) {
    if let Some(outputs) = outputs {
        for o in outputs {
            assert_eq!(o.values("SHUTDOWN"), ["ok"], "{}", o.stderr);
        }
    }
}

#[test]
fn a_call_refused_for_its_size_does_not_hold_up_shutdown() {
    let outputs = world_ok(
        "a_call_refused_for_its_size_does_not_hold_up_shutdown",
        3,
        |rank| {
            let mut options = options(rank);
            // Worker1 reads no payload over 4 KiB.
            if rank == 1 {
                options.limits.max_payload_bytes = 4 << 10;
            }
            init_rpc(options).unwrap();
            if rank == 0 {
                let err = LEN.rpc_sync(1, vec![7u8; 64 << 10]).unwrap_err();
                assert!(
                    !matches!(err, RpcError::Timeout { .. }),
                    "the refused call should fail at once: {err}"
                );
                // Worker1 still serves calls that fit.
                let n: u64 = LEN.rpc_sync(1, vec![7u8; 100]).unwrap();
                assert_eq!(n, 100);
                let n: u64 = LEN.rpc_sync(2, vec![7u8; 64 << 10]).unwrap();
                assert_eq!(n, 64 << 10);
            }
            ferry_rpc::shutdown().unwrap();
            println!("SHUTDOWN=ok");
        },
    );
    assert_all_shut_down(outputs);
}

/// A short shutdown bound, so that a test that falls back to it stays
/// quick; the rendezvous keeps its own, longer one.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(3);

/// Prints `SHUTDOWN=<workers>/<how>` for graceful shutdown's error, which
/// must be `Absent`.
fn print_absent(result: Result<(), RpcError>) {
    match result {
        Err(RpcError::Absent { workers, how }) => {
            let how = match how {
                Absence::Gone => "gone".to_string(),
                Absence::Silent { after } => {
                    assert_eq!(after, SHUTDOWN_TIMEOUT);
                    "silent".to_string()
                }
                Absence::Reported { by } => format!("reported by {by}"),
            };
            println!("SHUTDOWN={}/{how}", workers.join(","));
        }
        other => panic!("graceful shutdown should name the absent worker: {other:?}"),
    }
}

/// The absent workers and how, as each survivor printed them.
fn absences(outputs: &[ferry_testkit::Output], survivors: &[usize]) -> Vec<(String, String)> {
    survivors
        .iter()
        .map(|&r| {
            let o = &outputs[r];
            assert!(
                o.success,
                "rank {r}: {}\n{}\n{}",
                o.status, o.stdout, o.stderr
            );
            let v = o.values("SHUTDOWN");
            assert_eq!(v.len(), 1, "rank {r}: {}", o.stdout);
            let (workers, how) = v[0].split_once('/').unwrap();
            (workers.to_string(), how.to_string())
        })
        .collect()
}

#[test]
fn a_killed_worker_ends_every_survivors_shutdown_with_its_name() {
    let test = "a_killed_worker_ends_every_survivors_shutdown_with_its_name";
    let Some(outputs) = ferry_testkit::world(test, 3, |rank| {
        let options = options(rank)
            .init_timeout(Duration::from_secs(60))
            .shutdown_timeout(SHUTDOWN_TIMEOUT);
        init_rpc(options).unwrap();
        let agent = ferry_rpc::agent().unwrap();
        let dead = "test/worker2_dead".to_string();
        let talked = "test/worker1_talked_to_worker2".to_string();
        match rank {
            0 => {
                // Both survivors talked to worker 2 before it dies.
                let n: u64 = LEN.rpc_sync(2, vec![0u8; 3]).unwrap();
                assert_eq!(n, 3);
                agent
                    .block_on(agent.store().wait(&[talked], Duration::from_secs(60)))
                    .unwrap();
                let err = DIE.rpc_sync(2, ()).unwrap_err();
                assert!(
                    matches!(&err, RpcError::PeerUnreachable { worker, .. } if worker == "worker2"),
                    "{err}"
                );
                agent
                    .block_on(agent.store().set(&dead, Vec::new()))
                    .unwrap();
                print_absent(ferry_rpc::shutdown());
            }
            1 => {
                let n: u64 = LEN.rpc_sync(2, vec![0u8; 5]).unwrap();
                assert_eq!(n, 5);
                agent
                    .block_on(agent.store().set(&talked, Vec::new()))
                    .unwrap();
                // Shutdown once worker 2 is dead.
                agent
                    .block_on(agent.store().wait(&[dead], Duration::from_secs(60)))
                    .unwrap();
                print_absent(ferry_rpc::shutdown());
            }
            _ => loop {
                // Killed while serving DIE.
                std::thread::park();
            },
        }
    }) else {
        return;
    };
    assert!(
        outputs[2].status.contains("SIGKILL"),
        "{}",
        outputs[2].status
    );
    for (workers, how) in absences(&outputs, &[0, 1]) {
        assert_eq!(workers, "worker2");
        // Found through the closed connection, not after the timeout.
        assert!(how == "gone" || how.starts_with("reported by"), "{how}");
    }
}

#[test]
fn a_worker_that_never_calls_shutdown_is_named_after_the_shutdown_timeout() {
    let test = "a_worker_that_never_calls_shutdown_is_named_after_the_shutdown_timeout";
    let Some(outputs) = ferry_testkit::world(test, 3, |rank| {
        let options = options(rank)
            .init_timeout(Duration::from_secs(60))
            .shutdown_timeout(SHUTDOWN_TIMEOUT);
        init_rpc(options).unwrap();
        let agent = ferry_rpc::agent().unwrap();
        if rank == 2 {
            // Alive and serving, but it does not call shutdown: it waits
            // for a key nobody writes, until rank 0 stops the store.
            let never = agent.block_on(
                agent
                    .store()
                    .wait(&["test/never".to_string()], Duration::from_secs(600)),
            );
            assert!(never.is_err());
            ferry_rpc::shutdown_now().unwrap();
            println!("STORE_GONE=yes");
            return;
        }
        let n: u64 = LEN.rpc_sync(2, vec![0u8; 3]).unwrap();
        assert_eq!(n, 3);
        print_absent(ferry_rpc::shutdown());
    }) else {
        return;
    };
    let found = absences(&outputs, &[0, 1]);
    assert!(
        found.iter().all(|(workers, _)| workers == "worker2"),
        "{found:?}"
    );
    // One of them waited the timeout out; the other may have heard it.
    assert!(found.iter().any(|(_, how)| how == "silent"), "{found:?}");
    assert!(outputs[2].success, "{}", outputs[2].stderr);
    assert_eq!(outputs[2].values("STORE_GONE"), ["yes"]);
}

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
