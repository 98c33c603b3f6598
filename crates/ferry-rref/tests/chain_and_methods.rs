//! Across worker processes on 127.0.0.1: a recursive type holding RRefs
//! to itself (`Chain`) as the argument and the result of typed calls, a
//! declaration with another recursive type refused with both shapes
//! named, and methods called typed and by their one name (`"Type.method"`)
//! on the same owner. At the end every worker's RRef tables are empty and
//! nothing leaked.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry_rpc::{BoxError, Function, Functions, RpcError, RpcOptions, Schema};
use ferry_rref::{DebugInfo, Method, MethodsExt, RRef, RRefContext, RRefError, RemoteExt};
use ferry_testkit::world_ok;
use ferry_transport::RawTensor;
use serde::{Deserialize, Serialize};

/// Values spread over workers: a tensor, or links to other chains (each
/// where it was made).
#[derive(Serialize, Deserialize, Schema)]
enum Chain {
    Link(Vec<RRef<Chain>>),
    Value(RawTensor),
}

/// Another chain under the same name: a variant more.
mod other {
    use super::*;

    #[derive(Serialize, Deserialize, Schema)]
    #[serde(rename = "Chain")]
    pub(crate) enum Chain {
        Link(Vec<RRef<Chain>>),
        Value(RawTensor),
        Empty,
    }
}

/// A value holding four `x`s, made where it runs.
const VALUE: Function<f32, Chain> = Function::new("Chain.value");
/// The sum of every tensor the chain reaches, fetched from their owners.
const SUM: Function<Chain, f32> = Function::new("Chain.sum");
/// A chain of `depth` links made where it runs, each link's value and
/// rest owned there (see [`built_sum`]).
const BUILD: Function<u32, Chain> = Function::new("Chain.build");
const WAIT_EMPTY: Function<(), String> = Function::new("wait_empty");

/// A value with methods, kept on its owner.
#[derive(Default, Serialize, Deserialize, Schema)]
struct Counter {
    total: AtomicI64,
}

impl Counter {
    const NEW: Function<i64, Counter> = Function::new("Counter.new");
    const ADD: Method<Counter, i64, i64> = Method::new("Counter.add");
    const GET: Method<Counter, (), i64> = Method::new("Counter.get");
    /// Registered with a fallible body, called both ways too.
    const SCALED: Method<Counter, i64, i64> = Method::new("Counter.scaled");
}

fn tensor(x: f32) -> RawTensor {
    RawTensor::from_slice(&[x; 4], &[2, 2]).unwrap()
}

fn sum(chain: &Chain) -> Result<f32, BoxError> {
    match chain {
        Chain::Value(t) => Ok(t.as_slice::<f32>().ok_or("not f32")?.iter().sum()),
        Chain::Link(links) => {
            let mut total = 0.0;
            for link in links {
                total += sum(&link.to_here()?)?;
            }
            Ok(total)
        }
    }
}

fn build(depth: u32) -> Result<Chain, RRefError> {
    if depth == 0 {
        return Ok(Chain::Value(tensor(1.0)));
    }
    Ok(Chain::Link(vec![
        RRef::new(Chain::Value(tensor(depth as f32)))?,
        RRef::new(build(depth - 1)?)?,
    ]))
}

/// What [`build`]`(depth)` sums to: 4 × (depth + ... + 1 + 1).
fn built_sum(depth: u32) -> f32 {
    4.0 * (1 + depth * (depth + 1) / 2) as f32
}

fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(VALUE, |x| Chain::Value(tensor(x)));
    f.add(SUM, |chain| sum(&chain));
    f.add(BUILD, build);
    f.add(WAIT_EMPTY, |()| {
        match RRefContext::current()
            .unwrap()
            .wait_until_empty(Duration::from_secs(30))
        {
            Ok(()) => String::new(),
            Err(left) => format!("{left:?}"),
        }
    });
    f.add(Counter::NEW, |start| Counter {
        total: AtomicI64::new(start),
    });
    f.add_method(Counter::ADD, |c: &Counter, n| {
        c.total.fetch_add(n, Ordering::SeqCst) + n
    });
    f.add_method(Counter::GET, |c: &Counter, ()| {
        c.total.load(Ordering::SeqCst)
    });
    f.add_method(Counter::SCALED, |c: &Counter, k: i64| {
        c.total
            .load(Ordering::SeqCst)
            .checked_mul(k)
            .ok_or("the scaled total overflows")
    });
    f
}

fn init(rank: u32) -> Arc<RRefContext> {
    let mut options = RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(functions())
        .init_timeout(Duration::from_secs(60));
    let ctx = ferry_rref::install(&mut options);
    init_rpc(options).unwrap();
    ctx
}

/// Waits until no worker holds RRef state, shuts down, checks nothing
/// leaked.
fn finish(rank: u32, world: u32, ctx: &RRefContext) {
    if rank == 0 {
        for r in 0..world {
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
}

/// A chain of RRefs to chains, owned on three workers, travels as an
/// argument (summed by a worker that fetches every link from its owner)
/// and as a result (made on one worker, summed on another and here); a
/// declaration with another recursive chain is refused, naming both.
#[test]
fn a_recursive_type_with_rrefs_crosses_rpc() {
    let Some(outputs) = world_ok("a_recursive_type_with_rrefs_crosses_rpc", 3, |rank| {
        let ctx = init(rank);
        if rank == 0 {
            assert_eq!(
                Chain::SHAPE.to_string(),
                "enum Chain { Link([RRef<Chain>]), Value(RawTensor) }"
            );
            // Argument: links owned by worker1, worker2 and here.
            let one: RRef<Chain> = VALUE.remote(1, 1.0).unwrap();
            let two: RRef<Chain> = VALUE.remote(2, 2.0).unwrap();
            let inner = RRef::new(Chain::Link(vec![one.clone(), two.clone()])).unwrap();
            let half: RRef<Chain> = VALUE.remote(1, 0.5).unwrap();
            let top = Chain::Link(vec![inner.clone(), half]);
            assert_eq!(sum(&top).unwrap(), 14.0);
            assert_eq!(SUM.rpc_sync(2, top).unwrap(), 14.0);
            assert_eq!(
                SUM.rpc_sync(1, Chain::Link(vec![inner, one, two])).unwrap(),
                24.0
            );
            // Result: made on worker1, its links owned there.
            let built = BUILD.rpc_sync(1, 3).unwrap();
            assert_eq!(sum(&built).unwrap(), built_sum(3));
            // Passed on from here to worker2, which fetches from worker1.
            assert_eq!(SUM.rpc_sync(2, built).unwrap(), built_sum(3));
            let kept: RRef<Chain> = BUILD.remote(2, 4).unwrap();
            assert_eq!(
                SUM.rpc_sync(1, kept.to_here().unwrap()).unwrap(),
                built_sum(4)
            );

            // Another recursive chain is refused, its RRefs released.
            const SUM_OTHER: Function<other::Chain, f32> = Function::new("Chain.sum");
            let empty = RRef::new(other::Chain::Empty).unwrap();
            let e = SUM_OTHER
                .rpc_sync(2, other::Chain::Link(vec![empty]))
                .unwrap_err();
            let RpcError::WrongType {
                function,
                expected,
                got,
                ..
            } = &e
            else {
                panic!("not a wrong-type error: {e}");
            };
            assert_eq!(function, "Chain.sum");
            let mine = Chain::SHAPE.to_string();
            let theirs = other::Chain::SHAPE.to_string();
            assert_eq!(
                theirs,
                "enum Chain { Link([RRef<Chain>]), Value(RawTensor), Empty }"
            );
            assert!(
                expected.contains(&mine) && !expected.contains(&theirs),
                "{e}"
            );
            assert!(got.contains(&theirs), "{e}");
            drop(kept);
        }
        finish(rank, 3, &ctx);
    }) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED"), ["yes"]);
}

/// A method has one name: called typed and by that name on the same
/// owner, through each proxy, it gives the same value, whichever way it
/// was registered; a name nobody registered is refused, naming it.
#[test]
fn methods_are_called_typed_and_by_name() {
    let Some(outputs) = world_ok("methods_are_called_typed_and_by_name", 2, |rank| {
        let ctx = init(rank);
        if rank == 0 {
            let remote: RRef<Counter> = Counter::NEW.remote(1, 10).unwrap();
            let local = RRef::new(Counter::default()).unwrap();
            for c in [&remote, &local] {
                let typed = c.rpc_sync().call(Counter::GET, ()).unwrap();
                let by_name: i64 = c.rpc_sync().call_by_name(Counter::GET.name(), ()).unwrap();
                assert_eq!(typed, by_name);
                assert_eq!(Counter::ADD.name(), "Counter.add");
                let added = c.rpc_sync().call(Counter::ADD, 5).unwrap();
                let by_name: i64 = c.rpc_sync().call_by_name("Counter.add", 5i64).unwrap();
                assert_eq!(by_name, added + 5);
                let later = c.rpc_async().call_by_name::<i64, _>("Counter.add", 0i64);
                assert_eq!(later.wait().unwrap(), by_name);
                let kept: RRef<i64> = c.remote().call_by_name("Counter.get", ()).unwrap();
                assert_eq!(
                    kept.to_here().unwrap(),
                    c.rpc_async().call(Counter::GET, ()).wait().unwrap()
                );
                // A fallible method, called typed and by name.
                let typed = c.rpc_sync().call(Counter::SCALED, 3).unwrap();
                let by_name: i64 = c
                    .rpc_sync()
                    .call_by_name(Counter::SCALED.name(), 3i64)
                    .unwrap();
                assert_eq!(typed, by_name);
                assert_eq!(typed, 3 * c.rpc_sync().call(Counter::GET, ()).unwrap());
                // Its `Err` reaches the caller with its text.
                let e = c.rpc_sync().call(Counter::SCALED, i64::MAX).unwrap_err();
                assert!(e.to_string().contains("the scaled total overflows"), "{e}");
            }
            assert_eq!(remote.rpc_sync().call(Counter::GET, ()).unwrap(), 20);

            // Names nobody registered, each way: the error names it.
            for c in [&remote, &local] {
                let e = c
                    .rpc_sync()
                    .call_by_name::<i64, _>("Counter.nope", 1i64)
                    .unwrap_err();
                assert!(
                    matches!(
                        &e,
                        RRefError::Rpc(RpcError::UnknownFunction { function, .. })
                            if function == "Counter.nope"
                    ),
                    "{e}"
                );
                assert!(e.to_string().contains("\"Counter.nope\""), "{e}");
                const NOPE: Method<Counter, i64, i64> = Method::new("Counter.nope");
                let e = c.rpc_sync().call(NOPE, 1).unwrap_err();
                assert!(e.to_string().contains("\"Counter.nope\""), "{e}");
                let e = c
                    .rpc_async()
                    .call_by_name::<i64, _>("Counter.nope", 1i64)
                    .wait()
                    .unwrap_err();
                assert!(e.to_string().contains("\"Counter.nope\""), "{e}");
                let made: RRef<i64> = c.remote().call_by_name("Counter.nope", 1i64).unwrap();
                let e = made.to_here().unwrap_err();
                assert!(e.to_string().contains("Counter.nope"), "{e}");
                // A method's bare name is not its name.
                let e = c
                    .rpc_sync()
                    .call_by_name::<i64, _>("add", 1i64)
                    .unwrap_err();
                assert!(e.to_string().contains("\"add\""), "{e}");
            }
            drop((remote, local));
        }
        finish(rank, 2, &ctx);
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
