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
//!
//! Cross-host tests place ranks on separate "hosts" on one machine (their
//! own network, IPC, PID, UTS and mount namespaces, joined by veth; see
//! [`hosts`]) with [`world_on_hosts`] / [`world_across_hosts`], which print
//! `SKIPPED` with the reason where hosts cannot be made; with
//! [`CROSS_HOST_ENV`]`=1`, [`world`] and the others put every rank on a
//! host of its own, which runs a whole suite across hosts.
#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub mod hosts;
#[cfg(feature = "outsider")]
pub mod outsider;
pub use hosts::{Hosts, HostsError};

/// Set to `1`, it makes [`world`], [`world_ok`] and the wrapped variants
/// run every rank on a host of its own (network, IPC and PID namespaces,
/// see [`hosts`]): how the xtask runs a whole suite across hosts.
pub const CROSS_HOST_ENV: &str = "FERRY_TEST_CROSS_HOST";

/// Bound on one multi-process test.
const WORLD_DEADLINE: Duration = Duration::from_secs(120);

/// What one child printed.
#[derive(Debug)]
pub struct Output {
    /// Exit status success.
    pub success: bool,
    /// How the process ended, as the OS reports it: `exit status: 0`,
    /// `signal: 11 (SIGSEGV) (core dumped)`, … A rank whose test passed can
    /// still fail here, in what runs at process exit.
    pub status: String,
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
///
/// With [`CROSS_HOST_ENV`]`=1` in the environment, every rank runs on a
/// host of its own (see [`hosts`]; the wrapper then runs on that host), and
/// `MASTER_ADDR` is host 0's address: this is how a whole multi-process
/// suite is run across hosts. Hosts that cannot be made then fail the test
/// with the reason, since the run asked for them.
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
    let hosts = cross_host_requested().then(|| {
        Hosts::create(world as usize).unwrap_or_else(|e| {
            panic!("{CROSS_HOST_ENV}=1 asks for a host per rank of {test}, but: {e}")
        })
    });
    let plan = (0..world)
        .map(|r| {
            let mut prefix = match &hosts {
                Some(h) => h.enter(r as usize),
                None => Vec::new(),
            };
            prefix.extend(wrapper(r).into_iter().map(String::from));
            Placement {
                prefix,
                host: hosts.as_ref().map(|_| r as usize),
            }
        })
        .collect();
    let master = match &hosts {
        Some(h) => h.address(0).to_string(),
        None => "127.0.0.1".to_string(),
    };
    let outputs = launch(test, plan, &master);
    drop(hosts);
    Some(outputs)
}

/// Runs `body(rank)` in `world` processes placed on `hosts` separate hosts
/// (see [`hosts`]): rank `r` on host `host_of(r)`, ranks of one host sharing
/// its network, IPC and PID namespaces. `MASTER_ADDR` is host 0's address
/// and `FERRY_TEST_HOST` ([`this_host`]) each rank's host.
///
/// Returns `None` in a child, and in the parent when hosts cannot be made
/// on this machine: it then prints `SKIPPED <test>: <why>` (a runtime
/// check, so the test still runs wherever it can). A failing set-up step
/// panics.
pub fn world_on_hosts(
    test: &str,
    world: u32,
    hosts: usize,
    host_of: impl Fn(u32) -> usize,
    body: impl Fn(u32),
) -> Option<Vec<Output>> {
    if let Some(rank) = worker_rank(test) {
        body(rank);
        return None;
    }
    let set = match Hosts::create(hosts) {
        Ok(set) => set,
        Err(why @ HostsError::Unavailable(_)) => {
            println!("SKIPPED {test}: {why}");
            eprintln!("SKIPPED {test}: {why}");
            return None;
        }
        Err(e) => panic!("{test}: {e}"),
    };
    let plan = (0..world)
        .map(|r| {
            let host = host_of(r);
            Placement {
                prefix: set.enter(host),
                host: Some(host),
            }
        })
        .collect();
    let outputs = launch(test, plan, &set.address(0).to_string());
    drop(set);
    Some(outputs)
}

/// [`world_on_hosts`] with every rank on a host of its own.
pub fn world_across_hosts(test: &str, world: u32, body: impl Fn(u32)) -> Option<Vec<Output>> {
    world_on_hosts(test, world, world as usize, |r| r as usize, body)
}

/// Whether [`CROSS_HOST_ENV`] asks the harness for a host per rank (in
/// the parent and, inherited, in every rank).
pub fn cross_host_requested() -> bool {
    std::env::var(CROSS_HOST_ENV).is_ok_and(|v| v.trim() == "1")
}

/// The host this rank runs on, when started by [`world_on_hosts`] or
/// across hosts by [`world_wrapped`].
pub fn this_host() -> Option<usize> {
    std::env::var("FERRY_TEST_HOST").ok()?.parse().ok()
}

/// How one rank is started.
struct Placement {
    /// Command prefix (empty: the test binary is started directly).
    prefix: Vec<String>,
    /// Its host, if placed on one.
    host: Option<usize>,
}

/// Starts one process per placement running `test` and collects their
/// outputs, killing them all at [`WORLD_DEADLINE`].
fn launch(test: &str, plan: Vec<Placement>, master_addr: &str) -> Vec<Output> {
    let world = plan.len() as u32;
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let exe = std::env::current_exe().unwrap();
    let (tx, rx) = mpsc::channel();
    let mut pids = Vec::new();
    for (rank, placement) in plan.into_iter().enumerate() {
        let rank = rank as u32;
        let mut command = match placement.prefix.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        if let Some(host) = placement.host {
            command.env("FERRY_TEST_HOST", host.to_string());
        }
        let mut child = command
            .args([test, "--exact", "--nocapture", "--test-threads", "1"])
            .env("FERRY_TEST_NAME", test)
            .env("MASTER_ADDR", master_addr)
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
            let (success, status) = match child.wait() {
                Ok(s) => (s.success(), s.to_string()),
                Err(e) => (false, format!("could not wait for the process: {e}")),
            };
            let _ = tx.send((
                rank,
                Output {
                    success,
                    status,
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
    outputs.into_iter().map(Option::unwrap).collect()
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
            "rank {rank} of {test} failed ({})\n--- stdout ---\n{}\n--- stderr ---\n{}",
            o.status, o.stdout, o.stderr
        );
    }
    Some(outputs)
}
