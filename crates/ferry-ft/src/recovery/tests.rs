//! Live recovery against fake peers speaking the protocol (and breaking
//! it): malformed replies and chunks, a source dying mid-chunk or stalling,
//! and a healing replica that stops reading.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ferry_transport::{Endpoint, OutgoingMessage, PeerConnection, RawTensor};
use ferry_wire::payload::OutgoingTensor;
use ferry_wire::{DType, Flags, Frame, MessageKind};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::link;
use super::protocol::{
    ChunkHeader, Manifest, Reply, Request, TensorMeta, KIND_CHUNK, KIND_REPLY, KIND_REQUEST,
};
use super::*;

/// Upper bound on any single wait here.
const BOUND: Duration = Duration::from_secs(20);

async fn bounded<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing within {BOUND:?}"))
}

fn options() -> FetchOptions {
    FetchOptions::new("healer")
        .with_lanes(1)
        .with_chunk_bytes(4096)
        .with_io_timeout(Duration::from_secs(10))
        .with_wait(Duration::from_secs(5))
}

/// A fake checkpoint server: accepts one connection, handshakes, and runs
/// `script` on it.
async fn fake_source<F, Fut>(script: F) -> (String, JoinHandle<()>)
where
    F: FnOnce(PeerConnection) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let conn = PeerConnection::accept(stream, &Endpoint::new("fake", 0))
            .await
            .unwrap();
        script(conn).await;
    });
    (addr, task)
}

async fn read_request(conn: &mut PeerConnection) -> Request {
    let message = conn.reader.read().await.unwrap().unwrap();
    assert_eq!(message.header.kind, KIND_REQUEST);
    link::decode(message).unwrap()
}

fn reply_message(reply: &Reply) -> OutgoingMessage {
    link::message(KIND_REPLY, reply).unwrap()
}

async fn send_reply(conn: &mut PeerConnection, reply: &Reply) {
    conn.writer.write(&reply_message(reply)).await.unwrap();
}

fn manifest(step: i64, elements: i64) -> Manifest {
    Manifest {
        step,
        tensors: vec![TensorMeta {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![elements],
            byte_len: elements as u64 * 4,
        }],
    }
}

/// The header of chunk `index` of the only tensor, at its start.
fn header(index: u64) -> ChunkHeader {
    ChunkHeader {
        index,
        tensor: 0,
        offset: 0,
    }
}

fn chunk(header: ChunkHeader, tensor: RawTensor) -> OutgoingMessage {
    let mut message = link::message(KIND_CHUNK, &header).unwrap();
    message.tensors = vec![Arc::new(tensor) as Arc<dyn OutgoingTensor>];
    message
}

fn floats(n: usize) -> RawTensor {
    let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
    RawTensor::from_slice(&values, &[n as i64]).unwrap()
}

/// Fetches step 3 from `addr` and returns the error.
async fn fetch_error(addr: &str, options: &FetchOptions) -> RecoveryError {
    bounded("fetch", fetch_checkpoint(addr, 3, options))
        .await
        .expect_err("the fetch must fail")
}

/// Fetches step 3 from `addr` and checks that it fails as malformed, with
/// `needle` in the reason.
async fn assert_fetch_malformed(addr: &str, needle: &str) {
    match fetch_error(addr, &options()).await {
        RecoveryError::Malformed { reason, .. } => {
            assert!(reason.contains(needle), "{needle:?} not in {reason:?}")
        }
        other => panic!("expected Malformed ({needle}), got {other:?}"),
    }
}

#[tokio::test]
async fn the_fake_source_speaks_the_protocol() {
    // The script the malformed cases below break, run straight.
    let (addr, task) = fake_source(|mut conn| async move {
        assert_eq!(
            read_request(&mut conn).await,
            Request::Manifest {
                step: 3,
                wait_ms: 5000
            }
        );
        send_reply(&mut conn, &Reply::Manifest(manifest(3, 1024))).await;
        assert!(matches!(
            read_request(&mut conn).await,
            Request::Stream {
                step: 3,
                lane: 0,
                lanes: 1,
                chunk_bytes: 4096
            }
        ));
        conn.writer
            .write(&chunk(header(0), floats(1024)))
            .await
            .unwrap();
        send_reply(&mut conn, &Reply::End { chunks: 1 }).await;
    })
    .await;
    let state = bounded("fetch", fetch_checkpoint(&addr, 3, &options()))
        .await
        .unwrap();
    assert_eq!(state.step, 3);
    assert_eq!(state.get("w"), Some(&floats(1024)));
    task.await.unwrap();
}

