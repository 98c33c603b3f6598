//! Multi-process tests of the agent: 4 worker processes on 127.0.0.1 unless
//! said otherwise, each running the same test function as its rank. With
//! `FERRY_TEST_CROSS_HOST=1` every rank runs on a host of its own
//! (`ferry_testkit::hosts`), rendezvous at host 0's address: the xtask runs
//! the suite so over each cross-host path.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry_rpc::service::{IncomingCall, Interceptor, OutgoingCall, Service};
use ferry_rpc::{
    CallScope, Extension, Function, Functions, RpcError, RpcOptions, Schema, WorkerInfo,
};
use ferry_testkit::{world, world_ok};
use ferry_transport::{IncomingMessage, RawTensor};
use ferry_wire::payload::{self, Encoded};
use ferry_wire::{DType, MessageKind};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

static HOPS: AtomicU64 = AtomicU64::new(0);
static SLOW_DONE: AtomicU64 = AtomicU64::new(0);
static LAST_EXTENSION: Mutex<Option<String>> = Mutex::new(None);

thread_local! {
    /// Set by the `Tagger` interceptor's scope while a call it saw runs.
    static SCOPE_TAG: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
    /// Set by the thread-start hook of [`options`] on every agent thread.
    static HOOKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Tensors of every kind inside nested containers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Schema)]
struct Nested {
    label: String,
    by_dtype: HashMap<String, Vec<Option<RawTensor>>>,
    pair: (RawTensor, (u8, RawTensor)),
}

fn worker_name(rank: u32) -> String {
    format!("worker{rank}")
}

const ADD: Function<(i64, i64), i64> = Function::new("add");
const IDENTITY: Function<RawTensor, RawTensor> = Function::new("identity");
const ECHO_NESTED: Function<Nested, Nested> = Function::new("echo_nested");
const IDENTITY_MANY: Function<Vec<RawTensor>, Vec<RawTensor>> = Function::new("identity_many");
/// The name of the worker it runs on.
const WHOAMI: Function<(), String> = Function::new("whoami");
/// Fails with `boom: {msg}`.
const FAIL: Function<String, ()> = Function::new("fail");
const PANIC: Function<(), u8> = Function::new("panic");
/// A slow function: it runs until every key in `keys` is set in the
/// group's store (state the test controls, not time), then returns `v`.
const GATED: Function<(Vec<String>, u64), u64> = Function::new("gated");
/// A -> B -> C: each hop calls the next rank synchronously from a blocking
/// function; the names of the workers passed.
const NESTED: Function<(Vec<String>, u32), Vec<String>> = Function::new("nested");
/// A fire-and-forget chain: each hop starts the next and returns at once.
const CHAIN: Function<u32, ()> = Function::new("chain");
/// An async function that nests an rpc_async with .await.
const ASYNC_ADD: Function<(i64, i64), i64> = Function::new("async_add");
/// The extension the `Tagger` interceptor last saw.
const LAST_EXTENSION_SEEN: Function<(), Option<String>> = Function::new("last_extension");
/// What the interceptor's scope says while a function runs.
const SCOPE_TAG_NOW: Function<(), Option<String>> = Function::new("scope_tag");
/// The scope's tag before and after an await in an async function.
const SCOPE_TAG_ASYNC: Function<(), (Option<String>, Option<String>)> =
    Function::new("scope_tag_async");
const EXIT_PROCESS: Function<(), ()> = Function::new("exit_process");
/// Returns a result that is `Send` but not `Sync`, from the blocking pool.
const NOT_SYNC: Function<u64, std::cell::RefCell<u64>> = Function::new("not_sync");
/// The same from an async body.
const NOT_SYNC_ASYNC: Function<u64, std::cell::RefCell<u64>> = Function::new("not_sync_async");
/// Whether the thread-start hook ran on the thread of a blocking function.
const HOOKED_BLOCKING: Function<(), bool> = Function::new("hooked_blocking");
/// The same on the thread of an async function.
const HOOKED_ASYNC: Function<(), bool> = Function::new("hooked_async");
/// Registered nowhere.
const NO_SUCH_FN: Function<(), ()> = Function::new("no_such_fn");
/// Called by name.
const CONCAT: Function<(String, String), String> = Function::new("concat");

