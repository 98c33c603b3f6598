//! The multi-lane TCP channel over real loopback sockets: lane setup,
//! tensors of mixed sizes on 1, 2 and 4 lanes, bad hellos, bad chunk
//! headers, and either end going away.
#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use ferry_transport::mpt::{
    connect_lanes, split, ChunkHeader, Lane, LaneHello, LaneListener, MptReceiver, MptSender,
};
use ferry_transport::{Allocator, RawAllocator, RawTensor, RecvBuffer, TransportError};
use ferry_wire::payload::OutgoingTensor;
use ferry_wire::{DType, WireError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
/// Lane setup deadline (only reached when a test is broken).
const SETUP: Duration = Duration::from_secs(10);
/// Safety net around every test body: nothing here waits on a timer.
const NET: Duration = Duration::from_secs(60);

async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(NET, f)
        .await
        .expect("test did not finish within its safety timeout")
}

/// A sender and a receiver joined by `lanes` loopback lanes.
async fn pair(lanes: usize) -> (MptSender, MptReceiver) {
    let listener = LaneListener::bind(LOCALHOST).await.unwrap();
    let addr = listener.local_addr();
    let (accepted, connected) = tokio::join!(
        listener.accept(0xfe44_0001, lanes, SETUP),
        connect_lanes(addr, 0xfe44_0001, lanes, SETUP)
    );
    let (accepted, connected) = (accepted.unwrap(), connected.unwrap());
    assert_eq!(accepted.len(), lanes);
    assert_eq!(connected.len(), lanes);
    (
        MptSender::new(connected, "the receiver"),
        MptReceiver::new(accepted, "the sender"),
    )
}

/// A u8 tensor of `len` bytes whose contents depend on `seed`.
fn tensor(len: usize, seed: u64) -> RawTensor {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let bytes: Vec<u8> = (0..len)
        .map(|i| {
            if i % 8 == 0 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
            }
            (state >> ((i % 8) * 8)) as u8
        })
        .collect();
    RawTensor::from_bytes(DType::U8, &[len as i64], &bytes).unwrap()
}

fn destination(t: &RawTensor) -> Box<dyn RecvBuffer> {
    RawAllocator.allocate(&t.descriptor()).unwrap()
}

fn finish(buffer: Box<dyn RecvBuffer>) -> RawTensor {
    *buffer.finish().unwrap().downcast::<RawTensor>().unwrap()
}

fn assert_same(got: &RawTensor, want: &RawTensor, seq: u64) {
    assert_eq!(got.shape(), want.shape(), "tensor {seq}");
    assert!(
        got.bytes() == want.bytes(),
        "tensor {seq} ({} bytes) arrived with different bytes",
        want.bytes().len()
    );
}

const MIB: usize = 1 << 20;

/// Mixed sizes, including every edge the brief names, small ones repeated so
/// that they rotate over the lanes.
fn sizes() -> Vec<usize> {
    vec![
        0,
        1,
        4095,
        4 * MIB + 3,
        40 * MIB,
        0,
        1,
        4096,
        4097,
        256 << 10,
        (256 << 10) + 1,
        (512 << 10) + 4095,
        4095,
        1,
        3 * MIB,
        0,
        4 * MIB + 3,
        1,
        2,
        3,
    ]
}

/// Sends everything back to back, then registers one destination at a time
/// (lane readers wait for each registration).
async fn round_trip_sequential(lanes: usize) {
    let (sender, receiver) = pair(lanes).await;
    let tensors: Vec<RawTensor> = sizes()
        .into_iter()
        .enumerate()
        .map(|(i, len)| tensor(len, i as u64))
        .collect();
    for (i, t) in tensors.iter().enumerate() {
        // Sparse seqs: only increasing order is required.
        sender.send(10 + 3 * i as u64, Arc::new(t.clone())).unwrap();
    }
    for (i, t) in tensors.iter().enumerate() {
        let seq = 10 + 3 * i as u64;
        let got = receiver.receive(seq, destination(t)).await.unwrap();
        assert_same(&finish(got), t, seq);
    }
    sender.flush().await.unwrap();
    assert!(receiver.error().is_none());
}

