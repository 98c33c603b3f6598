//! Graceful shutdown under attack, across worker processes on 127.0.0.1:
//! a call from a stranger claiming a member's rank, and a call the callee
//! refuses for its size, used to keep the group's counts apart for good
//! (every rank looping through shutdown rounds). Each test is bounded by
//! the testkit's deadline and by the workers' `init_timeout`.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use ferry_rpc::{Function, Functions, RpcError, RpcOptions};
use ferry_testkit::world_ok;
use ferry_transport::{Endpoint, OutgoingMessage, PeerConnection};
use ferry_wire::{Flags, MessageKind};

const LEN: Function<Vec<u8>, u64> = Function::new("len");

fn options(rank: u32) -> RpcOptions {
    let mut f = Functions::new();
    f.add(LEN, |v| v.len() as u64);
    RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(f)
        .init_timeout(Duration::from_secs(20))
}

#[test]
fn a_strangers_call_does_not_hold_up_shutdown() {
    let outputs = world_ok("a_strangers_call_does_not_hold_up_shutdown", 3, |rank| {
        ferry_rpc::init_rpc(options(rank)).unwrap();
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
            ferry_rpc::init_rpc(options).unwrap();
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