/// The functions every test worker registers.
fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(ADD, |(a, b)| a + b);
    f.add(IDENTITY, |t| t);
    f.add(ECHO_NESTED, |n| n);
    f.add(IDENTITY_MANY, |v| v);
    f.add(WHOAMI, |()| ferry_rpc::get_worker_info(None).unwrap().name);
    f.add(FAIL, |msg| Err::<(), _>(format!("boom: {msg}")));
    f.add(PANIC, |()| -> u8 { panic!("deliberate panic") });
    f.add(GATED, |(keys, v): (Vec<String>, u64)| {
        let agent = ferry_rpc::Agent::current().unwrap();
        let store = agent.store();
        agent
            .block_on(store.wait(&keys, Duration::from_secs(60)))
            .unwrap();
        SLOW_DONE.fetch_add(1, Ordering::SeqCst);
        v
    });
    f.add(NESTED, |(path, hops)| {
        let me = ferry_rpc::get_worker_info(None)?;
        let mut path = path;
        path.push(me.name.clone());
        if hops == 0 {
            return Ok::<_, RpcError>(path);
        }
        let next = (me.id + 1) % 4;
        NESTED.rpc_sync(next, (path, hops - 1))
    });
    f.add(CHAIN, |hops| {
        HOPS.fetch_add(1, Ordering::SeqCst);
        if hops > 0 {
            let me = ferry_rpc::get_worker_info(None).unwrap();
            drop(CHAIN.rpc_async((me.id + 1) % 4, hops - 1));
        }
    });
    f.add(ASYNC_ADD, |(a, b)| async move {
        // An async function that nests an rpc_async with .await.
        let r: i64 = ADD.rpc_async(0, (a, b)).await?;
        Ok::<_, RpcError>(r)
    });
    f.add(LAST_EXTENSION_SEEN, |()| LAST_EXTENSION.lock().clone());
    f.add(SCOPE_TAG_NOW, |()| SCOPE_TAG.with(|t| t.borrow().clone()));
    f.add(SCOPE_TAG_ASYNC, |()| async move {
        let before = SCOPE_TAG.with(|t| t.borrow().clone());
        tokio::task::yield_now().await;
        let after = SCOPE_TAG.with(|t| t.borrow().clone());
        Ok::<_, RpcError>((before, after))
    });
    f.add(EXIT_PROCESS, exit_process);
    // Called by name in the string-named API's tests.
    f.add(CONCAT, |(a, b)| a + &b);
    // Results that are `Send` but not `Sync`.
    f.add(NOT_SYNC, |n| std::cell::RefCell::new(n + 1));
    f.add(NOT_SYNC_ASYNC, |n| async move {
        Ok::<_, RpcError>(std::cell::RefCell::new(n + 2))
    });
    f.add(HOOKED_BLOCKING, |()| HOOKED.get());
    f.add(
        HOOKED_ASYNC,
        |()| async move { Ok::<_, RpcError>(HOOKED.get()) },
    );
    f
}

/// Ends the process from inside a remote function: the caller sees its peer die mid-call.
fn exit_process((): ()) {
    let _ = std::io::stdout().flush();
    std::process::exit(0)
}

fn options(rank: u32) -> RpcOptions {
    let mut options = RpcOptions::from_env(worker_name(rank))
        .unwrap()
        .functions(functions())
        .init_timeout(Duration::from_secs(60));
    options
        .hooks
        .on_thread_start(std::sync::Arc::new(|| HOOKED.set(true)));
    options
}

fn start(rank: u32) {
    init_rpc(options(rank)).unwrap();
}

fn sample(dtype: DType, shape: &[i64], seed: u8) -> RawTensor {
    let n: i64 = shape.iter().product();
    let bytes: Vec<u8> = (0..n as usize * dtype.size())
        .map(|i| match dtype {
            DType::Bool => (i as u8 ^ seed) & 1,
            _ => (i as u8).wrapping_mul(37) ^ seed,
        })
        .collect();
    RawTensor::from_bytes(dtype, shape, &bytes).unwrap()
}

#[test]
fn call_to_self_by_name_and_by_rank() {
    world_ok("call_to_self_by_name_and_by_rank", 4, |rank| {
        start(rank);
        let me = worker_name(rank);
        let s: i64 = ADD.rpc_sync(me.as_str(), (rank as i64, 1i64)).unwrap();
        assert_eq!(s, rank as i64 + 1);
        let s: i64 = ADD.rpc_sync(rank, (2i64, 2i64)).unwrap();
        assert_eq!(s, 4);
        // Everyone by name and by rank.
        for peer in 0..4u32 {
            let by_name: String = WHOAMI.rpc_sync(worker_name(peer), ()).unwrap();
            let by_rank: String = WHOAMI.rpc_sync(peer, ()).unwrap();
            assert_eq!(by_name, worker_name(peer));
            assert_eq!(by_rank, worker_name(peer));
        }
        let info = ferry_rpc::get_worker_info(Some("worker2".into())).unwrap();
        assert_eq!(
            info,
            WorkerInfo {
                name: "worker2".into(),
                id: 2
            }
        );
        ferry_rpc::shutdown().unwrap();
    });
}

/// A hook added with `Hooks::on_thread_start` has run on the threads that
/// run blocking and async functions, and only on the agent's threads.
#[test]
fn the_thread_start_hook_runs_on_the_threads_that_run_functions() {
    world_ok(
        "the_thread_start_hook_runs_on_the_threads_that_run_functions",
        2,
        |rank| {
            start(rank);
            if rank == 0 {
                // Not on a thread the agent did not start.
                assert!(!HOOKED.get());
                assert!(!std::thread::spawn(|| HOOKED.get()).join().unwrap());
                for to in [0, 1] {
                    // Several calls, so more than one pool thread may serve them.
                    let blocking: Vec<_> =
                        (0..8).map(|_| HOOKED_BLOCKING.rpc_async(to, ())).collect();
                    for call in blocking {
                        assert!(call.wait().unwrap(), "a blocking function on worker{to}");
                    }
                    assert!(
                        HOOKED_ASYNC.rpc_sync(to, ()).unwrap(),
                        "an async function on worker{to}"
                    );
                }
            }
            ferry_rpc::shutdown().unwrap();
        },
    );
}

