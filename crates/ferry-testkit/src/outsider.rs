//! Support for tests of a group that holds a shared secret against an
//! outsider process (feature `outsider`): the group's secret and a wrong
//! guess at it, the side store the test's processes meet at (plain: it is
//! the test's, not the group's), a member's handshake as an eavesdropper
//! captures it, and its replay against a listener.

use std::net::SocketAddr;
use std::time::Duration;

use ferry_store::{TcpStore, TcpStoreServer};
use ferry_transport::auth::{self, AuthMessage, Secret};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long the helpers wait for a store key, a connection or a reply.
pub const WAIT: Duration = Duration::from_secs(30);

/// The environment variable holding the side store's address.
pub const SIDE_STORE_ENV: &str = "FERRY_TEST_SIDE_STORE";

/// The group's shared secret.
pub fn group_secret() -> Secret {
    Secret::new(b"the group's own secret, 32 bytes".to_vec()).expect("a valid secret")
}

/// An outsider's guess at the group's secret (wrong).
pub fn wrong_secret() -> Secret {
    Secret::new(b"a guess at the group's secret!!!".to_vec()).expect("a valid secret")
}

/// In the parent: starts the side store on 127.0.0.1 and returns it (it
/// serves while kept) with the `VAR=address` argument that puts its
/// address in each rank's environment (for `env`, as a rank's wrapper).
/// In a rank (`parent` false): `None`.
pub fn host_side_store(
    rt: &tokio::runtime::Runtime,
    parent: bool,
) -> Option<(TcpStoreServer, &'static str)> {
    if !parent {
        return None;
    }
    let server = rt
        .block_on(TcpStoreServer::bind(([127, 0, 0, 1], 0).into()))
        .expect("binding the side store");
    // One string per side store (a few bytes per test), so that tests
    // running side by side in one binary each reach their own.
    let env: &'static str =
        Box::leak(format!("{SIDE_STORE_ENV}={}", server.local_addr()).into_boxed_str());
    Some((server, env))
}

/// In a rank: a client of the side store named by [`SIDE_STORE_ENV`].
///
/// # Panics
/// If the variable is missing or the store cannot be reached.
pub fn side_store(rt: &tokio::runtime::Runtime) -> TcpStore {
    let addr: SocketAddr = std::env::var(SIDE_STORE_ENV)
        .expect("the side store's address in the environment")
        .parse()
        .expect("a socket address");
    rt.block_on(TcpStore::connect(addr, WAIT))
        .expect("connecting to the side store")
}

/// The bytes a member with the group's secret writes during a handshake
/// (its hello and its proof), as a listener recording what it reads (a
/// sniffer) sees them.
pub fn captured_handshake() -> Vec<u8> {
    let rt = tokio::runtime::Runtime::new().expect("a runtime");
    rt.block_on(async {
        let (mut listener_side, mut member_side) = tokio::io::duplex(1024);
        let s = group_secret();
        let listener = async {
            let mut seen = Vec::new();
            let mut h = auth::Handshake::new(auth::Role::Accept, s.key().clone(), [7; 32]);
            for _ in 0..2 {
                let mut buf = [0u8; 38];
                listener_side
                    .read_exact(&mut buf)
                    .await
                    .expect("a member's message");
                seen.extend_from_slice(&buf);
                let (m, _) = AuthMessage::decode(&buf)
                    .expect("a valid message")
                    .expect("a whole message");
                let reply = h.receive(m).send.expect("a reply");
                listener_side
                    .write_all(&reply.encode())
                    .await
                    .expect("writing the reply");
            }
            seen
        };
        let (seen, key) = tokio::join!(listener, auth::connect(&mut member_side, s.key(), WAIT));
        key.expect("the member's handshake succeeds");
        seen
    })
}

/// Replays `captured` to `addr`: asserts that the listener answers with a
/// challenge over its own fresh nonce, refuses the replayed proof and
/// closes.
pub async fn replay(addr: SocketAddr, captured: &[u8]) {
    let mut raw = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connecting for the replay");
    raw.write_all(captured).await.expect("writing the replay");
    let mut back = Vec::new();
    tokio::time::timeout(WAIT, raw.read_to_end(&mut back))
        .await
        .expect("the listener closes in time")
        .expect("reading the listener's answer");
    assert_eq!(back.len(), 6 + 64 + 6, "{back:?}");
    assert_eq!(&back[back.len() - 6..], &AuthMessage::Refused.encode()[..]);
}
