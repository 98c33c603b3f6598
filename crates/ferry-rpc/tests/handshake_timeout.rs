//! A worker gives an incoming connection `handshake_timeout` to send its
//! first message, whatever `init_timeout` says, with or without a secret:
//! a connection that stays silent is closed (it held a socket for the
//! whole `init_timeout`, 120 s by default, before). A peer that does
//! speak gets through the wait to the handshake. One worker in this
//! process on 127.0.0.1, its rendezvous in a memory store.
#![allow(clippy::unwrap_used)]

use std::io;
use std::sync::Arc;
use std::time::Duration;

use ferry_rpc::store::{MemoryStore, Store};
use ferry_rpc::{Agent, RpcOptions};
use ferry_transport::auth::Secret;
use ferry_transport::{Endpoint, PeerConnection};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Far longer than the handshake timeout: a connection dropped before a
/// test's guard was dropped by the handshake timeout, not by this.
const INIT_TIMEOUT: Duration = Duration::from_secs(3600);
/// Short, so the tests are fast (nothing here depends on its length).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_millis(200);
/// Only against a hang (a broken bound): never reached when it works.
const GUARD: Duration = Duration::from_secs(120);

fn worker(secret: Option<Secret>) -> Agent {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    let mut options = RpcOptions::new("worker0", 0, 1, "127.0.0.1:0".parse().unwrap())
        .store(store)
        .init_timeout(INIT_TIMEOUT)
        .handshake_timeout(HANDSHAKE_TIMEOUT);
    if let Some(secret) = secret {
        options = options.auth_secret(secret);
    }
    Agent::start(options).unwrap()
}

/// Connects to `agent` and sends nothing: the worker must close the
/// connection (end of stream; a reset counts too).
fn a_silent_connection_is_closed(agent: &Agent) {
    let addr = agent.worker_addr(0u32).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut got = Vec::new();
        let end = tokio::time::timeout(GUARD, silent.read_to_end(&mut got))
            .await
            .expect("the worker held a silent connection open");
        match end {
            Ok(_) => assert!(got.is_empty(), "the worker sent {got:?}"),
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}"),
        }
    });
}

#[test]
fn a_silent_connection_is_closed_without_a_secret() {
    let agent = worker(None);
    a_silent_connection_is_closed(&agent);
    agent.shutdown_now();
}

#[test]
fn a_silent_connection_is_closed_with_a_secret() {
    let secret = Secret::new(b"the group's secret, 16 bytes or more".to_vec()).unwrap();
    let agent = worker(Some(secret));
    a_silent_connection_is_closed(&agent);
    agent.shutdown_now();
}

/// A peer that sends its handshake gets the worker's: the wait for the
/// first message lets it through (channel set-up included, here `shm` and
/// `cma` on one host). The worker then drops it, a worker outside its group.
#[test]
fn a_peer_that_speaks_gets_through_to_the_handshake() {
    let agent = worker(None);
    let addr = agent.worker_addr(0u32).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let connected = tokio::time::timeout(
            GUARD,
            PeerConnection::connect(addr, &Endpoint::new("stranger", 7)),
        )
        .await
        .unwrap();
        let mut connection = connected.unwrap();
        assert_eq!(connection.peer.worker_name, "worker0");
        // Outside the group: dropped after the handshake.
        let end = tokio::time::timeout(GUARD, connection.reader.read())
            .await
            .unwrap();
        assert!(matches!(end, Ok(None) | Err(_)));
    });
    agent.shutdown_now();
}
