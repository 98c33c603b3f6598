//! An endpoint's keepalive settings reach every TCP socket of its
//! connections on 127.0.0.1: the connection's own and its `mpt` lanes, on
//! both sides. (What they do against a real partition is the agent's
//! test `a_partition_fails_calls_and_shutdown_within_bounds`.)
#![allow(clippy::unwrap_used)]

use std::os::fd::{BorrowedFd, RawFd};
use std::time::Duration;

use ferry_transport::{channel, Endpoint, Keepalive, PeerConnection};
use rustix::net::sockopt;
use tokio::net::TcpListener;

fn endpoint(name: &str, rank: u32, keepalive: Keepalive) -> Endpoint {
    let mut e = Endpoint::new(name, rank);
    e.channels = channel::parse_channels("mpt,inline").unwrap();
    e.transports = channel::parse_transports("tcp").unwrap();
    e.config.mpt_lanes = 2;
    e.config.small_tensor_bytes = 0;
    e.keepalive = keepalive;
    e
}

/// The settings of every connected TCP socket this process holds.
fn connected_tcp_sockets() -> Vec<(bool, Duration, Duration, u32, u32)> {
    let fds: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    fds.into_iter()
        .filter_map(|raw| {
            // SAFETY: the descriptor is only queried, and this test's own
            // sockets stay open until it ends; one closed meanwhile (the
            // directory's) fails the queries and is skipped.
            let fd = unsafe { BorrowedFd::borrow_raw(raw) };
            rustix::net::getpeername(fd).ok()??;
            let user_timeout = sockopt::tcp_user_timeout(fd).ok()?;
            Some((
                sockopt::socket_keepalive(fd).ok()?,
                sockopt::tcp_keepidle(fd).ok()?,
                sockopt::tcp_keepintvl(fd).ok()?,
                sockopt::tcp_keepcnt(fd).ok()?,
                user_timeout,
            ))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_reaches_the_connection_and_its_lanes() {
    let k = Keepalive {
        enabled: true,
        idle: Duration::from_secs(7),
        interval: Duration::from_secs(3),
        retries: 5,
        user_timeout: Duration::from_millis(11_000),
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let b = endpoint("b", 1, k);
    let server = tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        PeerConnection::accept(s, &b).await.unwrap()
    });
    let step = Duration::from_secs(20);
    let client = tokio::time::timeout(step, PeerConnection::connect(addr, &endpoint("a", 0, k)))
        .await
        .unwrap()
        .unwrap();
    let server = tokio::time::timeout(step, server).await.unwrap().unwrap();
    assert!(client
        .outgoing_channels()
        .iter()
        .any(|c| c.channel == channel::MPT));
    let sockets = connected_tcp_sockets();
    // Both ends of the connection and of 2 lanes each way.
    assert_eq!(sockets.len(), 2 * (1 + 2 * 2), "{sockets:?}");
    for s in &sockets {
        assert_eq!(
            *s,
            (
                true,
                Duration::from_secs(7),
                Duration::from_secs(3),
                5,
                11_000
            )
        );
    }
    drop((client, server));
}