/// A registered function's result need only be `Send`: a reply encodes
/// it on one thread (blocking and async registrations alike).
#[test]
fn results_that_are_not_sync_travel() {
    world_ok("results_that_are_not_sync_travel", 2, |rank| {
        start(rank);
        let peer = 1 - rank;
        assert_eq!(NOT_SYNC.rpc_sync(peer, 40).unwrap().into_inner(), 41);
        assert_eq!(NOT_SYNC_ASYNC.rpc_sync(peer, 40).unwrap().into_inner(), 42);
        ferry_rpc::shutdown().unwrap();
    });
}

#[test]
fn invalid_rank_and_unknown_worker() {
    world_ok("invalid_rank_and_unknown_worker", 4, |rank| {
        start(rank);
        let err = ADD.rpc_sync(4, (1i64, 1i64)).unwrap_err();
        assert_eq!(err.to_string(), "invalid rank 4: world size is 4");
        let err = ADD.rpc_sync("nobody", (1, 1)).unwrap_err();
        assert_eq!(err.to_string(), "unknown worker \"nobody\"");
        ferry_rpc::shutdown().unwrap();
    });
}

#[test]
fn nested_calls_a_to_b_to_c() {
    world_ok("nested_calls_a_to_b_to_c", 4, |rank| {
        start(rank);
        if rank == 0 {
            let path: Vec<String> = NESTED.rpc_sync(1, (Vec::<String>::new(), 2u32)).unwrap();
            assert_eq!(path, ["worker1", "worker2", "worker3"]);
            // Async function on worker2 nesting an rpc_async back to worker0.
            let s: i64 = ASYNC_ADD.rpc_sync(2, (20i64, 22i64)).unwrap();
            assert_eq!(s, 42);
        }
        ferry_rpc::shutdown().unwrap();
    });
}

#[test]
fn hundred_concurrent_rpc_async_calls() {
    world_ok("hundred_concurrent_rpc_async_calls", 4, |rank| {
        start(rank);
        let futures: Vec<_> = (0..100i64)
            .map(|i| ADD.rpc_async((i % 4) as u32, (i, rank as i64 * 1000)))
            .collect();
        for (i, f) in futures.into_iter().enumerate() {
            assert_eq!(f.wait().unwrap(), i as i64 + rank as i64 * 1000);
        }
        ferry_rpc::shutdown().unwrap();
    });
}

#[test]
fn tensors_of_every_dtype_in_nested_containers_round_trip() {
    world_ok(
        "tensors_of_every_dtype_in_nested_containers_round_trip",
        4,
        |rank| {
            start(rank);
            let to = (rank + 1) % 4;
            let mut by_dtype = HashMap::new();
            for (i, d) in DType::ALL.iter().enumerate() {
                let base = sample(*d, &[4, 6], i as u8);
                by_dtype.insert(
                    d.name().to_string(),
                    vec![
                        Some(base.clone()),
                        None,
                        Some(base.t().unwrap()),
                        Some(base.as_strided(&[2, 3], &[12, 2], 1).unwrap()),
                        Some(RawTensor::zeros(*d, &[0]).unwrap()),
                        Some(RawTensor::zeros(*d, &[]).unwrap()),
                    ],
                );
            }
            let value = Nested {
                label: format!("from {rank}"),
                by_dtype,
                pair: (
                    sample(DType::F32, &[5], 1),
                    (7, sample(DType::I64, &[2, 2], 2)),
                ),
            };
            let back: Nested = ECHO_NESTED.rpc_sync(to, value.clone()).unwrap();
            assert_eq!(back, value);
            for tensors in back.by_dtype.values() {
                let t = tensors[2].as_ref().unwrap();
                assert_eq!(t.strides(), &[1, 6], "strides are kept");
                assert_eq!(tensors[3].as_ref().unwrap().strides(), &[12, 2]);
                assert_eq!(tensors[5].as_ref().unwrap().numel(), 1, "0-d tensor");
            }
            let big = sample(DType::F32, &[1 << 20], 9);
            let back: RawTensor = IDENTITY.rpc_sync(to, big.clone()).unwrap();
            assert_eq!(back, big);
            ferry_rpc::shutdown().unwrap();
        },
    );
}

#[test]
fn graceful_shutdown_does_not_cut_a_twenty_hop_chain() {
    let outputs = world_ok(
        "graceful_shutdown_does_not_cut_a_twenty_hop_chain",
        4,
        |rank| {
            start(rank);
            if rank == 0 {
                // Fire and forget: 20 hops around the ring, then shut down at once.
                drop(CHAIN.rpc_async(1, 19u32));
            }
            ferry_rpc::shutdown().unwrap();
            println!("HOPS={}", HOPS.load(Ordering::SeqCst));
        },
    );
    if let Some(outputs) = outputs {
        let hops: u64 = outputs
            .iter()
            .map(|o| o.values("HOPS")[0].parse::<u64>().unwrap())
            .sum();
        assert_eq!(hops, 20);
    }
}