/// A source that answers the manifest request with `reply`, then holds the
/// connection open until the healer hangs up.
async fn source_replying(reply: OutgoingMessage) -> (String, JoinHandle<()>) {
    fake_source(|mut conn| async move {
        read_request(&mut conn).await;
        conn.writer.write(&reply).await.unwrap();
        let _ = conn.reader.read().await;
    })
    .await
}

#[tokio::test]
async fn a_garbage_reply_is_malformed() {
    let (addr, _task) = source_replying(OutgoingMessage {
        kind: KIND_REPLY,
        flags: Flags::NONE,
        request_id: 0,
        payload: vec![0xff; 17],
        tensors: Vec::new(),
    })
    .await;
    assert_fetch_malformed(&addr, "bad reply").await;
}

#[tokio::test]
async fn a_reply_of_another_kind_is_malformed() {
    let wrong = link::message(MessageKind::RESPONSE, &Reply::End { chunks: 0 }).unwrap();
    let (addr, _task) = source_replying(wrong).await;
    assert_fetch_malformed(&addr, "expected a reply").await;
}

#[tokio::test]
async fn an_inconsistent_manifest_is_malformed() {
    let mut bad = manifest(3, 1024);
    bad.tensors[0].byte_len = 4095;
    let (addr, _task) = source_replying(reply_message(&Reply::Manifest(bad))).await;
    assert_fetch_malformed(&addr, "4095 bytes").await;
}

#[tokio::test]
async fn a_manifest_for_another_step_is_malformed() {
    let (addr, _task) = source_replying(reply_message(&Reply::Manifest(manifest(4, 8)))).await;
    assert_fetch_malformed(&addr, "step 4").await;
}

#[tokio::test]
async fn a_manifest_beyond_the_size_limit_is_refused_before_allocating() {
    // 4 PiB announced.
    let huge = reply_message(&Reply::Manifest(manifest(3, 1 << 50)));
    let (addr, _task) = source_replying(huge).await;
    assert_fetch_malformed(&addr, "more than the").await;
}

#[tokio::test]
async fn a_tensor_riding_on_the_manifest_is_malformed() {
    let mut message = reply_message(&Reply::Manifest(manifest(3, 8)));
    message.tensors = vec![Arc::new(floats(8)) as Arc<dyn OutgoingTensor>];
    let (addr, _task) = source_replying(message).await;
    assert_fetch_malformed(&addr, "before the manifest").await;
}

/// A source that sends a valid manifest for 1024 f32 (one 4 KiB chunk) and
/// then whatever `stream` sends.
async fn source_streaming<F, Fut>(stream: F) -> (String, JoinHandle<()>)
where
    F: FnOnce(PeerConnection) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    fake_source(|mut conn| async move {
        read_request(&mut conn).await;
        send_reply(&mut conn, &Reply::Manifest(manifest(3, 1024))).await;
        read_request(&mut conn).await;
        stream(conn).await;
    })
    .await
}

/// [`source_streaming`] sending `messages`, then holding the connection
/// open until the healer hangs up (which it may do at the first bad
/// message: write errors are ignored).
async fn source_sending(messages: Vec<OutgoingMessage>) -> (String, JoinHandle<()>) {
    source_streaming(|mut conn| async move {
        for message in &messages {
            let _ = conn.writer.write(message).await;
        }
        let _ = conn.reader.read().await;
    })
    .await
}

#[tokio::test]
async fn a_chunk_of_the_wrong_size_is_malformed() {
    let (addr, _task) = source_sending(vec![chunk(header(0), floats(100))]).await;
    assert_fetch_malformed(&addr, "not the planned one").await;
}

#[tokio::test]
async fn a_chunk_of_the_wrong_dtype_is_malformed() {
    let ints = RawTensor::from_slice(&[7i32; 1024], &[1024]).unwrap();
    let (addr, _task) = source_sending(vec![chunk(header(0), ints)]).await;
    assert_fetch_malformed(&addr, "not the planned one").await;
}

