//! Criterion benchmarks of Ferry's wire format and TCP transport.
//!
//! Run with `cargo bench -p ferry-benches --bench wire`; for a quick pass add
//! `-- --warm-up-time 1 --measurement-time 2`. What is measured:
//!
//! - `header/encode+decode`: a 32-byte [`FrameHeader`] encoded and decoded
//!   (with its limit checks);
//! - `descriptors/{encode,decode}/{1,64}`: a descriptor table of 1 and 64
//!   three-dimensional f32 tensors, decoding including validation;
//! - `payload/{encode,decode}`: [`payload::encode`] / [`payload::decode`] of
//!   a small struct holding three [`RawTensor`]s inside a `Vec` and a
//!   `HashMap` (the tensor table, not tensor bytes: decoding hands back
//!   already-received tensors);
//! - `frame/decode_1KiB`: [`Frame::decode`] of a tensor-free frame with a
//!   1 KiB payload;
//! - `loopback/{empty,1MiB}`: a request/echo round trip over a real
//!   [`PeerConnection`] pair on 127.0.0.1 within one process, with an empty
//!   message and with one 1 MiB f32 tensor (its throughput counts the bytes
//!   of both directions).

use std::collections::HashMap;
use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::Arc;

use criterion::{criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use ferry_transport::{Endpoint, OutgoingMessage, PeerConnection, RawTensor};
use ferry_wire::payload::{self, IncomingTensor, OutgoingTensor};
use ferry_wire::{
    decode_descriptors, encode_descriptors, DType, Device, Flags, Frame, FrameHeader, Limits,
    MessageKind, TensorDescriptor, HEADER_LEN,
};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::runtime::Runtime;

/// One mebibyte.
const MIB: usize = 1 << 20;

/// A typical small call argument: a few scalars and three tensors nested in
/// a `Vec` and a `HashMap`.
#[derive(Debug, Serialize, Deserialize)]
struct Batch {
    /// Name of the step.
    name: String,
    /// Step number.
    step: u64,
    /// Two input tensors.
    inputs: Vec<RawTensor>,
    /// One named extra tensor.
    extras: HashMap<String, RawTensor>,
    /// A learning rate, to have a float in the payload.
    lr: f32,
}

/// Benchmarks [`FrameHeader::encode`] followed by [`FrameHeader::decode`].
fn header(c: &mut Criterion) {
    let limits = Limits::default();
    let h = FrameHeader {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id: 0x0123_4567_89ab_cdef,
        payload_len: 1024,
        descriptors_len: 24 * 4,
        tensor_count: 4,
    };
    c.bench_function("header/encode+decode", |b| {
        b.iter(|| {
            let bytes: [u8; HEADER_LEN] = black_box(&h).encode();
            FrameHeader::decode(black_box(&bytes), &limits).expect("valid header")
        })
    });
}

/// `n` descriptors of 3-D f32 tensors with distinct shapes.
fn descriptors_of(n: usize) -> Vec<TensorDescriptor> {
    (0..n as i64)
        .map(|i| TensorDescriptor::contiguous(DType::F32, &[i + 1, 16, 64], Device::Cpu))
        .collect()
}

/// Benchmarks encoding and decoding descriptor tables of 1 and 64 tensors.
fn descriptors(c: &mut Criterion) {
    let limits = Limits::default();
    let mut group = c.benchmark_group("descriptors");
    for n in [1usize, 64] {
        let table = descriptors_of(n);
        let mut encoded = Vec::new();
        encode_descriptors(&table, &mut encoded);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::new("encode", n), &table, |b, table| {
            let mut out = Vec::with_capacity(encoded.len());
            b.iter(|| {
                out.clear();
                encode_descriptors(black_box(table), &mut out);
                out.len()
            })
        });
        group.bench_with_input(BenchmarkId::new("decode", n), &encoded, |b, bytes| {
            b.iter(|| decode_descriptors(black_box(bytes), n as u32, &limits).expect("valid table"))
        });
    }
    group.finish();
}

