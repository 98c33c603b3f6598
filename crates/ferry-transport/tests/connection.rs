//! Connections over real loopback sockets: handshake, tensors of every dtype
//! and layout, batching, and bad input.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use ferry_transport::{Endpoint, PeerConnection, RawTensor, TransportError};
use ferry_wire::{payload, DType, Flags, FrameHeader, Limits, MessageKind};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use common::{decode, message, pair};

/// An endpoint on TCP with the `inline` channel only: the tests that write
/// raw frames write that format.
fn plain(name: &str, rank: u32) -> Endpoint {
    let mut e = Endpoint::new(name, rank);
    e.channels = ferry_transport::channel::parse_channels("inline").unwrap();
    e.transports = ferry_transport::channel::parse_transports("tcp").unwrap();
    e
}

fn sample(dtype: DType, shape: &[i64], seed: u8) -> RawTensor {
    let n: i64 = shape.iter().product();
    let bytes: Vec<u8> = (0..n as usize * dtype.size())
        .map(|i| {
            if dtype == DType::Bool {
                (i as u8 ^ seed) & 1
            } else {
                (i as u8).wrapping_mul(31) ^ seed
            }
        })
        .collect();
    RawTensor::from_bytes(dtype, shape, &bytes).unwrap()
}

#[tokio::test]
async fn handshake_names_both_ends() {
    let (server, client) = pair(Endpoint::new("server", 0), Endpoint::new("client", 1)).await;
    assert_eq!(server.peer.worker_name, "client");
    assert_eq!(server.peer.rank, 1);
    assert_eq!(client.peer.worker_name, "server");
    assert_eq!(client.peer.selection.len(), 1);
    // Both ends run here: the best channel this process offers is chosen
    // (`cma`, or `shm` where the kernel does not permit CMA).
    let best = ferry_transport::channel::default_channels()
        .into_iter()
        .max_by_key(|c| c.priority)
        .unwrap();
    assert_eq!(client.peer.selection[0].channel, best.name);
    assert_eq!(client.outgoing_channels(), server.incoming_channels());
}

#[tokio::test]
async fn every_dtype_and_layout_round_trips_bit_exact() {
    let (mut server, mut client) = pair(Endpoint::new("s", 0), Endpoint::new("c", 1)).await;
    let mut values = Vec::new();
    for (i, dtype) in DType::ALL.iter().enumerate() {
        let t = sample(*dtype, &[3, 4], i as u8);
        let transposed = t.t().unwrap();
        let empty = RawTensor::zeros(*dtype, &[0, 4]).unwrap();
        let strided = sample(*dtype, &[4, 6], 7)
            .as_strided(&[2, 3], &[12, 2], 1)
            .unwrap();
        values.push((
            dtype.name().to_string(),
            vec![t, transposed, empty, strided],
        ));
    }
    client.writer.write(&message(9, &values)).await.unwrap();
    let got = server.reader.read().await.unwrap().unwrap();
    assert_eq!(got.header.request_id, 9);
    let back: Vec<(String, Vec<RawTensor>)> = decode(got);
    assert_eq!(back, values);
    for (_, ts) in &back {
        // Strides are kept: the transpose arrives as a transposed view.
        assert_eq!(ts[1].strides(), &[1, 4]);
        assert!(!ts[1].is_contiguous());
        assert_eq!(ts[2].numel(), 0);
        assert_eq!(ts[3].strides(), &[12, 2]);
        // Only the span covering the strided view travelled (not the 4x6 storage).
        assert_eq!(
            ts[3].storage().len(),
            (12 + 2 * 2 + 1) * ts[3].dtype().size()
        );
    }
}

#[tokio::test]
async fn batches_keep_order_and_ids() {
    let (mut server, mut client) = pair(Endpoint::new("s", 0), Endpoint::new("c", 1)).await;
    let batch: Vec<_> = (0..100u64)
        .map(|i| message(i, &(i, sample(DType::F32, &[i as i64 % 5], i as u8))))
        .collect();
    client.writer.write_batch(&batch).await.unwrap();
    for i in 0..100u64 {
        let m = server.reader.read().await.unwrap().unwrap();
        assert_eq!(m.header.request_id, i);
        let (n, t): (u64, RawTensor) = decode(m);
        assert_eq!(n, i);
        assert_eq!(t, sample(DType::F32, &[i as i64 % 5], i as u8));
    }
    drop(client);
    assert!(
        server.reader.read().await.unwrap().is_none(),
        "clean end of stream"
    );
}

#[tokio::test]
async fn a_large_tensor_is_received_whole() {
    let (mut server, mut client) = pair(Endpoint::new("s", 0), Endpoint::new("c", 1)).await;
    let t = sample(DType::U8, &[32 << 20], 3);
    let writer = tokio::spawn(async move {
        client.writer.write(&message(1, &t)).await.unwrap();
        (client, t)
    });
    let got: RawTensor = decode(server.reader.read().await.unwrap().unwrap());
    let (_client, t) = writer.await.unwrap();
    assert_eq!(got, t);
}

