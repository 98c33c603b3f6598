//! Calls and results over a worker's limits, across real worker processes
//! on 127.0.0.1: the sender keeps them back with a size error naming the
//! limit and the size, and the connection and the other calls on it carry
//! on.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use ferry_rpc::{Functions, RpcError, RpcOptions};
use ferry_testkit::world_ok;
use ferry_transport::RawTensor;
use ferry_wire::{DType, Limits};

const MIB: u64 = 1 << 20;

/// Worker 1's limits: 64 KiB of payload, 1 MiB per tensor, 1.5 MiB of
/// tensors per message.
fn small_limits() -> Limits {
    Limits {
        max_payload_bytes: 64 << 10,
        max_tensor_bytes: MIB,
        max_message_tensor_bytes: MIB + MIB / 2,
        ..Limits::default()
    }
}

fn functions() -> Functions {
    let mut f = Functions::new();
    f.register("add", |(a, b): (i64, i64)| a + b);
    f.register("identity", |t: RawTensor| t);
    f.register("identity_many", |v: Vec<RawTensor>| v);
    f.register("len", |b: Vec<u8>| b.len());
    f.register("zeros", |n: i64| RawTensor::zeros(DType::U8, &[n]).unwrap());
    // Returns `v` once every key in `keys` is set in the group's store.
    f.register("gated", |(keys, v): (Vec<String>, u64)| {
        let agent = ferry_rpc::Agent::current().unwrap();
        agent
            .block_on(agent.store().wait(&keys, Duration::from_secs(60)))
            .unwrap();
        v
    });
    f
}

fn bytes(n: u64) -> RawTensor {
    RawTensor::zeros(DType::U8, &[n as i64]).unwrap()
}

/// Asserts `e` is the size error for `what`, with the call's length and
/// the callee's limit in it and in its text.
fn assert_too_large(e: &RpcError, what: &str, len: u64, max: u64) {
    match e {
        RpcError::TooLarge {
            worker,
            what: w,
            len: l,
            max: m,
            ..
        } => {
            assert_eq!(worker, "worker1");
            assert_eq!((*w, *l, *m), (what, len, max), "{e}");
        }
        other => panic!("expected a size error, got: {other}"),
    }
    let text = e.to_string();
    assert!(
        text.contains(&len.to_string()) && text.contains(&max.to_string()),
        "{text}"
    );
}

/// Worker 1 reads with small limits. Worker 2's very first call to it is
/// too large (queued before the handshake told worker 2 the limits);
/// worker 0 sends oversized calls on an established connection while a
/// call on it waits; worker 1 asks worker 0 for a result over its own
/// limits. Each gets a size error; every other call, the waiting one
/// included, completes, and the group shuts down gracefully.
#[test]
fn an_oversized_call_fails_at_the_sender_and_the_connection_lives_on() {
    world_ok(
        "an_oversized_call_fails_at_the_sender_and_the_connection_lives_on",
        3,
        |rank| {
            let mut options = RpcOptions::from_env(format!("worker{rank}"))
                .unwrap()
                .functions(functions())
                .init_timeout(Duration::from_secs(60));
            if rank == 1 {
                options.limits = small_limits();
            }
            ferry_rpc::init_rpc(options).unwrap();
            let agent = ferry_rpc::agent().unwrap();
            match rank {
                0 => {
                    let waiting = ferry_rpc::rpc_async::<u64, _>(
                        1u32,
                        "gated",
                        (vec!["test/release".to_string()], 5u64),
                    );
                    let s: i64 = ferry_rpc::rpc_sync(1u32, "add", (1i64, 2i64)).unwrap();
                    assert_eq!(s, 3);
                    let e = ferry_rpc::rpc_sync::<RawTensor, _>(1u32, "identity", bytes(2 * MIB))
                        .unwrap_err();
                    assert_too_large(&e, "tensor byte length", 2 * MIB, MIB);
                    let e = ferry_rpc::rpc_sync::<Vec<RawTensor>, _>(
                        1u32,
                        "identity_many",
                        vec![bytes(MIB), bytes(MIB)],
                    )
                    .unwrap_err();
                    assert_too_large(&e, "message tensor bytes", 2 * MIB, MIB + MIB / 2);
                    let e = ferry_rpc::rpc_sync::<usize, _>(1u32, "len", vec![7u8; 100_000])
                        .unwrap_err();
                    assert!(
                        matches!(e, RpcError::TooLarge { what: "payload length", max, .. } if max == 64 << 10),
                        "{e}"
                    );
                    // The connection lives on: calls under the limits work,
                    // tensors included, and the waiting call completes.
                    let t = bytes(MIB / 2);
                    let back: RawTensor = ferry_rpc::rpc_sync(1u32, "identity", t.clone()).unwrap();
                    assert_eq!(back, t);
                    assert!(!waiting.is_done());
                    agent
                        .block_on(agent.store().set("test/release", Vec::new()))
                        .unwrap();
                    assert_eq!(waiting.wait().unwrap(), 5);
                    println!("WORKER0_DONE=1");
                }
                1 => {
                    let e = ferry_rpc::rpc_sync::<RawTensor, _>(0u32, "zeros", 2 * MIB as i64)
                        .unwrap_err();
                    let text = e.to_string();
                    assert!(matches!(e, RpcError::Remote { .. }), "{text}");
                    assert!(
                        text.contains("would refuse")
                            && text.contains("tensor byte length")
                            && text.contains(&(2 * MIB).to_string()),
                        "{text}"
                    );
                    let s: i64 = ferry_rpc::rpc_sync(0u32, "add", (2i64, 2i64)).unwrap();
                    assert_eq!(s, 4);
                }
                _ => {
                    let e = ferry_rpc::rpc_sync::<RawTensor, _>(1u32, "identity", bytes(2 * MIB))
                        .unwrap_err();
                    assert_too_large(&e, "tensor byte length", 2 * MIB, MIB);
                    let s: i64 = ferry_rpc::rpc_sync(1u32, "add", (3i64, 4i64)).unwrap();
                    assert_eq!(s, 7);
                }
            }
            ferry_rpc::shutdown().unwrap();
        },
    );
}
