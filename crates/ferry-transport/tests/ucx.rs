//! The `ucx` channel and the `ucx` transport (feature `ucx`) between two
//! endpoints in this process, with UCX's TCP and its shared-memory
//! transports. Where `libucp.so.0` does not load, each test says so and
//! returns (the multi-process runs are the RPC suite's).
#![cfg(feature = "ucx")]
#![allow(clippy::unwrap_used)]

mod common;

use ferry_transport::{channel, Endpoint, RawTensor, TransportError, UcxUnusable};
use ferry_wire::DType;

use common::{decode, message, pair};

/// Whether UCX loads here; prints why not when it does not.
fn ucx_here(test: &str) -> bool {
    match ferry_transport::ucx::viability() {
        Ok(_) => true,
        Err(reason) => {
            eprintln!("{test}: skipped, {reason}");
            false
        }
    }
}

fn endpoint(name: &str, channels: &str, transports: &str, tls: &str) -> Endpoint {
    let mut e = Endpoint::new(name, 0);
    e.channels = channel::parse_channels(channels).unwrap();
    e.transports = channel::parse_transports(transports).unwrap();
    e.config.small_tensor_bytes = 0;
    e.config.ucx_tls = Some(tls.into());
    e
}

fn sample(len: usize, seed: u8) -> RawTensor {
    let bytes: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(29) ^ seed ^ (i >> 13) as u8)
        .collect();
    RawTensor::from_bytes(DType::U8, &[len as i64], &bytes).unwrap()
}

type Mixed = (String, Vec<RawTensor>, RawTensor);

/// Tensors of many sizes (empty, eager, rendezvous) and a strided view.
fn mixed(seed: u8) -> Mixed {
    let sizes = [0usize, 1, 4095, 70_000, (4 << 20) + 3, 9 << 20];
    let m = RawTensor::from_slice(
        &(0..300 * 200).map(|i| i as f32).collect::<Vec<_>>(),
        &[300, 200],
    )
    .unwrap();
    (
        format!("mixed {seed}"),
        sizes.iter().map(|&n| sample(n, seed)).collect(),
        m.t().unwrap(),
    )
}

