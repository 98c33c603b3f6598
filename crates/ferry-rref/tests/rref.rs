//! Multi-process tests of RRefs: 4 worker processes on 127.0.0.1, each
//! running the same test function as its rank. Rank 0 drives; at the end
//! every worker's RRef tables must be empty before shutdown (every value
//! deleted once its last user went away), and nothing leaked at shutdown.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry_rpc::{Agent, BoxError, Function, Functions, RpcOptions, Schema};
use ferry_rref::{DebugInfo, Method, MethodsExt, RRef, RRefContext, RRefError, RemoteExt};
use ferry_testkit::world_ok;
use serde::{Deserialize, Serialize};

const EMPTY_TIMEOUT: Duration = Duration::from_secs(30);

fn name(rank: u32) -> String {
    format!("worker{rank}")
}

/// A value with methods, kept on its owner.
#[derive(Debug, Default, Serialize, Deserialize, Schema)]
struct Counter {
    total: AtomicI64,
}

impl Counter {
    const NEW: Function<i64, Counter> = Function::new("counter");
    const ADD: Method<Counter, i64, i64> = Method::new("Counter.add");
    const GET: Method<Counter, (), i64> = Method::new("Counter.get");
}

const ADD: Function<(i64, i64), i64> = Function::new("add");
const VEC: Function<i64, Vec<i64>> = Function::new("vec");
/// Waits until the store key `gate` is set: a creation that stays
/// running until the test lets it finish.
const GATED: Function<(String, i64), i64> = Function::new("gated");
const FAIL: Function<String, i64> = Function::new("fail");
const FETCH: Function<RRef<i64>, i64> = Function::new("fetch");
const FETCH_VEC: Function<RRef<Vec<i64>>, Vec<i64>> = Function::new("fetch_vec");
/// The value and whether the worker it runs on owns it.
const LOCAL: Function<RRef<i64>, (i64, bool)> = Function::new("local");
const ECHO: Function<RRef<i64>, RRef<i64>> = Function::new("echo");
const CONFIRMED: Function<RRef<i64>, bool> = Function::new("confirmed");
const CONFIRMED_ASYNC: Function<RRef<i64>, bool> = Function::new("confirmed_async");
/// Forwards the RRef `hops` more times round the workers, then fetches
/// it: its value and the workers it passed.
const FORWARD: Function<Forwarded, (i64, Vec<String>)> = Function::new("forward");

/// The RRef, the hops left and the workers it passed.
type Forwarded = (RRef<i64>, u32, Vec<String>);
/// Nested RRefs: a value on this worker holding RRefs owned elsewhere.
const WRAP: Function<Vec<RRef<i64>>, Vec<RRef<i64>>> = Function::new("wrap");
const SUM_NESTED: Function<RRef<Vec<RRef<i64>>>, i64> = Function::new("sum_nested");
const NEW_LOCAL: Function<i64, RRef<i64>> = Function::new("new_local");
/// Waits until this worker's RRef tables are empty: what was left, if any.
const WAIT_EMPTY: Function<(), String> = Function::new("wait_empty");
/// Owner RRefs, confirmed and pending users on this worker.
const DEBUG_INFO: Function<(), (usize, usize, usize)> = Function::new("debug_info");

fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(ADD, |(a, b)| a + b);
    f.add(VEC, |n| (0..n).collect::<Vec<_>>());
    f.add(GATED, |(gate, v)| {
        let agent = Agent::current().unwrap();
        let store = agent.store();
        agent
            .block_on(store.wait(&[gate], Duration::from_secs(60)))
            .unwrap();
        v
    });
    f.add(FAIL, |msg| Err::<i64, _>(format!("boom: {msg}")));
    f.add(FETCH, |r| r.to_here());
    f.add(FETCH_VEC, |r| r.to_here());
    f.add(LOCAL, |r| {
        let owner = r.is_owner();
        r.local_value().map(|v| (*v, owner))
    });
    f.add(ECHO, |r| r);
    f.add(CONFIRMED, |r| r.confirmed_by_owner());
    f.add(CONFIRMED_ASYNC, |r| async move {
        Ok::<_, std::convert::Infallible>(r.confirmed_by_owner())
    });
    f.add(FORWARD, |(r, hops, path)| -> Result<_, BoxError> {
        let me = ferry_rpc::get_worker_info(None)?;
        let mut path = path;
        path.push(me.name.clone());
        if hops == 0 {
            let v = r.to_here()?;
            return Ok((v, path));
        }
        let next = (me.id + 1) % 4;
        Ok(FORWARD.rpc_sync(name(next), (r, hops - 1, path))?)
    });
    f.add(WRAP, |rs| rs);
    f.add(SUM_NESTED, |r| -> Result<i64, BoxError> {
        let mut sum = 0;
        for x in r.to_here()? {
            sum += x.to_here()?;
        }
        Ok(sum)
    });
    f.add(NEW_LOCAL, |v| RRef::new(v).unwrap());
    f.add(WAIT_EMPTY, |()| {
        match RRefContext::current()
            .unwrap()
            .wait_until_empty(EMPTY_TIMEOUT)
        {
            Ok(()) => String::new(),
            Err(left) => format!("{left:?}"),
        }
    });
    f.add(DEBUG_INFO, |()| {
        let d = RRefContext::current().unwrap().debug_info();
        (
            d.num_owner_rrefs,
            d.num_confirmed_users,
            d.num_pending_users,
        )
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
    f
}

/// Starts this rank's worker with the RRef layer.
fn init(rank: u32) -> Arc<RRefContext> {
    let mut options = RpcOptions::from_env(name(rank))
        .unwrap()
        .functions(functions());
    let ctx = ferry_rref::install(&mut options);
    init_rpc(options).unwrap();
    ctx
}

/// Rank 0, after dropping its handles: every worker's tables empty
/// (nothing left for the shutdown to clean up), then shutdown reports no leaks.
fn finish(rank: u32, ctx: &RRefContext) {
    if rank == 0 {
        for r in 0..4u32 {
            let left: String = WAIT_EMPTY.rpc_sync(name(r), ()).unwrap();
            assert_eq!(left, "", "{} still has RRef state", name(r));
        }
    }
    ferry_rpc::shutdown().unwrap();
    assert!(ctx.leaked().is_empty(), "leaked: {:?}", ctx.leaked());
    assert_eq!(ctx.debug_info(), DebugInfo::default());
    println!("FINISHED=1");
}

#[test]
fn user_shares_with_owner_as_return_value() {
    world_ok("user_shares_with_owner_as_return_value", 4, |rank| {
        let ctx = init(rank);
        if rank == 0 {
            let r: RRef<i64> = ADD.remote("worker1", (2i64, 3i64)).unwrap();
            assert!(!r.is_owner());
            assert_eq!(r.owner(), 1);
            assert_eq!(r.owner_name(), "worker1");
            assert_eq!(r.to_here().unwrap(), 5);
            // The owner returns the RRef it was given: it comes back as a new user here.
            let back: RRef<i64> = ECHO.rpc_sync("worker1", r.clone()).unwrap();
            assert_eq!(back.to_here().unwrap(), 5);
            let (owners, _, _): (usize, usize, usize) = DEBUG_INFO.rpc_sync("worker1", ()).unwrap();
            assert_eq!(owners, 1);
            drop((r, back));
        }
        finish(rank, &ctx);
    });
}

#[test]
fn user_shares_with_owner_as_argument() {
    world_ok("user_shares_with_owner_as_argument", 4, |rank| {
        let ctx = init(rank);
        if rank == 0 {
            let r: RRef<i64> = ADD.remote("worker1", (40i64, 2i64)).unwrap();
            // Sent right away, possibly before the owner has the value.
            let (v, is_owner): (i64, bool) = LOCAL.rpc_sync("worker1", r).unwrap();
            assert_eq!((v, is_owner), (42, true));
        }
        finish(rank, &ctx);
    });
}

#[test]
fn owner_shares_with_user() {
    world_ok("owner_shares_with_user", 4, |rank| {
        let ctx = init(rank);
        if rank == 0 {
            let r = RRef::new(7i64).unwrap();
            assert!(r.is_owner() && r.confirmed_by_owner());
            assert_eq!(*r.local_value().unwrap(), 7);
            let v: i64 = FETCH.rpc_sync("worker2", r.clone()).unwrap();
            assert_eq!(v, 7);
            // A user elsewhere made by a remote function: owned by worker3.
            let made: RRef<i64> = NEW_LOCAL.rpc_sync("worker3", 9i64).unwrap();
            assert_eq!(made.owner_name(), "worker3");
            assert_eq!(made.to_here().unwrap(), 9);
        }
        finish(rank, &ctx);
    });
}

#[test]
fn user_shares_with_user() {
    world_ok("user_shares_with_user", 4, |rank| {
        let ctx = init(rank);
        if rank == 0 {
            let r: RRef<Vec<i64>> = VEC.remote("worker1", 5i64).unwrap();
            // worker2 fetches from worker1 directly.
            let v: Vec<i64> = FETCH_VEC.rpc_sync("worker2", r.clone()).unwrap();
            assert_eq!(v, vec![0, 1, 2, 3, 4]);
            // Dropped here at once while worker3 is still being confirmed:
            // G2 keeps the parent until the child is confirmed.
            let f = FETCH_VEC.rpc_async("worker3", r);
            assert_eq!(f.wait().unwrap(), vec![0, 1, 2, 3, 4]);
        }
        finish(rank, &ctx);
    });
}

#[test]
fn self_owned_rrefs_and_rrefs_passed_back_to_their_owner() {
    world_ok(
        "self_owned_rrefs_and_rrefs_passed_back_to_their_owner",
        4,
        |rank| {
            let ctx = init(rank);
            if rank == 0 {
                let r: RRef<i64> = ADD.remote("worker0", (1i64, 1i64)).unwrap();
                assert!(r.is_owner());
                assert_eq!(r.to_here().unwrap(), 2);
                assert_eq!(*r.local_value().unwrap(), 2);
                // To itself as an argument.
                let (v, owner): (i64, bool) = LOCAL.rpc_sync("worker0", r.clone()).unwrap();
                assert_eq!((v, owner), (2, true));
                // Out to worker1 and back to the owner.
                let back: RRef<i64> = ECHO.rpc_sync("worker1", r.clone()).unwrap();
                assert!(back.is_owner());
                assert_eq!(*back.local_value().unwrap(), 2);
                // Dropped before their functions have run: nothing may stay behind.
                drop(ADD.remote("worker0", (5i64, 5i64)).unwrap());
                drop(ADD.remote("worker3", (5i64, 5i64)).unwrap());
            }
            finish(rank, &ctx);
        },
    );
}

#[test]
fn a_chain_of_eight_forwards() {
    let Some(out) = world_ok("a_chain_of_eight_forwards", 4, |rank| {
        let ctx = init(rank);
        if rank == 0 {
            let r: RRef<i64> = ADD.remote("worker2", (100i64, 23i64)).unwrap();
            let (v, path): (i64, Vec<String>) = FORWARD
                .rpc_sync("worker1", (r, 8u32, Vec::<String>::new()))
                .unwrap();
            assert_eq!(v, 123);
            println!("PATH={}", path.join(","));
        }
        finish(rank, &ctx);
    }) else {
        return;
    };
    assert_eq!(
        out[0].values("PATH"),
        ["worker1,worker2,worker3,worker0,worker1,worker2,worker3,worker0,worker1"]
    );
}

fn nested_once(i: i64) {
    let a: RRef<i64> = ADD.remote("worker1", (i, 1i64)).unwrap();
    let b: RRef<i64> = ADD.remote("worker2", (i, 2i64)).unwrap();
    let c = RRef::new(i + 3).unwrap();
    // An RRef on worker3 whose value holds RRefs owned by workers 1, 2 and 0.
    let nested: RRef<Vec<RRef<i64>>> = WRAP.remote("worker3", vec![a, b, c]).unwrap();
    let here = nested.to_here().unwrap();
    let sum: i64 = here.iter().map(|r| r.to_here().unwrap()).sum();
    assert_eq!(sum, 3 * i + 6);
    // And a different worker walks the nesting itself.
    let remote_sum: i64 = SUM_NESTED.rpc_sync("worker1", nested).unwrap();
    assert_eq!(remote_sum, 3 * i + 6);
}

#[test]
fn nested_rrefs() {
    world_ok("nested_rrefs", 4, |rank| {
        let ctx = init(rank);
        if rank == 0 {
            nested_once(10);
        }
        finish(rank, &ctx);
    });
}

#[test]
fn twenty_concurrent_nested_rref_tests() {
    world_ok("twenty_concurrent_nested_rref_tests", 4, |rank| {
        let ctx = init(rank);
        if rank == 0 {
            let threads: Vec<_> = (0..20)
                .map(|i| std::thread::spawn(move || nested_once(i)))
                .collect();
            for t in threads {
                t.join().unwrap();
            }
        }
        finish(rank, &ctx);
    });
}

#[test]
fn methods_run_on_the_owner() {
    world_ok("methods_run_on_the_owner", 4, |rank| {
        let ctx = init(rank);
        if rank == 0 {
            let c: RRef<Counter> = Counter::NEW.remote("worker1", 10i64).unwrap();
            assert_eq!(c.rpc_sync().call(Counter::ADD, 5).unwrap(), 15);
            let f = c.rpc_async().call(Counter::ADD, 1);
            assert_eq!(f.wait().unwrap(), 16);
            let total: RRef<i64> = c.remote().call(Counter::GET, ()).unwrap();
            assert_eq!(total.owner_name(), "worker1");
            assert_eq!(total.to_here().unwrap(), 16);
            // A user elsewhere calls methods too.
            let v: i64 = FETCH.rpc_sync("worker2", total).unwrap();
            assert_eq!(v, 16);
        }
        finish(rank, &ctx);
    });
}

#[test]
fn to_here_times_out_while_creation_runs_then_succeeds() {
    world_ok(
        "to_here_times_out_while_creation_runs_then_succeeds",
        4,
        |rank| {
            let ctx = init(rank);
            if rank == 0 {
                let agent = ferry_rpc::agent().unwrap();
                let r: RRef<i64> = GATED
                    .remote("worker1", ("gate/a".to_string(), 77i64))
                    .unwrap();
                // remote returned before the owner ran anything.
                assert!(!r.confirmed_by_owner());
                let err = r.timeout(Duration::from_millis(200)).to_here().unwrap_err();
                assert!(matches!(err, RRefError::Timeout { .. }), "{err}");
                assert!(err.to_string().contains("no value after"), "{err}");
                agent
                    .block_on(agent.store().set("gate/a", vec![1]))
                    .unwrap();
                assert_eq!(r.to_here().unwrap(), 77);
            }
            finish(rank, &ctx);
        },
    );
}

#[test]
fn error_texts() {
    world_ok("error_texts", 4, |rank| {
        let ctx = init(rank);
        if rank == 0 {
            // A failing function: stored on the owner, raised by to_here.
            let r: RRef<i64> = FAIL.remote("worker1", "no".to_string()).unwrap();
            let e = r.to_here().unwrap_err().to_string();
            assert!(e.contains("boom: no") && e.contains("worker1"), "{e}");
            // local_value away from the owner.
            let e = r.local_value().unwrap_err().to_string();
            assert!(
                e.contains("local_value()")
                    && e.contains("worker0")
                    && e.contains("owner is worker1"),
                "{e}"
            );
            // An unknown function.
            let r: RRef<i64> = ferry_rpc::by_name("nope").remote("worker2", ()).unwrap();
            let e = r.to_here().unwrap_err().to_string();
            assert!(e.contains("nope"), "{e}");
            // A creation that times out: to_here and forks fail, nothing hangs.
            let agent = ferry_rpc::agent().unwrap();
            let slow: RRef<i64> = GATED
                .timeout(Duration::from_millis(200))
                .remote("worker3", ("gate/b".to_string(), 1i64))
                .unwrap();
            // Asked while the creation runs: fails when the creation times out.
            let e = slow.timeout(Duration::from_secs(60)).to_here().unwrap_err();
            assert!(matches!(e, RRefError::CreationFailed { .. }), "{e}");
            assert!(
                e.to_string().contains("RRef creation failed/timed out"),
                "{e}"
            );
            let e = FETCH.rpc_sync("worker2", slow.clone()).unwrap_err();
            assert!(
                e.to_string().contains("RRef creation failed/timed out"),
                "{e}"
            );
            // The owner finishes later; the value must still be deleted.
            agent
                .block_on(agent.store().set("gate/b", vec![1]))
                .unwrap();
            drop(slow);
        }
        finish(rank, &ctx);
    });
}

/// An argument whose encoding fails (after the RRef before it was forked).
#[derive(Debug)]
struct Unencodable;

impl Serialize for Unencodable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "this value refuses to be encoded",
        ))
    }
}

