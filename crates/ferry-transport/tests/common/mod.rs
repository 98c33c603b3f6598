//! Helpers shared by the connection tests: a connected pair of endpoints
//! over loopback, endpoints offering chosen channels and transports,
//! messages in and out of serde values, and an exchange of messages with
//! tensors of many sizes, checked byte for byte.
#![allow(clippy::unwrap_used, dead_code)]

use ferry_transport::{
    channel, Endpoint, IncomingMessage, OutgoingMessage, PeerConnection, RawTensor,
};
use ferry_wire::{payload, DType, Flags, MessageKind};
use tokio::net::TcpListener;

/// Connects `client` to `server` over 127.0.0.1; returns (server, client).
pub(crate) async fn pair(server: Endpoint, client: Endpoint) -> (PeerConnection, PeerConnection) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accept = tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        PeerConnection::accept(s, &server).await.unwrap()
    });
    let c = PeerConnection::connect(addr, &client).await.unwrap();
    (accept.await.unwrap(), c)
}

/// Runs this test binary's test `test` alone in a child process with `env`
/// set (the child's side of a multi-process test), and waits for it.
pub(crate) fn run_test_in_child(test: &str, env: (&str, &str)) -> std::process::Output {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(env.0, env.1)
        .output()
        .unwrap()
}

/// Panics unless `out` (of `what`) exited successfully, showing its output.
pub(crate) fn assert_child_succeeded(out: &std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} ended with {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A request carrying `value`.
pub(crate) fn message<T: serde::Serialize>(id: u64, value: &T) -> OutgoingMessage {
    let e = payload::encode(value).unwrap();
    OutgoingMessage {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id: id,
        payload: e.payload,
        tensors: e.tensors,
    }
}

/// The value a received message carries.
pub(crate) fn decode<T: serde::de::DeserializeOwned>(m: IncomingMessage) -> T {
    payload::decode(&m.payload, m.tensors).unwrap()
}

/// An endpoint offering only `channels` and `transports`, sending every
/// tensor over its channel when `small` is 0.
pub(crate) fn endpoint(
    name: &str,
    rank: u32,
    channels: &str,
    transports: &str,
    small: usize,
) -> Endpoint {
    let mut e = Endpoint::new(name, rank);
    e.channels = channel::parse_channels(channels).unwrap();
    e.transports = channel::parse_transports(transports).unwrap();
    e.config.small_tensor_bytes = small;
    e.config.mpt_lanes = 3;
    e
}

/// A `len`-byte tensor whose bytes depend on `seed`.
pub(crate) fn sample(len: usize, seed: u8) -> RawTensor {
    let bytes: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 12) as u8)
        .collect();
    RawTensor::from_bytes(DType::U8, &[len as i64], &bytes).unwrap()
}

/// A message with tensors of many sizes and a strided view.
pub(crate) type Mixed = (String, Vec<RawTensor>, RawTensor);

/// Tensors of many sizes (empty, small, large) in one message, including
/// a strided view.
pub(crate) fn mixed(seed: u8) -> Mixed {
    let sizes = [0usize, 1, 4095, 70_000, (4 << 20) + 3, 9 << 20];
    let tensors = sizes.iter().map(|&n| sample(n, seed)).collect();
    let m = RawTensor::from_slice(
        &(0..600 * 500).map(|i| i as f32).collect::<Vec<_>>(),
        &[600, 500],
    )
    .unwrap();
    (format!("mixed {seed}"), tensors, m.t().unwrap())
}

/// Asserts that both connections use `transport` and, for their first
/// device pair both ways, `chosen`.
pub(crate) fn assert_link(conns: [&PeerConnection; 2], transport: &str, chosen: &str) {
    for conn in conns {
        assert_eq!(conn.transport, transport, "transport");
        assert_eq!(conn.outgoing_channels()[0].channel, chosen);
        assert_eq!(conn.incoming_channels()[0].channel, chosen);
    }
}

/// Sends three [`mixed`] messages from `client` to `server` in one batch,
/// then echoes them back from the memory the server received into; every
/// byte is checked both ways (`what` names the link in failures).
pub(crate) async fn exchange_mixed(
    server: &mut PeerConnection,
    client: &mut PeerConnection,
    what: &str,
) {
    let expected: Vec<Mixed> = (0..3u8).map(mixed).collect();
    let batch: Vec<_> = expected
        .iter()
        .enumerate()
        .map(|(i, m)| message(i as u64, m))
        .collect();
    // Writes and reads run together: a stream or ring holds less than a batch.
    let send = async { client.writer.write_batch(&batch).await.unwrap() };
    let recv = async {
        let mut got = Vec::new();
        for (i, want) in expected.iter().enumerate() {
            let m: Mixed = decode(server.reader.read().await.unwrap().unwrap());
            assert!(&m == want, "message {i} over {what} differs");
            got.push(m);
        }
        got
    };
    let ((), got) = tokio::join!(send, recv);
    // Echo them back: the server sends from the storage it received into.
    let send = async {
        for (i, m) in got.iter().enumerate() {
            server
                .writer
                .write(&message(10 + i as u64, m))
                .await
                .unwrap();
        }
    };
    let recv = async {
        for (i, want) in expected.iter().enumerate() {
            let m: Mixed = decode(client.reader.read().await.unwrap().unwrap());
            assert!(&m == want, "echo {i} over {what} differs");
        }
    };
    tokio::join!(send, recv);
}
