//! A real network partition: two worker processes in two network
//! namespaces joined by a veth pair, whose link goes down mid-run. The
//! call waiting across it (with no call timeout) fails with
//! `PeerUnreachable` thanks to TCP keepalive and `TCP_USER_TIMEOUT`, and
//! both workers' graceful shutdown ends within its bounds instead of
//! blocking for the kernel's ~15 minutes: worker0 with `Absent` naming
//! worker1, worker1 (cut off from the store) with `Join` or `Absent`.
//!
//! The two workers run on two hosts of `ferry_testkit::hosts` (their own
//! network, IPC and PID namespaces, joined by a veth pair), removed by the
//! harness also when the test fails. Where hosts cannot be made (not root,
//! no `ip`/`unshare`), the test prints why and skips.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use ferry_rpc::{BoxError, Function, Functions, RpcError, RpcOptions};
use ferry_testkit::hosts::LINK;
use ferry_testkit::world_across_hosts;
use ferry_transport::Keepalive;

const TEST: &str = "a_partition_fails_calls_and_shutdown_within_bounds";

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

const ADD: Function<(i64, i64), i64> = Function::new("add");
const CUT: Function<(), ()> = Function::new("cut");

fn options(rank: u32) -> RpcOptions {
    let mut f = Functions::new();
    f.add(ADD, |(a, b)| a + b);
    // Brings this worker's end of the link down: the partition.
    f.add(CUT, |()| -> Result<(), BoxError> {
        Ok(ip(&["link", "set", LINK, "down"])?)
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
    init_rpc(options(rank)).unwrap();
    let agent = ferry_rpc::agent().unwrap();
    let store = agent.store();
    let peer = 1 - rank;
    // Both connections are up and used.
    let s: i64 = ADD.rpc_sync(peer, (rank as i64, 1)).unwrap();
    assert_eq!(s, rank as i64 + 1);
    if rank == 1 {
        // Tells worker0 that this worker's call is done. worker0 cuts the
        // link as soon as the store (its own) holds the key, which can be
        // before this set's reply crosses: the reply may be lost to the
        // partition, so the result does not decide anything here (a set
        // that never lands fails worker0's wait below instead). Waiting
        // here for a key set by worker0 would race the same way: a CI run
        // saw that wait's answer lost and time out after 30 s.
        if let Err(e) = agent.block_on(store.set("test/called/1", Vec::new())) {
            eprintln!("the set's reply was lost to the partition: {e}");
        }
    } else {
        agent
            .block_on(store.wait(&["test/called/1".to_string()], Duration::from_secs(30)))
            .unwrap();
        // Both calls are done. No call timeout: only the kernel's
        // keepalive and user timeout can end this call once worker1 has
        // cut the link.
        let err = CUT.timeout(Duration::ZERO).rpc_sync(1, ()).unwrap_err();
        assert!(matches!(err, RpcError::PeerUnreachable { .. }), "{err}");
        println!("CALL={err}");
    }
    // Worker1 cannot reach the store across the partition (rank 0 hosts
    // it); worker0 waits for worker1 in vain and names it.
    let err = ferry_rpc::shutdown().unwrap_err();
    assert!(
        matches!(err, RpcError::Join(_) | RpcError::Absent { .. }),
        "{err}"
    );
    println!("SHUTDOWN={err}");
}

#[test]
fn a_partition_fails_calls_and_shutdown_within_bounds() {
    let Some(outputs) = world_across_hosts(TEST, 2, body) else {
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
        down.starts_with("graceful shutdown failed: workers [\"worker1\"] did not take part"),
        "{down}"
    );
    let cut_off = &outputs[1].values("SHUTDOWN")[0];
    assert!(
        cut_off.starts_with("graceful shutdown failed: "),
        "{cut_off}"
    );
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

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
