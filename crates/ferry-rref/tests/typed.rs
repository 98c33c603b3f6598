//! Typed `remote` and typed functions taking RRefs, across 3 worker
//! processes on 127.0.0.1: values made through a `Function` declaration,
//! a wrong-typed declaration refused with both signatures named, and RRef
//! and RPC errors converted with `?` inside function bodies. At the end
//! every worker's RRef tables are empty and nothing leaked.
#![allow(clippy::unwrap_used)]

use std::cell::RefCell;
use std::sync::Mutex;
use std::time::Duration;

use ferry_rpc::{BoxError, Function, Functions, RpcError, RpcOptions, Schema};
use ferry_rref::{DebugInfo, Method, MethodsExt, RRef, RRefContext, RRefError, RemoteExt};
use ferry_testkit::world_ok;

const ADD: Function<(i64, i64), i64> = Function::new("add");
const FETCH: Function<RRef<i64>, i64> = Function::new("fetch");
/// Passes the RRef on `hops` more times, then fetches it.
const FORWARD: Function<(RRef<i64>, i64), i64> = Function::new("forward");
const WAIT_EMPTY: Function<(), String> = Function::new("wait_empty");

/// A value that is `Send` but not `Sync`, kept on its owner.
const CELL: Function<i64, RefCell<i64>> = Function::new("cell");
/// Bumps the cell on its owner through `with_local_value`.
const BUMP: Function<RRef<RefCell<i64>>, i64> = Function::new("bump");

/// State kept on its owner behind an RRef, changed by typed methods.
#[derive(Default, serde::Serialize, serde::Deserialize, Schema)]
struct Log {
    lines: Mutex<Vec<String>>,
}

impl Log {
    const NEW: Function<String, Log> = Function::new("Log.new");
    const PUSH: Method<Log, String, usize> = Method::new("Log.push");
    const LINES: Method<Log, (), Vec<String>> = Method::new("Log.lines");
    /// Fails on an empty line, with the method's own error type.
    const CHECKED_PUSH: Method<Log, String, usize> = Method::new("Log.checked_push");
}

#[derive(Debug, thiserror::Error)]
#[error("empty line refused by the log")]
struct EmptyLine;

fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(ADD, |(a, b)| a + b);
    // `?` on an RRefError, no `.map_err(|e| e.to_string())`.
    f.add(FETCH, |r: RRef<i64>| -> Result<i64, BoxError> {
        Ok(r.to_here()?)
    });
    // `?` on RPC and RRef errors in one body.
    f.add(
        FORWARD,
        |(r, hops): (RRef<i64>, i64)| -> Result<i64, BoxError> {
            if hops == 0 {
                return Ok(r.to_here()?);
            }
            let me = ferry_rpc::get_worker_info(None)?;
            Ok(FORWARD.rpc_sync((me.id + 1) % 3, (r, hops - 1))?)
        },
    );
    f.add(CELL, RefCell::new);
    f.add(BUMP, |r: RRef<RefCell<i64>>| {
        r.with_local_value(|c| {
            *c.borrow_mut() += 1;
            *c.borrow()
        })
    });
    f.add(Log::NEW, |first| Log {
        lines: Mutex::new(vec![first]),
    });
    f.add_method(Log::PUSH, |log: &Log, line| {
        let mut lines = log.lines.lock().unwrap();
        lines.push(line);
        lines.len()
    });
    f.add_method(Log::LINES, |log: &Log, ()| {
        log.lines.lock().unwrap().clone()
    });
    f.add_method(Log::CHECKED_PUSH, |log: &Log, line: String| {
        if line.is_empty() {
            return Err(EmptyLine);
        }
        let mut lines = log.lines.lock().unwrap();
        lines.push(line);
        Ok(lines.len())
    });
    f.add(WAIT_EMPTY, |()| {
        match RRefContext::current()
            .unwrap()
            .wait_until_empty(Duration::from_secs(30))
        {
            Ok(()) => String::new(),
            Err(left) => format!("{left:?}"),
        }
    });
    f
}

