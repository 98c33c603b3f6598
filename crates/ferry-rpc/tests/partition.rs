//! A real network partition: two worker processes in two network
//! namespaces joined by a veth pair, whose link goes down mid-run. The
//! call waiting across it (with no call timeout) fails with
//! `PeerUnreachable` thanks to TCP keepalive and `TCP_USER_TIMEOUT`, and
//! both workers' graceful shutdown ends with `Join` within its bounds
//! instead of blocking for the kernel's ~15 minutes.
//!
//! The namespaces get unique names and are removed by a guard, also when
//! the test fails. Where `ip netns add` is not permitted (not root, no
//! `CAP_SYS_ADMIN`), the test prints why and skips.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use ferry_rpc::{BoxError, Function, Functions, RpcError, RpcOptions};
use ferry_testkit::{worker_rank, world_wrapped};
use ferry_transport::Keepalive;

const TEST: &str = "a_partition_fails_calls_and_shutdown_within_bounds";
const SUBNET: &str = "10.77.0";

/// Two network namespaces joined by a veth pair, removed on drop.
struct Partition {
    namespaces: [String; 2],
    links: [String; 2],
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Partition {
    /// `Err` (with the reason) only if the first namespace cannot be made:
    /// the test is then skipped. Any later step failing is a test failure.
    fn create() -> Result<Partition, String> {
        remove_stale();
        let id = std::process::id();
        let p = Partition {
            namespaces: [format!("ferry-part-{id}-a"), format!("ferry-part-{id}-b")],
            links: [format!("fy{id}a"), format!("fy{id}b")],
        };
        ip(&["netns", "add", &p.namespaces[0]])?;
        // From here on the guard removes whatever was made.
        let setup = || -> Result<(), String> {
            ip(&["netns", "add", &p.namespaces[1]])?;
            ip(&[
                "link",
                "add",
                &p.links[0],
                "netns",
                &p.namespaces[0],
                "type",
                "veth",
                "peer",
                "name",
                &p.links[1],
                "netns",
                &p.namespaces[1],
            ])?;
            for side in 0..2 {
                let ns = &p.namespaces[side];
                let addr = format!("{SUBNET}.{}/24", side + 1);
                ip(&["-n", ns, "addr", "add", &addr, "dev", &p.links[side]])?;
                ip(&["-n", ns, "link", "set", &p.links[side], "up"])?;
                ip(&["-n", ns, "link", "set", "lo", "up"])?;
            }
            Ok(())
        };
        setup().expect("setting up the namespaces failed");
        Ok(p)
    }

    /// How rank `r` is started: in its namespace, with the store's address
    /// there and the name of its end of the link.
    fn wrapper(&self, r: u32) -> Vec<&'static str> {
        let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
        vec![
            "ip",
            "netns",
            "exec",
            leak(self.namespaces[r as usize].clone()),
            "env",
            leak(format!("MASTER_ADDR={SUBNET}.1")),
            leak(format!("FERRY_TEST_LINK={}", self.links[r as usize])),
        ]
    }
}

/// Removes the namespaces of earlier runs whose test process is gone (a
/// run killed by a signal could not drop its guard).
fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let Some(pid) = name
            .strip_prefix("ferry-part-")
            .and_then(|rest| rest.split('-').next())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        // Removing a namespace removes its end of the veth pair, and the pair.
        for ns in &self.namespaces {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

const ADD: Function<(i64, i64), i64> = Function::new("add");
const CUT: Function<(), ()> = Function::new("cut");

fn options(rank: u32) -> RpcOptions {
    let mut f = Functions::new();
    f.add(ADD, |(a, b)| a + b);
    // Brings this worker's end of the link down: the partition.
    f.add_fallible(CUT, |()| -> Result<(), BoxError> {
        let link = std::env::var("FERRY_TEST_LINK")?;
        Ok(ip(&["link", "set", &link, "down"])?)
    });
    RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(f)
        .init_timeout(Duration::from_secs(10))
        .keepalive(Keepalive {
            enabled: true,
            idle: Duration::from_secs(1),
            interval: Duration::from_secs(1),
            retries: 2,
            user_timeout: Duration::from_secs(3),
        })
}

fn body(rank: u32) {
    ferry_rpc::init_rpc(options(rank)).unwrap();
    let agent = ferry_rpc::agent().unwrap();
    let store = agent.store();
    let peer = 1 - rank;
    // Both connections are up and used.
    let s: i64 = ADD.rpc_sync(peer, (rank as i64, 1)).unwrap();
    assert_eq!(s, rank as i64 + 1);
    agent
        .block_on(store.set(&format!("test/called/{rank}"), Vec::new()))
        .unwrap();
    agent
        .block_on(store.wait(
            &["test/called/0".to_string(), "test/called/1".to_string()],
            Duration::from_secs(30),
        ))
        .unwrap();
    if rank == 0 {
        // No call timeout: only the kernel's keepalive and user timeout
        // can end this call once worker1 has cut the link.
        let err = CUT.rpc_sync_timeout(1, (), Duration::ZERO).unwrap_err();
        assert!(matches!(err, RpcError::PeerUnreachable { .. }), "{err}");
        println!("CALL={err}");
    }
    // Worker1 cannot reach the store across the partition (rank 0 hosts
    // it); worker0 waits for worker1 in vain. Both end with `Join`.
    let err = ferry_rpc::shutdown().unwrap_err();
    assert!(matches!(err, RpcError::Join(_)), "{err}");
    println!("SHUTDOWN={err}");
}

#[test]
fn a_partition_fails_calls_and_shutdown_within_bounds() {
    let partition = match worker_rank(TEST) {
        Some(_) => None,
        None => match Partition::create() {
            Ok(p) => Some(p),
            Err(why) => {
                println!("SKIPPED {TEST}: `ip netns add` is not permitted here ({why})");
                eprintln!("SKIPPED {TEST}: `ip netns add` is not permitted here ({why})");
                return;
            }
        },
    };
    let Some(outputs) = world_wrapped(
        TEST,
        2,
        |r| partition.as_ref().expect("the parent").wrapper(r),
        body,
    ) else {
        return;
    };
    for (rank, o) in outputs.iter().enumerate() {
        assert!(
            o.success,
            "rank {rank} failed\n--- stdout ---\n{}\n--- stderr ---\n{}",
            o.stdout, o.stderr
        );
    }
    let call = outputs[0].values("CALL");
    assert_eq!(call.len(), 1, "{:?}", outputs[0].stdout);
    assert!(
        call[0].starts_with("worker \"worker1\" is unreachable"),
        "{call:?}"
    );
    let down = &outputs[0].values("SHUTDOWN")[0];
    assert!(
        down.starts_with("graceful shutdown failed: workers [\"worker1\"] did not reach"),
        "{down}"
    );
    let cut_off = &outputs[1].values("SHUTDOWN")[0];
    assert!(
        cut_off.starts_with("graceful shutdown failed: "),
        "{cut_off}"
    );
    drop(partition);
}

#[test]
fn invalid_keepalive_settings_are_refused_before_rendezvous() {
    let o = RpcOptions::new("w", 0, 1, "127.0.0.1:1".parse().unwrap()).keepalive(Keepalive {
        interval: Duration::from_millis(500),
        ..Keepalive::default()
    });
    let err = ferry_rpc::Agent::start(o).err().unwrap();
    assert!(matches!(err, RpcError::Config(_)), "{err}");
    assert_eq!(
        err.to_string(),
        "invalid RPC options: invalid keepalive setting: interval must be a whole number of seconds from 1 to 32767, not 500ms"
    );
}
