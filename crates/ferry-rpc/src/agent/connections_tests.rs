//! Tests of the agent's connections against a peer this test plays itself
//! (it speaks the handshake, then closes every connection it accepts).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use ferry_transport::{Endpoint, PeerConnection};
use tokio::net::TcpListener;

use crate::store::{MemoryStore, PrefixStore, Store};
use crate::{Agent, RpcError, RpcOptions};

/// How many times the peer closes the connection.
const RECONNECTS: usize = 1000;
/// Most tasks the agent may hold: its accept loop and timer, the
/// connection being served, one or two that ended but are not reaped yet.
const MAX_TASKS: usize = 6;

/// Worker 0 calls worker 1 a thousand times; worker 1 (played by this
/// test over 127.0.0.1) reads each request and closes the connection
/// without answering. Every call fails with `PeerUnreachable` and the
/// next one connects again; the agent's task set stays small (it held a
/// task per connection ever made before finished ones were reaped).
#[test]
fn reconnecting_a_thousand_times_keeps_the_task_count_bounded() {
    let peer_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = peer_rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
    let peer_addr = listener.local_addr().unwrap();

    // Worker 1's rendezvous, as its agent would have written it.
    let base: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    let ns = PrefixStore::new(crate::rendezvous::NAMESPACE, base.clone());
    peer_rt.block_on(async {
        let record = crate::rendezvous::record("worker1", peer_addr).unwrap();
        ns.set("worker/1", record).await.unwrap();
        ns.set("ready/1", Vec::new()).await.unwrap();
    });

    let closes = peer_rt.spawn(async move {
        let mut endpoint = Endpoint::new("worker1", 1);
        endpoint.transports = vec![ferry_transport::channel::transport_offer("tcp")
            .unwrap()
            .unwrap()];
        for _ in 0..RECONNECTS {
            let (stream, _) = listener.accept().await.unwrap();
            let mut connection = PeerConnection::accept(stream, &endpoint).await.unwrap();
            let request = connection.reader.read().await.unwrap();
            assert!(
                request.is_some(),
                "the connection closed before its request"
            );
            // Dropping the connection closes it, the request unanswered.
        }
    });

    let options = RpcOptions::new("worker0", 0, 2, "127.0.0.1:0".parse().unwrap())
        .store(base)
        .init_timeout(Duration::from_secs(60));
    let agent = Agent::start(options).unwrap();
    let mut peak = 0;
    for i in 0..RECONNECTS {
        let r = crate::by_name("f")
            .agent(&agent)
            .timeout(Duration::from_secs(60))
            .rpc_sync::<(), _>(1u32, ());
        assert!(
            matches!(r, Err(RpcError::PeerUnreachable { .. })),
            "call {i}: {r:?}"
        );
        peak = peak.max(agent.inner.task_count());
    }
    peer_rt.block_on(closes).unwrap();
    assert!(
        peak <= MAX_TASKS,
        "the agent held up to {peak} tasks over {RECONNECTS} reconnects"
    );
    agent.shutdown_now();
}