/// Messages both ways, every byte checked, over the expected link.
async fn exchange(channels: &str, transports: &str, tls: &str, transport: &str, chosen: &str) {
    let (mut server, mut client) = pair(
        endpoint("server", channels, transports, tls),
        endpoint("client", channels, transports, tls),
    )
    .await;
    for conn in [&server, &client] {
        assert_eq!(
            conn.transport, transport,
            "{channels} / {transports} / {tls}"
        );
        assert_eq!(conn.outgoing_channels()[0].channel, chosen);
        assert_eq!(conn.incoming_channels()[0].channel, chosen);
    }
    let expected: Vec<Mixed> = (0..3u8).map(mixed).collect();
    let batch: Vec<_> = expected
        .iter()
        .enumerate()
        .map(|(i, m)| message(i as u64, m))
        .collect();
    let send = async { client.writer.write_batch(&batch).await.unwrap() };
    let recv = async {
        let mut got = Vec::new();
        for (i, want) in expected.iter().enumerate() {
            let m: Mixed = decode(server.reader.read().await.unwrap().unwrap());
            assert!(&m == want, "message {i} over {chosen}/{transport} differs");
            got.push(m);
        }
        got
    };
    let ((), got) = tokio::join!(send, recv);
    // Echo back from the memory the server received into.
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
            assert!(&m == want, "echo {i} differs");
        }
    };
    tokio::join!(send, recv);
    // A clean end: the reader sees the end of the stream, not an error.
    client.writer.shutdown().await.unwrap();
    assert!(server.reader.read().await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_channel_over_tcp_with_ucx_tcp_and_shm() {
    if !ucx_here("ucx_channel_over_tcp_with_ucx_tcp_and_shm") {
        return;
    }
    exchange("ucx", "tcp", "tcp", "tcp", "ucx").await;
    exchange("ucx", "tcp", "shm,self", "tcp", "ucx").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_transport_with_inline_and_ucx_channels() {
    if !ucx_here("ucx_transport_with_inline_and_ucx_channels") {
        return;
    }
    for tls in ["tcp", "shm,self"] {
        exchange("inline", "ucx", tls, "ucx", "inline").await;
        exchange("ucx", "ucx", tls, "ucx", "ucx").await;
        exchange("mpt", "ucx", tls, "ucx", "mpt").await;
    }
}

#[tokio::test]
async fn ucx_on_a_current_thread_runtime() {
    if !ucx_here("ucx_on_a_current_thread_runtime") {
        return;
    }
    exchange("ucx", "ucx", "shm,self", "ucx", "ucx").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_is_above_mpt_and_below_the_same_host_channels() {
    if !ucx_here("ucx_is_above_mpt_and_below_the_same_host_channels") {
        return;
    }
    // Defaults: every viable channel with its default priority.
    let mut a = Endpoint::new("a", 0);
    let mut b = Endpoint::new("b", 1);
    for e in [&mut a, &mut b] {
        e.channels.retain(|o| o.name == "ucx" || o.name == "mpt");
        e.transports.retain(|o| o.name == "tcp");
    }
    let (_s, c) = pair(a, b).await;
    assert_eq!(c.outgoing_channels()[0].channel, "ucx");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_ucx_falls_back() {
    if !ucx_here("a_peer_without_ucx_falls_back") {
        return;
    }
    let (s, c) = pair(
        endpoint("s", "mpt,inline", "tcp", "tcp"),
        endpoint("c", "ucx,mpt,inline", "ucx,tcp", "tcp"),
    )
    .await;
    assert_eq!((s.transport, c.transport), ("tcp", "tcp"));
    assert_eq!(c.outgoing_channels()[0].channel, "mpt");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_ucx_transport_list_withdraws_the_offer() {
    if !ucx_here("an_unknown_ucx_transport_list_withdraws_the_offer") {
        return;
    }
    // UCX refuses the list on the connecting side: it offers no UCX, and
    // the connection falls back to what both offer besides.
    let (s, c) = pair(
        endpoint("s", "ucx,inline", "ucx,tcp", "tcp"),
        endpoint("c", "ucx,inline", "ucx,tcp", "no-such-transport"),
    )
    .await;
    assert_eq!((s.transport, c.transport), ("tcp", "tcp"));
    assert_eq!(c.outgoing_channels()[0].channel, "inline");
}

#[test]
fn a_missing_library_names_the_loader_error() {
    let Err(err) = ferry_transport::ucx::load("libucp-that-is-not-there.so.0") else {
        panic!("loading a missing library succeeded");
    };
    assert!(matches!(
        err,
        TransportError::Unavailable { what: "UCX", .. }
    ));
    let text = err.to_string();
    assert!(text.starts_with("UCX not available: "), "{text}");
    assert!(text.contains("libucp-that-is-not-there.so.0"), "{text}");
}

/// Messages both ways over `server` and `client`, every byte checked.
async fn round_trip(
    server: &mut ferry_transport::PeerConnection,
    client: &mut ferry_transport::PeerConnection,
) {
    let want = mixed(7);
    client.writer.write(&message(1, &want)).await.unwrap();
    let got: Mixed = decode(server.reader.read().await.unwrap().unwrap());
    assert!(got == want, "the request differs");
    server.writer.write(&message(2, &got)).await.unwrap();
    let back: Mixed = decode(client.reader.read().await.unwrap().unwrap());
    assert!(back == want, "the reply differs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_that_cannot_reach_the_peer_falls_back_to_the_next_viable_link() {
    if !ucx_here("ucx_that_cannot_reach_the_peer_falls_back_to_the_next_viable_link") {
        return;
    }
    // Both sides load UCX and offer it, so the selection picks the `ucx`
    // transport and channel; but one side's UCX has only TCP and the
    // other's only shared memory: no endpoint can be created. Both fall
    // back to what ranks next (`mpt` over `tcp`) and say why.
    let (mut s, mut c) = pair(
        endpoint("s", "ucx,mpt,inline", "ucx,tcp", "tcp"),
        endpoint("c", "ucx,mpt,inline", "ucx,tcp", "shm,self"),
    )
    .await;
    for conn in [&s, &c] {
        assert_eq!(conn.transport, "tcp");
        assert_eq!(conn.outgoing_channels()[0].channel, "mpt");
        assert_eq!(conn.incoming_channels()[0].channel, "mpt");
        let why = conn.ucx_fallback.clone().expect("a recorded reason");
        assert!(
            matches!(why.local, Some(UcxUnusable::Endpoint(_))),
            "{why:?}"
        );
        assert!(
            matches!(why.peer, Some(UcxUnusable::Endpoint(_))),
            "{why:?}"
        );
        assert!(why.to_string().contains("no UCX endpoint"), "{why}");
    }
    round_trip(&mut s, &mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_usable_ucx_records_no_fallback() {
    if !ucx_here("a_usable_ucx_records_no_fallback") {
        return;
    }
    let (mut s, mut c) = pair(
        endpoint("s", "ucx,mpt,inline", "ucx,tcp", "tcp"),
        endpoint("c", "ucx,mpt,inline", "ucx,tcp", "tcp"),
    )
    .await;
    for conn in [&s, &c] {
        assert_eq!(conn.transport, "ucx");
        assert_eq!(conn.outgoing_channels()[0].channel, "ucx");
        assert_eq!(conn.ucx_fallback, None);
    }
    round_trip(&mut s, &mut c).await;
}
