use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use super::{UcxLink, UcxWorker, STREAMING_BYTES, STREAMING_FOR, STREAMING_SPIN_FACTOR};

/// Two workers of this process connected to each other, or `None`
/// (with the reason printed) where UCX does not load.
pub(crate) fn linked(tls: &str) -> Option<(UcxLink, UcxLink)> {
    linked_spinning(tls, Duration::from_micros(20))
}

/// As [`linked`], with waits that spin for `spin`.
fn linked_spinning(tls: &str, spin: Duration) -> Option<(UcxLink, UcxLink)> {
    linked_with(tls, spin, super::BACKSTOP)
}

/// As [`linked`], with waits that do not spin and sleeps that only the
/// event fd ends (a backstop of a day).
fn linked_asleep(tls: &str) -> Option<(UcxLink, UcxLink)> {
    linked_with(tls, Duration::ZERO, Duration::from_secs(86_400))
}

fn linked_with(tls: &str, spin: Duration, backstop: Duration) -> Option<(UcxLink, UcxLink)> {
    if let Err(reason) = super::super::viability() {
        eprintln!("skipped: {reason}");
        return None;
    }
    let a = UcxWorker::with_backstop(Some(tls), spin, backstop).unwrap();
    let b = UcxWorker::with_backstop(Some(tls), spin, backstop).unwrap();
    let (addr_a, addr_b) = (a.address().to_vec(), b.address().to_vec());
    Some((
        a.connect(&addr_b, "b").unwrap(),
        b.connect(&addr_a, "a").unwrap(),
    ))
}

/// Two workers of this process, connected through a listener the way
/// the handshake connects them where UCX's transports include TCP
/// ([`UcxWorker::listen`]), with waits that spin for `spin` and sleeps
/// bounded by `backstop`; or `None` where UCX does not load.
async fn linked_by_listener(
    tls: &str,
    spin: Duration,
    backstop: Duration,
) -> Option<(UcxLink, UcxLink)> {
    if let Err(reason) = super::super::viability() {
        eprintln!("skipped: {reason}");
        return None;
    }
    let mut a = UcxWorker::with_backstop(Some(tls), spin, backstop).unwrap();
    let b = UcxWorker::with_backstop(Some(tls), spin, backstop).unwrap();
    let here = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let addr = a.listen(here).unwrap();
    assert_eq!(addr.ip(), here);
    assert_ne!(addr.port(), 0, "the listener's address names its port");
    let b = b.connect_to_listener(addr, "a").unwrap();
    // The client's endpoint connects as its worker progresses: its
    // probe progresses it while this side accepts, as in the handshake.
    let (a, probed) = tokio::join!(
        async {
            let a = a.accept(here, "b", Duration::from_secs(30)).await.unwrap();
            a.probe(1, Duration::from_secs(30)).await.unwrap();
            a
        },
        b.probe(2, Duration::from_secs(30))
    );
    probed.unwrap();
    Some((a, b))
}

