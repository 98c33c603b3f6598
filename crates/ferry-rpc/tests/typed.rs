//! Typed remote functions across worker processes on 127.0.0.1: calls
//! through `Function` declarations, with options and through an agent
//! started alone, their type check against typed and string-named
//! callers, and errors of function bodies.
#![allow(clippy::unwrap_used, missing_docs, unreachable_pub)]

use std::time::Duration;

use ferry_rpc::{Agent, BoxError, Function, Functions, RpcError, RpcOptions, Schema};
use ferry_testkit::world_ok;
use serde::{Deserialize, Serialize};

pub const ADD: Function<(i64, i64), i64> = Function::new("add");
pub const ASYNC_ADD: Function<(i64, i64), i64> = Function::new("async_add");
pub const NORM1: Function<v1::Point, i64> = Function::new("norm1");
pub const GATED: Function<String, u64> = Function::new("gated");
pub const LOOKUP: Function<String, u64> = Function::new("lookup");
pub const CHECKED_DIV: Function<(i64, i64), Result<i64, DivError>> = Function::new("checked_div");
pub const RELAY: Function<(i64, i64, i64), i64> = Function::new("relay");

mod v1 {
    use super::*;

    #[derive(Debug, Clone, Serialize, Deserialize, Schema)]
    pub struct Point {
        pub x: i64,
        pub y: i64,
    }
}

/// Another declaration of the same point (as another build of the program
/// would have it, under other type names): the same shape.
mod v2 {
    use super::*;

    #[derive(Debug, Clone, Serialize, Deserialize, Schema)]
    #[serde(rename = "Point")]
    pub struct Moved {
        pub x: i64,
        pub y: i64,
    }
}

/// A function's own error, with a source.
#[derive(Debug, thiserror::Error)]
enum LookupError {
    #[error("no entry for {key:?}")]
    Missing {
        key: String,
        #[source]
        source: std::io::Error,
    },
}

/// An error that travels typed, inside the result.
#[derive(Debug, PartialEq, Serialize, Deserialize, Schema, thiserror::Error)]
pub enum DivError {
    #[error("division by zero")]
    ByZero,
}

fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(ADD, |(a, b)| a + b);
    f.add(ASYNC_ADD, |(a, b)| async move {
        // Nested typed call from an async body, awaited.
        ADD.rpc_async(0, (a, b)).await
    });
    f.add(NORM1, |p| p.x.abs() + p.y.abs());
    f.add(GATED, |key: String| {
        let agent = ferry_rpc::Agent::current().unwrap();
        agent
            .block_on(agent.store().wait(&[key], Duration::from_secs(60)))
            .unwrap();
        7
    });
    f.add(LOOKUP, |key: String| {
        if key == "present" {
            Ok(1)
        } else {
            Err(LookupError::Missing {
                key,
                source: std::io::Error::other("disk gone"),
            })
        }
    });
    f.add(CHECKED_DIV, |(a, b)| -> Result<_, BoxError> {
        Ok(if b == 0 {
            Err(DivError::ByZero)
        } else {
            Ok(a / b)
        })
    });
    // `?` on an RPC error (a nested call to rank `to`) and on a parse error.
    f.add(RELAY, |(to, a, b)| -> Result<i64, BoxError> {
        let sum = ADD.rpc_sync(to, (a, b))?;
        let doubled: i64 = format!("{}", sum * 2).parse()?;
        Ok(doubled)
    });
    f
}

fn start(rank: u32) {
    let options = RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(functions())
        .init_timeout(Duration::from_secs(60));
    init_rpc(options).unwrap();
}