/// An RRef owned by worker0 (`RRef::new`) and a user of one owned by worker1
/// (`remote`), both confirmed: the two kinds of parent a fork can have.
fn owned_and_user() -> (RRef<i64>, RRef<i64>) {
    let owned = RRef::new(7i64).unwrap();
    let user: RRef<i64> = ADD.remote("worker1", (1i64, 1i64)).unwrap();
    assert_eq!(user.to_here().unwrap(), 2);
    (owned, user)
}

#[test]
fn a_call_to_a_missing_function_releases_its_rrefs() {
    world_ok(
        "a_call_to_a_missing_function_releases_its_rrefs",
        4,
        |rank| {
            let ctx = init(rank);
            if rank == 0 {
                let (owned, user) = owned_and_user();
                for r in [&owned, &user] {
                    let e = ferry_rpc::by_name("no_such_function")
                        .rpc_sync::<i64, _>("worker2", r.clone())
                        .unwrap_err();
                    assert!(
                        matches!(e, ferry_rpc::RpcError::UnknownFunction { .. }),
                        "{e}"
                    );
                    // Also to the owner itself (worker1 owns `user`).
                    let e = ferry_rpc::by_name("no_such_function")
                        .rpc_sync::<i64, _>("worker1", r.clone())
                        .unwrap_err();
                    assert!(e.to_string().contains("no_such_function"), "{e}");
                }
                // Undone at once, before the error came back.
                assert_eq!(ctx.debug_info().num_pending_children, 0);
                drop((owned, user));
            }
            finish(rank, &ctx);
        },
    );
}