#[test]
fn typed_remote_and_rref_arguments() {
    let Some(outputs) = world_ok("typed_remote_and_rref_arguments", 3, |rank| {
        let mut options = RpcOptions::from_env(format!("worker{rank}"))
            .unwrap()
            .functions(functions())
            .init_timeout(Duration::from_secs(60));
        let ctx = ferry_rref::install(&mut options);
        init_rpc(options).unwrap();
        if rank == 0 {
            let sum: RRef<i64> = ADD.remote(1, (2, 3)).unwrap();
            assert_eq!(sum.to_here().unwrap(), 5);
            let own = ADD
                .timeout(Duration::from_secs(30))
                .remote("worker0", (4, 5))
                .unwrap();
            assert_eq!(own.to_here().unwrap(), 9);
            // Typed calls taking the RRef: fetched on worker2, forwarded
            // round the group.
            assert_eq!(FETCH.rpc_sync(2, sum.clone()).unwrap(), 5);
            assert_eq!(FORWARD.rpc_sync(1, (own.clone(), 4)).unwrap(), 9);

            // A declaration with other types is refused by the owner; the
            // RRef's value is that error, naming both signatures.
            const ADD_BYTES: Function<(u8, u8), i64> = Function::new("add");
            let wrong = ADD_BYTES.remote(1, (2, 3)).unwrap();
            let e = wrong.to_here().unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains("fn((i64, i64)) -> i64") && text.contains("fn((u8, u8)) -> i64"),
                "{text}"
            );
            // The error converts with `?` into a BoxError, and so does an RpcError.
            let via_box = || -> Result<i64, BoxError> {
                let v = wrong.to_here()?;
                Ok(v + ADD.rpc_sync(1, (0, 0))?)
            };
            let e = via_box().unwrap_err();
            assert!(e.downcast_ref::<RRefError>().is_some(), "{e}");
            let e = ADD.remote(-2, (1, 1)).unwrap_err();
            assert!(
                matches!(e, RRefError::Rpc(RpcError::RankOutOfRange { rank: -2, .. })),
                "{e}"
            );
            // Typed methods on a value owned by worker2, through each proxy.
            let log: RRef<Log> = Log::NEW.remote(2, "a".to_string()).unwrap();
            assert_eq!(log.rpc_sync().call(Log::PUSH, "b".into()).unwrap(), 2);
            let pending = log.rpc_async().call(Log::PUSH, "c".into());
            assert_eq!(pending.wait().unwrap(), 3);
            let count: RRef<usize> = log.remote().call(Log::PUSH, "d".into()).unwrap();
            assert_eq!(count.to_here().unwrap(), 4);
            assert_eq!(
                log.rpc_sync()
                    .timeout(Duration::from_secs(30))
                    .call(Log::LINES, ())
                    .unwrap(),
                ["a", "b", "c", "d"]
            );
            // The method's own error reaches the caller with its text.
            let e = log
                .rpc_sync()
                .call(Log::CHECKED_PUSH, String::new())
                .unwrap_err();
            assert!(
                e.to_string().contains("empty line refused by the log"),
                "{e}"
            );
            assert_eq!(
                log.rpc_sync().call(Log::CHECKED_PUSH, "e".into()).unwrap(),
                5
            );
            // A method declared with other types is refused, naming both.
            const PUSH_NUMBER: Method<Log, u64, usize> = Method::new("Log.push");
            let e = log.rpc_sync().call(PUSH_NUMBER, 7).unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains("the call sent fn((RRef<Log { lines: [String] }>, u64)) -> u64")
                    && text.contains("it takes fn((RRef<Log { lines: [String] }>, String)) -> u64"),
                "{text}"
            );
            // A value that is not Sync lives on worker1: bumped there in
            // turns, fetched by copy.
            let cell = CELL.remote(1, 40).unwrap();
            assert_eq!(BUMP.rpc_sync(1, cell.clone()).unwrap(), 41);
            assert_eq!(BUMP.rpc_sync(1, cell.clone()).unwrap(), 42);
            assert_eq!(cell.to_here().unwrap().into_inner(), 42);
            // Elsewhere than on its owner, the value is out of reach.
            let e = BUMP.rpc_sync(2, cell.clone()).unwrap_err();
            assert!(e.to_string().contains("owner is worker1"), "{e}");
            drop(cell);
            // A value owned here runs its methods locally through the same proxies.
            let local = RRef::new(Log::default()).unwrap();
            assert_eq!(local.rpc_sync().call(Log::PUSH, "x".into()).unwrap(), 1);
            drop((sum, own, wrong, log, count, local));
            for r in 0..3 {
                assert_eq!(
                    WAIT_EMPTY.rpc_sync(r, ()).unwrap(),
                    "",
                    "worker{r} has RRef state"
                );
            }
            println!("CHECKED=yes");
        }
        ferry_rpc::shutdown().unwrap();
        assert!(ctx.leaked().is_empty(), "leaked: {:?}", ctx.leaked());
        assert_eq!(ctx.debug_info(), DebugInfo::default());
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