/// An agent started alone (`Agent::start`, what an embedder does) is not
/// the process's: calls name it, with any option, typed or by name, and
/// calls that name no agent find none.
#[test]
fn an_agent_started_alone_is_called_through() {
    let Some(outputs) = world_ok("an_agent_started_alone_is_called_through", 2, |rank| {
        let options = RpcOptions::from_env(format!("worker{rank}"))
            .unwrap()
            .functions(functions())
            .init_timeout(Duration::from_secs(60));
        let agent = Agent::start(options).unwrap();
        if rank == 0 {
            let e = ADD.rpc_sync(1, (2, 3)).unwrap_err();
            assert!(matches!(e, RpcError::NotInitialized), "{e}");
            assert_eq!(ADD.agent(&agent).rpc_sync(1, (2, 3)).unwrap(), 5);
            let call = ADD.agent(&agent).timeout(Duration::from_secs(30));
            let pending: Vec<_> = (0..2).map(|r| call.rpc_async(r, (r as i64, 1))).collect();
            assert_eq!(ferry_rpc::wait_all(pending).unwrap(), [1, 2]);
            let by_name: i64 = ferry_rpc::by_name("add")
                .agent(&agent)
                .rpc_sync("worker1", (4i64, 5i64))
                .unwrap();
            assert_eq!(by_name, 9);
            println!("CHECKED=yes");
        }
        agent.shutdown().unwrap();
    }) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED"), ["yes"]);
}

/// Typed calls reach workers by any integer rank and by name, sync, async,
/// nested, with a timeout; bad ranks give errors naming them.
#[test]
fn typed_calls_by_rank_and_name() {
    let Some(outputs) = world_ok("typed_calls_by_rank_and_name", 3, |rank| {
        start(rank);
        if rank == 0 {
            assert_eq!(ADD.rpc_sync(1, (2, 3)).unwrap(), 5);
            assert_eq!(ADD.rpc_sync(2usize, (2, 4)).unwrap(), 6);
            assert_eq!(ADD.rpc_sync(0u32, (1, 1)).unwrap(), 2);
            assert_eq!(ADD.rpc_sync("worker1", (10, 1)).unwrap(), 11);
            assert_eq!(ADD.rpc_sync(String::from("worker2"), (10, 2)).unwrap(), 12);
            let pending: Vec<_> = (0..3).map(|r| ADD.rpc_async(r, (r as i64, 100))).collect();
            let sums: Vec<i64> = pending.into_iter().map(|p| p.wait().unwrap()).collect();
            assert_eq!(sums, [100, 101, 102]);
            // An async body awaiting a nested typed call back to rank 0.
            assert_eq!(ASYNC_ADD.rpc_sync(2, (20, 22)).unwrap(), 42);
            let p = v1::Point { x: 3, y: -4 };
            assert_eq!(NORM1.rpc_sync(1, p).unwrap(), 7);

            let e = ADD.rpc_sync(-1, (1, 1)).unwrap_err();
            assert!(
                matches!(
                    e,
                    RpcError::RankOutOfRange {
                        rank: -1,
                        world_size: 3
                    }
                ),
                "{e}"
            );
            let e = ADD.rpc_sync(3, (1, 1)).unwrap_err();
            assert!(matches!(e, RpcError::InvalidRank { rank: 3, .. }), "{e}");
            let e = ADD.rpc_sync("nobody", (1, 1)).unwrap_err();
            assert!(matches!(e, RpcError::UnknownWorker(_)), "{e}");

            // A call that cannot finish before its key is set times out;
            // then the key is set and the same call completes.
            let key = "typed/gate".to_string();
            let e = GATED
                .timeout(Duration::from_millis(200))
                .rpc_sync(1, key.clone())
                .unwrap_err();
            assert!(
                matches!(e, RpcError::Timeout { ref function, .. } if function == "gated"),
                "{e}"
            );
            let agent = ferry_rpc::agent().unwrap();
            agent
                .block_on(agent.store().set(&key, b"go".to_vec()))
                .unwrap();
            let late = GATED.timeout(Duration::ZERO).rpc_async(1, key);
            assert_eq!(late.wait().unwrap(), 7);
            println!("CHECKED=yes");
        }
        ferry_rpc::shutdown().unwrap();
    }) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED"), ["yes"]);
}

