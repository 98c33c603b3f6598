//! Multi-process tests of RRefs: 4 worker processes on 127.0.0.1, each
//! running the same test function as its rank. Rank 0 drives; at the end
//! every worker's RRef tables must be empty before shutdown (every value
//! deleted once its last user went away), and nothing leaked at shutdown.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry_rpc::{Agent, Functions, RpcOptions};
use ferry_rref::{DebugInfo, RRef, RRefContext, RRefError};
use ferry_testkit::world_ok;
use serde::{Deserialize, Serialize};

const EMPTY_TIMEOUT: Duration = Duration::from_secs(30);

fn name(rank: u32) -> String {
    format!("worker{rank}")
}

/// A value with methods, kept on its owner.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Counter {
    total: AtomicI64,
}

fn functions() -> Functions {
    let mut f = Functions::new();
    f.register("add", |(a, b): (i64, i64)| a + b);
    f.register("vec", |n: i64| (0..n).collect::<Vec<i64>>());
    // Waits until the store key `gate` is set: a creation that stays
    // running until the test lets it finish.
    f.register("gated", |(gate, v): (String, i64)| {
        let agent = Agent::current().unwrap();
        let store = agent.store();
        agent
            .block_on(store.wait(&[gate], Duration::from_secs(60)))
            .unwrap();
        v
    });
    f.register_fallible("fail", |msg: String| Err::<i64, _>(format!("boom: {msg}")));
    f.register_fallible("fetch", |r: RRef<i64>| {
        r.to_here().map_err(|e| e.to_string())
    });
    f.register_fallible("fetch_vec", |r: RRef<Vec<i64>>| {
        r.to_here().map_err(|e| e.to_string())
    });
    f.register_fallible("local", |r: RRef<i64>| {
        let owner = r.is_owner();
        r.local_value()
            .map(|v| (*v, owner))
            .map_err(|e| e.to_string())
    });
    f.register("echo", |r: RRef<i64>| r);
    f.register("confirmed", |r: RRef<i64>| r.confirmed_by_owner());
    f.register_async("confirmed_async", |r: RRef<i64>| async move {
        Ok::<_, std::convert::Infallible>(r.confirmed_by_owner())
    });
    // Forwards the RRef `hops` more times round the workers, then fetches it.
    f.register_fallible(
        "forward",
        |(r, hops, path): (RRef<i64>, u32, Vec<String>)| {
            let me = ferry_rpc::get_worker_info(None).map_err(|e| e.to_string())?;
            let mut path = path;
            path.push(me.name.clone());
            if hops == 0 {
                let v = r.to_here().map_err(|e| e.to_string())?;
                return Ok::<_, String>((v, path));
            }
            let next = (me.id + 1) % 4;
            ferry_rpc::rpc_sync(name(next), "forward", (r, hops - 1, path))
                .map_err(|e| e.to_string())
        },
    );
    // Nested RRefs: a value on this worker holding RRefs owned elsewhere.
    f.register("wrap", |rs: Vec<RRef<i64>>| rs);
    f.register_fallible("sum_nested", |r: RRef<Vec<RRef<i64>>>| {
        let inner = r.to_here().map_err(|e| e.to_string())?;
        let mut sum = 0;
        for x in inner {
            sum += x.to_here().map_err(|e| e.to_string())?;
        }
        Ok::<_, String>(sum)
    });
    f.register("new_local", |v: i64| RRef::new(v).unwrap());
    f.register("wait_empty", |(): ()| {
        match RRefContext::current()
            .unwrap()
            .wait_until_empty(EMPTY_TIMEOUT)
        {
            Ok(()) => String::new(),
            Err(left) => format!("{left:?}"),
        }
    });
    f.register("debug_info", |(): ()| {
        let d = RRefContext::current().unwrap().debug_info();
        (
            d.num_owner_rrefs,
            d.num_confirmed_users,
            d.num_pending_users,
        )
    });
    f.register("counter", |start: i64| Counter {
        total: AtomicI64::new(start),
    });
    ferry_rref::register_method(&mut f, "add", |c: &Counter, n: i64| {
        c.total.fetch_add(n, Ordering::SeqCst) + n
    });
    ferry_rref::register_method(&mut f, "get", |c: &Counter, (): ()| {
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
    ferry_rpc::init_rpc(options).unwrap();
    ctx
}

/// Rank 0, after dropping its handles: every worker's tables empty
/// (nothing left for the shutdown to clean up), then shutdown reports no leaks.
fn finish(rank: u32, ctx: &RRefContext) {
    if rank == 0 {
        for r in 0..4u32 {
            let left: String = ferry_rpc::rpc_sync(name(r), "wait_empty", ()).unwrap();
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
            let r: RRef<i64> = ferry_rref::remote("worker1", "add", (2i64, 3i64)).unwrap();
            assert!(!r.is_owner());
            assert_eq!(r.owner(), 1);
            assert_eq!(r.owner_name(), "worker1");
            assert_eq!(r.to_here().unwrap(), 5);
            // The owner returns the RRef it was given: it comes back as a new user here.
            let back: RRef<i64> = ferry_rpc::rpc_sync("worker1", "echo", r.clone()).unwrap();
            assert_eq!(back.to_here().unwrap(), 5);
            let (owners, _, _): (usize, usize, usize) =
                ferry_rpc::rpc_sync("worker1", "debug_info", ()).unwrap();
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
            let r: RRef<i64> = ferry_rref::remote("worker1", "add", (40i64, 2i64)).unwrap();
            // Sent right away, possibly before the owner has the value.
            let (v, is_owner): (i64, bool) = ferry_rpc::rpc_sync("worker1", "local", r).unwrap();
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
            let v: i64 = ferry_rpc::rpc_sync("worker2", "fetch", r.clone()).unwrap();
            assert_eq!(v, 7);
            // A user elsewhere made by a remote function: owned by worker3.
            let made: RRef<i64> = ferry_rpc::rpc_sync("worker3", "new_local", 9i64).unwrap();
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
            let r: RRef<Vec<i64>> = ferry_rref::remote("worker1", "vec", 5i64).unwrap();
            // worker2 fetches from worker1 directly.
            let v: Vec<i64> = ferry_rpc::rpc_sync("worker2", "fetch_vec", r.clone()).unwrap();
            assert_eq!(v, vec![0, 1, 2, 3, 4]);
            // Dropped here at once while worker3 is still being confirmed:
            // G2 keeps the parent until the child is confirmed.
            let f = ferry_rpc::rpc_async::<Vec<i64>, _>("worker3", "fetch_vec", r);
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
                let r: RRef<i64> = ferry_rref::remote("worker0", "add", (1i64, 1i64)).unwrap();
                assert!(r.is_owner());
                assert_eq!(r.to_here().unwrap(), 2);
                assert_eq!(*r.local_value().unwrap(), 2);
                // To itself as an argument.
                let (v, owner): (i64, bool) =
                    ferry_rpc::rpc_sync("worker0", "local", r.clone()).unwrap();
                assert_eq!((v, owner), (2, true));
                // Out to worker1 and back to the owner.
                let back: RRef<i64> = ferry_rpc::rpc_sync("worker1", "echo", r.clone()).unwrap();
                assert!(back.is_owner());
                assert_eq!(*back.local_value().unwrap(), 2);
                // Dropped before their functions have run: nothing may stay behind.
                drop(ferry_rref::remote::<i64, _>("worker0", "add", (5i64, 5i64)).unwrap());
                drop(ferry_rref::remote::<i64, _>("worker3", "add", (5i64, 5i64)).unwrap());
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
            let r: RRef<i64> = ferry_rref::remote("worker2", "add", (100i64, 23i64)).unwrap();
            let (v, path): (i64, Vec<String>) =
                ferry_rpc::rpc_sync("worker1", "forward", (r, 8u32, Vec::<String>::new())).unwrap();
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
    let a: RRef<i64> = ferry_rref::remote("worker1", "add", (i, 1i64)).unwrap();
    let b: RRef<i64> = ferry_rref::remote("worker2", "add", (i, 2i64)).unwrap();
    let c = RRef::new(i + 3).unwrap();
    // An RRef on worker3 whose value holds RRefs owned by workers 1, 2 and 0.
    let nested: RRef<Vec<RRef<i64>>> =
        ferry_rref::remote("worker3", "wrap", vec![a, b, c]).unwrap();
    let here = nested.to_here().unwrap();
    let sum: i64 = here.iter().map(|r| r.to_here().unwrap()).sum();
    assert_eq!(sum, 3 * i + 6);
    // And a different worker walks the nesting itself.
    let remote_sum: i64 = ferry_rpc::rpc_sync("worker1", "sum_nested", nested).unwrap();
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
            let c: RRef<Counter> = ferry_rref::remote("worker1", "counter", 10i64).unwrap();
            assert_eq!(
                c.rpc_sync().call_by_name::<i64, _>("add", 5i64).unwrap(),
                15
            );
            let f = c.rpc_async().call_by_name::<i64, _>("add", 1i64);
            assert_eq!(f.wait().unwrap(), 16);
            let total: RRef<i64> = c.remote().call_by_name("get", ()).unwrap();
            assert_eq!(total.owner_name(), "worker1");
            assert_eq!(total.to_here().unwrap(), 16);
            // A user elsewhere calls methods too.
            let v: i64 = ferry_rpc::rpc_sync("worker2", "fetch", total).unwrap();
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
                let r: RRef<i64> =
                    ferry_rref::remote("worker1", "gated", ("gate/a".to_string(), 77i64)).unwrap();
                // remote returned before the owner ran anything.
                assert!(!r.confirmed_by_owner());
                let err = r.to_here_timeout(Duration::from_millis(200)).unwrap_err();
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
            let r: RRef<i64> = ferry_rref::remote("worker1", "fail", "no".to_string()).unwrap();
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
            let r: RRef<i64> = ferry_rref::remote("worker2", "nope", ()).unwrap();
            let e = r.to_here().unwrap_err().to_string();
            assert!(e.contains("nope"), "{e}");
            // A creation that times out: to_here and forks fail, nothing hangs.
            let agent = ferry_rpc::agent().unwrap();
            let slow: RRef<i64> = ferry_rref::remote_timeout(
                "worker3",
                "gated",
                ("gate/b".to_string(), 1i64),
                Duration::from_millis(200),
            )
            .unwrap();
            // Asked while the creation runs: fails when the creation times out.
            let e = slow.to_here_timeout(Duration::from_secs(60)).unwrap_err();
            assert!(matches!(e, RRefError::CreationFailed { .. }), "{e}");
            assert!(
                e.to_string().contains("RRef creation failed/timed out"),
                "{e}"
            );
            let e = ferry_rpc::rpc_sync::<i64, _>("worker2", "fetch", slow.clone()).unwrap_err();
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
    let user: RRef<i64> = ferry_rref::remote("worker1", "add", (1i64, 1i64)).unwrap();
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
                    let e = ferry_rpc::rpc_sync::<i64, _>("worker2", "no_such_function", r.clone())
                        .unwrap_err();
                    assert!(
                        matches!(e, ferry_rpc::RpcError::UnknownFunction { .. }),
                        "{e}"
                    );
                    // Also to the owner itself (worker1 owns `user`).
                    let e = ferry_rpc::rpc_sync::<i64, _>("worker1", "no_such_function", r.clone())
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
                    let e = ferry_rpc::rpc_sync::<Vec<i64>, _>("worker2", "fetch_vec", r.clone())
                        .unwrap_err();
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
                    let e =
                        ferry_rpc::rpc_sync::<i64, _>("worker2", "fetch", (r.clone(), Unencodable))
                            .unwrap_err();
                    assert!(matches!(e, ferry_rpc::RpcError::Codec { .. }), "{e}");
                    // The type's own message, not only postcard's.
                    assert!(e.to_string().contains("refuses to be encoded"), "{e}");
                    let e =
                        ferry_rref::remote::<i64, _>("worker3", "fetch", (r.clone(), Unencodable))
                            .unwrap_err();
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
                        let made: RRef<i64> =
                            ferry_rref::remote(to, "no_such_function", r.clone()).unwrap();
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
                let c: RRef<Counter> = ferry_rref::remote("worker1", "counter", 10i64).unwrap();
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
                assert_eq!(
                    c.rpc_sync().call_by_name::<i64, _>("add", 5i64).unwrap(),
                    15
                );
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
                let v: i64 = ferry_rpc::rpc_sync("worker2", "fetch", user.clone()).unwrap();
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
                    let r: RRef<i64> = ferry_rref::remote("worker1", "add", (1i64, 2i64)).unwrap();
                    let confirmed: bool =
                        ferry_rpc::rpc_sync("worker2", "confirmed", r.clone()).unwrap();
                    assert!(confirmed, "rpc_sync ran before its RRef was confirmed");
                    let f = ferry_rpc::rpc_async::<bool, _>("worker3", "confirmed", r.clone());
                    assert!(
                        f.wait().unwrap(),
                        "rpc_async ran before its RRef was confirmed"
                    );
                    let made: RRef<bool> =
                        ferry_rref::remote("worker2", "confirmed", r.clone()).unwrap();
                    assert!(
                        made.to_here().unwrap(),
                        "remote ran before its RRef was confirmed"
                    );
                    let made: RRef<bool> =
                        ferry_rref::remote("worker3", "confirmed_async", r).unwrap();
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
            let r: RRef<i64> = ferry_rref::remote("worker1", "add", (1i64, 2i64)).unwrap();
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
            let e = ferry_rpc::rpc_sync::<i64, _>("worker1", "fetch", r).unwrap_err();
            assert!(
                e.to_string().contains("not initialized") || e.to_string().contains("shut"),
                "{e}"
            );
        }
        println!("FINISHED=1");
    });
}
