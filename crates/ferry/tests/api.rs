//! The facade's API as a user of `ferry` writes it, across 2 worker
//! processes on 127.0.0.1: the [`ferry::Worker`] `init_rpc` returns,
//! `wait_all`, the default timeout changed at run time, asynchronous
//! proxy methods on an RRef, generic helpers bounded by `Arg` and `Ret`,
//! and the exact text of a failed `remote`.
//!
//! Nothing here waits on the clock: a call that must still be running is
//! one whose function waits for a store key the test sets only afterwards.
#![allow(clippy::unwrap_used)]

use std::ops::Range;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use ferry::rpc::MAX_ERROR_TEXT_BYTES;
use ferry::{
    Agent, Arg, BoxError, Function, Functions, Method, MethodsExt, RRef, RRefError, RemoteExt, Ret,
    RpcError, RpcOptions, Schema, Worker,
};
use ferry_testkit::{world_ok, Output};
use serde::{Deserialize, Serialize};

/// Waits until the store key it is given is set, then returns the key.
const BLOCK: Function<String, String> = Function::new("block");
/// Sets the store key it is given, then returns it.
const RELEASE: Function<String, String> = Function::new("release");
/// Fails with its argument as the error's text.
const RAISE: Function<String, String> = Function::new("raise");
const SQUARE: Function<i64, i64> = Function::new("square");
const NEW_COUNTER: Function<i64, Counter> = Function::new("Counter.new");

/// PyTorch's `raise_func_escape` text (`test_py_raise_in_user_func_escaped_str`).
const PYTORCH_TEXT: &str = "\nFirst line of error \n next line of error \n last line of error";

/// A value kept on its owner, whose methods run there.
#[derive(Default, Serialize, Deserialize, Schema)]
struct Counter {
    total: AtomicI64,
}

impl Counter {
    const ADD: Method<Counter, i64, i64> = Method::new("Counter.add");
    /// Waits until the store key it is given is set, then returns the total.
    const WAIT: Method<Counter, String, i64> = Method::new("Counter.wait");
}

/// The process's agent as a function body sees it.
fn agent() -> Agent {
    Agent::current().unwrap()
}

/// Waits (in a function body) until `key` is set in the group's store.
fn wait_for(key: &str) {
    let agent = agent();
    agent
        .block_on(
            agent
                .store()
                .wait(&[key.to_string()], Duration::from_secs(60)),
        )
        .unwrap();
}

/// Sets `key` in the group's store, which the functions waiting for it see.
fn set(worker: &Worker, key: &str) {
    let agent = worker.agent();
    agent.block_on(agent.store().set(key, vec![1])).unwrap();
}

fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(BLOCK, |key: String| {
        wait_for(&key);
        key
    });
    f.add(RELEASE, |key: String| {
        let agent = agent();
        agent.block_on(agent.store().set(&key, vec![1])).unwrap();
        key
    });
    f.add(RAISE, Err::<String, _>);
    f.add(SQUARE, |n| n * n);
    f.add(NEW_COUNTER, |start| Counter {
        total: AtomicI64::new(start),
    });
    f.add_method(Counter::ADD, |c: &Counter, n| {
        c.total.fetch_add(n, Ordering::SeqCst) + n
    });
    f.add_method(Counter::WAIT, |c: &Counter, key: String| {
        wait_for(&key);
        c.total.load(Ordering::SeqCst)
    });
    f
}

fn start(rank: u32) -> Worker {
    let options = RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(functions())
        .init_timeout(Duration::from_secs(60));
    ferry::init_rpc(options).unwrap()
}

/// Rank 0 checks that no RRef is left on either worker, then every worker
/// shuts down and checks its own tables.
fn finish(rank: u32, worker: &Worker) {
    worker
        .rref_context()
        .wait_until_empty(Duration::from_secs(60))
        .unwrap();
    if rank == 0 {
        println!("CHECKED=yes");
    }
    ferry::shutdown().unwrap();
    assert!(worker.rref_context().leaked().is_empty());
}

/// Runs `body` on 2 workers; rank 0 prints `CHECKED=yes` when it passed.
/// Returns the workers' outputs in the test, `None` in a worker.
fn two_workers(test: &str, body: impl Fn(u32, &Worker)) -> Option<Vec<Output>> {
    let outputs = world_ok(test, 2, |rank| {
        let worker = start(rank);
        body(rank, &worker);
        finish(rank, &worker);
    })?;
    assert_eq!(outputs[0].values("CHECKED"), ["yes"]);
    Some(outputs)
}