#[test]
fn uneven_workload_at_shutdown() {
    let outputs = world_ok("uneven_workload_at_shutdown", 4, |rank| {
        start(rank);
        // Each slow call runs until every worker has begun its shutdown,
        // so shutdown provably starts with calls still running.
        let all_stopping: Vec<String> = (0..4).map(|r| format!("stopping/{r}")).collect();
        if rank == 0 {
            for i in 0..6u64 {
                drop(GATED.rpc_async(1, (all_stopping.clone(), i)));
            }
        }
        if rank == 3 {
            drop(GATED.rpc_async(2, (all_stopping.clone(), 0u64)));
        }
        let agent = ferry_rpc::agent().unwrap();
        agent
            .block_on(agent.store().set(&format!("stopping/{rank}"), vec![1]))
            .unwrap();
        ferry_rpc::shutdown().unwrap();
        println!("SLOW_DONE={}", SLOW_DONE.load(Ordering::SeqCst));
    });
    if let Some(outputs) = outputs {
        let done: Vec<u64> = outputs
            .iter()
            .map(|o| o.values("SLOW_DONE")[0].parse().unwrap())
            .collect();
        assert_eq!(done, [0, 6, 1, 0]);
    }
}

#[test]
fn remote_errors_name_worker_function_and_message() {
    world_ok(
        "remote_errors_name_worker_function_and_message",
        4,
        |rank| {
            start(rank);
            if rank == 0 {
                let err = FAIL.rpc_sync(1, "bad input".to_string()).unwrap_err();
                assert!(matches!(err, RpcError::Remote { .. }));
                assert_eq!(
                    err.to_string(),
                    "function \"fail\" failed on worker \"worker1\": boom: bad input"
                );
                let err = PANIC.rpc_sync(2, ()).unwrap_err();
                assert_eq!(
                    err.to_string(),
                    "function \"panic\" failed on worker \"worker2\": panicked: deliberate panic"
                );
                let err = NO_SUCH_FN.rpc_sync(3, ()).unwrap_err();
                assert_eq!(
                    err.to_string(),
                    "worker \"worker3\" has no function \"no_such_fn\" registered"
                );
                // Wrong argument type: a caller built from another
                // declaration, with strings where integers are registered.
                const ADD_STRINGS: Function<(String, String), i64> = Function::new("add");
                let err = ADD_STRINGS
                    .rpc_sync(1, ("1".to_string(), "2".to_string()))
                    .unwrap_err();
                assert!(matches!(err, RpcError::WrongType { .. }), "{err}");
                let text = err.to_string();
                assert!(text.contains("it takes fn((i64, i64)) -> i64"), "{text}");
                assert!(text.contains("fn((String, String)) -> i64"), "{text}");
                // Wrong result type.
                const ADD_TO_TEXT: Function<(i64, i64), String> = Function::new("add");
                let err = ADD_TO_TEXT.rpc_sync(1, (1, 2)).unwrap_err();
                assert!(matches!(err, RpcError::WrongType { .. }), "{err}");
                // The worker keeps serving after all that.
                let s: i64 = ADD.rpc_sync(1, (1i64, 2i64)).unwrap();
                assert_eq!(s, 3);
            }
            ferry_rpc::shutdown().unwrap();
        },
    );
}

// The string-named (dynamic) API: functions called by name, with the
// types checked only at run time, by their names. These tests keep that
// path covered beside the typed calls every other test makes.

#[test]
fn string_named_api_calls_typed_functions_by_name() {
    world_ok(
        "string_named_api_calls_typed_functions_by_name",
        2,
        |rank| {
            start(rank);
            if rank == 0 {
                // Called by name, with every option.
                let s: String = ferry_rpc::by_name("concat")
                    .rpc_sync(1u32, ("fer".to_string(), "ry".to_string()))
                    .unwrap();
                assert_eq!(s, "ferry");
                let pending = ferry_rpc::by_name("concat")
                    .rpc_async::<String, _>("worker1", ("a".to_string(), "b".to_string()));
                assert_eq!(pending.wait().unwrap(), "ab");
                let s: String = ferry_rpc::by_name("concat")
                    .timeout(Duration::from_secs(30))
                    .rpc_sync(1u32, ("x".to_string(), "y".to_string()))
                    .unwrap();
                assert_eq!(s, "xy");
                let s: i64 = ferry_rpc::by_name("add")
                    .rpc_sync(1u32, (1i64, 2i64))
                    .unwrap();
                assert_eq!(s, 3);
                let err = ferry_rpc::by_name("no_such_fn")
                    .rpc_sync::<(), _>(1u32, ())
                    .unwrap_err();
                assert_eq!(
                    err.to_string(),
                    "worker \"worker1\" has no function \"no_such_fn\" registered"
                );
            }
            ferry_rpc::shutdown().unwrap();
        },
    );
}

