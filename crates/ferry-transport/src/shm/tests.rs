//! Shared-memory rings end to end: two mappings of one memfd, bulk data in
//! both directions, fd passing over a Unix socket, end of stream, a peer
//! that goes away, and bad input from the peer.
#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use super::ring::Ring;
use super::segment::Segment;
use super::{recv_fds, send_fds, PeerGone, ShmLink, ShmReader, ShmWriter};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::oneshot;

/// Every test is bounded: a hang is a failure, not a stuck CI job.
const LIMIT: Duration = Duration::from_secs(20);

async fn bounded<T>(fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, fut)
        .await
        .expect("test timed out")
}

/// A peer-gone future fired by sending on (or dropping) the returned sender.
fn gone_signal() -> (oneshot::Sender<()>, PeerGone) {
    let (tx, rx) = oneshot::channel::<()>();
    (
        tx,
        Box::pin(async move {
            let _ = rx.await;
        }),
    )
}

/// Both sides of a link in this process: the second side maps the memfd a
/// second time, through the duplicated fds, as a peer process would.
fn link_pair(
    capacity: usize,
    gone_a: Option<PeerGone>,
    gone_b: Option<PeerGone>,
) -> ((ShmReader, ShmWriter), (ShmReader, ShmWriter)) {
    let (a, fds) = ShmLink::create(capacity).unwrap();
    assert_eq!(fds.len(), ShmLink::FD_COUNT);
    let b = ShmLink::open(fds).unwrap();
    assert_eq!(b.capacity(), capacity);
    (a.split(gone_a), b.split(gone_b))
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The stream is `PATTERN[i % PERIOD]`; `doubled` holds two periods so any
/// chunk of at most `PERIOD` bytes is one slice.
const PERIOD: usize = 65_521;

fn doubled_pattern(seed: u64) -> Vec<u8> {
    let mut rng = XorShift(seed);
    let period: Vec<u8> = (0..PERIOD).map(|_| rng.next() as u8).collect();
    [period.as_slice(), period.as_slice()].concat()
}

async fn send_pattern(mut w: ShmWriter, total: usize, seed: u64) {
    let pattern = doubled_pattern(seed);
    let mut rng = XorShift(seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut pos = 0;
    while pos < total {
        // Mostly small writes, some up to a whole period.
        let max = if rng.below(8) == 0 { PERIOD } else { 4096 };
        let len = (rng.below(max) + 1).min(total - pos);
        let off = pos % PERIOD;
        let n = w.write(&pattern[off..off + len]).await.unwrap();
        assert!(n > 0);
        pos += n;
    }
    w.shutdown().await.unwrap();
}

async fn check_pattern(mut r: ShmReader, total: usize, seed: u64) {
    let pattern = doubled_pattern(seed);
    let mut rng = XorShift(seed ^ 0x5851_f42d_4c95_7f2d);
    let mut buf = vec![0u8; PERIOD];
    let mut pos = 0;
    loop {
        let len = rng.below(PERIOD) + 1;
        let n = r.read(&mut buf[..len]).await.unwrap();
        if n == 0 {
            break;
        }
        let off = pos % PERIOD;
        if buf[..n] != pattern[off..off + n] {
            panic!("wrong bytes in stream range {pos}..{}", pos + n);
        }
        pos += n;
    }
    assert_eq!(pos, total, "stream ended early");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_data_both_directions_through_two_mappings() {
    const TOTAL: usize = 64 << 20;
    let ((ra, wa), (rb, wb)) = link_pair(1 << 20, None, None);
    bounded(async move {
        let tasks = [
            tokio::spawn(send_pattern(wa, TOTAL, 1)),
            tokio::spawn(check_pattern(rb, TOTAL, 1)),
            tokio::spawn(send_pattern(wb, TOTAL, 2)),
            tokio::spawn(check_pattern(ra, TOTAL, 2)),
        ];
        for t in tasks {
            t.await.unwrap();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_ring_many_wake_ups() {
    // A 64-byte ring makes both sides sleep and wake constantly.
    const TOTAL: usize = 1 << 18;
    let ((_ra, wa), (rb, _wb)) = link_pair(64, None, None);
    bounded(async move {
        let w = tokio::spawn(send_pattern(wa, TOTAL, 3));
        let r = tokio::spawn(check_pattern(rb, TOTAL, 3));
        w.await.unwrap();
        r.await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn fds_over_a_unix_socket_then_messages_both_ways() {
    bounded(async {
        let (sa, sb) = UnixStream::pair().unwrap();
        let (link, fds) = ShmLink::create(4096).unwrap();
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        send_fds(&sa, b"link", &borrowed).await.unwrap();
        drop(fds);
        let mut buf = [0u8; 16];
        let (n, received) = recv_fds(&sb, &mut buf, ShmLink::FD_COUNT).await.unwrap();
        assert_eq!(&buf[..n], b"link");
        assert_eq!(received.len(), ShmLink::FD_COUNT);
        let peer = ShmLink::open(received).unwrap();

        let (mut ra, mut wa) = link.split(None);
        let (mut rb, mut wb) = peer.split(None);
        for i in 0..100u32 {
            let msg = format!("ping {i}");
            wa.write_all(msg.as_bytes()).await.unwrap();
            let mut got = vec![0u8; msg.len()];
            rb.read_exact(&mut got).await.unwrap();
            assert_eq!(got, msg.as_bytes());
            let reply = format!("pong {i}");
            wb.write_all(reply.as_bytes()).await.unwrap();
            let mut got = vec![0u8; reply.len()];
            ra.read_exact(&mut got).await.unwrap();
            assert_eq!(got, reply.as_bytes());
        }
        // A message larger than the ring goes through in pieces.
        let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let (big2, mut got) = (big.clone(), Vec::new());
        let writer = tokio::spawn(async move {
            wa.write_all(&big2).await.unwrap();
            wa.shutdown().await.unwrap();
        });
        rb.read_to_end(&mut got).await.unwrap();
        writer.await.unwrap();
        assert_eq!(got, big);
    })
    .await;
}

#[tokio::test]
async fn eof_after_shutdown_and_after_drop() {
    bounded(async {
        let ((mut ra, wa), (mut rb, mut wb)) = link_pair(256, None, None);
        wb.write_all(b"last words").await.unwrap();
        wb.shutdown().await.unwrap();
        let err = wb.write(b"more").await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
        let mut got = Vec::new();
        ra.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"last words");
        // End of stream is sticky.
        assert_eq!(ra.read(&mut [0u8; 8]).await.unwrap(), 0);

        // Dropping the writer without shutdown also ends the stream, waking
        // a reader that already waits.
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            rb.read_to_end(&mut got).await.unwrap();
            got
        });
        tokio::task::yield_now().await;
        drop(wa);
        assert!(reader.await.unwrap().is_empty());
    })
    .await;
}

/// Polls `fut` once and asserts that it is waiting.
async fn assert_pending<F: Future + Unpin>(fut: &mut F) {
    std::future::poll_fn(|cx| {
        assert!(
            Pin::new(&mut *fut).poll(cx).is_pending(),
            "expected to wait"
        );
        Poll::Ready(())
    })
    .await;
}

#[tokio::test]
async fn peer_gone_fails_a_waiting_reader_and_writer() {
    bounded(async {
        let (fire, gone) = gone_signal();
        let ((mut ra, mut wa), (_rb, _wb)) = link_pair(64, Some(gone), None);
        // The writer fills the ring, then waits for space; the reader waits
        // for data. Both share one peer-gone future.
        wa.write_all(&[7u8; 64]).await.unwrap();
        let mut buf = [0u8; 8];
        let mut read = Box::pin(ra.read(&mut buf));
        assert_pending(&mut read).await;
        let mut write = Box::pin(wa.write(b"x"));
        assert_pending(&mut write).await;
        fire.send(()).unwrap();
        let err = read.await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert!(err.to_string().contains("went away"), "{err}");
        let err = write.await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
        // It stays failed.
        assert_eq!(
            ra.read(&mut [0u8; 8]).await.unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    })
    .await;
}

#[tokio::test]
async fn peer_gone_still_delivers_buffered_bytes() {
    bounded(async {
        let (fire, gone) = gone_signal();
        let ((_ra, mut wa), (mut rb, _wb)) = link_pair(64, None, Some(gone));
        wa.write_all(b"before the crash").await.unwrap();
        // A crash never sets `closed`: forget the writer instead of dropping it.
        std::mem::forget(wa);
        drop(fire);
        let mut got = [0u8; 16];
        rb.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"before the crash");
        let err = rb.read(&mut [0u8; 4]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    })
    .await;
}

#[tokio::test]
async fn dropped_reader_fails_the_writer() {
    bounded(async {
        let ((_ra, mut wa), (rb, _wb)) = link_pair(64, None, None);
        wa.write_all(&[1u8; 64]).await.unwrap();
        let mut write = Box::pin(wa.write(b"x"));
        assert_pending(&mut write).await;
        drop(rb);
        assert_eq!(write.await.unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    })
    .await;
}

#[test]
fn create_and_open_reject_bad_input() {
    // Capacity not a power of two.
    assert!(ShmLink::create(1000).is_err());
    assert!(ShmLink::create(0).is_err());

    // Too few or too many fds.
    let (_a, mut fds) = ShmLink::create(1024).unwrap();
    let extra = rustix::io::fcntl_dupfd_cloexec(fds[1].as_fd(), 0).unwrap();
    let last = fds.pop().unwrap();
    assert!(ShmLink::open(fds).is_err());
    let (_a, mut fds) = ShmLink::create(1024).unwrap();
    fds.push(last);
    fds.push(extra);
    assert!(ShmLink::open(fds).is_err());

    let eventfds = || -> Vec<OwnedFd> {
        let (_l, fds) = ShmLink::create(64).unwrap();
        fds.into_iter().skip(1).collect()
    };
    let with_memfd = |memfd: OwnedFd| {
        let mut fds = vec![memfd];
        fds.extend(eventfds());
        ShmLink::open(fds)
    };
    // A segment of the right size whose headers were never written.
    let blank = Segment::create(2 * Ring::bytes_needed(1024), "blank").unwrap();
    let dup = rustix::io::fcntl_dupfd_cloexec(blank.fd(), 0).unwrap();
    let err = with_memfd(dup).unwrap_err().to_string();
    assert!(err.contains("magic"), "{err}");
    // A segment of the wrong size for its headers: a valid link's memfd is
    // fine, but an odd-sized one or one with an extra page is not.
    let odd = Segment::create(2 * Ring::bytes_needed(1024) + 1, "odd").unwrap();
    assert!(with_memfd(rustix::io::fcntl_dupfd_cloexec(odd.fd(), 0).unwrap()).is_err());
    let (_l, fds) = ShmLink::create(1024).unwrap();
    let memfd = fds.into_iter().next().unwrap();
    assert!(with_memfd(memfd).is_ok());
    // Something that is not a sealed memfd.
    let (pipe_r, _pipe_w) = rustix::pipe::pipe().unwrap();
    assert!(with_memfd(pipe_r).is_err());
}

#[test]
fn open_rejects_a_mismatched_capacity() {
    // A well-formed ring header whose capacity does not fill its region.
    let per = Ring::bytes_needed(4096);
    let seg = Segment::create(2 * per, "mismatch").unwrap();
    for offset in [0, per] {
        let ptr = std::ptr::NonNull::new(seg.as_ptr().wrapping_add(offset)).unwrap();
        // SAFETY: inside the mapping; no other ring uses it.
        unsafe { Ring::init(ptr, per, 1024) }.unwrap();
    }
    let mut fds = vec![rustix::io::fcntl_dupfd_cloexec(seg.fd(), 0).unwrap()];
    let (_l, more) = ShmLink::create(64).unwrap();
    fds.extend(more.into_iter().skip(1));
    let err = ShmLink::open(fds).unwrap_err().to_string();
    assert!(err.contains("does not match"), "{err}");
}

#[tokio::test]
async fn recv_fds_rejects_more_fds_than_expected() {
    bounded(async {
        let (sa, sb) = UnixStream::pair().unwrap();
        let (_link, fds) = ShmLink::create(64).unwrap();
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        send_fds(&sa, b"x", &borrowed).await.unwrap();
        let err = recv_fds(&sb, &mut [0u8; 4], 1).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);

        // Plain bytes come through with no fds; end of stream reads 0.
        send_fds(&sa, b"plain", &[]).await.unwrap();
        let mut buf = [0u8; 8];
        let (n, none) = recv_fds(&sb, &mut buf, 4).await.unwrap();
        assert_eq!((&buf[..n], none.len()), (&b"plain"[..], 0));
        drop(sa);
        assert_eq!(recv_fds(&sb, &mut buf, 4).await.unwrap().0, 0);
        assert!(send_fds(&sb, b"", &[]).await.is_err());
    })
    .await;
}

/// Polls `r` once for a read into a fresh buffer; the poll must be pending.
fn poll_pending_once(r: &mut ShmReader, cx: &mut std::task::Context<'_>) {
    let mut bytes = [0u8; 8];
    let mut buf = tokio::io::ReadBuf::new(&mut bytes);
    assert!(tokio::io::AsyncRead::poll_read(Pin::new(r), cx, &mut buf).is_pending());
}

/// Held by the tests that watch a reader arm its sleep: the spin policy
/// ([`crate::spin::compute_bound`], [`crate::spin::awaiting_input`]) is
/// process-wide, and one of them changes it.
static SPIN_POLICY: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `test` on a one-thread runtime, bounded, holding [`SPIN_POLICY`].
fn under_spin_policy(test: impl Future<Output = ()>) {
    let _policy = SPIN_POLICY
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(bounded(test));
}

#[test]
fn yield_before_spin_lets_queued_tasks_run_before_the_reader_spins_and_sleeps() {
    under_spin_policy(async {
        let ((mut r, _w), _other_side) = link_pair(4096, None, None);
        let ran = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ran.clone();
        // The task a message woke: on this one-thread runtime it runs only
        // when the reading task returns.
        tokio::spawn(async move { flag.store(true, std::sync::atomic::Ordering::SeqCst) });
        r.yield_before_spin();
        // First poll of an empty ring: back to the scheduler at once,
        // neither spinning nor arming the sleep.
        std::future::poll_fn(|cx| {
            poll_pending_once(&mut r, cx);
            Poll::Ready(())
        })
        .await;
        assert!(format!("{r:?}").contains("armed: false"), "{r:?}");
        // Let the scheduler run what is queued.
        tokio::task::yield_now().await;
        assert!(ran.load(std::sync::atomic::Ordering::SeqCst));
        // The next poll spins as usual, then arms the sleep; so does every
        // later read (the request is for one yield).
        std::future::poll_fn(|cx| {
            poll_pending_once(&mut r, cx);
            Poll::Ready(())
        })
        .await;
        assert!(format!("{r:?}").contains("armed: true"), "{r:?}");
    });
}

/// A waker that counts its wake-ups.
#[derive(Default)]
struct CountWakes(std::sync::atomic::AtomicUsize);

impl std::task::Wake for CountWakes {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl CountWakes {
    fn count(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[test]
fn with_cores_to_spare_a_sleeping_reader_polls_while_an_input_is_awaited() {
    use crate::spin::{awaiting_input, compute_bound, HostCores};
    under_spin_policy(async {
        let ((mut r, _w), (_other_reader, mut w)) = link_pair(4096, None, None);
        let _spare = compute_bound(HostCores::Spare);
        let wakes = std::sync::Arc::new(CountWakes::default());
        let waker = std::task::Waker::from(wakes.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        // Nothing awaited: a reader of an empty ring spins, then sleeps.
        poll_pending_once(&mut r, &mut cx);
        assert!(format!("{r:?}").contains("armed: true"), "{r:?}");
        assert_eq!(wakes.count(), 0);
        // An input comes to be awaited: the sleeping reader is woken...
        let awaiting = awaiting_input();
        assert_eq!(wakes.count(), 1);
        // ...and polls rather than sleeps: not armed, its task asked to be
        // polled again at once.
        poll_pending_once(&mut r, &mut cx);
        assert!(format!("{r:?}").contains("armed: false"), "{r:?}");
        assert_eq!(wakes.count(), 2);
        // The message needs no eventfd signal: the next poll reads it.
        let written = tokio::io::AsyncWrite::poll_write(Pin::new(&mut w), &mut cx, b"hand-off");
        assert!(matches!(written, Poll::Ready(Ok(8))), "{written:?}");
        let mut bytes = [0u8; 8];
        let mut buf = tokio::io::ReadBuf::new(&mut bytes);
        let read = tokio::io::AsyncRead::poll_read(Pin::new(&mut r), &mut cx, &mut buf);
        assert!(matches!(read, Poll::Ready(Ok(()))), "{read:?}");
        assert_eq!(buf.filled(), b"hand-off");
        // Nothing awaited any more: the reader sleeps again.
        drop(awaiting);
        poll_pending_once(&mut r, &mut cx);
        assert!(format!("{r:?}").contains("armed: true"), "{r:?}");
    });
}

#[test]
fn with_cores_scarce_an_awaited_input_leaves_the_reader_asleep() {
    use crate::spin::{awaiting_input, compute_bound, HostCores};
    under_spin_policy(async {
        let ((mut r, _w), _other_side) = link_pair(4096, None, None);
        let _scarce = compute_bound(HostCores::Scarce);
        let wakes = std::sync::Arc::new(CountWakes::default());
        let waker = std::task::Waker::from(wakes.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        poll_pending_once(&mut r, &mut cx);
        let _awaiting = awaiting_input();
        poll_pending_once(&mut r, &mut cx);
        assert!(format!("{r:?}").contains("armed: true"), "{r:?}");
        assert_eq!(wakes.count(), 0);
    });
}
