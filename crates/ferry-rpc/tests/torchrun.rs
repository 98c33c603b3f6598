//! Ferry workers launched by the real `torchrun` (the `.venv`'s, torch
//! 2.13): two torchrun "nodes" on 127.0.0.1, started as two processes with
//! `--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d`, run the
//! `torchrun_worker` example (`--no-python`). Its workers join through the
//! c10d store torchrun's agent hosts and call each other.
//!
//! - `two_torchrun_nodes_form_one_group_of_four`: one group of 4, every
//!   worker calls all 4 and sees two nodes of two local workers each.
//! - `a_failed_attempt_is_restarted_as_a_fresh_group`: with
//!   `--max-restarts 1`, every worker of the first attempt fails once the
//!   group has formed (its keys stay in the store); torchrun restarts both
//!   nodes, and the second attempt (restart count 1, its own store
//!   namespace) succeeds.
//!
//! Without `.venv/bin/torchrun` or torch, the tests print `SKIPPED: …` and
//! pass. The example is built by `cargo test` (examples are built with the
//! tests) next to the test binary.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Bound on one torchrun job (importing torch alone takes seconds on a
/// loaded machine); below nextest's 4 minutes, so this test's own message
/// and the nodes' logs are what a hang shows.
const BOUND: Duration = Duration::from_secs(200);
const WORLD: usize = 4;

/// `.venv/bin/torchrun` at the repository root if the `.venv` has torch.
fn torchrun() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent()?.parent()?;
    let bin = root.join(".venv").join("bin");
    let (torchrun, python) = (bin.join("torchrun"), bin.join("python"));
    if !torchrun.is_file() || !python.is_file() {
        println!("SKIPPED: no .venv/bin/torchrun at the repository root");
        return None;
    }
    let has_torch = Command::new(&python)
        .args([
            "-c",
            "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)",
        ])
        .status()
        .is_ok_and(|s| s.success());
    if !has_torch {
        println!("SKIPPED: {} has no torch", python.display());
        return None;
    }
    Some(torchrun)
}

/// The `torchrun_worker` example, which `cargo test` builds into the
/// `examples` folder beside this test's `deps` folder (a run of this test
/// file alone does not build it: then it must not be older than the
/// sources it is built from).
fn worker_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    let worker = profile_dir.join("examples").join("torchrun_worker");
    let build = "build it with `cargo build -p ferry-rpc --example torchrun_worker` \
                 (`cargo test -p ferry-rpc` builds it)";
    let built = std::fs::metadata(&worker)
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| panic!("{}: {e}: {build}", worker.display()));
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    for dir in [
        "ferry-rpc/src",
        "ferry-rpc/examples",
        "ferry-store/src",
        "ferry-transport/src",
        "ferry-wire/src",
    ] {
        if let Some((path, changed)) = newest(&crates.join(dir)) {
            assert!(
                changed <= built,
                "{} is older than {}: {build}",
                worker.display(),
                path.display()
            );
        }
    }
    worker
}