/// Typed and string-named callers meet typed registrations: matching
/// types are served; a mismatch in either pairing is refused with an
/// error naming both signatures, as their declared shapes between typed
/// sides and as type names otherwise. Two typed declarations of one shape under other
/// type names agree (type names play no part between typed sides).
#[test]
fn typed_and_dynamic_signatures_are_checked() {
    let Some(outputs) = world_ok("typed_and_dynamic_signatures_are_checked", 2, |rank| {
        start(rank);
        if rank == 0 {
            // Matching types, every pairing.
            let s: i64 = ferry_rpc::by_name("add").rpc_sync(1, (2i64, 3i64)).unwrap();
            assert_eq!(s, 5);
            const MOVED_NORM1: Function<v2::Moved, i64> = Function::new("norm1");
            assert_eq!(
                MOVED_NORM1.rpc_sync(1, v2::Moved { x: 1, y: 2 }).unwrap(),
                3
            );

            // Typed caller, typed registration.
            const ADD_STRINGS: Function<(String, String), i64> = Function::new("add");
            let e = ADD_STRINGS
                .rpc_sync(1, ("2".into(), "3".into()))
                .unwrap_err();
            assert_wrong_type(&e, "fn((i64, i64)) -> i64", "fn((String, String)) -> i64");
            const NORM1_AS_TUPLE: Function<(i64, i64), i64> = Function::new("norm1");
            let e = NORM1_AS_TUPLE.rpc_sync(1, (1, 2)).unwrap_err();
            assert_wrong_type(
                &e,
                "fn(Point { x: i64, y: i64 }) -> i64",
                "fn((i64, i64)) -> i64",
            );

            // String-named caller, typed registration.
            let e = ferry_rpc::by_name("add")
                .rpc_sync::<i64, _>(1, (2u8, 3u8))
                .unwrap_err();
            assert_wrong_type(&e, "fn((i64, i64)) -> i64", "fn((u8, u8)) -> i64");

            // A wrong result type is refused the same way.
            const ADD_TO_STRING: Function<(i64, i64), String> = Function::new("add");
            let e = ADD_TO_STRING.rpc_sync(1, (2, 3)).unwrap_err();
            assert_wrong_type(&e, "fn((i64, i64)) -> i64", "fn((i64, i64)) -> String");
            println!("CHECKED=yes");
        }
        ferry_rpc::shutdown().unwrap();
    }) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED"), ["yes"]);
}

fn assert_wrong_type(e: &RpcError, expected: &str, got: &str) {
    match e {
        RpcError::WrongType {
            expected: e_expected,
            got: e_got,
            worker,
            ..
        } => {
            assert_eq!(worker, "worker1");
            assert_eq!(
                (e_expected.as_str(), e_got.as_str()),
                (expected, got),
                "{e}"
            );
        }
        other => panic!("expected a wrong-type error, got: {other}"),
    }
    let text = e.to_string();
    assert!(text.contains(expected) && text.contains(got), "{text}");
}

/// Function bodies return their own errors: a custom error type reaches
/// the caller with its sources' text; an error declared in the result
/// arrives typed; `?` converts RPC and parse errors into a `BoxError`.
#[test]
fn function_errors_pass_through() {
    let Some(outputs) = world_ok("function_errors_pass_through", 2, |rank| {
        start(rank);
        if rank == 0 {
            assert_eq!(LOOKUP.rpc_sync(1, "present".into()).unwrap(), 1);
            let e = LOOKUP.rpc_sync(1, "absent".into()).unwrap_err();
            match &e {
                RpcError::Remote {
                    function, message, ..
                } => {
                    assert_eq!(function, "lookup");
                    assert_eq!(message, "no entry for \"absent\": disk gone");
                }
                other => panic!("expected a remote error, got: {other}"),
            }

            assert_eq!(CHECKED_DIV.rpc_sync(1, (7, 2)).unwrap(), Ok(3));
            assert_eq!(
                CHECKED_DIV.rpc_sync(1, (7, 0)).unwrap(),
                Err(DivError::ByZero)
            );

            assert_eq!(RELAY.rpc_sync(1, (0, 2, 3)).unwrap(), 10);
            let e = RELAY.rpc_sync(1, (-5, 2, 3)).unwrap_err();
            match &e {
                RpcError::Remote { message, .. } => {
                    assert_eq!(message, "invalid rank -5: world size is 2")
                }
                other => panic!("expected a remote error, got: {other}"),
            }
            // The caller's own `?`: RpcError into BoxError.
            let via_box = || -> Result<i64, BoxError> { Ok(ADD.rpc_sync(9, (1, 1))?) };
            let e = via_box().unwrap_err();
            assert!(e.downcast_ref::<RpcError>().is_some(), "{e}");
            println!("CHECKED=yes");
        }
        ferry_rpc::shutdown().unwrap();
    }) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED"), ["yes"]);
}

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