#[test]
fn a_call_with_the_wrong_argument_type_releases_its_rrefs() {
    world_ok(
        "a_call_with_the_wrong_argument_type_releases_its_rrefs",
        4,
        |rank| {
            let ctx = init(rank);
            if rank == 0 {
                let (owned, user) = owned_and_user();
                for r in [&owned, &user] {
                    // The callee refuses the call before decoding its arguments.
                    // A caller built from another declaration of `fetch_vec`.
                    const FETCH_VEC_OF_I64: Function<RRef<i64>, Vec<i64>> =
                        Function::new("fetch_vec");
                    let e = FETCH_VEC_OF_I64.rpc_sync("worker2", r.clone()).unwrap_err();
                    assert!(e.to_string().contains("wrong type"), "{e}");
                }
                assert_eq!(ctx.debug_info().num_pending_children, 0);
                drop((owned, user));
            }
            finish(rank, &ctx);
        },
    );
}

#[test]
fn a_call_whose_arguments_fail_to_encode_releases_its_rrefs() {
    world_ok(
        "a_call_whose_arguments_fail_to_encode_releases_its_rrefs",
        4,
        |rank| {
            let ctx = init(rank);
            if rank == 0 {
                let (owned, user) = owned_and_user();
                for r in [&owned, &user] {
                    // Through the string-named API: no declaration takes
                    // an argument made only to fail its encoding.
                    let e = ferry_rpc::by_name("fetch")
                        .rpc_sync::<i64, _>("worker2", (r.clone(), Unencodable))
                        .unwrap_err();
                    assert!(matches!(e, ferry_rpc::RpcError::Codec { .. }), "{e}");
                    // The type's own message, not only postcard's.
                    assert!(e.to_string().contains("refuses to be encoded"), "{e}");
                    let made: Result<RRef<i64>, _> =
                        ferry_rpc::by_name("fetch").remote("worker3", (r.clone(), Unencodable));
                    let e = made.unwrap_err();
                    assert!(matches!(e, RRefError::Codec(_)), "{e}");
                    assert!(e.to_string().contains("refuses to be encoded"), "{e}");
                }
                assert_eq!(ctx.debug_info().num_pending_children, 0);
                drop((owned, user));
            }
            finish(rank, &ctx);
        },
    );
}

