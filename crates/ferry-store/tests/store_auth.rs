//! A store server holding the group's secret: its clients prove they
//! hold it before any request is read; a client with another secret, with
//! none, torch's c10d protocol or a replayed handshake reads and writes
//! nothing, and the server goes on serving the group.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use ferry_store::c10d::C10dStore;
use ferry_store::{Store, StoreError, StoreLimits, TcpStore, TcpStoreServer};
use ferry_transport::auth::{self, Secret, AUTH_TIMEOUT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const T: Duration = Duration::from_secs(10);

/// c10d's first query: `VALIDATE` (query type 0) and its magic, 5 bytes,
/// fewer than a handshake header.
const VALIDATE: [u8; 5] = [0x00, 0xCE, 0xF7, 0x85, 0x3C];

fn secret(s: &str) -> Secret {
    Secret::new(format!("secret-of-the-group-{s}").into_bytes()).unwrap()
}

async fn server() -> TcpStoreServer {
    TcpStoreServer::bind_authenticated(
        "127.0.0.1:0".parse().unwrap(),
        StoreLimits::default(),
        Some(secret("a")),
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn a_member_with_the_secret_reads_and_writes() {
    let server = server().await;
    let member = TcpStore::connect_authenticated(server.local_addr(), T, Some(secret("a")))
        .await
        .unwrap();
    member.set("k", b"v".to_vec()).await.unwrap();
    assert_eq!(member.get("k").await.unwrap(), b"v");
}

#[tokio::test]
async fn outsiders_read_and_write_nothing_and_the_member_is_served_meanwhile() {
    let server = server().await;
    let addr = server.local_addr();
    let member = TcpStore::connect_authenticated(addr, T, Some(secret("a")))
        .await
        .unwrap();
    member.set("secret/key", b"v".to_vec()).await.unwrap();

    // Another secret: refused during the handshake.
    let wrong = TcpStore::connect_authenticated(addr, T, Some(secret("b"))).await;
    assert!(matches!(wrong, Err(StoreError::Auth { .. })), "{wrong:?}");

    // No secret: the first request is not a handshake; the connection
    // closes and nothing is stored or read.
    let none = TcpStore::connect(addr, T).await.unwrap();
    assert!(none.set("planted", b"x".to_vec()).await.is_err());
    assert!(none.get("secret/key").await.is_err());

    // torch's c10d protocol knows no secret.
    let c10d = C10dStore::connect(addr, Duration::from_secs(2)).await;
    if let Ok(c) = c10d {
        assert!(c.set("planted", b"x".to_vec()).await.is_err());
    }

    // A replayed handshake: an outsider sends the bytes a member sent in
    // an earlier handshake (captured from a duplex pipe, as on the wire).
    let s = secret("a");
    let (mut a, mut b) = tokio::io::duplex(1024);
    let mut recorder = Recorder {
        inner: &mut a,
        seen: Vec::new(),
    };
    let (x, y) = tokio::join!(
        auth::connect(&mut b, s.key(), T),
        auth::accept(&mut recorder, s.key(), T)
    );
    // Both ends authenticated (session keys have no `==`).
    x.unwrap();
    y.unwrap();
    let replay = recorder.seen;
    assert_eq!(replay.len(), 6 + 32 + 6 + 32, "hello and proof captured");
    let mut raw = TcpStream::connect(addr).await.unwrap();
    raw.write_all(&replay).await.unwrap();
    let mut rest = Vec::new();
    // The server sends its challenge (over its fresh nonce, which the
    // replayed proof does not match), then `Refused`, then closes.
    tokio::time::timeout(T, raw.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rest.len(), 6 + 64 + 6);
    assert_eq!(
        &rest[rest.len() - 6..],
        &auth::AuthMessage::Refused.encode()[..]
    );

    // Nothing the outsiders tried is in the store; the member goes on.
    assert!(!member.check(&["planted".into()]).await.unwrap());
    member.set("after", b"w".to_vec()).await.unwrap();
    assert_eq!(member.get("after").await.unwrap(), b"w");
}

/// Under paused time the runtime jumps to the next timer whenever it
/// waits: had the store waited for the rest of a handshake header, the
/// client's timeout (half the handshake's) would fire first.
#[tokio::test(start_paused = true)]
async fn c10d_validate_is_refused_before_the_handshake_timeout() {
    let server = server().await;
    let mut c10d = TcpStream::connect(server.local_addr()).await.unwrap();
    c10d.write_all(&VALIDATE).await.unwrap();
    tokio::time::timeout(AUTH_TIMEOUT / 2, closed_by_server(&mut c10d))
        .await
        .expect("the store waited for more than c10d's VALIDATE");
}

/// Reads until the server closed the connection: an end of stream, or a
/// reset (the server closes without reading what the client sent).
async fn closed_by_server(stream: &mut TcpStream) {
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("{e}"),
    }
}

/// A stream that records every byte read through it.
struct Recorder<'a, S> {
    inner: &'a mut S,
    seen: Vec<u8>,
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Recorder<'_, S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let r = std::pin::Pin::new(&mut *this.inner).poll_read(cx, buf);
        this.seen.extend_from_slice(&buf.filled()[before..]);
        r
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Recorder<'_, S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut *self.inner).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut *self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut *self.inner).poll_shutdown(cx)
    }
}