/// The most recently modified file under `dir` that goes into the worker:
/// unit-test modules (`tests.rs`, `*_tests.rs`, compiled only under
/// `cfg(test)`) do not, and editing one does not rebuild it.
fn newest(dir: &Path) -> Option<(PathBuf, std::time::SystemTime)> {
    let mut best: Option<(PathBuf, std::time::SystemTime)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let found = if path.is_dir() {
            newest(&path)
        } else if name == "tests.rs" || name.ends_with("_tests.rs") {
            None
        } else {
            entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .map(|t| (path, t))
        };
        if let Some((p, t)) = found {
            if best.as_ref().is_none_or(|(_, b)| t > *b) {
                best = Some((p, t));
            }
        }
    }
    best
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fresh folder for one test's reports and logs.
fn out_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// One torchrun "node", its output in `out/node{n}.log`; killed if dropped
/// before it exits.
struct Node {
    child: Option<Child>,
    log: PathBuf,
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts node `n` of a 2-node job with rendezvous at `port`.
fn start_node(
    torchrun: &Path,
    n: usize,
    port: u16,
    run_id: &str,
    max_restarts: u32,
    out: &Path,
    fail: Option<&str>,
) -> Node {
    let log = out.join(format!("node{n}.log"));
    let file = std::fs::File::create(&log).unwrap();
    let mut cmd = Command::new(torchrun);
    cmd.args(["--nnodes", "2", "--nproc-per-node", "2"])
        .args(["--rdzv-backend", "c10d"])
        .args(["--rdzv-endpoint", &format!("127.0.0.1:{port}")])
        .args(["--rdzv-id", run_id])
        // The first node hosts the rendezvous store; both say they are
        // on 127.0.0.1 (torchrun's default is the host name).
        .args([
            "--rdzv-conf",
            if n == 0 { "is_host=1" } else { "is_host=0" },
        ])
        .args(["--local-addr", "127.0.0.1"])
        .args(["--max-restarts", &max_restarts.to_string()])
        .arg("--no-python")
        .arg(worker_binary())
        .env("FERRY_TORCHRUN_OUT", out)
        .env("OMP_NUM_THREADS", "1")
        .env("PYTHONUNBUFFERED", "1")
        // torchrun sets these for its workers; none may leak from here.
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .env_remove("FERRY_TEST_NAME")
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file);
    match fail {
        Some(f) => cmd.env("FERRY_TORCHRUN_FAIL", f),
        None => cmd.env_remove("FERRY_TORCHRUN_FAIL"),
    };
    Node {
        child: Some(cmd.spawn().expect("start torchrun")),
        log,
    }
}

/// Waits for both nodes within [`BOUND`] (killing them past it) and
/// asserts that both succeeded; returns their logs.
fn finish(mut nodes: Vec<Node>) -> String {
    let (tx, rx) = mpsc::channel();
    let mut pids = Vec::new();
    for (i, node) in nodes.iter_mut().enumerate() {
        let mut child = node.child.take().unwrap();
        let tx = tx.clone();
        // The child moves to a waiting thread; past the bound it is sent
        // SIGTERM through its pid (torchrun then stops its workers).
        pids.push(child.id());
        std::thread::spawn(move || {
            let status = child.wait();
            let _ = tx.send((i, status));
        });
    }
    drop(tx);
    let mut statuses = vec![None; nodes.len()];
    while statuses.iter().any(Option::is_none) {
        match rx.recv_timeout(BOUND) {
            Ok((i, status)) => statuses[i] = Some(status.unwrap()),
            Err(_) => {
                for (i, pid) in pids.iter().enumerate() {
                    if statuses[i].is_none() {
                        if let Some(pid) = rustix::process::Pid::from_raw(*pid as i32) {
                            let _ =
                                rustix::process::kill_process(pid, rustix::process::Signal::TERM);
                        }
                    }
                }
                for node in &nodes {
                    eprintln!("{}", std::fs::read_to_string(&node.log).unwrap_or_default());
                }
                panic!("torchrun did not finish within {BOUND:?}");
            }
        }
    }
    let logs: Vec<String> = nodes
        .iter()
        .map(|n| std::fs::read_to_string(&n.log).unwrap_or_default())
        .collect();
    for (i, status) in statuses.iter().enumerate() {
        let status = status.unwrap();
        assert!(
            status.success(),
            "torchrun node {i} failed ({status}):\n{}",
            logs[i]
        );
    }
    logs.join("\n")
}

/// The reports of attempt `restart`: for each rank, what it saw.
fn reports(out: &Path, restart: u32) -> Vec<String> {
    (0..WORLD)
        .map(|rank| {
            let path = out.join(format!("restart{restart}_rank{rank}"));
            std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("no report {}: {e}", path.display()))
        })
        .collect()
}