#[tokio::test]
async fn malformed_bytes_are_a_typed_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        PeerConnection::accept(s, &Endpoint::new("s", 0)).await
    });
    let mut raw = TcpStream::connect(addr).await.unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\nHost: example.com\r\nAccept: */*\r\n\r\n")
        .await
        .unwrap();
    match server.await.unwrap() {
        Err(TransportError::Malformed { source, .. }) => {
            assert!(source.to_string().contains("bad magic"), "{source}")
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("garbage was accepted"),
    }
}

#[tokio::test]
async fn oversized_lengths_are_refused_before_allocation() {
    let mut small = Endpoint::new("s", 0);
    small.limits = Limits {
        max_payload_bytes: 1024,
        ..Limits::default()
    };
    let (mut server, mut client) = pair(small, Endpoint::new("c", 1)).await;
    let header = FrameHeader {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id: 1,
        payload_len: u32::MAX,
        descriptors_len: 0,
        tensor_count: 0,
    };
    // A bare header announcing a 4 GiB payload.
    client.writer.write_raw_for_tests(&header.encode()).await;
    let err = server.reader.read().await.unwrap_err();
    assert!(
        err.to_string()
            .contains("payload length of 4294967295 exceeds the limit of 1024"),
        "{err}"
    );
}

/// Each side states its limits in its handshake; the other side's writer
/// refuses a message over them before writing any of it, and the
/// connection carries on with the next.
#[tokio::test]
async fn a_message_over_the_peers_limits_is_refused_by_the_writer() {
    let mut small = Endpoint::new("s", 0);
    small.limits = Limits {
        max_tensor_bytes: 1 << 10,
        ..Limits::default()
    };
    let (mut server, mut client) = pair(small, Endpoint::new("c", 1)).await;
    assert_eq!(client.peer.limits.max_tensor_bytes, 1 << 10);
    assert_eq!(client.writer.peer_limits(), Some(client.peer.limits));
    let big = sample(DType::U8, &[4096], 1);
    let err = client.writer.write(&message(1, &big)).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("tensor byte length of 4096 exceeds the limit of 1024"),
        "{err}"
    );
    let fits = sample(DType::U8, &[512], 2);
    client.writer.write(&message(2, &fits)).await.unwrap();
    let got = server.reader.read().await.unwrap().unwrap();
    assert_eq!(got.header.request_id, 2);
    assert_eq!(decode::<RawTensor>(got), fits);
}

#[tokio::test]
async fn a_peer_dying_mid_frame_is_reported() {
    let (mut server, client) = pair(plain("s", 0), plain("c", 1)).await;
    let t = sample(DType::F64, &[1000], 1);
    let e = payload::encode(&t).unwrap();
    // Header and descriptors, then only part of the tensor bytes.
    let descs = e.descriptors();
    let full = ferry_wire::Frame::encode(
        MessageKind::REQUEST,
        Flags::NONE,
        1,
        &descs,
        &e.payload,
        &[e.tensors[0].bytes()],
    );
    let mut w = client.writer;
    w.write_raw_for_tests(&full[..full.len() - 100]).await;
    drop(w);
    drop(client.reader);
    let err = server.reader.read().await.unwrap_err();
    assert!(
        matches!(err, TransportError::Closed { ref peer } if peer == "c"),
        "{err}"
    );
}

#[tokio::test]
async fn allocation_hook_provides_destinations() {
    use ferry_transport::{Allocator, RawAllocator, RecvBuffer};
    use std::sync::atomic::{AtomicUsize, Ordering};
    struct Counting(AtomicUsize);
    impl Allocator for Counting {
        fn allocate(
            &self,
            d: &ferry_wire::TensorDescriptor,
        ) -> Result<Box<dyn RecvBuffer>, TransportError> {
            self.0.fetch_add(d.byte_len as usize, Ordering::SeqCst);
            RawAllocator.allocate(d)
        }
    }
    let counting = Arc::new(Counting(AtomicUsize::new(0)));
    let mut server_end = Endpoint::new("s", 0);
    server_end.allocator = counting.clone();
    let (mut server, mut client) = pair(server_end, Endpoint::new("c", 1)).await;
    let ts = vec![
        sample(DType::I32, &[10], 0),
        sample(DType::BF16, &[3, 3], 1),
    ];
    client.writer.write(&message(1, &ts)).await.unwrap();
    let back: Vec<RawTensor> = decode(server.reader.read().await.unwrap().unwrap());
    assert_eq!(back, ts);
    assert_eq!(counting.0.load(Ordering::SeqCst), 40 + 18);
}