/// `init_rpc` returns the worker: its agent (the process's), its RRef
/// context and, with `torch`, its autograd container.
#[test]
fn init_rpc_returns_the_worker_with_its_agent_and_layers() {
    let outputs = two_workers(
        "init_rpc_returns_the_worker_with_its_agent_and_layers",
        |rank, worker| {
            // A second worker in this process is refused before it meets
            // any group.
            let again = RpcOptions::from_env(format!("worker{rank}")).unwrap();
            let err = ferry::init_rpc(again).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("RPC is already initialized in this process as worker \"worker{rank}\"")
            );
            assert_eq!(worker.info().name, format!("worker{rank}"));
            assert_eq!(worker.info().id, rank);
            assert_eq!(*worker.info(), ferry::get_worker_info(None).unwrap());
            assert_eq!(worker.agent().workers().len(), 2);
            assert_eq!(
                format!("{worker:?}"),
                format!("Worker {{ name: \"worker{rank}\", rank: {rank} }}")
            );

            // The RRef context is the one RRefs of this worker live in.
            if rank == 0 {
                let counter: RRef<Counter> = NEW_COUNTER.remote(1, 3).unwrap();
                assert_eq!(counter.rpc_sync().call(Counter::ADD, 1).unwrap(), 4);
                let info = worker.rref_context().debug_info();
                assert_eq!(info.num_confirmed_users + info.num_pending_users, 1);
                let here = RRef::new(7i64).unwrap();
                assert_eq!(worker.rref_context().debug_info().num_owner_rrefs, 1);
                drop((counter, here));
            }

            #[cfg(feature = "torch")]
            {
                let container = worker.autograd_container();
                assert!(container.context_ids().is_empty());
                let context = ferry::autograd::context().unwrap();
                assert_eq!(container.context_ids(), [context.id()]);
                drop(context);
                assert!(container.wait_until_empty(Duration::from_secs(60)));
                println!("AUTOGRAD=checked");
            }
        },
    );
    #[cfg(feature = "torch")]
    for output in outputs.iter().flatten() {
        assert_eq!(output.values("AUTOGRAD"), ["checked"]);
    }
    #[cfg(not(feature = "torch"))]
    drop(outputs);
}

/// `wait_all` gives every result in the order of its futures, whatever
/// order they complete in; on an error it returns that error at once,
/// while another call is still running.
#[test]
fn wait_all_keeps_the_order_and_fails_fast() {
    two_workers("wait_all_keeps_the_order_and_fails_fast", |rank, worker| {
        if rank != 0 {
            return;
        }
        // The first call can only finish after the second has run.
        let results = ferry::wait_all([
            BLOCK.rpc_async(1, "order/a".to_string()),
            RELEASE.rpc_async(1, "order/a".to_string()),
        ])
        .unwrap();
        assert_eq!(results, ["order/a", "order/a"]);
        let squares = ferry::wait_all((0..6).map(|n| SQUARE.rpc_async(n % 2, n))).unwrap();
        assert_eq!(squares, [0, 1, 4, 9, 16, 25]);
        assert!(ferry::wait_all(Vec::<ferry::RpcFuture<i64>>::new())
            .unwrap()
            .is_empty());

        // The first call waits for a key set only after wait_all returned:
        // the error of the second comes back while the first still runs.
        let e = ferry::wait_all([
            BLOCK.rpc_async(1, "fail_fast".to_string()),
            RAISE.rpc_async(1, "boom".to_string()),
        ])
        .unwrap_err();
        match &e {
            RpcError::Remote {
                function, message, ..
            } => assert_eq!((function.as_str(), message.as_str()), ("raise", "boom")),
            other => panic!("expected the remote error of \"raise\", got: {other}"),
        }
        set(worker, "fail_fast");
    });
}

