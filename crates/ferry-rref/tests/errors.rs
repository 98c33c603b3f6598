//! What the errors of `remote` calls say, across 2 worker processes on
//! 127.0.0.1: a proxy `remote` that times out names the method and the
//! owner (not the RRef service carrying it), and a refused `remote` writes
//! both signatures the same way. At the end every worker's RRef tables
//! are empty and nothing leaked.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use ferry_rpc::{Agent, Function, Functions, RpcOptions, Schema};
use ferry_rref::{DebugInfo, Method, MethodsExt, RRef, RRefContext, RRefError, RemoteExt};
use ferry_testkit::world_ok;
use serde::{Deserialize, Serialize};

/// A value kept on its owner, whose method waits for a store key.
#[derive(Default, Serialize, Deserialize, Schema)]
struct Gate {
    opened: u64,
}

impl Gate {
    const NEW: Function<(), Gate> = Function::new("Gate.new");
    /// Waits until the store key named by the argument is set, then
    /// returns 7.
    const WAIT: Method<Gate, String, u64> = Method::new("Gate.wait");
}

const SUM: Function<(Vec<i64>, i64), i64> = Function::new("sum");
const WAIT_EMPTY: Function<(), String> = Function::new("wait_empty");

fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(Gate::NEW, |()| Gate::default());
    f.add_method(Gate::WAIT, |gate: &Gate, key: String| {
        let agent = Agent::current().unwrap();
        agent
            .block_on(agent.store().wait(&[key], Duration::from_secs(60)))
            .unwrap();
        gate.opened + 7
    });
    f.add(SUM, |(v, n): (Vec<i64>, i64)| v.iter().sum::<i64>() + n);
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

fn start(rank: u32) -> std::sync::Arc<RRefContext> {
    let mut options = RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(functions())
        .init_timeout(Duration::from_secs(60));
    let ctx = ferry_rref::install(&mut options);
    init_rpc(options).unwrap();
    ctx
}

fn finish(rank: u32, ctx: &RRefContext) {
    if rank == 0 {
        for r in 0..2u32 {
            assert_eq!(WAIT_EMPTY.rpc_sync(r, ()).unwrap(), "", "worker{r}");
        }
        println!("CHECKED=yes");
    }
    ferry_rpc::shutdown().unwrap();
    assert!(ctx.leaked().is_empty(), "leaked: {:?}", ctx.leaked());
    assert_eq!(ctx.debug_info(), DebugInfo::default());
}

#[test]
fn a_proxy_remote_that_times_out_names_the_method_and_the_owner() {
    let Some(outputs) = world_ok(
        "a_proxy_remote_that_times_out_names_the_method_and_the_owner",
        2,
        |rank| {
            let ctx = start(rank);
            if rank == 0 {
                let gate: RRef<Gate> = Gate::NEW.remote(1, ()).unwrap();
                let waiting: RRef<u64> = gate
                    .remote()
                    .timeout(Duration::from_millis(200))
                    .call(Gate::WAIT, "gate/a".to_string())
                    .unwrap();
                let e = waiting
                    .timeout(Duration::from_secs(60))
                    .to_here()
                    .unwrap_err();
                assert!(matches!(e, RRefError::CreationFailed { .. }), "{e}");
                let text = e.to_string();
                assert!(
                    text.contains("on owner worker1: call of \"Gate.wait\" on worker \"worker1\" timed out after 200ms"),
                    "{text}"
                );
                assert!(!text.contains("\"rref\""), "{text}");
                // The owner finishes later; nothing is left behind.
                let agent = ferry_rpc::agent().unwrap();
                agent
                    .block_on(agent.store().set("gate/a", vec![1]))
                    .unwrap();
                drop((waiting, gate));
            }
            finish(rank, &ctx);
        },
    ) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED"), ["yes"]);
}

/// An owner that refuses a `remote` names both signatures the same way:
/// declared shapes when both sides are typed, type names without module
/// paths otherwise.
#[test]
fn a_refused_remote_shows_both_signatures_in_one_notation() {
    let Some(outputs) = world_ok(
        "a_refused_remote_shows_both_signatures_in_one_notation",
        2,
        |rank| {
            let ctx = start(rank);
            if rank == 0 {
                let refused = |r: RRef<i64>| r.to_here().unwrap_err().to_string();
                assert_eq!(
                    SUM.remote(1, (vec![1, 2], 3)).unwrap().to_here().unwrap(),
                    6
                );

                // Typed creator, typed registration.
                const SUM_STRINGS: Function<(Vec<String>, i64), i64> = Function::new("sum");
                let text = refused(SUM_STRINGS.remote(1, (vec!["a".into()], 3)).unwrap());
                assert!(
                    text.contains("it takes fn(([i64], i64)) -> i64, the call sent fn(([String], i64)) -> i64"),
                    "{text}"
                );

                // String-named creator, typed registration.
                let by_name = ferry_rpc::by_name("sum")
                    .remote(1, (vec!["a".to_string()], 3i64))
                    .unwrap();
                let text = refused(by_name);
                assert!(
                    text.contains("it takes fn((Vec<i64>, i64)) -> i64, the call sent fn((Vec<String>, i64)) -> i64"),
                    "{text}"
                );
                assert!(!text.contains("alloc::"), "{text}");
            }
            finish(rank, &ctx);
        },
    ) else {
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