#[test]
fn string_named_api_wrong_types_name_both_signatures() {
    world_ok(
        "string_named_api_wrong_types_name_both_signatures",
        2,
        |rank| {
            start(rank);
            if rank == 0 {
                // Wrong argument type: strings where integers are registered.
                let err = ferry_rpc::by_name("add")
                    .rpc_sync::<i64, _>(1u32, ("1".to_string(), "2".to_string()))
                    .unwrap_err();
                assert!(matches!(err, RpcError::WrongType { .. }), "{err}");
                let text = err.to_string();
                // Both sides as the type names that were compared, without
                // module paths.
                assert!(
                    text.contains(
                        "it takes fn((i64, i64)) -> i64, the call sent fn((String, String)) -> i64"
                    ),
                    "{text}"
                );
                // Wrong result type.
                let err = ferry_rpc::by_name("add")
                    .rpc_sync::<String, _>(1u32, (1i64, 2i64))
                    .unwrap_err();
                assert!(matches!(err, RpcError::WrongType { .. }), "{err}");
                // A typed caller of a function registered with other
                // types: both signatures in the error.
                const CONCAT_NUMBERS: Function<(i64, i64), String> = Function::new("concat");
                let err = CONCAT_NUMBERS.rpc_sync(1, (1, 2)).unwrap_err();
                assert!(matches!(err, RpcError::WrongType { .. }), "{err}");
                let text = err.to_string();
                assert!(
                    text.contains(
                        "it takes fn((String, String)) -> String, the call sent fn((i64, i64)) -> String"
                    ),
                    "{text}"
                );
                // The worker keeps serving after all that.
                let s: String = ferry_rpc::by_name("concat")
                    .rpc_sync(1u32, ("o".to_string(), "k".to_string()))
                    .unwrap();
                assert_eq!(s, "ok");
            }
            ferry_rpc::shutdown().unwrap();
        },
    );
}

#[test]
fn timeouts_fail_and_zero_means_none() {
    world_ok("timeouts_fail_and_zero_means_none", 2, |rank| {
        start(rank);
        if rank == 0 {
            let agent = ferry_rpc::agent().unwrap();
            let gate = vec!["gate/open".to_string()];
            // No timeout: still waiting after another call has timed out.
            let unbounded = GATED
                .timeout(Duration::ZERO)
                .rpc_async(1, (gate.clone(), 1000u64));
            let err = GATED
                .timeout(Duration::from_millis(100))
                .rpc_sync(1, (gate.clone(), 7u64))
                .unwrap_err();
            assert_eq!(
                err.to_string(),
                "call of \"gated\" on worker \"worker1\" timed out after 100ms"
            );
            assert!(!unbounded.is_done());
            agent
                .block_on(agent.store().set("gate/open", vec![1]))
                .unwrap();
            assert_eq!(unbounded.wait().unwrap(), 1000);
            // The late reply of the timed-out call was dropped; calls go on.
            let s: i64 = ADD.rpc_sync(1, (5i64, 5i64)).unwrap();
            assert_eq!(s, 10);
        }
        ferry_rpc::shutdown().unwrap();
    });
}

#[test]
fn invalid_names_are_refused_before_rendezvous() {
    for bad in ["", "has space", "a.b", &"x".repeat(128)] {
        let o = RpcOptions::new(bad, 0, 1, "127.0.0.1:1".parse().unwrap());
        let err = ferry_rpc::Agent::start(o).err().unwrap();
        assert!(matches!(err, RpcError::InvalidName { .. }), "{err}");
    }
    let o = RpcOptions::new("w", 3, 2, "127.0.0.1:1".parse().unwrap());
    let err = ferry_rpc::Agent::start(o).err().unwrap();
    assert_eq!(err.to_string(), "invalid rank 3: world size is 2");
}

#[test]
fn duplicate_names_fail_every_worker() {
    world_ok("duplicate_names_fail_every_worker", 4, |rank| {
        let name = if rank == 1 || rank == 2 {
            "twin".to_string()
        } else {
            worker_name(rank)
        };
        let o = RpcOptions::from_env(name)
            .unwrap()
            .init_timeout(Duration::from_secs(60));
        let err = init_rpc(o).unwrap_err();
        assert_eq!(
            err.to_string(),
            "duplicate worker name \"twin\" used by ranks [1, 2]"
        );
        assert!(matches!(ferry_rpc::agent(), Err(RpcError::NotInitialized)));
    });
}

/// One agent at a time is the process's; after shutdown, calls that name
/// no agent fail.
#[test]
fn a_second_process_agent_and_calls_after_shutdown_are_errors() {
    world_ok(
        "a_second_process_agent_and_calls_after_shutdown_are_errors",
        2,
        |rank| {
            start(rank);
            let running = ferry_rpc::agent().unwrap();
            let err = ferry_rpc::set_process_agent(&running).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("RPC is already initialized in this process as worker \"worker{rank}\"")
            );
            ferry_rpc::shutdown().unwrap();
            let err = ADD.rpc_sync(0, (1i64, 1i64)).unwrap_err();
            assert!(matches!(err, RpcError::NotInitialized), "{err}");
            assert!(ADD.rpc_async(0, (1i64, 1i64)).wait().is_err());
            assert!(matches!(
                ferry_rpc::shutdown(),
                Err(RpcError::NotInitialized)
            ));
        },
    );
}

