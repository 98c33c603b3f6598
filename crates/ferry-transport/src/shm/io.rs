//! Async reader and writer over one direction of a shared-memory ring.

use std::fmt;
use std::future::Future;
use std::io;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Acquire, Release};
use std::sync::{Mutex, PoisonError};
use std::task::{Wake, Waker};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::ring::Ring;
use super::segment::Segment;
use super::wake::{Signal, Wait};
use crate::spin::{spin_until, yield_once, SPIN_BUDGET};

/// How long one poll of a reader that keeps polling while an input is
/// awaited ([`crate::spin::awaiting_input`]) spins before it hands its
/// thread back to the runtime, to be polled again.
const KEEP_POLLING_SPIN: Duration = Duration::from_micros(5);

/// Wake-ups handled within one `poll` before yielding to the executor (a
/// guard against a peer that signals without making progress).
const MAX_WAKES_PER_POLL: u32 = 8;

/// A future that completes when the peer process is gone; the optional
/// argument of [`ShmLink::split`](super::ShmLink::split).
///
/// A crashed process never marks its rings closed, so a side waiting on it
/// would wait forever; the owner of the link (which typically watches the
/// peer's pidfd, or the Unix socket the fds came over) passes a future that
/// completes once the peer is dead. A read that would wait then fails with
/// [`io::ErrorKind::UnexpectedEof`], a write that would wait with
/// [`io::ErrorKind::BrokenPipe`]; bytes already in the ring are still
/// delivered first. The future is only polled when a side is about to wait,
/// so it costs nothing on the fast path. The reader and the writer of a link
/// share it: whichever waits polls it, and both are woken when it
/// completes. With a `tokio::sync::watch::Receiver<bool>` `rx`, pass
/// `Box::pin(async move { let _ = rx.wait_for(|gone| *gone).await; })`.
pub type PeerGone = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Wakes every half waiting on a shared [`PeerGone`].
#[derive(Default)]
struct WakeAll {
    wakers: Mutex<[Option<Waker>; 2]>,
}

impl WakeAll {
    fn register(&self, slot: usize, waker: &Waker) {
        let mut wakers = self.wakers.lock().unwrap_or_else(PoisonError::into_inner);
        match &wakers[slot] {
            Some(w) if w.will_wake(waker) => {}
            _ => wakers[slot] = Some(waker.clone()),
        }
    }
}

impl Wake for WakeAll {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let wakers = self
            .wakers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        for waker in wakers.into_iter().flatten() {
            waker.wake();
        }
    }
}

/// A [`PeerGone`] future shared by a link's reader and writer.
struct SharedGone {
    fut: Mutex<Option<PeerGone>>,
    fired: AtomicBool,
    wake_all: Arc<WakeAll>,
    waker: Waker,
}

/// One half's handle on the shared peer-gone signal.
pub(crate) struct Gone {
    shared: Option<Arc<SharedGone>>,
    slot: usize,
}

impl Gone {
    /// The reader's (slot 0) and the writer's (slot 1) handles on `fut`.
    pub(crate) fn pair(fut: Option<PeerGone>) -> (Gone, Gone) {
        let shared = fut.map(|fut| {
            let wake_all = Arc::new(WakeAll::default());
            Arc::new(SharedGone {
                fut: Mutex::new(Some(fut)),
                fired: AtomicBool::new(false),
                waker: Waker::from(wake_all.clone()),
                wake_all,
            })
        });
        (
            Gone {
                shared: shared.clone(),
                slot: 0,
            },
            Gone { shared, slot: 1 },
        )
    }

    /// Whether the peer is gone; if not, `cx` is woken when it goes.
    fn poll(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(shared) = &self.shared else {
            return false;
        };
        if shared.fired.load(Acquire) {
            return true;
        }
        shared.wake_all.register(self.slot, cx.waker());
        // If the other half is polling the future right now, it will wake us
        // (our waker is registered) when the future completes.
        if let Ok(mut fut) = shared.fut.try_lock() {
            if let Some(f) = fut.as_mut() {
                if f.as_mut()
                    .poll(&mut Context::from_waker(&shared.waker))
                    .is_ready()
                {
                    *fut = None;
                    shared.fired.store(true, Release);
                    drop(fut);
                    shared.waker.wake_by_ref();
                }
            }
        }
        shared.fired.load(Acquire)
    }
}

fn peer_gone(kind: io::ErrorKind) -> io::Error {
    io::Error::new(kind, "the shm peer process went away")
}

