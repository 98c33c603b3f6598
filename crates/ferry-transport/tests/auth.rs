//! Connections between endpoints holding a secret: both ends prove it
//! before a frame is read, the shared-memory socket and `mpt` lanes are
//! authenticated with the connection's session key, and a peer with
//! another secret, or none, is refused.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use ferry_transport::auth::{self, Secret};
use ferry_transport::mpt::{connect_lanes_authenticated, LaneListener};
use ferry_transport::{Endpoint, PeerConnection, RawTensor, TransportError};
use ferry_wire::OutgoingTensor;
use tokio::net::TcpListener;

use common::{decode, message, pair};

fn secret(s: &str) -> Secret {
    Secret::new(format!("secret-of-the-group-{s}").into_bytes()).unwrap()
}

fn endpoint(name: &str, rank: u32, channels: &str, transports: &str, s: Option<&str>) -> Endpoint {
    let mut e = Endpoint::new(name, rank);
    e.channels = ferry_transport::channel::parse_channels(channels).unwrap();
    e.transports = ferry_transport::channel::parse_transports(transports).unwrap();
    e.config.small_tensor_bytes = 16;
    e.config.mpt_lanes = 3;
    e.auth = s.map(secret);
    e
}

async fn round_trip(server: Endpoint, client: Endpoint) {
    let (mut server, mut client) = pair(server, client).await;
    let t =
        RawTensor::from_slice(&(0..4096).map(|i| i as f32).collect::<Vec<_>>(), &[4096]).unwrap();
    client.writer.write(&message(1, &t)).await.unwrap();
    let got: RawTensor = decode(server.reader.read().await.unwrap().unwrap());
    assert_eq!(got.bytes(), t.bytes());
}

#[tokio::test]
async fn the_same_secret_connects_over_shm_with_an_authenticated_setup_socket() {
    let s = Some("a");
    round_trip(
        endpoint("server", 0, "shm", "shm", s),
        endpoint("client", 1, "shm", "shm", s),
    )
    .await;
}

#[tokio::test]
async fn the_same_secret_connects_over_authenticated_mpt_lanes() {
    let s = Some("a");
    round_trip(
        endpoint("server", 0, "mpt", "tcp", s),
        endpoint("client", 1, "mpt", "tcp", s),
    )
    .await;
}

/// Connects `client` to an accepting `server`; returns both results.
async fn attempt(
    server: Endpoint,
    client: Endpoint,
) -> (
    Result<PeerConnection, TransportError>,
    Result<PeerConnection, TransportError>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accept = tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        PeerConnection::accept(s, &server).await
    });
    let c = tokio::time::timeout(
        Duration::from_secs(30),
        PeerConnection::connect(addr, &client),
    )
    .await
    .unwrap();
    (accept.await.unwrap(), c)
}

fn assert_auth_failed(r: &Result<PeerConnection, TransportError>) {
    match r {
        Err(TransportError::Handshake { reason, .. }) => {
            assert!(reason.contains("authentication failed"), "{reason}")
        }
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("connected"),
    }
}

#[tokio::test]
async fn another_secret_is_refused_on_both_ends() {
    let (server, client) = attempt(
        endpoint("server", 0, "inline", "tcp", Some("a")),
        endpoint("client", 1, "inline", "tcp", Some("b")),
    )
    .await;
    assert_auth_failed(&server);
    assert_auth_failed(&client);
}

#[tokio::test]
async fn a_peer_with_no_secret_is_refused_before_its_handshake_is_read() {
    let (server, client) = attempt(
        endpoint("server", 0, "inline", "tcp", Some("a")),
        endpoint("client", 1, "inline", "tcp", None),
    )
    .await;
    let Err(TransportError::Handshake { reason, .. }) = &server else {
        panic!("accepted a peer with no secret");
    };
    assert!(
        reason.contains("not an authentication handshake"),
        "{reason}"
    );
    assert!(client.is_err());
}

#[tokio::test]
async fn a_lane_from_an_outsider_is_dropped_and_the_peers_lanes_still_connect() {
    let listener = LaneListener::bind("127.0.0.1".parse().unwrap())
        .await
        .unwrap();
    let addr = listener.local_addr();
    let session = secret("session");
    let key = session.key().clone();
    let accepting = async {
        listener
            .accept_authenticated(5, 2, Duration::from_secs(30), Some(&key))
            .await
    };
    let connecting = async {
        // The outsider comes first, knowing the nonce but not the key.
        let outsider = connect_lanes_authenticated(
            addr,
            5,
            2,
            Duration::from_secs(30),
            Some(secret("outsider").key().clone()),
        )
        .await;
        assert!(outsider.is_err());
        connect_lanes_authenticated(addr, 5, 2, Duration::from_secs(30), Some(key.clone())).await
    };
    let (accepted, connected) = tokio::join!(accepting, connecting);
    assert_eq!(accepted.unwrap().len(), 2);
    assert_eq!(connected.unwrap().len(), 2);
}

#[tokio::test]
async fn the_handshake_shell_reads_nothing_past_the_handshake() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = secret("a");
    let (mut a, mut b) = tokio::io::duplex(1024);
    let t = Duration::from_secs(5);
    let (x, y) = tokio::join!(auth::accept(&mut a, s.key(), t), async {
        let k = auth::connect(&mut b, s.key(), t).await;
        b.write_all(b"after").await.unwrap();
        k
    });
    let mut rest = [0u8; 5];
    a.read_exact(&mut rest).await.unwrap();
    assert_eq!(&rest, b"after");
    // Both ends derived the same session key (keys have no `==`): a
    // handshake keyed by one end's and the other's succeeds.
    let (x, y) = (x.unwrap().key(), y.unwrap().key());
    let (mut c, mut d) = tokio::io::duplex(1024);
    let (p, q) = tokio::join!(auth::accept(&mut c, &x, t), auth::connect(&mut d, &y, t));
    p.unwrap();
    q.unwrap();
}