/// Benchmarks payload encoding and decoding of a [`Batch`].
fn payloads(c: &mut Criterion) {
    let x = RawTensor::from_slice(&[1.0f32; 64], &[8, 8]).expect("tensor");
    let y = RawTensor::from_slice(&[2i64; 16], &[16]).expect("tensor");
    let mask = RawTensor::from_slice(&[true; 8], &[2, 4]).expect("tensor");
    let batch = Batch {
        name: "forward".into(),
        step: 42,
        inputs: vec![x.clone(), y.clone()],
        extras: HashMap::from([("mask".to_string(), mask.clone())]),
        lr: 0.01,
    };
    // Table order is serialisation order: inputs first, then the one extra.
    let table = [x, y, mask];

    let mut group = c.benchmark_group("payload");
    group.bench_function("encode", |b| {
        b.iter(|| payload::encode(black_box(&batch)).expect("encodes"))
    });
    let encoded = payload::encode(&batch).expect("encodes");
    assert_eq!(encoded.tensors.len(), table.len());
    group.bench_function("decode", |b| {
        b.iter_batched(
            || {
                table
                    .iter()
                    .map(|t| IncomingTensor {
                        descriptor: t.descriptor(),
                        storage: Box::new(t.clone()),
                    })
                    .collect::<Vec<_>>()
            },
            |incoming| {
                payload::decode::<Batch>(black_box(&encoded.payload), incoming).expect("decodes")
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

/// Benchmarks [`Frame::decode`] of a frame with a 1 KiB payload and no tensors.
fn frame(c: &mut Criterion) {
    let limits = Limits::default();
    let body = vec![0x5au8; 1024];
    let bytes = Frame::encode(MessageKind::REQUEST, Flags::NONE, 9, &[], &body, &[]);
    let mut group = c.benchmark_group("frame");
    // No throughput: decoding borrows the payload, it copies no bytes.
    group.bench_function("decode_1KiB", |b| {
        b.iter(|| {
            let (f, used) = Frame::decode(black_box(&bytes), &limits).expect("valid frame");
            (f.payload.len(), used)
        })
    });
    group.finish();
}

/// Accepts one connection and echoes every message back as a response with
/// the same payload and tensors, until the client closes.
async fn echo_server(listener: TcpListener) {
    let (stream, _) = listener.accept().await.expect("accept");
    let mut conn = PeerConnection::accept(stream, &Endpoint::new("server", 0))
        .await
        .expect("server handshake");
    while let Some(msg) = conn.reader.read().await.expect("server read") {
        let tensors = msg
            .tensors
            .into_iter()
            .map(|t| {
                let raw = t
                    .storage
                    .downcast::<RawTensor>()
                    .expect("raw allocator yields RawTensor");
                Arc::new(*raw) as Arc<dyn OutgoingTensor>
            })
            .collect();
        conn.writer
            .write(&OutgoingMessage {
                kind: MessageKind::RESPONSE,
                flags: Flags::REPLY,
                request_id: msg.header.request_id,
                payload: msg.payload,
                tensors,
            })
            .await
            .expect("server write");
    }
}

/// Starts an echo server on 127.0.0.1 and returns a connected client.
fn connect(rt: &Runtime) -> PeerConnection {
    rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr: SocketAddr = listener.local_addr().expect("local addr");
        tokio::spawn(echo_server(listener));
        PeerConnection::connect(addr, &Endpoint::new("client", 1))
            .await
            .expect("client handshake")
    })
}

/// Sends `msg` and waits for its echo; returns the number of tensors back.
async fn round_trip(conn: &mut PeerConnection, msg: &OutgoingMessage) -> usize {
    conn.writer.write(msg).await.expect("client write");
    let reply = conn
        .reader
        .read()
        .await
        .expect("client read")
        .expect("a reply");
    assert_eq!(reply.header.request_id, msg.request_id);
    reply.tensors.len()
}

/// Benchmarks request/echo round trips over a loopback [`PeerConnection`].
fn loopback(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let mut conn = connect(&rt);
    let mut group = c.benchmark_group("loopback");

    let empty = OutgoingMessage {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id: 1,
        payload: Vec::new(),
        tensors: Vec::new(),
    };
    group.bench_function("empty", |b| {
        b.iter(|| rt.block_on(round_trip(&mut conn, &empty)))
    });

    let big = RawTensor::zeros(DType::F32, &[(MIB / 4) as i64]).expect("tensor");
    let encoded = payload::encode(&big).expect("encodes");
    let one_mib = OutgoingMessage {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id: 2,
        payload: encoded.payload,
        tensors: encoded.tensors,
    };
    group.throughput(Throughput::Bytes(2 * MIB as u64));
    group.bench_function("1MiB", |b| {
        b.iter(|| rt.block_on(round_trip(&mut conn, &one_mib)))
    });
    group.finish();
    // Closing the client ends the server task.
    drop(conn);
}

/// Runs every benchmark of this file, configured from the command line (what
/// `criterion_group!` generates, written out so that it carries a doc comment).
fn benches() {
    let mut c = Criterion::default().configure_from_args();
    header(&mut c);
    descriptors(&mut c);
    payloads(&mut c);
    frame(&mut c);
    loopback(&mut c);
}

criterion_main!(benches);