/// Registers every destination first (each receive running as its own
/// task), then sends.
async fn round_trip_registered_first(lanes: usize) {
    let (sender, receiver) = pair(lanes).await;
    let tensors: Vec<RawTensor> = sizes()
        .into_iter()
        .rev()
        .enumerate()
        .map(|(i, len)| tensor(len, 1000 + i as u64))
        .collect();
    let waits: Vec<_> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| tokio::spawn(receiver.receive(i as u64, destination(t))))
        .collect();
    for (i, t) in tensors.iter().enumerate() {
        sender.send(i as u64, Arc::new(t.clone())).unwrap();
    }
    for (i, (wait, t)) in waits.into_iter().zip(&tensors).enumerate() {
        let got = wait.await.unwrap().unwrap();
        assert_same(&finish(got), t, i as u64);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lane_round_trip() {
    bounded(async {
        round_trip_sequential(1).await;
        round_trip_registered_first(1).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_lane_round_trip() {
    bounded(async {
        round_trip_sequential(2).await;
        round_trip_registered_first(2).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_lane_round_trip() {
    bounded(async {
        round_trip_sequential(4).await;
        round_trip_registered_first(4).await;
    })
    .await;
}

#[tokio::test(flavor = "current_thread")]
async fn four_lanes_on_a_single_thread() {
    bounded(round_trip_sequential(4)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_small_tensors_interleaved() {
    bounded(async {
        let (sender, receiver) = pair(3).await;
        let receiver = Arc::new(receiver);
        let tensors: Vec<RawTensor> = (0..500)
            .map(|i| tensor([0, 1, 7, 4096, 70_000, 300_000][i % 6], i as u64))
            .collect();
        let expected = tensors.clone();
        let rx = receiver.clone();
        let reader = tokio::spawn(async move {
            for (i, t) in expected.iter().enumerate() {
                let got = rx.receive(i as u64, destination(t)).await.unwrap();
                assert_same(&finish(got), t, i as u64);
            }
        });
        for (i, t) in tensors.into_iter().enumerate() {
            sender.send(i as u64, Arc::new(t)).unwrap();
            if i % 50 == 0 {
                sender.flush().await.unwrap();
            }
        }
        reader.await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn seqs_must_increase() {
    bounded(async {
        let (sender, receiver) = pair(2).await;
        let t = tensor(10, 1);
        sender.send(5, Arc::new(t.clone())).unwrap();
        assert!(sender.send(5, Arc::new(t.clone())).is_err());
        assert!(sender.send(4, Arc::new(t.clone())).is_err());
        let got = receiver.receive(5, destination(&t)).await.unwrap();
        assert_same(&finish(got), &t, 5);
        assert!(receiver.receive(5, destination(&t)).await.is_err());
    })
    .await;
}

#[tokio::test]
async fn bad_hellos_are_dropped() {
    bounded(async {
        let listener = LaneListener::bind(LOCALHOST).await.unwrap();
        let addr = listener.local_addr();
        let strays = async {
            // Wrong nonce, through the real connector.
            let wrong_nonce = connect_lanes(addr, 2, 1, SETUP).await.unwrap();
            // Wrong magic, wrong lane count, index out of range.
            let mut raw = Vec::new();
            for bytes in [
                *b"NOTFERRYxxxxxxxxxxxxxxxx",
                LaneHello {
                    nonce: 1,
                    index: 0,
                    count: 3,
                }
                .encode(),
                LaneHello {
                    nonce: 1,
                    index: 2,
                    count: 2,
                }
                .encode(),
            ] {
                let mut s = TcpStream::connect(addr).await.unwrap();
                s.write_all(&bytes).await.unwrap();
                raw.push(s);
            }
            // A connection that never says hello.
            raw.push(TcpStream::connect(addr).await.unwrap());
            // Then the real ones.
            let good = connect_lanes(addr, 1, 2, SETUP).await.unwrap();
            (wrong_nonce, raw, good)
        };
        let (accepted, (wrong_nonce, raw, good)) =
            tokio::join!(listener.accept(1, 2, SETUP), strays);
        let accepted = accepted.unwrap();
        assert_eq!(accepted.len(), 2);
        // The rejected ones were closed by the listener.
        for mut s in wrong_nonce
            .into_iter()
            .map(Lane::into_stream)
            .chain(raw.into_iter().take(3))
        {
            let mut b = [0u8; 1];
            let n = s.read(&mut b).await.unwrap_or(0);
            assert_eq!(n, 0, "a rejected lane stays open");
        }
        // The accepted ones are the good lanes, in order.
        let sender = MptSender::new(good, "r");
        let receiver = MptReceiver::new(accepted, "s");
        let t = tensor(3 * MIB, 9);
        sender.send(0, Arc::new(t.clone())).unwrap();
        let got = receiver.receive(0, destination(&t)).await.unwrap();
        assert_same(&finish(got), &t, 0);
    })
    .await;
}

#[tokio::test]
async fn accept_times_out_with_only_wrong_lanes() {
    bounded(async {
        let listener = LaneListener::bind(LOCALHOST).await.unwrap();
        let addr = listener.local_addr();
        let (accepted, wrong) = tokio::join!(
            listener.accept(1, 2, Duration::from_millis(300)),
            connect_lanes(addr, 2, 2, SETUP)
        );
        wrong.unwrap();
        match accepted {
            Err(TransportError::Handshake { reason, .. }) => {
                assert!(reason.contains("0 of 2"), "{reason}")
            }
            other => panic!(
                "expected a handshake timeout, got {:?}",
                other.map(|v| v.len())
            ),
        }
    })
    .await;
}

#[tokio::test]
async fn lane_counts_are_checked() {
    let listener = LaneListener::bind(LOCALHOST).await.unwrap();
    assert!(listener.accept(1, 0, SETUP).await.is_err());
    assert!(listener.accept(1, 65, SETUP).await.is_err());
    assert!(connect_lanes(listener.local_addr(), 1, 0, SETUP)
        .await
        .is_err());
}

/// A receiver on `lanes` lanes whose sending ends are raw sockets.
async fn raw_pair(lanes: usize) -> (Vec<TcpStream>, MptReceiver) {
    let listener = LaneListener::bind(LOCALHOST).await.unwrap();
    let (accepted, raw) = tokio::join!(
        listener.accept(77, lanes, SETUP),
        connect_lanes(listener.local_addr(), 77, lanes, SETUP)
    );
    (
        raw.unwrap().into_iter().map(Lane::into_stream).collect(),
        MptReceiver::new(accepted.unwrap(), "raw peer"),
    )
}

async fn expect_malformed(
    len: usize,
    lanes: usize,
    write: impl FnOnce(&mut Vec<TcpStream>) -> Vec<(usize, Vec<u8>)>,
) -> WireError {
    let (mut raw, receiver) = raw_pair(lanes).await;
    let t = tensor(len, 3);
    let pending = receiver.receive(0, destination(&t));
    for (lane, bytes) in write(&mut raw) {
        raw[lane].write_all(&bytes).await.unwrap();
    }
    let err = pending
        .await
        .err()
        .expect("a bad chunk header was accepted");
    // Later receives fail too.
    assert!(receiver.receive(1, destination(&t)).await.is_err());
    match err {
        TransportError::Malformed { peer, source } => {
            assert_eq!(peer, "raw peer");
            source
        }
        other => panic!("expected Malformed, got {other}"),
    }
}

fn header(seq: u64, offset: u64, len: u64) -> Vec<u8> {
    ChunkHeader { seq, offset, len }.encode().to_vec()
}

#[tokio::test]
async fn chunk_past_the_end_is_malformed() {
    bounded(async {
        let e = expect_malformed(8192, 1, |_| vec![(0, header(0, 4096, 8192))]).await;
        assert!(matches!(e, WireError::TooLarge { .. }), "{e}");
        let e = expect_malformed(8192, 1, |_| vec![(0, header(0, u64::MAX, 2))]).await;
        assert!(matches!(e, WireError::TooLarge { .. }), "{e}");
    })
    .await;
}

#[tokio::test]
async fn chunk_outside_the_plan_is_malformed() {
    bounded(async {
        // In bounds but not the range the plan gives lane 0.
        let e = expect_malformed(8192, 1, |_| vec![(0, header(0, 0, 4096))]).await;
        assert!(matches!(e, WireError::InvalidDescriptor(_)), "{e}");
        // 2 MiB on 2 lanes: seq 0 puts 0..1 MiB on lane 0; lane 1 claims it.
        let plan: Vec<_> = split(0, 2 * MIB as u64, 2).collect();
        assert_eq!(plan[0].lane, 0);
        let (o, l) = (plan[0].offset, plan[0].len);
        let e = expect_malformed(2 * MIB, 2, |_| vec![(1, header(0, o, l))]).await;
        assert!(matches!(e, WireError::InvalidDescriptor(_)), "{e}");
    })
    .await;
}

#[tokio::test]
async fn skipped_or_unknown_seq_is_malformed() {
    bounded(async {
        // Seq 0 is registered and owed by lane 0, which sends seq 9 instead.
        let e = expect_malformed(100, 1, |_| vec![(0, header(9, 0, 100))]).await;
        assert!(
            e.to_string().contains("before its chunk of tensor 0"),
            "{e}"
        );
        // A chunk for a seq that was never registered, while later ones were.
        let (mut raw, receiver) = raw_pair(1).await;
        let t = tensor(0, 0);
        raw[0].write_all(&header(3, 0, 5)).await.unwrap();
        receiver.receive(7, destination(&t)).await.unwrap();
        let t = tensor(10, 0);
        assert!(receiver.receive(8, destination(&t)).await.is_err());
        assert!(matches!(
            receiver.error(),
            Some(TransportError::Malformed { .. })
        ));
    })
    .await;
}

#[tokio::test]
async fn lane_closed_mid_chunk_fails_receive() {
    bounded(async {
        let (mut raw, receiver) = raw_pair(2).await;
        let t = tensor(8 * MIB, 4);
        let pending = receiver.receive(0, destination(&t));
        let plan: Vec<_> = split(0, t.bytes().len() as u64, 2).collect();
        // Lane of chunk 0: header and half of its bytes, then gone.
        let c = plan[0];
        let mut stream = raw.remove(c.lane);
        stream.write_all(&header(0, c.offset, c.len)).await.unwrap();
        let start = c.offset as usize;
        stream
            .write_all(&t.bytes()[start..start + c.len as usize / 2])
            .await
            .unwrap();
        drop(stream);
        match pending.await {
            Err(TransportError::Closed { peer }) => assert_eq!(peer, "raw peer"),
            other => panic!("expected Closed, got {:?}", other.err()),
        }
        assert!(matches!(
            receiver.receive(1, destination(&t)).await,
            Err(TransportError::Closed { .. })
        ));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_dropped_mid_transfer_fails_receive() {
    bounded(async {
        for lanes in [1, 2] {
            let (sender, receiver) = pair(lanes).await;
            // Nothing is registered yet, so each lane reader stops after the
            // chunk header and its socket's receive buffer does not grow:
            // 96 MiB cannot all be in flight (the send buffers top out at
            // `net.ipv4.tcp_wmem`'s maximum, 4 MiB by default), so dropping
            // the sender cuts the transfer, wherever the writers were.
            let t = tensor(96 * MIB, 5);
            sender.send(0, Arc::new(t.clone())).unwrap();
            drop(sender);
            match receiver.receive(0, destination(&t)).await {
                Err(TransportError::Closed { peer }) => assert_eq!(peer, "the sender"),
                other => panic!("expected Closed, got {:?}", other.err()),
            }
            assert!(receiver.receive(1, destination(&t)).await.is_err());
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_gone_before_a_registered_tensor() {
    bounded(async {
        let (sender, receiver) = pair(2).await;
        let t = tensor(3 * MIB, 6);
        sender.send(0, Arc::new(t.clone())).unwrap();
        let got = receiver.receive(0, destination(&t)).await.unwrap();
        assert_same(&finish(got), &t, 0);
        let pending = receiver.receive(1, destination(&t));
        sender.flush().await.unwrap();
        drop(sender);
        assert!(matches!(pending.await, Err(TransportError::Closed { .. })));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushed_then_dropped_sender_still_delivers() {
    bounded(async {
        let (sender, receiver) = pair(4).await;
        let t = tensor(10 * MIB, 7);
        let small = tensor(5, 8);
        sender.send(0, Arc::new(t.clone())).unwrap();
        sender.send(1, Arc::new(small.clone())).unwrap();
        sender.flush().await.unwrap();
        drop(sender);
        let got = receiver.receive(0, destination(&t)).await.unwrap();
        assert_same(&finish(got), &t, 0);
        // Seq 1 rides on lane 1, which may have ended already: still delivered.
        let got = receiver.receive(1, destination(&small)).await.unwrap();
        assert_same(&finish(got), &small, 1);
        // Anything more needs a lane that has ended (or will).
        assert!(receiver.receive(2, destination(&t)).await.is_err());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_dropped_makes_send_fail() {
    bounded(async {
        let (sender, receiver) = pair(2).await;
        drop(receiver);
        let t = Arc::new(tensor(MIB, 1));
        let mut seq = 0;
        let err = loop {
            let sent = sender.send(seq, t.clone());
            seq += 1;
            if let Err(e) = sent {
                break e;
            }
            if let Err(e) = sender.flush().await {
                break e;
            }
        };
        assert!(
            matches!(
                err,
                TransportError::Closed { ref peer } | TransportError::Io { ref peer, .. }
                    if peer == "the receiver"
            ),
            "{err}"
        );
        // The error is kept.
        assert!(sender.send(seq, t.clone()).is_err());
        assert!(sender.flush().await.is_err());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_receive_future_keeps_the_stream_in_step() {
    bounded(async {
        let (sender, receiver) = pair(2).await;
        let big = tensor(6 * MIB, 1);
        let next = tensor(3 * MIB, 2);
        drop(receiver.receive(0, destination(&big)));
        sender.send(0, Arc::new(big)).unwrap();
        sender.send(1, Arc::new(next.clone())).unwrap();
        let got = receiver.receive(1, destination(&next)).await.unwrap();
        assert_same(&finish(got), &next, 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_dropped_with_pending_receive() {
    bounded(async {
        let (_sender, receiver) = pair(2).await;
        let t = tensor(2 * MIB, 1);
        let pending = receiver.receive(0, destination(&t));
        drop(receiver);
        assert!(matches!(pending.await, Err(TransportError::Closed { .. })));
    })
    .await;
}

/// Passes one lane's authentication through, then its records, flipping
/// one byte of the first record large enough to hold a chunk's bytes
/// (an attacker on the path between the two hosts).
async fn flipping_proxy(listener: tokio::net::TcpListener, to: std::net::SocketAddr) {
    let (c, _) = listener.accept().await.unwrap();
    let s = TcpStream::connect(to).await.unwrap();
    let (mut cr, mut cw) = c.into_split();
    let (mut sr, mut sw) = s.into_split();
    let pass = |n: usize| vec![0u8; n];
    // Hello, challenge, proof, verdict.
    let mut b = pass(38);
    cr.read_exact(&mut b).await.unwrap();
    sw.write_all(&b).await.unwrap();
    let mut b = pass(70);
    sr.read_exact(&mut b).await.unwrap();
    cw.write_all(&b).await.unwrap();
    let mut b = pass(38);
    cr.read_exact(&mut b).await.unwrap();
    sw.write_all(&b).await.unwrap();
    let mut b = pass(6);
    sr.read_exact(&mut b).await.unwrap();
    cw.write_all(&b).await.unwrap();
    let tag = ferry_transport::auth::Protection::Mac.tag_len();
    let mut flipped = false;
    loop {
        let mut len = [0u8; 4];
        if cr.read_exact(&mut len).await.is_err() {
            return;
        }
        let mut record = vec![0u8; u32::from_be_bytes(len) as usize + tag];
        if cr.read_exact(&mut record).await.is_err() {
            return;
        }
        if !flipped && record.len() > 100_000 {
            let at = record.len() / 3;
            record[at] ^= 1;
            flipped = true;
        }
        if sw.write_all(&len).await.is_err() || sw.write_all(&record).await.is_err() {
            return;
        }
    }
}

#[tokio::test]
async fn sealed_lanes_deliver_and_a_flipped_byte_fails_the_receiver() {
    bounded(async {
        let key = ferry_transport::auth::Secret::new(b"the session key of a connection".to_vec())
            .unwrap()
            .key()
            .clone();
        // Untouched, sealed lanes deliver.
        let listener = LaneListener::bind(LOCALHOST).await.unwrap();
        let (accepted, connected) = tokio::join!(
            listener.accept_authenticated(5, 2, SETUP, Some(&key)),
            ferry_transport::mpt::connect_lanes_authenticated(
                listener.local_addr(),
                5,
                2,
                SETUP,
                Some(key.clone())
            )
        );
        let (accepted, connected) = (accepted.unwrap(), connected.unwrap());
        assert!(accepted.iter().chain(&connected).all(Lane::is_sealed));
        let sender = MptSender::new(connected, "r");
        let receiver = MptReceiver::new(accepted, "s");
        let t = tensor(3 * MIB, 4);
        sender.send(0, Arc::new(t.clone())).unwrap();
        let got = receiver.receive(0, destination(&t)).await.unwrap();
        assert_same(&finish(got), &t, 0);

        // Through an attacker on the path that flips one byte.
        let listener = LaneListener::bind(LOCALHOST).await.unwrap();
        let proxy = tokio::net::TcpListener::bind((LOCALHOST, 0)).await.unwrap();
        let via = proxy.local_addr().unwrap();
        let proxying = tokio::spawn(flipping_proxy(proxy, listener.local_addr()));
        let (accepted, connected) = tokio::join!(
            listener.accept_authenticated(6, 1, SETUP, Some(&key)),
            ferry_transport::mpt::connect_lanes_authenticated(via, 6, 1, SETUP, Some(key.clone()))
        );
        let sender = MptSender::new(connected.unwrap(), "r");
        let receiver = MptReceiver::new(accepted.unwrap(), "s");
        sender.send(0, Arc::new(t.clone())).unwrap();
        match receiver.receive(0, destination(&t)).await {
            Err(TransportError::Integrity { source, .. }) => {
                assert!(matches!(
                    source,
                    ferry_transport::auth::RecordError::Forged { .. }
                ))
            }
            other => panic!("expected an integrity error, got {:?}", other.map(|_| ())),
        }
        proxying.abort();
    })
    .await;
}