#[test]
fn remote_of_a_missing_function_releases_its_rrefs() {
    world_ok(
        "remote_of_a_missing_function_releases_its_rrefs",
        4,
        |rank| {
            let ctx = init(rank);
            if rank == 0 {
                let (owned, user) = owned_and_user();
                for r in [&owned, &user] {
                    for to in ["worker2", "worker1", "worker0"] {
                        let made: RRef<i64> = ferry_rpc::by_name("no_such_function")
                            .remote(to, r.clone())
                            .unwrap();
                        let e = made.to_here().unwrap_err();
                        assert!(e.to_string().contains("no_such_function"), "{e}");
                    }
                }
                drop((owned, user));
            }
            finish(rank, &ctx);
        },
    );
}

#[test]
fn a_proxy_call_to_a_missing_method_releases_its_rrefs() {
    world_ok(
        "a_proxy_call_to_a_missing_method_releases_its_rrefs",
        4,
        |rank| {
            let ctx = init(rank);
            if rank == 0 {
                let c: RRef<Counter> = Counter::NEW.remote("worker1", 10i64).unwrap();
                let e = c
                    .rpc_sync()
                    .call_by_name::<i64, _>("no_such_method", 1i64)
                    .unwrap_err();
                assert!(e.to_string().contains("no_such_method"), "{e}");
                let e = c
                    .rpc_async()
                    .call_by_name::<i64, _>("no_such_method", 1i64)
                    .wait()
                    .unwrap_err();
                assert!(e.to_string().contains("no_such_method"), "{e}");
                let made: RRef<i64> = c.remote().call_by_name("no_such_method", 1i64).unwrap();
                let e = made.to_here().unwrap_err();
                assert!(e.to_string().contains("no_such_method"), "{e}");
                // Owned here, too.
                let local = RRef::new(Counter::default()).unwrap();
                let e = local
                    .rpc_sync()
                    .call_by_name::<i64, _>("no_such_method", 1i64)
                    .unwrap_err();
                assert!(e.to_string().contains("no_such_method"), "{e}");
                // And the methods that exist still work.
                assert_eq!(c.rpc_sync().call(Counter::ADD, 5).unwrap(), 15);
                drop((c, made, local));
            }
            finish(rank, &ctx);
        },
    );
}

