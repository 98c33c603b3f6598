//! A relay between a member and a store server that both hold the
//! group's secret (an attacker on the path) passes the authentication
//! handshake through, then tries to write: a request of its own, or the
//! member's with one byte flipped. The server refuses both (the records
//! after the handshake are sealed with the session's keys), writes
//! nothing, and serves the member on a direct connection.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

use ferry_store::{Store, StoreLimits, TcpStore, TcpStoreServer};
use ferry_transport::auth::{Protection, Secret};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const T: Duration = Duration::from_secs(10);

fn secret() -> Secret {
    Secret::new(b"secret-of-the-group-relayed".to_vec()).unwrap()
}

/// Copies exactly `n` bytes from `from` to `to`.
async fn pass(from: &mut TcpStream, to: &mut TcpStream, n: usize) {
    let mut buf = vec![0u8; n];
    from.read_exact(&mut buf).await.unwrap();
    to.write_all(&buf).await.unwrap();
}

/// Accepts a member's connection and opens one to the server; passes the
/// four authentication messages through.
async fn relay_handshake(relay: &TcpListener, server: SocketAddr) -> (TcpStream, TcpStream) {
    let (mut c, _) = relay.accept().await.unwrap();
    let mut s = TcpStream::connect(server).await.unwrap();
    pass(&mut c, &mut s, 38).await;
    pass(&mut s, &mut c, 70).await;
    pass(&mut c, &mut s, 38).await;
    pass(&mut s, &mut c, 6).await;
    (c, s)
}

/// The bytes a client without a secret sends for `set(key, value)`.
async fn plain_set(key: &str) -> Vec<u8> {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let key = key.to_owned();
    let client = tokio::spawn(async move {
        let store = TcpStore::connect(addr, T).await.unwrap();
        let _ = store.set(&key, b"planted".to_vec()).await;
    });
    let (mut s, _) = listener.accept().await.unwrap();
    let mut prefix = [0u8; ferry_store::format::LENGTH_PREFIX_BYTES];
    s.read_exact(&mut prefix).await.unwrap();
    let mut body = vec![0u8; ferry_store::format::body_len(prefix).unwrap()];
    s.read_exact(&mut body).await.unwrap();
    client.abort();
    [&prefix[..], &body].concat()
}

#[tokio::test]
async fn a_relay_can_neither_write_its_own_request_nor_alter_the_members() {
    let server = TcpStoreServer::bind_authenticated(
        "127.0.0.1:0".parse().unwrap(),
        StoreLimits::default(),
        Some(secret()),
    )
    .await
    .unwrap();
    let relay = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let via = relay.local_addr().unwrap();

    // 1: the relay speaks for the member after the handshake.
    let member = tokio::spawn(TcpStore::connect_authenticated(via, T, Some(secret())));
    let (_c, mut s) = relay_handshake(&relay, server.local_addr()).await;
    let _member = member.await.unwrap().unwrap();
    s.write_all(&plain_set("planted/injected").await)
        .await
        .unwrap();
    let mut answer = Vec::new();
    // Bounded: a server that took the request would answer and wait.
    let n = tokio::time::timeout(T, s.read_to_end(&mut answer))
        .await
        .expect("the server neither answered nor closed")
        .unwrap_or(0);
    assert_eq!(n, 0, "the server answered the relay's request");

    // 2: the relay flips a byte of the member's request.
    let member = tokio::spawn(TcpStore::connect_authenticated(via, T, Some(secret())));
    let (c, s) = relay_handshake(&relay, server.local_addr()).await;
    let member = member.await.unwrap().unwrap();
    let (mut cr, mut cw) = c.into_split();
    let (mut sr, mut sw) = s.into_split();
    let flipping = tokio::spawn(async move {
        let mut len = [0u8; 4];
        cr.read_exact(&mut len).await.unwrap();
        let mut record = vec![0u8; u32::from_be_bytes(len) as usize + Protection::Mac.tag_len()];
        cr.read_exact(&mut record).await.unwrap();
        record[3] ^= 0x20;
        sw.write_all(&len).await.unwrap();
        sw.write_all(&record).await.unwrap();
        // The server closes: so does the relay.
        let _ = tokio::io::copy(&mut sr, &mut cw).await;
    });
    assert!(member.set("planted/altered", b"x".to_vec()).await.is_err());
    tokio::time::timeout(T, flipping).await.unwrap().unwrap();

    // Nothing was written; the server serves a direct member on.
    let direct = TcpStore::connect_authenticated(server.local_addr(), T, Some(secret()))
        .await
        .unwrap();
    for key in ["planted/injected", "planted/altered"] {
        assert!(
            !direct.check(&[key.into()]).await.unwrap(),
            "{key} was written"
        );
    }
    direct.set("served", b"yes".to_vec()).await.unwrap();
    assert_eq!(direct.get("served").await.unwrap(), b"yes");
}
