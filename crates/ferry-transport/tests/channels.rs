//! Every transport and channel on its own, forced by the offer lists, over
//! real sockets and shared memory between two endpoints in this process
//! (the multi-process runs are the RPC suite's, once per combination).
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use ferry_transport::{channel, Endpoint, RawTensor};

use common::{assert_link, decode, endpoint, exchange_mixed, message, pair, sample};

/// Sends mixed messages both ways, checks every byte, and checks that the
/// connection uses the expected transport and channel.
async fn exchange(channels: &str, transports: &str, small: usize, transport: &str, chosen: &str) {
    let (mut server, mut client) = pair(
        endpoint("server", 0, channels, transports, small),
        endpoint("client", 1, channels, transports, small),
    )
    .await;
    assert_link([&server, &client], transport, chosen);
    exchange_mixed(&mut server, &mut client, chosen).await;
    // Out-of-band tensors are released once the receiver has copied them:
    // a round of empty batches carries the releases back.
    server.writer.write_batch(&[]).await.unwrap();
    client.writer.write_batch(&[]).await.unwrap();
    server.writer.write(&message(99, &"done")).await.unwrap();
    client.writer.write(&message(99, &"done")).await.unwrap();
    let _: String = decode(server.reader.read().await.unwrap().unwrap());
    let _: String = decode(client.reader.read().await.unwrap().unwrap());
    assert_eq!(client.writer.tensors_in_flight(), 0);
    assert_eq!(server.writer.tensors_in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_over_tcp() {
    exchange("inline", "tcp", 0, "tcp", "inline").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cma_over_the_shm_transport_only() {
    exchange("cma", "shm", 0, "shm", "cma").await;
    exchange("cma, inline", "shm", 1 << 20, "shm", "cma").await;
    // Over TCP nothing ties a record's sender to a process: no cma.
    exchange("cma, inline", "tcp", 0, "tcp", "inline").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_channel_over_tcp() {
    exchange("shm", "tcp", 0, "tcp", "shm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mpt_over_tcp() {
    exchange("mpt", "tcp", 0, "tcp", "mpt").await;
    exchange("mpt, inline", "tcp", 64 << 10, "tcp", "mpt").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_channel_over_the_shm_transport() {
    for ch in ["inline", "cma", "shm", "mpt"] {
        exchange(ch, "shm", 0, "shm", ch).await;
    }
}

#[tokio::test]
async fn cma_on_a_current_thread_runtime() {
    exchange("cma", "shm", 0, "shm", "cma").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defaults_pick_cma_and_the_shm_transport_on_one_host() {
    let (server, client) = pair(Endpoint::new("s", 0), Endpoint::new("c", 1)).await;
    assert_eq!(client.transport, "shm");
    assert_eq!(client.outgoing_channels()[0].channel, "cma");
    assert_eq!(server.outgoing_channels()[0].channel, "cma");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_shm_transport_falls_back_to_tcp() {
    // One side offers only TCP: the shm transport is not selected.
    let (server, client) = pair(
        endpoint("s", 0, "cma,shm,mpt,inline", "tcp", 0),
        endpoint("c", 1, "cma,shm,mpt,inline", "shm,tcp", 0),
    )
    .await;
    assert_eq!((server.transport, client.transport), ("tcp", "tcp"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channels_fall_back_when_the_peer_lacks_them() {
    // The server is a "process where CMA is not viable": it does not offer
    // it, so tensors go over shm; then neither same-host channel: mpt.
    let mut no_cma = endpoint("s", 0, "shm,mpt,inline", "tcp", 0);
    let (_s, c) = pair(
        no_cma.clone(),
        endpoint("c", 1, "cma,shm,mpt,inline", "tcp", 0),
    )
    .await;
    assert_eq!(c.outgoing_channels()[0].channel, "shm");
    no_cma.channels = channel::parse_channels("mpt,inline").unwrap();
    let (_s, c) = pair(no_cma, endpoint("c", 1, "cma,shm,mpt,inline", "tcp", 0)).await;
    assert_eq!(c.outgoing_channels()[0].channel, "mpt");
    // A same-host descriptor from another host never matches.
    let mut elsewhere = endpoint("s", 0, "cma,inline", "tcp", 0);
    elsewhere.channels[0].devices[0].descriptor = "another-boot/pid:[1]".into();
    let (_s, c) = pair(elsewhere, endpoint("c", 1, "cma,inline", "tcp", 0)).await;
    assert_eq!(c.outgoing_channels()[0].channel, "inline");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_stays_alive_until_released() {
    let (mut server, mut client) = pair(
        endpoint("s", 0, "cma", "shm", 0),
        endpoint("c", 1, "cma", "shm", 0),
    )
    .await;
    let t = sample(1 << 20, 7);
    let weak = Arc::downgrade(t.storage());
    client.writer.write(&message(1, &t)).await.unwrap();
    drop(t);
    // The writer holds it until the receiver has pulled the bytes.
    assert!(weak.upgrade().is_some());
    assert_eq!(client.writer.tensors_in_flight(), 1);
    let got: RawTensor = decode(server.reader.read().await.unwrap().unwrap());
    assert_eq!(got, sample(1 << 20, 7));
    server.writer.write_batch(&[]).await.unwrap();
    server.writer.write(&message(2, &())).await.unwrap();
    let () = decode(client.reader.read().await.unwrap().unwrap());
    assert_eq!(client.writer.tensors_in_flight(), 0);
    assert!(weak.upgrade().is_none(), "released after the peer's copy");
}

/// Writes a raw frame carrying one 1 KiB tensor whose record is `record`.
fn raw_frame(record: &[u8]) -> Vec<u8> {
    let t = sample(1024, 1);
    let e = ferry_wire::payload::encode(&t).unwrap();
    ferry_wire::Frame::encode(
        ferry_wire::MessageKind::REQUEST,
        ferry_wire::Flags::NONE,
        1,
        &e.descriptors(),
        &e.payload,
        &[record],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_channel_records_are_typed_errors() {
    let cases: [(&str, Vec<u8>, &str); 3] = [
        ("cma", vec![7u8; 17], "channel record: unknown mode 7"),
        (
            "mpt",
            [&[1u8][..], &5u64.to_le_bytes()].concat(),
            "channel record: mpt transfer 5 where 0 was due",
        ),
        // A truncated record: the peer closes after half of it.
        ("cma", vec![1u8, 0, 0], "closed"),
    ];
    for (ch, record, expected) in cases {
        // cma is selected only with the shm transport.
        let transport = if ch == "cma" { "shm" } else { "tcp" };
        let (mut server, mut client) = pair(
            endpoint("s", 0, ch, transport, 0),
            endpoint("c", 1, ch, transport, 0),
        )
        .await;
        client.writer.write_raw_for_tests(&raw_frame(&record)).await;
        client.writer.shutdown().await.unwrap();
        let err = server.reader.read().await.unwrap_err();
        assert!(err.to_string().contains(expected), "{ch}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_list_of_partial_tokens_is_refused() {
    let (mut server, mut client) = pair(
        endpoint("s", 0, "cma", "shm", 0),
        endpoint("c", 1, "cma", "shm", 0),
    )
    .await;
    let header = ferry_wire::FrameHeader {
        kind: ferry_wire::MessageKind::RELEASE,
        flags: ferry_wire::Flags::NONE,
        request_id: 0,
        payload_len: 9,
        descriptors_len: 0,
        tensor_count: 0,
    };
    let frame = [&header.encode()[..], &[0u8; 9]].concat();
    client.writer.write_raw_for_tests(&frame).await;
    let err = server.reader.read().await.unwrap_err();
    assert!(
        matches!(
            &err,
            ferry_transport::TransportError::Malformed {
                source: ferry_wire::WireError::Record(
                    ferry_wire::channel_record::RecordError::ReleaseLength { len: 9 }
                ),
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_of_an_unknown_token_is_refused() {
    let (mut server, mut client) = pair(
        endpoint("s", 0, "cma", "shm", 0),
        endpoint("c", 1, "cma", "shm", 0),
    )
    .await;
    let header = ferry_wire::FrameHeader {
        kind: ferry_wire::MessageKind::RELEASE,
        flags: ferry_wire::Flags::NONE,
        request_id: 0,
        payload_len: 8,
        descriptors_len: 0,
        tensor_count: 0,
    };
    let frame = [&header.encode()[..], &42u64.to_le_bytes()].concat();
    client.writer.write_raw_for_tests(&frame).await;
    let err = server.reader.read().await.unwrap_err();
    assert!(
        err.to_string()
            .contains("release of token 42, which names no tensor in flight"),
        "{err}"
    );
}
