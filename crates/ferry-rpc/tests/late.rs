//! Functions registered while the agent runs (`LateFunctions`), across
//! worker processes on 127.0.0.1: unknown before they are added, served
//! and described once added (type-checked as any registration), unknown
//! again once removed. The steps are ordered by keys in the group's store.
#![allow(clippy::unwrap_used, missing_docs, unreachable_pub)]

use std::time::Duration;

use ferry_rpc::describe::DESCRIBE;
use ferry_rpc::{Agent, Function, Functions, LateFunctions, RpcError, RpcOptions};
use ferry_testkit::world_ok;

pub const LATER: Function<i64, i64> = Function::new("later");
/// `later` declared with other types.
pub const LATER_WRONG: Function<String, String> = Function::new("later");

fn set(agent: &Agent, key: &str) {
    agent.block_on(agent.store().set(key, Vec::new())).unwrap();
}

fn wait(agent: &Agent, key: &str) {
    agent
        .block_on(
            agent
                .store()
                .wait(&[key.to_string()], Duration::from_secs(60)),
        )
        .unwrap();
}

fn unknown(result: Result<i64, RpcError>) -> bool {
    matches!(result, Err(RpcError::UnknownFunction { ref function, .. }) if function == "later")
}

#[test]
fn a_function_added_while_the_agent_runs_is_served_from_then_on() {
    let Some(outputs) = world_ok(
        "a_function_added_while_the_agent_runs_is_served_from_then_on",
        2,
        |rank| {
            let late = LateFunctions::new();
            let mut functions = Functions::new();
            functions.serve_late(late.clone());
            let options = RpcOptions::from_env(format!("worker{rank}"))
                .unwrap()
                .functions(functions)
                .init_timeout(Duration::from_secs(60));
            let agent = Agent::start(options).unwrap();
            if rank == 0 {
                assert!(unknown(LATER.agent(&agent).rpc_sync(1, 1)));
                let described = DESCRIBE.agent(&agent).rpc_sync(1, "later".to_string());
                assert_eq!(described.unwrap(), None);
                set(&agent, "test/asked");
                wait(&agent, "test/added");
                assert_eq!(LATER.agent(&agent).rpc_sync(1, 41).unwrap(), 42);
                let d = DESCRIBE
                    .agent(&agent)
                    .rpc_sync(1, "later".to_string())
                    .unwrap()
                    .unwrap();
                assert_eq!(d.signature_text(), "fn(i64) -> i64");
                let e = LATER_WRONG
                    .agent(&agent)
                    .rpc_sync(1, "x".to_string())
                    .unwrap_err();
                assert!(matches!(e, RpcError::WrongType { .. }), "{e}");
                set(&agent, "test/checked");
                wait(&agent, "test/removed");
                assert!(unknown(LATER.agent(&agent).rpc_sync(1, 1)));
                println!("CHECKED=yes");
            } else {
                wait(&agent, "test/asked");
                late.update(|f| {
                    f.add(LATER, |x| x + 1);
                });
                assert_eq!(late.names(), ["later"]);
                set(&agent, "test/added");
                wait(&agent, "test/checked");
                assert!(late.remove("later"));
                assert!(!late.remove("later"));
                set(&agent, "test/removed");
            }
            agent.shutdown().unwrap();
        },
    ) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED"), ["yes"]);
}