/// Checks that every worker of attempt `restart` reached all 4, on two
/// nodes of two local workers each, all of the same attempt.
fn assert_one_group(out: &Path, restart: u32) {
    let reports = reports(out, restart);
    let mut placements = BTreeSet::new();
    for (rank, report) in reports.iter().enumerate() {
        let (head, seen) = report.split_once(": ").unwrap();
        assert!(
            head.starts_with(&format!("worker{rank} ")),
            "report of rank {rank}: {report}"
        );
        let seen: Vec<&str> = seen.split(' ').collect();
        assert_eq!(seen.len(), WORLD, "{report}");
        for (peer, s) in seen.iter().enumerate() {
            assert!(s.starts_with(&format!("worker{peer}@")), "{report}");
            assert!(s.ends_with(&format!("/restart{restart}")), "{report}");
            placements.insert(s.split('@').nth(1).unwrap().to_owned());
        }
    }
    // Every worker saw the same 4 placements: 2 nodes × 2 local ranks.
    let expected: BTreeSet<String> = ["node0", "node1"]
        .iter()
        .flat_map(|n| (0..2).map(move |l| format!("{n}/local{l}/restart{restart}")))
        .collect();
    assert_eq!(placements, expected);
}

#[test]
fn two_torchrun_nodes_form_one_group_of_four() {
    let Some(torchrun) = torchrun() else {
        return;
    };
    let out = out_dir("torchrun-group");
    let port = free_port();
    let nodes = (0..2)
        .map(|n| start_node(&torchrun, n, port, "ferry-group", 0, &out, None))
        .collect();
    finish(nodes);
    assert_one_group(&out, 0);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_failed_attempt_is_restarted_as_a_fresh_group() {
    let Some(torchrun) = torchrun() else {
        return;
    };
    let out = out_dir("torchrun-restart");
    let port = free_port();
    let nodes = (0..2)
        .map(|n| start_node(&torchrun, n, port, "ferry-restart", 1, &out, Some("0")))
        .collect();
    let logs = finish(nodes);
    // The first attempt formed and failed, so nobody wrote a report for
    // it ...
    for rank in 0..WORLD {
        assert!(
            logs.contains(&format!("worker{rank} (restart 0) fails on purpose")),
            "{logs}"
        );
    }
    assert!(
        !out.join("restart0_rank0").exists(),
        "attempt 0 was not meant to succeed"
    );
    // ... and the second formed a fresh group of 4 and succeeded.
    assert_one_group(&out, 1);
    let _ = std::fs::remove_dir_all(&out);
}

/// Without torchrun itself: a worker whose group's other rank registered
/// at another restart count (as when torchrun counts a restart on one node
/// only) fails its rendezvous with an error naming that rank and count.
#[test]
fn a_rank_at_another_restart_count_is_named_when_rendezvous_times_out() {
    use ferry_rpc::store::{MemoryStore, Store};
    use ferry_rpc::{Agent, RpcOptions, TorchElastic};
    use std::sync::Arc;

    let store = Arc::new(MemoryStore::default());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    // Rank 1 last joined at restart 0.
    runtime
        .block_on(store.set("torchelastic/job/restart_of/1", b"0".to_vec()))
        .unwrap();
    let mut options = RpcOptions::new("worker0", 0, 2, "127.0.0.1:1".parse().unwrap())
        .store(store)
        .init_timeout(Duration::from_millis(200));
    options.torchelastic = Some(TorchElastic {
        run_id: "job".into(),
        restart_count: 1,
        max_restarts: Some(1),
        use_agent_store: true,
    });
    let Err(e) = Agent::start(options) else {
        panic!("a group of 2 formed with one worker");
    };
    let e = e.to_string();
    assert!(
        e.contains("torchrun rendezvous of restart 1 (run \"job\") timed out: rank 1 at restart 0"),
        "{e}"
    );
}