/// The reading side of one ring direction: an [`AsyncRead`] that copies
/// bytes out of shared memory.
///
/// An empty ring is first re-checked for up to its spin ([`SPIN_BUDGET`]
/// unless [set](ShmReader::set_spin)), after one yield to the scheduler
/// if [`yield_before_spin`](Self::yield_before_spin) asked for it; then the reader sets `reader_sleeping` and waits on the
/// data-available eventfd. Once the writer has shut down (or was dropped) and the ring is
/// drained, reads return 0 bytes (end of stream). If the [`PeerGone`]
/// future completes while the reader waits, the read fails with
/// [`io::ErrorKind::UnexpectedEof`]. Dropping the reader tells the writer
/// (whose writes then fail with `BrokenPipe`).
pub struct ShmReader {
    ring: Ring,
    data_ready: Wait,
    space_ready: Signal,
    gone: Gone,
    armed: bool,
    /// How long an empty ring is re-checked before the reader sleeps
    /// ([`ShmReader::set_spin`]).
    spin: Duration,
    /// Set by [`ShmReader::yield_before_spin`]; cleared by the yield.
    yield_before_spin: bool,
    /// Keeps the mapping alive while `ring` points into it.
    _segment: Arc<Segment>,
}

impl fmt::Debug for ShmReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmReader")
            .field("ring", &self.ring)
            .field("armed", &self.armed)
            .finish_non_exhaustive()
    }
}

impl ShmReader {
    pub(crate) fn new(
        segment: Arc<Segment>,
        ring: Ring,
        data_ready: Wait,
        space_ready: Signal,
        gone: Gone,
    ) -> ShmReader {
        ShmReader {
            ring,
            data_ready,
            space_ready,
            gone,
            armed: false,
            spin: SPIN_BUDGET,
            yield_before_spin: false,
            _segment: segment,
        }
    }

    /// The ring's capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.ring.capacity()
    }

    /// How long a read that finds the ring empty re-checks it before it
    /// sleeps on the eventfd ([`SPIN_BUDGET`] unless set; zero: one round
    /// of [`SPIN_ITERATIONS`](crate::spin::SPIN_ITERATIONS) checks). A shorter spin leaves more CPU to
    /// other threads on the same cores (compute, say) and costs a wake-up
    /// whenever the peer answers later than it.
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// The next time a read finds the ring empty, yield to the tokio
    /// scheduler once (`tokio::task::yield_now`) before spinning.
    ///
    /// For a reader whose last message woke or spawned a task: tokio runs
    /// that task on this thread, but only after the reading task returns,
    /// which a spinning reader does only after its spin, while the
    /// message it waits for may be the one that task is to cause. While the
    /// ring holds bytes the reader reads on; it yields when it would spin.
    pub fn yield_before_spin(&mut self) {
        self.yield_before_spin = true;
    }

    fn disarm(&mut self) {
        if self.armed {
            self.ring.disarm_reader_wait();
            self.armed = false;
        }
    }

    /// Copies what is available into `buf`; `true` if anything was.
    fn try_read(&mut self, buf: &mut ReadBuf<'_>) -> bool {
        // SAFETY: `read_uninit` only writes into the slice, and we mark as
        // initialized exactly the `n` bytes it reports written.
        let n = self.ring.read_uninit(unsafe { buf.unfilled_mut() });
        if n == 0 {
            return false;
        }
        // SAFETY: see above.
        unsafe { buf.assume_init(n) };
        buf.advance(n);
        self.disarm();
        if self.ring.take_writer_sleeping() {
            if let Err(e) = self.space_ready.notify() {
                tracing::error!("cannot signal the shm writer: {e}");
            }
        }
        true
    }
}

impl AsyncRead for ShmReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let mut wakes = 0;
        loop {
            if this.try_read(buf) {
                return Poll::Ready(Ok(()));
            }
            if this.ring.is_closed() {
                // Everything written before `closed` is visible now.
                this.try_read(buf);
                this.disarm();
                return Poll::Ready(Ok(()));
            }
            if !this.armed {
                if this.yield_before_spin {
                    this.yield_before_spin = false;
                    std::task::ready!(yield_once(cx));
                }
                let ring = &this.ring;
                let polling = crate::spin::keep_polling();
                let spin = if polling {
                    KEEP_POLLING_SPIN
                } else {
                    crate::spin::reader_spin(this.spin)
                };
                if spin_until(spin, || ring.readable() > 0 || ring.is_closed()) {
                    continue;
                }
                if polling {
                    // An input is awaited and the host has a core for this
                    // reader: poll again at once, without sleeping, after
                    // a spin short enough that the runtime's other tasks
                    // (other readers) still run every few microseconds.
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                if !this.ring.arm_reader_wait() {
                    continue;
                }
                this.armed = true;
                if crate::spin::sleep_until_awaited(cx.waker()) {
                    this.disarm();
                    continue;
                }
            } else if crate::spin::keep_polling() {
                // Woken for an input awaited in this process: poll instead
                // of sleeping.
                this.disarm();
                continue;
            }
            if this.gone.poll(cx) {
                this.disarm();
                return Poll::Ready(Err(peer_gone(io::ErrorKind::UnexpectedEof)));
            }
            match this.data_ready.poll_wait(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => {
                    this.disarm();
                    return Poll::Ready(Err(e));
                }
                Poll::Ready(Ok(())) => {
                    this.disarm();
                    wakes += 1;
                    if wakes >= MAX_WAKES_PER_POLL {
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                }
            }
        }
    }
}