#[test]
fn malformed_bytes_leave_the_worker_serving() {
    world_ok("malformed_bytes_leave_the_worker_serving", 4, |rank| {
        start(rank);
        let agent = ferry_rpc::agent().unwrap();
        if rank != 1 {
            let addr = agent.worker_addr(1u32).unwrap();
            let mut garbage = std::net::TcpStream::connect(addr).unwrap();
            garbage.write_all(&[0xAB; 4096]).unwrap();
            // A Ferry header announcing a 4 GiB payload.
            let mut header = vec![b'F', b'R', b'Y', 1, 1, 0, 0, 0];
            header.extend_from_slice(&[0; 8]);
            header.extend_from_slice(&u32::MAX.to_le_bytes());
            header.extend_from_slice(&[0; 12]);
            let mut oversized = std::net::TcpStream::connect(addr).unwrap();
            oversized.write_all(&header).unwrap();
            for i in 0..10i64 {
                let s: i64 = ADD.rpc_sync(1, (i, 1i64)).unwrap();
                assert_eq!(s, i + 1);
            }
        }
        ferry_rpc::shutdown().unwrap();
    });
}

#[test]
fn a_dead_peer_fails_calls_without_hanging() {
    world_ok("a_dead_peer_fails_calls_without_hanging", 3, |rank| {
        start(rank);
        if rank == 0 {
            let err = EXIT_PROCESS.rpc_sync(2, ()).unwrap_err();
            assert!(matches!(err, RpcError::PeerUnreachable { .. }), "{err}");
            assert!(
                err.to_string()
                    .starts_with("worker \"worker2\" is unreachable"),
                "{err}"
            );
            let err = ADD.rpc_sync(2, (1i64, 1i64)).unwrap_err();
            assert!(matches!(err, RpcError::PeerUnreachable { .. }), "{err}");
            let s: i64 = ADD.rpc_sync(1, (1i64, 1i64)).unwrap();
            assert_eq!(s, 2);
            // Graceful shutdown would wait for the dead worker: shut down at once.
            release_the_bystander();
        } else if rank == 1 {
            serve_as_bystander();
        } else {
            // Rank 2 exits inside `exit_process`; this point is never reached
            // unless the call never came.
            std::thread::park();
        }
    });
}

/// Rank 0 of a test with a dead peer: tells the bystander (rank 1) through
/// the store that it may stop serving, then shuts down at once (a graceful
/// shutdown would wait for the dead worker).
fn release_the_bystander() {
    let agent = ferry_rpc::agent().unwrap();
    agent
        .block_on(agent.store().set("test/done", Vec::new()))
        .unwrap();
    ferry_rpc::shutdown_now().unwrap();
}

/// Rank 1 of a test with a dead peer: serves until rank 0 is done with it
/// (the key is set, or rank 0's store went away with it), then stops.
fn serve_as_bystander() {
    let agent = ferry_rpc::agent().unwrap();
    let _ = agent.block_on(
        agent
            .store()
            .wait(&["test/done".to_string()], Duration::from_secs(60)),
    );
    ferry_rpc::shutdown_now().unwrap();
}