/// `set_rpc_timeout` changes the default timeout of the calls started
/// after it, typed calls and proxy calls alike: a call that cannot finish
/// times out after the new timeout, which its error names.
#[test]
fn set_rpc_timeout_changes_the_default_of_later_calls() {
    two_workers(
        "set_rpc_timeout_changes_the_default_of_later_calls",
        |rank, worker| {
            if rank != 0 {
                return;
            }
            let start = ferry::get_rpc_timeout().unwrap();
            assert_eq!(start, worker.agent().rpc_timeout());
            let new = Duration::from_millis(750);
            assert_ne!(start, new);
            ferry::set_rpc_timeout(new).unwrap();
            assert_eq!(ferry::get_rpc_timeout().unwrap(), new);
            assert_eq!(worker.agent().rpc_timeout(), new);

            let e = BLOCK.rpc_sync(1, "timeout/a".to_string()).unwrap_err();
            match &e {
                RpcError::Timeout {
                    worker,
                    function,
                    after,
                } => assert_eq!(
                    (worker.as_str(), function.as_str(), *after),
                    ("worker1", "block", new)
                ),
                other => panic!("expected a timeout, got: {other}"),
            }
            assert!(e.to_string().ends_with("timed out after 750ms"), "{e}");

            // Through the agent, and for a method on an RRef's owner.
            let newer = Duration::from_millis(600);
            worker.agent().set_rpc_timeout(newer);
            let counter: RRef<Counter> = NEW_COUNTER.remote(1, 0).unwrap();
            let e = counter
                .rpc_async()
                .call(Counter::WAIT, "timeout/b".to_string())
                .wait()
                .unwrap_err();
            match &e {
                RpcError::Timeout {
                    function, after, ..
                } => assert_eq!((function.as_str(), *after), ("Counter.wait", newer)),
                other => panic!("expected a timeout, got: {other}"),
            }

            // Back to the start: the blocked bodies finish when released.
            ferry::set_rpc_timeout(start).unwrap();
            set(worker, "timeout/a");
            set(worker, "timeout/b");
            drop(counter);
        },
    );
}

/// `rref.rpc_async()` runs methods on the value's owner and returns their
/// futures at once: several in flight together, awaited or waited for, by
/// the typed `Method` or by name, with a timeout of their own.
#[test]
fn rpc_async_proxy_methods_return_futures() {
    two_workers("rpc_async_proxy_methods_return_futures", |rank, worker| {
        if rank != 0 {
            return;
        }
        let counter: RRef<Counter> = NEW_COUNTER.remote(1, 10).unwrap();

        // A method that waits is in flight while others run and finish.
        let waiting = counter
            .rpc_async()
            .call(Counter::WAIT, "proxy/a".to_string());
        let adds: Vec<_> = (1..=3)
            .map(|n| counter.rpc_async().call(Counter::ADD, n))
            .collect();
        let mut totals = ferry::wait_all(adds).unwrap();
        totals.sort_unstable();
        assert_eq!(totals.last(), Some(&16));
        assert!(!waiting.is_done());
        set(worker, "proxy/a");
        assert_eq!(waiting.wait().unwrap(), 16);

        // Awaited in async code, and called by name.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let by_name = counter
            .rpc_async()
            .call_by_name::<i64, _>("Counter.add", 4i64);
        // The second call starts once the first is answered: two calls in
        // flight together may run on the owner in either order.
        let (a, b) = runtime.block_on(async {
            let a = by_name.await;
            let b = counter.rpc_async().call(Counter::ADD, 0).await;
            (a, b)
        });
        assert_eq!((a.unwrap(), b.unwrap()), (20, 20));

        // A timeout of its own.
        let e = counter
            .rpc_async()
            .timeout(Duration::from_millis(300))
            .call(Counter::WAIT, "proxy/b".to_string())
            .wait()
            .unwrap_err();
        assert!(
            matches!(&e, RpcError::Timeout { function, after, .. }
                if function == "Counter.wait" && *after == Duration::from_millis(300)),
            "{e}"
        );
        set(worker, "proxy/b");
        drop(counter);
    });
}

/// Calls `function` on every rank of `ranks` with the same arguments.
fn call_each<A: Arg + Clone, R: Ret>(
    function: Function<A, R>,
    ranks: Range<u32>,
    args: A,
) -> Result<Vec<R>, RpcError> {
    ferry::wait_all(ranks.map(|rank| function.rpc_async(rank, args.clone())))
}

/// Runs `function` with `remote` and fetches its result.
fn through_rref<A: Arg, R: Ret>(function: Function<A, R>, to: u32, args: A) -> Result<R, BoxError> {
    let kept: RRef<R> = function.remote(to, args)?;
    Ok(kept.to_here()?)
}

/// Calls `method` on the value `rref` refers to.
fn on_owner<T: Arg, A: Arg, R: Ret>(
    rref: &RRef<T>,
    method: Method<T, A, R>,
    args: A,
) -> Result<R, RRefError> {
    rref.rpc_sync().call(method, args)
}

