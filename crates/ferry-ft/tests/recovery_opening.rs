//! A checkpoint server holding the group's secret refuses a connection
//! whose first bytes cannot open the authentication handshake as soon as
//! they are in: c10d's 5-byte `VALIDATE` or one byte of garbage, both
//! shorter than the handshake's 6-byte header, which the handshake would
//! wait for until `AUTH_TIMEOUT` (10 s; the server's `io_timeout` is an
//! hour here).
//!
//! "At once" is measured against the server's own clock, not a
//! wall-clock threshold: a connection that sends nothing, opened first,
//! is closed only when its wait for a handshake times out; the refused
//! connection must be closed while that one is still held.
#![allow(clippy::unwrap_used)]

use std::io;
use std::time::Duration;

use ferry_ft::recovery::{
    fetch_checkpoint, CheckpointServer, CheckpointServerOptions, CheckpointState, FetchOptions,
};
use ferry_transport::auth::Secret;
use ferry_transport::RawTensor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// c10d's first query: `VALIDATE` (query type 0) and its magic.
const VALIDATE: [u8; 5] = [0x00, 0xCE, 0xF7, 0x85, 0x3C];

fn group_secret() -> Secret {
    Secret::new(b"the replica groups' shared secret".to_vec()).unwrap()
}

fn state() -> CheckpointState {
    let w: Vec<f32> = (0..1_000).map(|i| i as f32).collect();
    CheckpointState::new(3).with_tensor("w", RawTensor::from_slice(&w, &[1_000]).unwrap())
}

/// Reads until the server closed the connection (an end of stream, or a
/// reset: it closes without reading what was sent); what it sent first.
async fn closed_by_server(stream: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    match stream.read_to_end(&mut got).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("{e}"),
    }
    got
}

/// Sends `first` on a fresh connection to `server` and waits until the
/// server closes it, while a connection opened before that sends nothing
/// is still held open by the server (its handshake timeout has not run
/// out): the refusal came at once, not after a timeout.
async fn refused_while_a_silent_connection_waits(server: &CheckpointServer, first: &[u8]) {
    // Opened first, the silent connection's wait for a handshake runs
    // out (10 s) long after a refusal at once.
    let mut silent = TcpStream::connect(server.local_addr()).await.unwrap();
    let mut opening = TcpStream::connect(server.local_addr()).await.unwrap();
    opening.write_all(first).await.unwrap();
    let sent = tokio::select! {
        biased;
        _ = closed_by_server(&mut silent) => panic!(
            "the silent connection's handshake timed out before {first:02x?} was refused: \
             the server waited for a timeout"
        ),
        sent = closed_by_server(&mut opening) => sent,
    };
    assert!(
        sent.is_empty(),
        "the server answered {first:02x?}: {sent:02x?}"
    );
}

#[tokio::test]
async fn bytes_that_cannot_open_the_handshake_are_refused_at_once() {
    let server = CheckpointServer::bind(
        "127.0.0.1:0",
        CheckpointServerOptions::new("source")
            .with_auth_secret(group_secret())
            .with_io_timeout(Duration::from_secs(3600)),
    )
    .await
    .unwrap();
    server.allow(state()).unwrap();
    refused_while_a_silent_connection_waits(&server, &VALIDATE).await;
    refused_while_a_silent_connection_waits(&server, b"G").await;
    // A member is served as before.
    let options = FetchOptions::new("member")
        .with_wait(Duration::from_secs(60))
        .with_auth_secret(group_secret());
    let got = fetch_checkpoint(&server.address(), 3, &options)
        .await
        .unwrap();
    assert_eq!(got, state());
    assert_eq!(server.stats().manifests, 1);
    server.shutdown().await;
}