impl Drop for ShmReader {
    fn drop(&mut self) {
        self.ring.close_reader();
        if let Err(e) = self.space_ready.notify() {
            tracing::warn!("cannot signal the shm writer on close: {e}");
        }
    }
}

/// The writing side of one ring direction: an [`AsyncWrite`] that copies
/// bytes into shared memory.
///
/// Writes complete as soon as the bytes are in the ring (there is nothing
/// to flush). A full ring is first re-checked for up to its spin
/// ([`SPIN_BUDGET`] unless [set](ShmWriter::set_spin)), then the writer
/// sets `writer_sleeping` and waits on the space-available eventfd. `poll_shutdown` (and dropping the writer) marks
/// the ring closed and wakes the reader, which sees end of stream after the
/// remaining bytes. Writes fail with [`io::ErrorKind::BrokenPipe`] after
/// shutdown, once the reader was dropped, or if the [`PeerGone`] future
/// completes while the writer waits for space.
pub struct ShmWriter {
    ring: Ring,
    data_ready: Signal,
    space_ready: Wait,
    gone: Gone,
    armed: bool,
    /// How long a full ring is re-checked before the writer sleeps.
    spin: Duration,
    shut: bool,
    /// Keeps the mapping alive while `ring` points into it.
    _segment: Arc<Segment>,
}

impl fmt::Debug for ShmWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmWriter")
            .field("ring", &self.ring)
            .field("armed", &self.armed)
            .field("shut", &self.shut)
            .finish_non_exhaustive()
    }
}

impl ShmWriter {
    pub(crate) fn new(
        segment: Arc<Segment>,
        ring: Ring,
        data_ready: Signal,
        space_ready: Wait,
        gone: Gone,
    ) -> ShmWriter {
        ShmWriter {
            ring,
            data_ready,
            space_ready,
            gone,
            armed: false,
            spin: SPIN_BUDGET,
            shut: false,
            _segment: segment,
        }
    }

    /// The ring's capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.ring.capacity()
    }

    /// How long a write that finds the ring full re-checks it before it
    /// sleeps on the eventfd ([`SPIN_BUDGET`] unless set); as
    /// [`ShmReader::set_spin`].
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    fn disarm(&mut self) {
        if self.armed {
            self.ring.disarm_writer_wait();
            self.armed = false;
        }
    }

    /// Copies with `copy` (which returns the bytes it wrote), waiting for
    /// space if it wrote nothing.
    fn poll_write_with(
        &mut self,
        cx: &mut Context<'_>,
        mut copy: impl FnMut(&mut Ring) -> usize,
    ) -> Poll<io::Result<usize>> {
        if self.shut {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "write to a shm writer after shutdown",
            )));
        }
        let mut wakes = 0;
        loop {
            if self.ring.is_reader_closed() {
                self.disarm();
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "the shm reader was closed",
                )));
            }
            let n = copy(&mut self.ring);
            if n > 0 {
                self.disarm();
                if self.ring.take_reader_sleeping() {
                    if let Err(e) = self.data_ready.notify() {
                        tracing::error!("cannot signal the shm reader: {e}");
                    }
                }
                return Poll::Ready(Ok(n));
            }
            if !self.armed {
                let ring = &self.ring;
                if spin_until(self.spin, || ring.writable() > 0 || ring.is_reader_closed()) {
                    continue;
                }
                if !self.ring.arm_writer_wait() {
                    continue;
                }
                self.armed = true;
            }
            if self.gone.poll(cx) {
                self.disarm();
                return Poll::Ready(Err(peer_gone(io::ErrorKind::BrokenPipe)));
            }
            match self.space_ready.poll_wait(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => {
                    self.disarm();
                    return Poll::Ready(Err(e));
                }
                Poll::Ready(Ok(())) => {
                    self.disarm();
                    wakes += 1;
                    if wakes >= MAX_WAKES_PER_POLL {
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                }
            }
        }
    }

    fn close(&mut self) -> io::Result<()> {
        if self.shut {
            return Ok(());
        }
        self.shut = true;
        self.disarm();
        self.ring.close();
        self.data_ready.notify()
    }
}

impl AsyncWrite for ShmWriter {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        self.get_mut().poll_write_with(cx, |ring| ring.write(buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if bufs.iter().all(|b| b.is_empty()) {
            return Poll::Ready(Ok(0));
        }
        self.get_mut().poll_write_with(cx, |ring| {
            let mut total = 0;
            for buf in bufs {
                let n = ring.write(buf);
                total += n;
                if n < buf.len() {
                    break;
                }
            }
            total
        })
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.get_mut().close())
    }
}

impl Drop for ShmWriter {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::warn!("cannot signal the shm reader on close: {e}");
        }
    }
}