#[tokio::test]
async fn a_chunk_header_off_the_plan_is_malformed() {
    let (addr, _task) = source_sending(vec![chunk(header(5), floats(1024))]).await;
    assert_fetch_malformed(&addr, "does not match").await;
}

#[tokio::test]
async fn a_stream_ending_early_is_malformed() {
    let (addr, _task) = source_sending(vec![reply_message(&Reply::End { chunks: 0 })]).await;
    assert_fetch_malformed(&addr, "ended after 0 chunks").await;
}

#[tokio::test]
async fn a_chunk_beyond_the_plan_is_malformed() {
    let chunks = (0..2).map(|_| chunk(header(0), floats(1024))).collect();
    let (addr, _task) = source_sending(chunks).await;
    assert_fetch_malformed(&addr, "after every planned one").await;
}

#[tokio::test]
async fn a_source_dying_mid_chunk_is_lost_not_malformed() {
    let (addr, _task) = source_streaming(|conn| async move {
        let encoded = ferry_wire::payload::encode(&header(0)).unwrap();
        let tensor = floats(1024);
        let frame = Frame::encode(
            KIND_CHUNK,
            Flags::NONE,
            0,
            &[tensor.descriptor()],
            &encoded.payload,
            &[tensor.bytes()],
        );
        let PeerConnection { mut writer, .. } = conn;
        // Half the chunk, then the process is gone.
        writer.write_raw_for_tests(&frame[..frame.len() / 2]).await;
        drop(writer);
    })
    .await;
    match fetch_error(&addr, &options()).await {
        RecoveryError::SourceLost { address, .. } => assert_eq!(address, addr),
        other => panic!("expected SourceLost, got {other:?}"),
    }
}

#[tokio::test]
async fn a_stalled_source_times_out() {
    let (addr, _task) = fake_source(|mut conn| async move {
        read_request(&mut conn).await;
        // Never answers; keeps the connection open.
        let _ = conn.reader.read().await;
    })
    .await;
    let options = options()
        .with_wait(Duration::from_millis(100))
        .with_io_timeout(Duration::from_millis(200));
    match fetch_error(&addr, &options).await {
        RecoveryError::Timeout { waiting_for, .. } => assert_eq!(waiting_for, "the manifest"),
        other => panic!("expected Timeout, got {other:?}"),
    }
}

/// A healing replica that asks for a large state and stops reading: the
/// source's transfer is in flight, `disallow` waits for it, and the
/// source's write timeout ends it, so the source is never held for good.
#[tokio::test]
async fn a_healer_that_stops_reading_cannot_hold_the_source() {
    let server = CheckpointServer::bind(
        "127.0.0.1:0",
        CheckpointServerOptions::new("source").with_io_timeout(Duration::from_millis(300)),
    )
    .await
    .unwrap();
    let weights = RawTensor::zeros(DType::F32, &[16 << 20]).unwrap(); // 64 MiB
    server
        .allow(CheckpointState::new(3).with_tensor("w", weights.clone()))
        .unwrap();

    let addr = server.local_addr();
    let mut conn = PeerConnection::connect(addr, &Endpoint::new("stuck", 0))
        .await
        .unwrap();
    let stream = Request::Stream {
        step: 3,
        lane: 0,
        lanes: 1,
        chunk_bytes: 1 << 20,
    };
    conn.writer
        .write(&link::message(KIND_REQUEST, &stream).unwrap())
        .await
        .unwrap();
    bounded(
        "stream in flight",
        server.wait_for_stats(|s| s.in_flight == 1),
    )
    .await;
    assert!(Arc::strong_count(weights.storage()) > 1);

    // Never read: the socket fills, the server's write stalls and is dropped.
    bounded("disallow", server.disallow()).await;
    let stats = server.stats();
    assert_eq!((stats.in_flight, stats.streams_completed), (0, 0));
    assert_eq!(server.serving_step(), None);
    // The server no longer holds the state's storage.
    assert_eq!(Arc::strong_count(weights.storage()), 1);
    drop(conn);
}
