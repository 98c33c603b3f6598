//! How much the shared-memory set-up socket of an authenticated connection
//! says about the connections it closes: a flood of them is logged in a
//! few lines whose `refusals=` count them all, not one line each. The test
//! plays the connecting side with a `SetupMachine` over real TCP against
//! `PeerConnection::accept`, so that it learns the socket's name and the
//! session key, and floods the socket before it connects as the peer.
//! (The only test of this binary: see `refusal_log`.)
#![allow(clippy::unwrap_used)]

mod refusal_log;

use std::io;
use std::time::{Duration, Instant};

use ferry_transport::accept::REFUSAL_WARN_EVERY;
use ferry_transport::auth::{self, Key, Secret, AUTH_TIMEOUT};
use ferry_transport::setup_machine::{Action, Agreement, Output, Role, SetupMachine};
use ferry_transport::{channel, Endpoint, PeerConnection};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};

const REFUSED: &str = "refused a shared-memory set-up connection that failed authentication";
const OVERFLOWED: &str = "closed a shared-memory set-up connection";

/// The set-up socket's bound on connections authenticating at once
/// (`MAX_AUTHENTICATING` in `connection/setup.rs`).
const AUTHENTICATING_AT_ONCE: usize = 16;

fn endpoint(name: &str, rank: u32) -> Endpoint {
    let mut e = Endpoint::new(name, rank);
    e.channels = channel::parse_channels("shm").unwrap();
    e.transports = channel::parse_transports("shm").unwrap();
    e.auth = Some(Secret::new(b"secret-of-the-group-setup-refusals".to_vec()).unwrap());
    e
}

/// Runs the connecting side's set-up over `stream` up to the set-up of
/// shared memory: what was agreed, and the session key that authenticates
/// the set-up socket.
async fn handshake_until_setup(stream: &mut TcpStream, local: &Endpoint) -> (Agreement, Key) {
    let mut machine = SetupMachine::new(local, Role::Connect, [3; 32], "server", Instant::now());
    let mut buf = vec![0u8; 64 << 10];
    loop {
        while let Some(output) = machine.poll_output() {
            match output {
                Output::Transmit(bytes) => stream.write_all(&bytes).await.unwrap(),
                Output::Action(Action::RunSetup { agreement, session }) => {
                    return (*agreement, session.expect("a session key"));
                }
                Output::Action(other) => panic!("unexpected action {other:?}"),
                Output::Done(done) => panic!("the set-up ended first: {done:?}"),
            }
        }
        assert!(machine.wants_read(), "the machine waits for nothing");
        let n = stream.read(&mut buf).await.unwrap();
        match n {
            0 => machine.handle_eof(Instant::now()),
            n => machine.handle_bytes(Instant::now(), &buf[..n]),
        }
    }
}

fn connect_abstract(name: &str) -> UnixStream {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let stream = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
    stream.set_nonblocking(true).unwrap();
    UnixStream::from_std(stream).unwrap()
}

/// Reads until the set-up socket closed the connection: an end of stream,
/// or a reset.
async fn closed_by_listener(stream: &mut UnixStream) {
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("{e}"),
    }
}

/// Before the peer connects to the set-up socket: 200 connections with
/// another key, one after the other, each closed before the next comes;
/// then 16 that say nothing (as many as may authenticate at once) and 50
/// more, closed unread as they come; then the 16 hang up. Each kind is
/// warned about once at once, the others summarized (here when the socket
/// has the peer's connection, unless 10 s passed), in at most 3 lines
/// whose counts add up to every connection closed.
#[tokio::test]
async fn a_flood_of_set_up_connections_is_logged_in_a_few_lines_counting_them_all() {
    const WRONG_KEY: u64 = 200;
    const OVERFLOW: u64 = 50;
    let (log, _default) = refusal_log::capture();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = endpoint("server", 0);
    let accepting = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        PeerConnection::accept(stream, &server).await
    });
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let (agreement, session) = handshake_until_setup(&mut tcp, &endpoint("client", 1)).await;
    let socket = agreement
        .peer
        .properties
        .iter()
        .find(|(k, _)| k == "shm.socket")
        .map(|(_, v)| v.clone())
        .expect("the accepting side names its set-up socket");

    let wrong = Secret::new(b"a guess at the connection's session key".to_vec()).unwrap();
    for _ in 0..WRONG_KEY {
        let mut outsider = connect_abstract(&socket);
        let proved = auth::connect(&mut outsider, wrong.key(), AUTH_TIMEOUT).await;
        assert!(proved.is_err(), "a connection with another key got in");
        // Once the socket closes it, the refusal is counted.
        let _ = outsider.shutdown().await;
        closed_by_listener(&mut outsider).await;
    }
    let mut silent: Vec<UnixStream> = (0..AUTHENTICATING_AT_ONCE)
        .map(|_| connect_abstract(&socket))
        .collect();
    for _ in 0..OVERFLOW {
        let mut extra = connect_abstract(&socket);
        closed_by_listener(&mut extra).await;
    }
    for s in &mut silent {
        let _ = s.shutdown().await;
        closed_by_listener(s).await;
    }
    // The peer: the socket has its connection, and the set-up's warnings
    // are summarized as it stops accepting.
    let mut peer = connect_abstract(&socket);
    auth::connect(&mut peer, &session, AUTH_TIMEOUT)
        .await
        .unwrap();
    // No shared memory follows: the accepting side's set-up fails.
    drop(peer);
    let accepted = tokio::time::timeout(Duration::from_secs(60), accepting)
        .await
        .expect("the accepting side ended")
        .unwrap();
    assert!(accepted.is_err(), "accepted without shared memory");

    let text = log.text();
    let refused = log.lines_with(REFUSED);
    let overflowed = log.lines_with(OVERFLOWED);
    for (lines, count) in [
        (&refused, WRONG_KEY + AUTHENTICATING_AT_ONCE as u64),
        (&overflowed, OVERFLOW),
    ] {
        assert!(
            (1..=3).contains(&lines.len()),
            "{} lines for {count} refusals (one per {REFUSAL_WARN_EVERY:?} at most):\n{text}",
            lines.len()
        );
        assert_eq!(refusal_log::total(lines), count, "{text}");
        assert_eq!(refusal_log::refusals(&lines[0]), 1, "{text}");
        assert!(lines[0].contains("peer=pid "), "{text}");
    }
    assert!(
        overflowed[0].contains("16 are authenticating already"),
        "{text}"
    );
    // Nothing else was logged per connection (the refused set-up is the
    // caller's to report).
    assert_eq!(
        log.lines().len(),
        refused.len() + overflowed.len(),
        "{text}"
    );
}
