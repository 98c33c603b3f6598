//! Calls and results over a worker's limits, across real worker processes
//! on 127.0.0.1: the sender keeps them back with a size error naming the
//! limit and the size, and the connection and the other calls on it carry
//! on.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use ferry_rpc::{Function, Functions, RpcError, RpcOptions};
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

const ADD: Function<(i64, i64), i64> = Function::new("add");
const IDENTITY: Function<RawTensor, RawTensor> = Function::new("identity");
const IDENTITY_MANY: Function<Vec<RawTensor>, Vec<RawTensor>> = Function::new("identity_many");
const LEN: Function<Vec<u8>, usize> = Function::new("len");
const ZEROS: Function<i64, RawTensor> = Function::new("zeros");
/// Returns `v` once every key in `keys` is set in the group's store.
const GATED: Function<(Vec<String>, u64), u64> = Function::new("gated");

fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(ADD, |(a, b)| a + b);
    f.add(IDENTITY, |t| t);
    f.add(IDENTITY_MANY, |v| v);
    f.add(LEN, |b| b.len());
    f.add(ZEROS, |n| RawTensor::zeros(DType::U8, &[n]).unwrap());
    f.add(GATED, |(keys, v): (Vec<String>, u64)| {
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
            init_rpc(options).unwrap();
            let agent = ferry_rpc::agent().unwrap();
            match rank {
                0 => {
                    let waiting = GATED.rpc_async(1, (vec!["test/release".to_string()], 5));
                    let s: i64 = ADD.rpc_sync(1, (1, 2)).unwrap();
                    assert_eq!(s, 3);
                    let e = IDENTITY.rpc_sync(1, bytes(2 * MIB)).unwrap_err();
                    assert_too_large(&e, "tensor byte length", 2 * MIB, MIB);
                    let e = IDENTITY_MANY
                        .rpc_sync(1, vec![bytes(MIB), bytes(MIB)])
                        .unwrap_err();
                    assert_too_large(&e, "message tensor bytes", 2 * MIB, MIB + MIB / 2);
                    let e = LEN.rpc_sync(1, vec![7u8; 100_000]).unwrap_err();
                    assert!(
                        matches!(e, RpcError::TooLarge { what: "payload length", max, .. } if max == 64 << 10),
                        "{e}"
                    );
                    // The connection lives on: calls under the limits work,
                    // tensors included, and the waiting call completes.
                    let t = bytes(MIB / 2);
                    let back: RawTensor = IDENTITY.rpc_sync(1, t.clone()).unwrap();
                    assert_eq!(back, t);
                    assert!(!waiting.is_done());
                    agent
                        .block_on(agent.store().set("test/release", Vec::new()))
                        .unwrap();
                    assert_eq!(waiting.wait().unwrap(), 5);
                    println!("WORKER0_DONE=1");
                }
                1 => {
                    let e = ZEROS.rpc_sync(0, 2 * MIB as i64).unwrap_err();
                    let text = e.to_string();
                    assert!(matches!(e, RpcError::Remote { .. }), "{text}");
                    assert!(
                        text.contains("would refuse")
                            && text.contains("tensor byte length")
                            && text.contains(&(2 * MIB).to_string()),
                        "{text}"
                    );
                    let s: i64 = ADD.rpc_sync(0, (2, 2)).unwrap();
                    assert_eq!(s, 4);
                }
                _ => {
                    let e = IDENTITY.rpc_sync(1, bytes(2 * MIB)).unwrap_err();
                    assert_too_large(&e, "tensor byte length", 2 * MIB, MIB);
                    let s: i64 = ADD.rpc_sync(1, (3, 4)).unwrap();
                    assert_eq!(s, 7);
                }
            }
            ferry_rpc::shutdown().unwrap();
        },
    );
}

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