/// Counts service messages and answers with the sum of a list.
struct SumService;
impl Service for SumService {
    fn name(&self) -> &str {
        "sum"
    }
    fn handle(
        &self,
        from: WorkerInfo,
        message: IncomingMessage,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Encoded, String>> + Send>> {
        // The agent is current while `handle` runs (not inside the future).
        let store = ferry_rpc::Agent::current().map(|a| a.store());
        Box::pin(async move {
            let v: Vec<i64> =
                payload::decode(&message.payload, message.tensors).map_err(|e| e.to_string())?;
            if v.is_empty() {
                return Err(format!("empty list from {}", from.name));
            }
            if v == [-1] {
                // Answers once the store key `gate/sum` is set.
                store
                    .ok_or("no current agent")?
                    .wait(&["gate/sum".to_string()], Duration::from_secs(60))
                    .await
                    .map_err(|e| e.to_string())?;
            }
            tokio::task::yield_now().await;
            let tag = SCOPE_TAG.with(|t| t.borrow().clone());
            payload::encode(&(from.name, v.iter().sum::<i64>(), tag)).map_err(|e| e.to_string())
        })
    }
}

/// Attaches the caller's name to every call and records it on the callee.
struct Tagger(Arc<AtomicU64>);
impl Interceptor for Tagger {
    fn on_send(&self, call: &mut OutgoingCall<'_>) {
        self.0.fetch_add(1, Ordering::SeqCst);
        call.extensions.push(Extension {
            id: 7,
            data: format!("to {} calling {}", call.to.name, call.function).into_bytes(),
        });
    }
    fn on_receive(&self, call: &IncomingCall<'_>) -> Option<Arc<dyn CallScope>> {
        let tag = call.extensions.iter().find(|e| e.id == 7)?;
        let tag = format!(
            "{} from {}",
            String::from_utf8_lossy(&tag.data),
            call.from.name
        );
        if call.function == "add" {
            *LAST_EXTENSION.lock() = Some(tag.clone());
        }
        Some(Arc::new(TagScope(tag)))
    }
}

/// Makes its tag the thread's `SCOPE_TAG` while entered.
struct TagScope(String);
impl CallScope for TagScope {
    fn enter(&self) -> Box<dyn std::any::Any> {
        struct Restore(Option<String>);
        impl Drop for Restore {
            fn drop(&mut self) {
                SCOPE_TAG.with(|t| *t.borrow_mut() = self.0.take());
            }
        }
        let previous = SCOPE_TAG.with(|t| t.borrow_mut().replace(self.0.clone()));
        Box::new(Restore(previous))
    }
}

#[test]
fn services_and_interceptors_plug_in() {
    world_ok("services_and_interceptors_plug_in", 2, |rank| {
        let sent = Arc::new(AtomicU64::new(0));
        let kind = MessageKind(MessageKind::FIRST_SERVICE.0 + 1);
        let o = options(rank)
            .service(kind, Arc::new(SumService))
            .interceptor(Arc::new(Tagger(sent.clone())));
        init_rpc(o).unwrap();
        if rank == 0 {
            let agent = ferry_rpc::agent().unwrap();
            let reply = agent
                .call_service(
                    1u32,
                    kind,
                    payload::encode(&vec![1i64, 2, 3]).unwrap(),
                    Duration::from_secs(10),
                )
                .wait()
                .unwrap();
            let (from, sum, tag): (String, i64, Option<String>) =
                payload::decode(&reply.payload, reply.tensors).unwrap();
            assert_eq!((from.as_str(), sum), ("worker0", 6));
            // Service messages carry extensions, and the handler runs in the scope.
            // Named as the service calls itself.
            assert_eq!(tag.as_deref(), Some("to worker1 calling sum from worker0"));
            // A service message that times out names the service too.
            let err = agent
                .call_service(
                    1u32,
                    kind,
                    payload::encode(&vec![-1i64]).unwrap(),
                    Duration::from_millis(100),
                )
                .wait()
                .unwrap_err();
            assert!(matches!(err, RpcError::Timeout { .. }), "{err}");
            assert!(
                err.to_string()
                    .starts_with("call of \"sum\" on worker \"worker1\" timed out"),
                "{err}"
            );
            agent
                .block_on(agent.store().set("gate/sum", vec![1]))
                .unwrap();
            let err = agent
                .call_service(
                    1u32,
                    kind,
                    payload::encode(&Vec::<i64>::new()).unwrap(),
                    Duration::ZERO,
                )
                .wait()
                .unwrap_err();
            assert!(err.to_string().contains("empty list from worker0"), "{err}");
            let _: i64 = ADD.rpc_sync(1, (1i64, 1i64)).unwrap();
            let seen: Option<String> = LAST_EXTENSION_SEEN.rpc_sync(1, ()).unwrap();
            assert_eq!(seen.as_deref(), Some("to worker1 calling add from worker0"));
            // The scope the interceptor returned is current while the
            // function runs, across the awaits of an async one.
            let tag: Option<String> = SCOPE_TAG_NOW.rpc_sync(1, ()).unwrap();
            assert_eq!(
                tag.as_deref(),
                Some("to worker1 calling scope_tag from worker0")
            );
            let (before, after): (Option<String>, Option<String>) =
                SCOPE_TAG_ASYNC.rpc_sync(1, ()).unwrap();
            let want = Some("to worker1 calling scope_tag_async from worker0".to_string());
            assert_eq!((before, after), (want.clone(), want));
            // The caller's own thread never saw a scope.
            assert_eq!(SCOPE_TAG.with(|t| t.borrow().clone()), None);
            assert_eq!(
                sent.load(Ordering::SeqCst),
                7,
                "interceptors see function calls and service messages"
            );
        }
        ferry_rpc::shutdown().unwrap();
    });
}

#[test]
fn the_harness_reports_a_failing_rank() {
    let outputs = world("the_harness_reports_a_failing_rank", 2, |rank| {
        if rank == 1 {
            panic!("rank 1 fails on purpose");
        }
    });
    if let Some(outputs) = outputs {
        assert!(outputs[0].success);
        assert!(!outputs[1].success);
        assert!(outputs[1].stderr.contains("rank 1 fails on purpose"));
    }
}

/// The transport and channel the environment asks for (the xtask runs this
/// suite once per combination), or the defaults: the first offered. Across
/// hosts (`FERRY_TEST_CROSS_HOST=1`: every rank on a host of its own) the
/// same-host ones cannot qualify: the best of the others, TCP for frames.
fn expected_link() -> (String, String) {
    use ferry_transport::channel;
    let mut transports = match std::env::var("FERRY_TRANSPORTS") {
        Ok(list) => channel::parse_transports(&list).unwrap(),
        Err(_) => channel::default_transports(),
    };
    let mut channels = match std::env::var("FERRY_CHANNELS") {
        Ok(list) => channel::parse_channels(&list).unwrap(),
        Err(_) => channel::default_channels(),
    };
    if ferry_testkit::cross_host_requested() {
        channels.retain(|c| c.name != channel::CMA && c.name != channel::SHM);
        transports.retain(|t| t.name != channel::SHM_TRANSPORT);
    }
    let best_channel = channels.iter().max_by_key(|c| c.priority).unwrap();
    let best_transport = transports
        .iter()
        .max_by_key(|t| t.priority)
        .map_or(channel::TCP, |t| t.name.as_str());
    (best_transport.to_string(), best_channel.name.clone())
}

/// One message with tensors of many sizes (from empty to 12 MiB), and views.
fn many_sizes(seed: u8) -> Vec<RawTensor> {
    let mut out: Vec<RawTensor> = [0i64, 1, 3, 1000, 70_000, 1 << 20, 3 << 20]
        .iter()
        .enumerate()
        .map(|(i, &n)| sample(DType::F32, &[n], seed ^ i as u8))
        .collect();
    out.push(sample(DType::U8, &[(12 << 20) + 5], seed));
    let m = sample(DType::F64, &[300, 700], seed);
    out.push(m.t().unwrap());
    out
}

#[test]
fn links_use_the_configured_transport_and_channel() {
    let outputs = world_ok(
        "links_use_the_configured_transport_and_channel",
        3,
        |rank| {
            start(rank);
            // Mixed messages to every other worker, several in flight at once.
            let calls: Vec<_> = (0..3u32)
                .filter(|&p| p != rank)
                .flat_map(|p| (0..3u8).map(move |i| (p, i)))
                .map(|(p, i)| {
                    let value = many_sizes(i ^ rank as u8);
                    let f = IDENTITY_MANY.rpc_async(p, value);
                    (f, i)
                })
                .collect();
            for (f, i) in calls {
                assert!(f.wait().unwrap() == many_sizes(i ^ rank as u8));
            }
            let (transport, channel) = expected_link();
            let agent = ferry_rpc::agent().unwrap();
            for peer in (0..3u32).filter(|&p| p != rank) {
                let link = agent
                    .link_info(peer)
                    .unwrap()
                    .expect("a connection was made");
                assert_eq!(link.transport, transport, "transport to {peer}");
                assert_eq!(link.outgoing[0].channel, channel, "channel to {peer}");
                assert_eq!(link.incoming[0].channel, channel, "channel from {peer}");
            }
            println!("LINK={transport}/{channel}");
            println!("HOST={:?}", ferry_testkit::this_host());
            ferry_rpc::shutdown().unwrap();
        },
    );
    let Some(outputs) = outputs else { return };
    let (transport, channel) = expected_link();
    for (rank, o) in outputs.iter().enumerate() {
        assert_eq!(o.values("LINK"), [format!("{transport}/{channel}")]);
        // Across hosts, each rank on its own.
        let host = ferry_testkit::cross_host_requested().then_some(rank);
        assert_eq!(o.values("HOST"), [format!("{host:?}")]);
    }
}

/// A tensor of this many bytes makes its receiver exit while allocating the
/// destination: the peer dies with the transfer under way.
const FATAL_BYTES: u64 = (24 << 20) + 7;

/// The default allocator, except that a [`FATAL_BYTES`] tensor kills the
/// process.
struct DieOnFatal;
impl ferry_transport::Allocator for DieOnFatal {
    fn allocate(
        &self,
        d: &ferry_wire::TensorDescriptor,
    ) -> Result<Box<dyn ferry_transport::RecvBuffer>, ferry_transport::TransportError> {
        if d.byte_len == FATAL_BYTES {
            let _ = std::io::stdout().flush();
            std::process::exit(0);
        }
        ferry_transport::RawAllocator.allocate(d)
    }
}

#[test]
fn a_peer_dying_mid_transfer_fails_the_call_and_others_keep_serving() {
    world_ok(
        "a_peer_dying_mid_transfer_fails_the_call_and_others_keep_serving",
        3,
        |rank| {
            let mut o = options(rank);
            o.allocator = Arc::new(DieOnFatal);
            init_rpc(o).unwrap();
            if rank == 0 {
                let fatal = sample(DType::U8, &[FATAL_BYTES as i64], 3);
                let err = IDENTITY.rpc_sync(2, fatal).unwrap_err();
                assert!(matches!(err, RpcError::PeerUnreachable { .. }), "{err}");
                // The others keep serving, tensors included.
                let t = sample(DType::F32, &[3 << 20], 4);
                let back: RawTensor = IDENTITY.rpc_sync(1, t.clone()).unwrap();
                assert_eq!(back, t);
                release_the_bystander();
            } else if rank == 1 {
                serve_as_bystander();
            } else {
                // Rank 2 exits while receiving; never reached otherwise.
                std::thread::park();
            }
        },
    );
}

/// Rank 1 runs in a user namespace of its own (`unshare --user`): the
/// kernel would refuse CMA between the two, their `cma` domain descriptors
/// differ, and selection falls back to the `shm` channel; calls with large
/// tensors still work. (Needs the default channel list: the xtask's runs
/// that force one channel leave it out.)
#[test]
fn cma_across_user_namespaces_falls_back_to_shm() {
    let unshare = |rank: u32| {
        if rank == 1 {
            vec!["unshare", "--user", "--map-root-user"]
        } else {
            Vec::new()
        }
    };
    ferry_testkit::world_wrapped_ok(
        "cma_across_user_namespaces_falls_back_to_shm",
        2,
        unshare,
        |rank| {
            start(rank);
            let peer = 1 - rank;
            let t = sample(DType::F32, &[3 << 20], rank as u8);
            let back: RawTensor = IDENTITY.rpc_sync(peer, t.clone()).unwrap();
            assert_eq!(back, t);
            let link = ferry_rpc::agent()
                .unwrap()
                .link_info(peer)
                .unwrap()
                .unwrap();
            assert_eq!(link.outgoing[0].channel, "shm");
            assert_eq!(link.incoming[0].channel, "shm");
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