/// Sends `len` patterned bytes from `from` to `to` under `tag` and
/// checks every byte that arrives.
async fn cross(from: &UcxLink, to: &UcxLink, tag: u64, len: usize) {
    let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let ptr = bytes.as_ptr();
    // SAFETY: the vector owns the bytes and is kept with the request.
    unsafe { from.send_kept(tag, ptr, len, Box::new(bytes)) }.unwrap();
    let mut dest = vec![0u8; len];
    let dptr = dest.as_mut_ptr();
    // SAFETY: `dest`'s heap bytes move with it into the request.
    let pending = unsafe { to.recv(tag, dptr, len, Box::new(dest)) }.unwrap();
    let (keep, got) = tokio::time::timeout(Duration::from_secs(60), pending)
        .await
        .expect("the message never arrived")
        .unwrap();
    assert_eq!(got, len);
    let dest = keep.downcast::<Vec<u8>>().unwrap();
    assert!(dest.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_made_through_a_listener_carries_small_and_rendezvous_messages_both_ways() {
    let Some((a, b)) = linked_by_listener("tcp", Duration::from_micros(20), super::BACKSTOP).await
    else {
        return;
    };
    // 8 MiB is far above UCX's rendezvous threshold: the zero-copy
    // rendezvous this listener exists for.
    for (tag, len) in [(10, 8), (11, 8 << 20)] {
        cross(&a, &b, tag, len).await;
        cross(&b, &a, tag + 100, len).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_goes_away_fails_a_sleeping_receive_on_a_link_made_through_a_listener() {
    // Peer-failure handling with the connection manager's endpoints: the
    // failure reaches the receive (no backstop: through the event fd),
    // and the process goes on.
    let Some((a, b)) = linked_by_listener("tcp", Duration::ZERO, Duration::from_secs(86_400)).await
    else {
        return;
    };
    a_sleeping_receive_fails_when_its_peer_goes_away(a, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_rejects_a_connection_from_another_address_than_the_peers() {
    if let Err(reason) = super::super::viability() {
        eprintln!("skipped: {reason}");
        return;
    }
    let mut a = UcxWorker::new(Some("tcp"), Duration::from_micros(20)).unwrap();
    let b = UcxWorker::new(Some("tcp"), Duration::from_micros(20)).unwrap();
    let addr = a.listen(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
    let b = b.connect_to_listener(addr, "a").unwrap();
    // This side expects its peer at 127.0.0.2; the request comes from
    // 127.0.0.1 and is rejected, so no connection is accepted. The
    // client's probe progresses its worker meanwhile, and fails: its
    // endpoint was rejected.
    let other = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    let (accepted, probed) = tokio::join!(
        a.accept(other, "b", Duration::from_millis(500)),
        b.probe(4, Duration::from_secs(5))
    );
    let err = accepted
        .err()
        .expect("a request from another address was accepted");
    assert!(
        err.to_string()
            .contains("the peer did not connect to this side's UCX listener within 500ms"),
        "{err}"
    );
    assert!(probed.is_err(), "a rejected endpoint's probe was answered");
}

/// Owns bytes and says when it is dropped.
struct Watched {
    bytes: Vec<u8>,
    dropped: Arc<AtomicBool>,
}
impl Drop for Watched {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_keeps_its_bytes_until_ucx_completes_it() {
    let Some((a, b)) = linked("shm,self") else {
        return;
    };
    let dropped = Arc::new(AtomicBool::new(false));
    let len = 16 << 20;
    let w = Watched {
        bytes: (0..len).map(|i| i as u8).collect(),
        dropped: dropped.clone(),
    };
    let ptr = w.bytes.as_ptr();
    // SAFETY: `w` owns the bytes and is kept with the request.
    unsafe { a.send_kept(5, ptr, len, Box::new(w)) }.unwrap();
    // A rendezvous send cannot complete before the receiver posts.
    assert!(!dropped.load(Ordering::SeqCst));
    assert_eq!(a.in_flight(), 1);
    let mut dest = vec![0u8; len];
    let dptr = dest.as_mut_ptr();
    // SAFETY: `dest`'s heap bytes move with it into the request.
    let pending = unsafe { b.recv(5, dptr, len, Box::new(dest)) }.unwrap();
    let (keep, got) = pending.await.unwrap();
    assert_eq!(got, len);
    let dest = keep.downcast::<Vec<u8>>().unwrap();
    assert!(dest.iter().enumerate().all(|(i, &x)| x == i as u8));
    // The sender's progress task completes the send and lets it go.
    while !dropped.load(Ordering::SeqCst) {
        tokio::task::yield_now().await;
    }
    assert_eq!(a.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_ucx_completes_at_once_leaves_its_bytes_free_and_one_it_keeps_takes_them() {
    for tls in ["shm,self", "tcp"] {
        let Some((a, b)) = linked(tls) else {
            return;
        };
        // Small (eager): on shared memory UCX copies the bytes within
        // the call, so the buffer is overwritten at once and the
        // receiver still gets what was sent. Over tcp the first sends
        // may wait for the connection, and then the bytes go with them.
        let mut small: Vec<u8> = (0..200).map(|i| (i % 251) as u8).collect();
        let ptr = small.as_ptr();
        let mut kept = 0;
        // SAFETY: `keep` takes the Vec, whose heap bytes do not move.
        let done = unsafe {
            a.send_or_keep(21, ptr, 200, || {
                kept += 1;
                Box::new(std::mem::take(&mut small))
            })
        }
        .unwrap();
        if tls.starts_with("shm") {
            assert!(
                done,
                "a 200-byte send over shared memory was not completed at once"
            );
        }
        assert_eq!(kept, usize::from(!done), "UCX_TLS={tls}");
        small.fill(0xFF);
        let kept_before = kept;
        // Large (rendezvous): it cannot finish before the receiver
        // posts, so its bytes go with the send.
        let len = 4 << 20;
        let mut large: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let ptr = large.as_ptr();
        // SAFETY: `keep` takes the Vec, whose heap bytes do not move.
        let done = unsafe {
            a.send_or_keep(22, ptr, len, || {
                kept += 1;
                Box::new(std::mem::take(&mut large))
            })
        }
        .unwrap();
        assert!(!done, "UCX_TLS={tls}: a rendezvous send completed at once");
        assert_eq!((kept - kept_before, large.len()), (1, 0), "UCX_TLS={tls}");
        assert!(
            a.in_flight() >= 1,
            "UCX_TLS={tls}: the kept send is not in flight"
        );
        for (tag, n) in [(21u64, 200usize), (22, len)] {
            let mut dest = vec![0u8; n];
            let dptr = dest.as_mut_ptr();
            // SAFETY: `dest`'s heap bytes move with it into the request.
            let pending = unsafe { b.recv(tag, dptr, n, Box::new(dest)) }.unwrap();
            let (keep, got) = pending.await.unwrap();
            assert_eq!(got, n, "UCX_TLS={tls}: tag {tag}");
            let dest = keep.downcast::<Vec<u8>>().unwrap();
            assert!(
                dest.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8),
                "UCX_TLS={tls}: tag {tag}: the bytes differ"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_moving_bulk_data_spins_longer_until_it_has_been_quiet_a_while() {
    let spin = Duration::from_micros(50);
    let Some((a, b)) = linked_spinning("shm,self", spin) else {
        return;
    };
    let streaming = spin * STREAMING_SPIN_FACTOR;
    assert_eq!(a.shared.spin_budget(), spin);
    // Short messages leave the budget alone.
    let small = vec![1u8; STREAMING_BYTES - 1];
    let ptr = small.as_ptr();
    // SAFETY: the Vec owns the bytes and is kept with the request.
    unsafe { a.send_kept(1, ptr, small.len(), Box::new(small)) }.unwrap();
    let mut dest = vec![0u8; STREAMING_BYTES - 1];
    let dptr = dest.as_mut_ptr();
    // SAFETY: `dest`'s heap bytes move with it into the request.
    let pending = unsafe { b.recv(1, dptr, STREAMING_BYTES - 1, Box::new(dest)) }.unwrap();
    assert_eq!(pending.await.unwrap().1, STREAMING_BYTES - 1);
    assert_eq!(a.shared.spin_budget(), spin);
    assert_eq!(b.shared.spin_budget(), spin);
    // A long send marks the sender, a long receive the receiver.
    let big = vec![2u8; STREAMING_BYTES];
    let ptr = big.as_ptr();
    // SAFETY: as above.
    unsafe { a.send_kept(2, ptr, big.len(), Box::new(big)) }.unwrap();
    let sent_at = a.shared.now();
    assert_eq!(a.shared.spin_budget_at(sent_at), streaming);
    assert_eq!(b.shared.spin_budget(), spin);
    let mut dest = vec![0u8; STREAMING_BYTES];
    let dptr = dest.as_mut_ptr();
    // SAFETY: as above.
    let pending = unsafe { b.recv(2, dptr, STREAMING_BYTES, Box::new(dest)) }.unwrap();
    let received_at = b.shared.now();
    assert_eq!(b.shared.spin_budget_at(received_at), streaming);
    assert_eq!(pending.await.unwrap().1, STREAMING_BYTES);
    // Until STREAMING_FOR has passed since the last long one was
    // posted.
    let later = STREAMING_FOR.as_nanos() as u64;
    for link in [&a, &b] {
        let posted = link.shared.streamed_at.load(Ordering::Relaxed);
        assert_eq!(link.shared.spin_budget_at(posted + later - 1), streaming);
        assert_eq!(link.shared.spin_budget_at(posted + later), spin);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_progress_task_arms_the_worker_only_while_a_send_is_unfinished() {
    let Some((a, b)) = linked_spinning("shm,self", Duration::ZERO) else {
        return;
    };
    // Nothing posted: nobody needs UCX's events, so no peer is asked to
    // signal this side.
    assert!(!a.needs_events() && !b.needs_events());
    // A rendezvous send stays unfinished until the receiver posts.
    let len = 4 << 20;
    let bytes = vec![9u8; len];
    let ptr = bytes.as_ptr();
    // SAFETY: the Vec owns the bytes and is kept with the request.
    unsafe { a.send_kept(7, ptr, len, Box::new(bytes)) }.unwrap();
    assert!(a.needs_events());
    // A receive that is posted but not awaited needs nothing yet.
    let mut dest = vec![0u8; len];
    let dptr = dest.as_mut_ptr();
    // SAFETY: `dest`'s heap bytes move with it into the request.
    let mut pending = unsafe { b.recv(7, dptr, len, Box::new(dest)) }.unwrap();
    let (keep, got) = (&mut pending).await.unwrap();
    assert_eq!(got, len);
    assert!(keep.downcast::<Vec<u8>>().unwrap().iter().all(|&x| x == 9));
    // The sender's progress task finishes the send; then it disarms.
    while a.in_flight() > 0 {
        tokio::task::yield_now().await;
    }
    assert!(!a.needs_events());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_waiting_for_room_sleeps_until_a_send_finishes() {
    let Some((a, b)) = linked_spinning("tcp", Duration::ZERO) else {
        return;
    };
    let len = 4 << 20;
    let bytes = vec![3u8; len];
    let ptr = bytes.as_ptr();
    // SAFETY: the Vec owns the bytes and is kept with the request.
    unsafe { a.send_kept(11, ptr, len, Box::new(bytes)) }.unwrap();
    // The rendezvous send cannot finish before the receiver posts: a
    // writer that wants none in flight waits, with its waker kept for
    // the sweep.
    let waiting =
        std::future::poll_fn(|cx| Poll::Ready(a.poll_in_flight_at_most(cx, 0).is_pending())).await;
    assert!(waiting, "a send finished before its receiver posted");
    let room = tokio::spawn({
        let a = a.clone();
        async move { std::future::poll_fn(|cx| a.poll_in_flight_at_most(cx, 0)).await }
    });
    let mut dest = vec![0u8; len];
    let dptr = dest.as_mut_ptr();
    // SAFETY: `dest`'s heap bytes move with it into the request.
    let pending = unsafe { b.recv(11, dptr, len, Box::new(dest)) }.unwrap();
    let (_, got) = pending.await.unwrap();
    assert_eq!(got, len);
    tokio::time::timeout(Duration::from_secs(30), room)
        .await
        .expect("the writer was never woken once its send finished")
        .unwrap()
        .unwrap();
    assert_eq!(a.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_asleep_before_its_message_is_sent_wakes_on_the_event_fd_itself() {
    for tls in ["shm,self", "tcp"] {
        // No backstop: only the worker's event fd can end the sleep.
        let Some((a, b)) = linked_asleep(tls) else {
            return;
        };
        for (tag, len) in [(1u64, 8usize), (2, 4 << 20)] {
            let mut dest = vec![0u8; len];
            let dptr = dest.as_mut_ptr();
            // SAFETY: `dest`'s heap bytes move with it into the request.
            let mut pending = unsafe { b.recv(tag, dptr, len, Box::new(dest)) }.unwrap();
            // One poll: nothing has been sent, so the task goes to sleep
            // on the armed worker's event fd. The progress task is not
            // involved: it watches unfinished sends only.
            let first = std::future::poll_fn(|cx| {
                std::task::Poll::Ready(pending.poll_done(cx).is_pending())
            })
            .await;
            assert!(first, "{tls}: a receive completed before its send");
            assert!(
                !b.needs_events(),
                "{tls}: a sleeping receive made the progress task watch"
            );
            let bytes: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let ptr = bytes.as_ptr();
            // SAFETY: the Vec owns the bytes and is kept with the request.
            unsafe { a.send_kept(tag, ptr, len, Box::new(bytes)) }.unwrap();
            let (keep, got) = tokio::time::timeout(Duration::from_secs(30), &mut pending)
                .await
                .unwrap_or_else(|_| {
                    panic!("{tls}: a sleeping receive of {len} bytes was never woken")
                })
                .unwrap();
            assert_eq!(got, len);
            let dest = keep.downcast::<Vec<u8>>().unwrap();
            assert!(dest.iter().enumerate().all(|(i, &x)| x == i as u8));
        }
    }
}

/// Records the thread of each wake-up and tells a waiting test.
#[derive(Default)]
struct WakeLog {
    wakes: std::sync::Mutex<Vec<std::thread::ThreadId>>,
    woken: tokio::sync::Notify,
}

impl WakeLog {
    /// Wake-ups so far.
    fn count(&self) -> usize {
        self.wakes.lock().unwrap().len()
    }
    /// Wake-ups after the first `from` made on this thread.
    fn on_this_thread_since(&self, from: usize) -> usize {
        let me = std::thread::current().id();
        self.wakes.lock().unwrap()[from..]
            .iter()
            .filter(|t| **t == me)
            .count()
    }
}

impl std::task::Wake for WakeLog {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.lock().unwrap().push(std::thread::current().id());
        self.woken.notify_one();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_woken_from_its_sleep_does_not_wake_itself_again_as_it_completes() {
    for tls in ["shm,self", "tcp"] {
        // No backstop: only the worker's event fd can end the sleep.
        let Some((a, b)) = linked_asleep(tls) else {
            return;
        };
        let mut dest = vec![0u8; 8];
        let dptr = dest.as_mut_ptr();
        // SAFETY: `dest`'s heap bytes move with it into the request.
        let mut pending = unsafe { b.recv(5, dptr, 8, Box::new(dest)) }.unwrap();
        let counter = Arc::new(WakeLog::default());
        let waker = std::task::Waker::from(counter.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(
            pending.poll_done(&mut cx).is_pending(),
            "{tls}: a receive completed before its send"
        );
        let bytes = vec![7u8; 8];
        let ptr = bytes.as_ptr();
        // SAFETY: the Vec owns the bytes and is kept with the request.
        unsafe { a.send_kept(5, ptr, 8, Box::new(bytes)) }.unwrap();
        // Each wake-up (the event fd; over tcp first for UCX's own
        // connection set-up) leads to a poll, which progresses the
        // worker. The poll that completes the receive must not wake the
        // task that is polling it: tokio would queue that task again and
        // wake another worker thread for it. Such a wake-up happens in
        // the poll's own progress call, on this thread; the progress
        // task's one progress call at its start, if it comes late, may
        // complete the receive too, but on a runtime thread.
        let got = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                counter.woken.notified().await;
                let before = counter.count();
                if let Poll::Ready(done) = pending.poll_done(&mut cx) {
                    break (done, counter.on_this_thread_since(before));
                }
            }
        })
        .await;
        let (done, woken_by_itself) =
            got.unwrap_or_else(|_| panic!("{tls}: the sleeping receive never completed"));
        assert_eq!(done.unwrap().1, 8);
        assert_eq!(
            woken_by_itself, 0,
            "{tls}: the receive woke its own task as it completed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_asleep_when_its_peer_goes_away_fails_with_the_links_failure() {
    // No backstop: the event fd alone must bring the failure.
    let Some((a, b)) = linked_asleep("tcp") else {
        return;
    };
    a_sleeping_receive_fails_when_its_peer_goes_away(a, b).await;
}

/// Posts a receive on `b`, checks that it sleeps, drops `a` (its
/// worker, and with it its TCP connections) and checks that the
/// receive fails with the link's failure.
async fn a_sleeping_receive_fails_when_its_peer_goes_away(a: UcxLink, b: UcxLink) {
    let mut dest = vec![0u8; 64];
    let dptr = dest.as_mut_ptr();
    // SAFETY: `dest`'s heap bytes move with it into the request.
    let mut pending = unsafe { b.recv(3, dptr, 64, Box::new(dest)) }.unwrap();
    let first = std::future::poll_fn(|cx| Poll::Ready(pending.poll_done(cx).is_pending())).await;
    assert!(first, "a receive completed with nothing sent");
    drop(a);
    let outcome = tokio::time::timeout(Duration::from_secs(30), &mut pending)
        .await
        .expect("a sleeping receive never learned that its peer went away");
    let Err(err) = outcome else {
        panic!("a receive from a peer that went away succeeded");
    };
    let text = err.to_string();
    assert!(
        text.contains("UCX endpoint failed") || text.contains("UCX receive failed"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_receive_is_cancelled_and_its_buffer_kept_until_then() {
    let Some((a, b)) = linked("tcp") else {
        return;
    };
    let dropped = Arc::new(AtomicBool::new(false));
    let mut w = Watched {
        bytes: vec![0u8; 64],
        dropped: dropped.clone(),
    };
    let ptr = w.bytes.as_mut_ptr();
    // SAFETY: `w` owns the bytes and moves into the request.
    let pending = unsafe { b.recv(9, ptr, 64, Box::new(w)) }.unwrap();
    drop(pending);
    // Cancelled: the buffer is released once UCX reported it done.
    while !dropped.load(Ordering::SeqCst) {
        tokio::task::yield_now().await;
    }
    // The message with that tag goes to the next receive, whole.
    let msg = vec![42u8; 64];
    let mptr = msg.as_ptr();
    // SAFETY: `msg` owns the bytes and is kept with the request.
    unsafe { a.send_kept(9, mptr, 64, Box::new(msg)) }.unwrap();
    let mut dest = vec![0u8; 64];
    let dptr = dest.as_mut_ptr();
    // SAFETY: as above.
    let (keep, got) = unsafe { b.recv(9, dptr, 64, Box::new(dest)) }
        .unwrap()
        .await
        .unwrap();
    assert_eq!(got, 64);
    assert_eq!(*keep.downcast::<Vec<u8>>().unwrap(), vec![42u8; 64]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_cross_both_ways_and_a_missing_one_is_an_error() {
    let Some((a, b)) = linked("tcp") else {
        return;
    };
    let (x, y) = tokio::join!(
        a.probe(1, Duration::from_secs(30)),
        b.probe(2, Duration::from_secs(30))
    );
    assert_eq!((x, y), (Ok(()), Ok(())));
    // The peer sends no probe this time: the wait ends with the reason.
    let err = a.probe(3, Duration::from_millis(20)).await.unwrap_err();
    assert_eq!(err, "no probe from the peer within 20ms");
}