#[test]
fn an_rref_serialized_outside_any_message_is_refused() {
    world_ok(
        "an_rref_serialized_outside_any_message_is_refused",
        4,
        |rank| {
            let ctx = init(rank);
            if rank == 0 {
                let (owned, user) = owned_and_user();
                for r in [&owned, &user] {
                    let e = ferry_wire::payload::encode(r).unwrap_err().to_string();
                    let want = RRefError::OutsideMessage { rref_id: r.id() }.to_string();
                    assert!(e.contains(&want), "{e}");
                }
                // Nothing was forked.
                assert_eq!(ctx.debug_info().num_pending_children, 0);
                // Inside a message it still travels.
                let v: i64 = FETCH.rpc_sync("worker2", user.clone()).unwrap();
                assert_eq!(v, 2);
                drop((owned, user));
            }
            finish(rank, &ctx);
        },
    );
}

#[test]
fn user_rrefs_are_confirmed_before_the_function_runs() {
    world_ok(
        "user_rrefs_are_confirmed_before_the_function_runs",
        4,
        |rank| {
            let ctx = init(rank);
            if rank == 0 {
                // Sent on at once from a user (worker0) that the owner
                // (worker1) has not confirmed yet: worker2 and worker3 get
                // pending users, confirmed by worker1 before they run.
                for _ in 0..10 {
                    let r: RRef<i64> = ADD.remote("worker1", (1i64, 2i64)).unwrap();
                    let confirmed: bool = CONFIRMED.rpc_sync("worker2", r.clone()).unwrap();
                    assert!(confirmed, "rpc_sync ran before its RRef was confirmed");
                    let f = CONFIRMED.rpc_async("worker3", r.clone());
                    assert!(
                        f.wait().unwrap(),
                        "rpc_async ran before its RRef was confirmed"
                    );
                    let made: RRef<bool> = CONFIRMED.remote("worker2", r.clone()).unwrap();
                    assert!(
                        made.to_here().unwrap(),
                        "remote ran before its RRef was confirmed"
                    );
                    let made: RRef<bool> = CONFIRMED_ASYNC.remote("worker3", r).unwrap();
                    assert!(made.to_here().unwrap(), "an async function ran unconfirmed");
                }
            }
            finish(rank, &ctx);
        },
    );
}

#[test]
fn an_rref_used_after_shutdown() {
    world_ok("an_rref_used_after_shutdown", 4, |rank| {
        let ctx = init(rank);
        let kept = (rank == 0).then(|| {
            let r: RRef<i64> = ADD.remote("worker1", (1i64, 2i64)).unwrap();
            assert_eq!(r.to_here().unwrap(), 3);
            r
        });
        ferry_rpc::shutdown().unwrap();
        // The shutdown deleted the user and the owner's value: nothing leaked.
        assert!(ctx.leaked().is_empty());
        if let Some(r) = kept {
            let e = r.to_here().unwrap_err();
            assert!(matches!(e, RRefError::ShutDown { .. }), "{e}");
            assert!(e.to_string().contains("used after shutdown"), "{e}");
            let e = FETCH.rpc_sync("worker1", r).unwrap_err();
            assert!(
                e.to_string().contains("not initialized") || e.to_string().contains("shut"),
                "{e}"
            );
        }
        println!("FINISHED=1");
    });
}

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
