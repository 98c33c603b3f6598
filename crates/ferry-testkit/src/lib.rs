//! # ferry-testkit
//!
//! A harness for multi-process tests: the test binary re-runs itself once
//! per rank, each child runs the same test function as a worker (with
//! `MASTER_ADDR`, `MASTER_PORT`, `RANK` and `WORLD_SIZE` set), and the
//! parent collects every child's exit status and output.
//!
//! ```no_run
//! #[test]
//! fn two_workers() {
//!     let Some(outputs) = ferry_testkit::world_ok("two_workers", 2, |rank| {
//!         println!("RANK_SEEN={rank}");
//!     }) else {
//!         return; // a child: done
//!     };
//!     assert_eq!(outputs[1].values("RANK_SEEN"), ["1"]);
//! }
//! ```
#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Bound on one multi-process test.
const WORLD_DEADLINE: Duration = Duration::from_secs(120);

/// What one child printed.
#[derive(Debug)]
pub struct Output {
    /// Exit status success.
    pub success: bool,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl Output {
    /// Values printed as `KEY=value` (the test harness may print its own
    /// text before them on the same line).
    pub fn values(&self, key: &str) -> Vec<String> {
        let prefix = format!("{key}=");
        self.stdout
            .lines()
            .filter_map(|l| l.rsplit_once(&prefix).map(|(_, v)| v.trim().to_string()))
            .collect()
    }
}

/// The rank of this process when it runs as a worker of `test`.
pub fn worker_rank(test: &str) -> Option<u32> {
    if std::env::var("FERRY_TEST_NAME").ok()? != test {
        return None;
    }
    std::env::var("RANK").ok()?.parse().ok()
}

/// Runs `body(rank)` in `world` processes. In the parent, returns each
/// rank's output once all have exited (killing them at the deadline); in a
/// child, runs the body and returns `None`.
pub fn world(test: &str, world: u32, body: impl Fn(u32)) -> Option<Vec<Output>> {
    world_wrapped(test, world, |_| Vec::new(), body)
}

/// Like [`world`], with rank `r`'s process started through the command
/// `wrapper(r)` (e.g. `["unshare", "--user", "--map-root-user"]` to run it
/// in a user namespace of its own; empty: started directly).
pub fn world_wrapped(
    test: &str,
    world: u32,
    wrapper: impl Fn(u32) -> Vec<&'static str>,
    body: impl Fn(u32),
) -> Option<Vec<Output>> {
    if let Some(rank) = worker_rank(test) {
        body(rank);
        return None;
    }
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let exe = std::env::current_exe().unwrap();
    let (tx, rx) = mpsc::channel();
    let mut pids = Vec::new();
    for rank in 0..world {
        let wrap = wrapper(rank);
        let mut command = match wrap.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        let mut child = command
            .args([test, "--exact", "--nocapture", "--test-threads", "1"])
            .env("FERRY_TEST_NAME", test)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        pids.push(child.id());
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut stdout = String::new();
            let mut stderr = String::new();
            let mut out = child.stdout.take().unwrap();
            let mut err = child.stderr.take().unwrap();
            let t = std::thread::spawn(move || {
                let mut s = String::new();
                let _ = err.read_to_string(&mut s);
                s
            });
            let _ = out.read_to_string(&mut stdout);
            stderr.push_str(&t.join().unwrap_or_default());
            let success = child.wait().map(|s| s.success()).unwrap_or(false);
            let _ = tx.send((
                rank,
                Output {
                    success,
                    stdout,
                    stderr,
                },
            ));
        });
    }
    drop(tx);
    let deadline = std::time::Instant::now() + WORLD_DEADLINE;
    let mut outputs: Vec<Option<Output>> = (0..world).map(|_| None).collect();
    for _ in 0..world {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, out)) => outputs[rank as usize] = Some(out),
            Err(_) => {
                for pid in &pids {
                    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
                }
                panic!("test {test} did not finish within {WORLD_DEADLINE:?}; ranks killed");
            }
        }
    }
    Some(outputs.into_iter().map(Option::unwrap).collect())
}

/// Like [`world`], and asserts every rank succeeded, printing their output if not.
pub fn world_ok(test: &str, size: u32, body: impl Fn(u32)) -> Option<Vec<Output>> {
    world_wrapped_ok(test, size, |_| Vec::new(), body)
}

/// Like [`world_wrapped`], and asserts every rank succeeded.
pub fn world_wrapped_ok(
    test: &str,
    size: u32,
    wrapper: impl Fn(u32) -> Vec<&'static str>,
    body: impl Fn(u32),
) -> Option<Vec<Output>> {
    let outputs = world_wrapped(test, size, wrapper, body)?;
    for (rank, o) in outputs.iter().enumerate() {
        assert!(
            o.success,
            "rank {rank} of {test} failed\n--- stdout ---\n{}\n--- stderr ---\n{}",
            o.stdout, o.stderr
        );
    }
    Some(outputs)
}
