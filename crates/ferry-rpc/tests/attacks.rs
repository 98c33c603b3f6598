//! Attacks on a group's workers from a peer that does not play by the
//! rules, each across real worker processes on 127.0.0.1.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use ferry_rpc::{Function, Functions, RpcOptions};
use ferry_testkit::world_ok;
use ferry_transport::{Endpoint, OutgoingMessage, PeerConnection};
use ferry_wire::{payload, Flags, MessageKind};

const ADD: Function<(i64, i64), i64> = Function::new("add");
/// Returns `v` once every key in `keys` is set in the group's store
/// (state the test controls, not time).
const GATED: Function<(Vec<String>, u64), u64> = Function::new("gated");

/// What every attack's workers register.
fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(ADD, |(a, b)| a + b);
    f.add(GATED, |(keys, v): (Vec<String>, u64)| {
        let agent = ferry_rpc::Agent::current().unwrap();
        agent
            .block_on(agent.store().wait(&keys, Duration::from_secs(60)))
            .unwrap();
        v
    });
    f
}

fn start(rank: u32) -> ferry_rpc::Agent {
    // Warnings go to stderr, which the test reads back.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .try_init();
    let options = RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(functions())
        .init_timeout(Duration::from_secs(60));
    init_rpc(options).unwrap();
    ferry_rpc::agent().unwrap()
}

fn store_set(agent: &ferry_rpc::Agent, key: &str) {
    agent.block_on(agent.store().set(key, Vec::new())).unwrap();
}

fn store_wait(agent: &ferry_rpc::Agent, key: &str) {
    agent
        .block_on(
            agent
                .store()
                .wait(&[key.to_string()], Duration::from_secs(60)),
        )
        .unwrap();
}

/// A forged reply. Worker 0 calls worker 1 (a call that waits for a store
/// key); meanwhile worker 2 connects to worker 0 twice, once as itself and
/// once claiming to be worker 1, and sends REPLY frames for every request
/// id a fresh worker could have used. None of them may complete worker
/// 0's call: only worker 1's reply, on the connection the request went out
/// on, does.
#[test]
fn a_forged_reply_does_not_complete_a_call() {
    let outputs = world_ok("a_forged_reply_does_not_complete_a_call", 3, |rank| {
        let agent = start(rank);
        match rank {
            0 => {
                let call = GATED.rpc_async(1, (vec!["test/forged".to_string()], 7));
                store_set(&agent, "test/pending");
                let v = call.wait().unwrap();
                assert_eq!(v, 7, "a forged reply completed the call");
                println!("RESULT={v}");
                store_set(&agent, "test/done");
            }
            1 => {}
            _ => {
                store_wait(&agent, "test/pending");
                let victim = agent.worker_addr(0u32).unwrap();
                for (name, rank) in [("worker2", 2), ("worker1", 1)] {
                    agent.block_on(forge_replies(victim, name, rank));
                }
                // Worker 0 has handled every forged frame: its call must
                // still be waiting. Now let worker 1 answer it.
                store_set(&agent, "test/forged");
            }
        }
        // The attacker's requests were never counted as sent by a worker
        // of the group: stop at once, not gracefully (rank 0's store may be
        // gone by the time the others look).
        let _ = agent.block_on(
            agent
                .store()
                .wait(&["test/done".to_string()], Duration::from_secs(60)),
        );
        ferry_rpc::shutdown_now().unwrap();
    });
    if let Some(outputs) = outputs {
        assert_eq!(outputs[0].values("RESULT"), ["7"]);
        // Worker 0 said so, naming the sender, but not once per frame.
        let warned = outputs[0]
            .stderr
            .lines()
            .filter(|l| l.contains("dropping a reply that did not come from the callee"))
            .collect::<Vec<_>>();
        assert!(!warned.is_empty(), "{}", outputs[0].stderr);
        assert!(warned.iter().any(|l| l.contains("peer=worker2")));
        assert!(warned.iter().any(|l| l.contains("peer=worker1")));
        assert!(warned.len() < 128, "{} warnings", warned.len());
    }
}

/// A name with a line break and an ANSI escape, stated in a handshake to
/// worker 0: the warning that rejects the connection shows it escaped, on
/// one line, and the forged log line never starts a line of its own.
#[test]
fn a_peer_supplied_name_is_logged_escaped() {
    const SHOWN: &str = r"evil\n2026-01-01T00:00:00Z  INFO forged: all is well\u{1b}[2J";
    let outputs = world_ok("a_peer_supplied_name_is_logged_escaped", 2, |rank| {
        let agent = start(rank);
        if rank == 1 {
            let evil = "evil\n2026-01-01T00:00:00Z  INFO forged: all is well\u{1b}[2J";
            let victim = agent.worker_addr(0u32).unwrap();
            agent.block_on(async {
                let mut conn = PeerConnection::connect(victim, &Endpoint::new(evil, 1))
                    .await
                    .unwrap();
                // Worker 0 logs, then drops the connection.
                let end = tokio::time::timeout(Duration::from_secs(30), conn.reader.read())
                    .await
                    .unwrap();
                assert!(matches!(end, Ok(None) | Err(_)));
            });
        }
        ferry_rpc::shutdown().unwrap();
    });
    if let Some(outputs) = outputs {
        let log = &outputs[0].stderr;
        let line = log
            .lines()
            .find(|l| l.contains("rejected a connection") && l.contains("outside the group"))
            .unwrap_or_else(|| panic!("no warning in:\n{log}"));
        assert!(line.contains(SHOWN), "{line}");
        assert!(!log.contains('\u{1b}'), "{log}");
        assert!(!log.lines().any(|l| l.starts_with("2026-01-01")), "{log}");
    }
}

/// Connects to `victim` as `name` (rank `rank`) and sends a forged reply
/// for every request id from 1 to 64, each claiming the result 424242.
/// Returns once the victim has handled them all: a request sent after
/// them (malformed, so no function runs) has been answered, and the
/// victim handles a connection's frames in order.
async fn forge_replies(victim: std::net::SocketAddr, name: &str, rank: u32) {
    let mut conn = PeerConnection::connect(victim, &Endpoint::new(name, rank))
        .await
        .unwrap();
    let forged = payload::encode(&424242u64).unwrap().payload;
    for id in 1..=64 {
        let reply = OutgoingMessage {
            kind: MessageKind::RESPONSE,
            flags: Flags::REPLY,
            request_id: id,
            payload: forged.clone(),
            tensors: Vec::new(),
        };
        conn.writer.write(&reply).await.unwrap();
    }
    let probe = OutgoingMessage {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id: 1 << 40,
        payload: Vec::new(),
        tensors: Vec::new(),
    };
    conn.writer.write(&probe).await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(30), conn.reader.read())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(answer.header.request_id, 1 << 40);
    assert_eq!(answer.header.kind, MessageKind::ERROR);
}

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