/// Registers `body` as `function` and as the method `method` of `T`.
fn register_both<T, A, R>(
    functions: &mut Functions,
    function: Function<A, R>,
    method: Method<T, A, R>,
    body: fn(A) -> R,
) where
    T: Arg + Sync,
    A: Arg,
    R: Ret,
{
    functions.add(function, body);
    functions.add_method(method, move |_: &T, a| body(a));
}

const DOUBLE: Function<Vec<i64>, Vec<i64>> = Function::new("double");
const DOUBLE_METHOD: Method<Counter, Vec<i64>, Vec<i64>> = Method::new("Counter.double");

/// Generic helpers over calls name `Arg` and `Ret` only, and work for any
/// typed function or method.
#[test]
fn generic_helpers_bounded_by_arg_and_ret() {
    let Some(outputs) = world_ok("generic_helpers_bounded_by_arg_and_ret", 2, |rank| {
        let mut functions = functions();
        register_both(&mut functions, DOUBLE, DOUBLE_METHOD, |v: Vec<i64>| {
            v.iter().map(|x| x * 2).collect()
        });
        let options = RpcOptions::from_env(format!("worker{rank}"))
            .unwrap()
            .functions(functions)
            .init_timeout(Duration::from_secs(60));
        let worker = ferry::init_rpc(options).unwrap();
        if rank == 0 {
            assert_eq!(call_each(SQUARE, 0..2, 3).unwrap(), [9, 9]);
            assert_eq!(
                call_each(DOUBLE, 0..2, vec![1, 2]).unwrap(),
                [vec![2, 4], vec![2, 4]]
            );
            assert_eq!(through_rref(SQUARE, 1, 5).unwrap(), 25);
            let counter: RRef<Counter> = NEW_COUNTER.remote(1, 1).unwrap();
            assert_eq!(on_owner(&counter, Counter::ADD, 2).unwrap(), 3);
            assert_eq!(on_owner(&counter, DOUBLE_METHOD, vec![3]).unwrap(), [6]);
            drop(counter);
        }
        finish(rank, &worker);
    }) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED"), ["yes"]);
}

/// The error of a value whose function failed on its owner holds the
/// function's text exactly as raised (line breaks and all), bounded at
/// `MAX_ERROR_TEXT_BYTES` with the bytes left out counted; its `Display`
/// shows it escaped on one line. The same on the owner itself.
#[test]
fn a_failed_remote_keeps_the_error_text_as_raised() {
    two_workers(
        "a_failed_remote_keeps_the_error_text_as_raised",
        |rank, _worker| {
            if rank != 0 {
                return;
            }
            let failed = |e: RRefError| match e {
                RRefError::ValueFailed {
                    owner,
                    message,
                    omitted_bytes,
                    ..
                } => (owner, message, omitted_bytes),
                other => panic!("expected ValueFailed, got: {other}"),
            };

            // Fetched from another owner.
            let r: RRef<String> = RAISE.remote(1, PYTORCH_TEXT.to_string()).unwrap();
            let e = r.to_here().unwrap_err();
            let shown = e.to_string();
            assert_eq!(
                failed(e),
                ("worker1".to_string(), PYTORCH_TEXT.to_string(), 0)
            );
            assert!(
                shown.ends_with(
                    r#"failed on owner worker1: \nFirst line of error \n next line of error \n last line of error"#
                ),
                "{shown}"
            );
            assert!(!shown.contains('\n'), "{shown}");

            // Owned here: fetched, and read on the owner.
            let mine: RRef<String> = RAISE.remote(0, PYTORCH_TEXT.to_string()).unwrap();
            let (owner, message, omitted) = failed(mine.to_here().unwrap_err());
            assert_eq!(
                (owner.as_str(), message.as_str(), omitted),
                ("worker0", PYTORCH_TEXT, 0)
            );
            let (_, message, _) = failed(mine.local_value().unwrap_err());
            assert_eq!(message, PYTORCH_TEXT);

            // Over the bound: cut, and the rest counted.
            let long = format!("{PYTORCH_TEXT}{}", "x".repeat(MAX_ERROR_TEXT_BYTES));
            let r: RRef<String> = RAISE.remote(1, long.clone()).unwrap();
            let e = r.to_here().unwrap_err();
            let shown = e.to_string();
            let (_, message, omitted) = failed(e);
            assert_eq!(message.len(), MAX_ERROR_TEXT_BYTES);
            assert!(long.starts_with(&message));
            assert_eq!(omitted, (long.len() - MAX_ERROR_TEXT_BYTES) as u64);
            assert!(
                shown.ends_with(&format!("x…({omitted} more bytes)")),
                "{shown}"
            );
            drop((r, mine));
        },
    );
}
