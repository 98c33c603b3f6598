//! A single-producer single-consumer byte ring in shared memory.
//!
//! Layout of one ring (all offsets from the ring's start, which must be
//! 64-byte aligned):
//!
//! | offset | field             | written by          |
//! |--------|-------------------|---------------------|
//! | 0      | magic, capacity   | `init`              |
//! | 64     | `head` (u64)      | producer            |
//! | 128    | `tail` (u64)      | consumer            |
//! | 192    | `reader_sleeping` | consumer (set), producer (clear) |
//! | 256    | `writer_sleeping` | producer (set), consumer (clear) |
//! | 320    | `closed`          | producer            |
//! | 384    | `reader_closed`   | consumer            |
//! | 448    | data (`capacity` bytes, a power of two) | both |
//!
//! `head` and `tail` count bytes since the start and only grow (wrapping at
//! 2^64); byte `i` of the stream lives at data offset `i % capacity`. The
//! producer copies data in and then publishes `head` with `Release`; the
//! consumer loads `head` with `Acquire`, copies out, and publishes `tail`
//! with `Release`, which the producer loads with `Acquire` before reusing
//! the space.
//!
//! Every value read from the header is treated as untrusted (the other
//! process may be buggy or hostile): the capacity is validated once by
//! [`Ring::attach`] and then only the local copy is used, and indices are
//! always masked, so a corrupt `head` or `tail` can at worst deliver garbage
//! bytes or stall the ring, never touch memory outside it.

use std::fmt;
use std::io;
use std::mem::MaybeUninit;
use std::ptr::NonNull;

use super::sync::Ordering::{Acquire, Relaxed, Release, SeqCst};
use super::sync::{fence, AtomicU32, AtomicU64, DataByte};

/// The first header word: `"FRYRING"` followed by the layout version (1).
const MAGIC: u64 = u64::from_be_bytes(*b"FRYRING\x01");

/// The alignment a ring's start must have (one cache line).
pub(crate) const RING_ALIGN: usize = 64;

/// The largest capacity a ring may have (1 TiB).
pub(crate) const MAX_RING_CAPACITY: usize = 1 << 40;

/// A value on its own cache line, so the producer's and the consumer's
/// fields never share one.
#[repr(C, align(64))]
struct Line<T>(T);

#[repr(C)]
struct Meta {
    magic: AtomicU64,
    capacity: AtomicU64,
}

/// The shared header at the start of every ring.
#[repr(C)]
struct Header {
    meta: Line<Meta>,
    /// Total bytes written (producer).
    head: Line<AtomicU64>,
    /// Total bytes read (consumer).
    tail: Line<AtomicU64>,
    /// 1 while the consumer is (about to be) asleep waiting for data.
    reader_sleeping: Line<AtomicU32>,
    /// 1 while the producer is (about to be) asleep waiting for space.
    writer_sleeping: Line<AtomicU32>,
    /// 1 once the producer will write no more (shutdown or drop).
    closed: Line<AtomicU32>,
    /// 1 once the consumer will read no more (drop).
    reader_closed: Line<AtomicU32>,
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Header>() == 448);

impl Header {
    fn new(capacity: u64) -> Header {
        Header {
            meta: Line(Meta {
                magic: AtomicU64::new(MAGIC),
                capacity: AtomicU64::new(capacity),
            }),
            head: Line(AtomicU64::new(0)),
            tail: Line(AtomicU64::new(0)),
            reader_sleeping: Line(AtomicU32::new(0)),
            writer_sleeping: Line(AtomicU32::new(0)),
            closed: Line(AtomicU32::new(0)),
            reader_closed: Line(AtomicU32::new(0)),
        }
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// One process's handle on a shared SPSC byte ring.
///
/// The same ring is normally reached through two `Ring` values, one per
/// process (or per mapping): the producer calls [`write`](Ring::write), the
/// consumer [`read`](Ring::read). Each side keeps its own position locally,
/// so a given `Ring` value must be used by at most one producer and one
/// consumer overall (the `unsafe` contract of [`init`](Ring::init) and
/// [`attach`](Ring::attach)); `write` and `read` take `&mut self`.
///
/// The sleep/wake methods implement the wake-up protocol described in the
/// [module docs](super); [`ShmReader`](super::ShmReader) and
/// [`ShmWriter`](super::ShmWriter) use them with eventfds.
pub(crate) struct Ring {
    hdr: NonNull<Header>,
    data: NonNull<DataByte>,
    capacity: usize,
    mask: u64,
    /// Producer: total bytes written (our copy of `head`).
    head: u64,
    /// Producer: the last `tail` loaded.
    tail_seen: u64,
    /// Consumer: total bytes read (our copy of `tail`).
    tail: u64,
    /// Consumer: the last `head` loaded.
    head_seen: u64,
    /// Under loom the ring lives in ordinary memory owned here.
    #[cfg(loom)]
    _backing: std::sync::Arc<LoomBacking>,
}

// SAFETY: the ring's memory is shared memory that outlives the `Ring` (the
// contract of `init`/`attach`); all shared state is accessed through atomics
// and the data bytes are only touched under the SPSC protocol, with the
// producer and consumer roles each exclusive (`&mut self`).
unsafe impl Send for Ring {}
// SAFETY: the `&self` methods only use atomics.
unsafe impl Sync for Ring {}

impl fmt::Debug for Ring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ring")
            .field("capacity", &self.capacity)
            .field("head", &self.hdr().head.0.load(Relaxed))
            .field("tail", &self.hdr().tail.0.load(Relaxed))
            .finish_non_exhaustive()
    }
}

impl Ring {
    /// Size of the shared header that precedes the data bytes.
    pub(crate) const HEADER_SIZE: usize = std::mem::size_of::<Header>();

    /// Bytes of shared memory a ring of `capacity` data bytes occupies: the
    /// header plus the data, rounded up to [`RING_ALIGN`] so rings can be
    /// laid out back to back (ring `k` at offset `k * bytes_needed(c)`).
    pub(crate) const fn bytes_needed(capacity: usize) -> usize {
        Self::HEADER_SIZE + capacity.div_ceil(RING_ALIGN) * RING_ALIGN
    }

    fn check_region(ptr: NonNull<u8>, len: usize, capacity: u64) -> io::Result<usize> {
        if ptr.as_ptr() as usize % RING_ALIGN != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("ring memory at {ptr:p} is not {RING_ALIGN}-byte aligned"),
            ));
        }
        let capacity = usize::try_from(capacity)
            .ok()
            .filter(|c| c.is_power_of_two() && *c <= MAX_RING_CAPACITY)
            .ok_or_else(|| {
                invalid(format!(
                    "ring capacity {capacity} is not a power of two in 1..={MAX_RING_CAPACITY}"
                ))
            })?;
        let needed = Self::bytes_needed(capacity);
        if needed > len {
            return Err(invalid(format!(
                "a ring of capacity {capacity} needs {needed} bytes but its region has {len}"
            )));
        }
        Ok(capacity)
    }

    /// Writes a fresh header (empty ring of `capacity` bytes, not closed) at
    /// `ptr` and returns a handle on it.
    ///
    /// Fails if `ptr` is not [`RING_ALIGN`]-aligned, `capacity` is not a power
    /// of two up to [`MAX_RING_CAPACITY`], or `len <
    /// bytes_needed(capacity)`.
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for reads and writes of `len` bytes for as long as
    /// the returned `Ring` (and any ring attached to the same memory) lives,
    /// and must be accessed by nothing else than `Ring`s while they do. Over
    /// the ring's whole life, at most one `Ring` may call `write` and at most
    /// one may call `read` (they may be the same value).
    pub(crate) unsafe fn init(ptr: NonNull<u8>, len: usize, capacity: usize) -> io::Result<Ring> {
        let capacity = Self::check_region(ptr, len, capacity as u64)?;
        let hdr = ptr.cast::<Header>();
        // SAFETY: the region is valid for `len >= HEADER_SIZE` bytes and
        // aligned for `Header` (the caller's contract and `check_region`).
        unsafe {
            std::ptr::write_bytes(ptr.as_ptr(), 0, Self::HEADER_SIZE);
            hdr.as_ptr().write(Header::new(capacity as u64));
        }
        // SAFETY: as above; the data bytes follow the header inside the region.
        let data = unsafe { ptr.add(Self::HEADER_SIZE) }.cast::<DataByte>();
        Ok(Self::from_parts(hdr, data, capacity, 0, 0))
    }

    /// Returns a handle on a ring that [`init`](Ring::init) already wrote at
    /// `ptr` (typically in another process's mapping of the same memory).
    ///
    /// Checks the magic word and that the recorded capacity is a power of
    /// two that fits in `len`; a mismatch is an error (`InvalidData`), never
    /// a panic.
    ///
    /// # Safety
    ///
    /// Same as [`init`](Ring::init): `ptr` valid for `len` bytes while the
    /// ring lives, and one producer and one consumer overall.
    pub(crate) unsafe fn attach(ptr: NonNull<u8>, len: usize) -> io::Result<Ring> {
        if len < Self::HEADER_SIZE {
            return Err(invalid(format!(
                "ring region of {len} bytes is smaller than the {}-byte header",
                Self::HEADER_SIZE
            )));
        }
        if ptr.as_ptr() as usize % RING_ALIGN != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("ring memory at {ptr:p} is not {RING_ALIGN}-byte aligned"),
            ));
        }
        let hdr = ptr.cast::<Header>();
        // SAFETY: valid and aligned for a `Header` (checked above and the
        // caller's contract); only atomics are read through the reference.
        let h = unsafe { hdr.as_ref() };
        let magic = h.meta.0.magic.load(Acquire);
        if magic != MAGIC {
            return Err(invalid(format!(
                "bad ring magic {magic:#018x} (expected {MAGIC:#018x})"
            )));
        }
        let capacity = Self::check_region(ptr, len, h.meta.0.capacity.load(Relaxed))?;
        let head = h.head.0.load(Acquire);
        let tail = h.tail.0.load(Acquire);
        // SAFETY: the data bytes follow the header inside the region.
        let data = unsafe { ptr.add(Self::HEADER_SIZE) }.cast::<DataByte>();
        Ok(Self::from_parts(hdr, data, capacity, head, tail))
    }

    #[cfg(not(loom))]
    fn from_parts(
        hdr: NonNull<Header>,
        data: NonNull<DataByte>,
        capacity: usize,
        head: u64,
        tail: u64,
    ) -> Ring {
        Ring {
            hdr,
            data,
            capacity,
            mask: capacity as u64 - 1,
            head,
            tail_seen: tail,
            tail,
            head_seen: head,
        }
    }

    #[cfg(loom)]
    fn from_parts(
        _hdr: NonNull<Header>,
        _data: NonNull<DataByte>,
        _capacity: usize,
        _head: u64,
        _tail: u64,
    ) -> Ring {
        panic!("under cfg(loom) rings only live in `Ring::loom_pair` memory")
    }

    fn hdr(&self) -> &Header {
        // SAFETY: the header stays valid while `self` lives (the contract of
        // `init`/`attach`); it is only accessed through atomics.
        unsafe { self.hdr.as_ref() }
    }

    /// The number of data bytes the ring holds when full.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    fn free_seen(&self) -> usize {
        let used = self.head.wrapping_sub(self.tail_seen);
        // A corrupt `tail` (used > capacity) reads as "full".
        (self.capacity as u64).saturating_sub(used) as usize
    }

    fn avail_seen(&self) -> usize {
        // A corrupt `head` is clamped: garbage bytes, never out of bounds.
        self.head_seen
            .wrapping_sub(self.tail)
            .min(self.capacity as u64) as usize
    }

    /// Producer: copies as much of `src` as fits (possibly wrapping around
    /// the end of the data area) and publishes it. Returns the number of
    /// bytes written, 0 if the ring is full (or `src` empty).
    ///
    /// Call [`take_reader_sleeping`](Ring::take_reader_sleeping) afterwards
    /// to learn whether the consumer must be signalled.
    pub(crate) fn write(&mut self, src: &[u8]) -> usize {
        if src.is_empty() {
            return 0;
        }
        if self.free_seen() < src.len() {
            self.tail_seen = self.hdr().tail.0.load(Acquire);
        }
        let n = self.free_seen().min(src.len());
        if n == 0 {
            return 0;
        }
        // SAFETY: `n <= free`, so bytes `head..head + n` of the stream are
        // not readable by the consumer (its `tail` is at least `tail_seen`,
        // loaded with Acquire after it finished reading them).
        unsafe { self.copy_in(self.head, src.as_ptr(), n) };
        self.head = self.head.wrapping_add(n as u64);
        self.hdr().head.0.store(self.head, Release);
        n
    }

    /// Consumer: copies up to `dst.len()` available bytes into `dst` and
    /// frees their space. Returns the number of bytes read, 0 if the ring is
    /// empty.
    ///
    /// Call [`take_writer_sleeping`](Ring::take_writer_sleeping) afterwards
    /// to learn whether the producer must be signalled. (The transport
    /// reads into uninitialised buffers with `read_uninit`; the tests and
    /// the model checks read with this.)
    #[cfg(any(test, loom))]
    pub(crate) fn read(&mut self, dst: &mut [u8]) -> usize {
        // SAFETY: `dst` is valid for writes of `dst.len()` bytes.
        unsafe { self.read_raw(dst.as_mut_ptr(), dst.len()) }
    }

    /// [`read`](Ring::read) into possibly uninitialized memory; the first
    /// `n` (returned) bytes of `dst` are initialized afterwards.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn read_uninit(&mut self, dst: &mut [MaybeUninit<u8>]) -> usize {
        // SAFETY: `dst` is valid for writes of `dst.len()` bytes.
        unsafe { self.read_raw(dst.as_mut_ptr().cast::<u8>(), dst.len()) }
    }

    /// # Safety
    /// `dst` valid for writes of `len` bytes.
    unsafe fn read_raw(&mut self, dst: *mut u8, len: usize) -> usize {
        if len == 0 {
            return 0;
        }
        if self.avail_seen() < len {
            self.head_seen = self.hdr().head.0.load(Acquire);
        }
        let n = self.avail_seen().min(len);
        if n == 0 {
            return 0;
        }
        // SAFETY: bytes `tail..tail + n` were published by the producer's
        // Release store of `head`, which our Acquire load observed; `dst` is
        // valid for `n <= len` bytes.
        unsafe { self.copy_out(self.tail, dst, n) };
        self.tail = self.tail.wrapping_add(n as u64);
        self.hdr().tail.0.store(self.tail, Release);
        n
    }

    /// Bytes the consumer could read now.
    pub(crate) fn readable(&self) -> usize {
        let head = self.hdr().head.0.load(Acquire);
        head.wrapping_sub(self.tail).min(self.capacity as u64) as usize
    }

    /// Bytes the producer could write now.
    pub(crate) fn writable(&self) -> usize {
        let tail = self.hdr().tail.0.load(Acquire);
        (self.capacity as u64).saturating_sub(self.head.wrapping_sub(tail)) as usize
    }

    /// Consumer, about to sleep because the ring is empty: sets
    /// `reader_sleeping`, issues a `SeqCst` fence and re-checks. Returns
    /// `true` if the ring is still empty and not closed, in which case the
    /// consumer may sleep until signalled (the producer is now bound to
    /// signal after its next publish). Returns `false`, with the flag
    /// cleared again, if data or `closed` showed up meanwhile.
    pub(crate) fn arm_reader_wait(&self) -> bool {
        let h = self.hdr();
        h.reader_sleeping.0.store(1, Relaxed);
        fence(SeqCst);
        if h.head.0.load(Relaxed) != self.tail || h.closed.0.load(Relaxed) != 0 {
            h.reader_sleeping.0.store(0, Relaxed);
            return false;
        }
        true
    }

    /// Consumer: clears `reader_sleeping` after waking up (or giving up on
    /// sleeping). Harmless if the producer already cleared it.
    pub(crate) fn disarm_reader_wait(&self) {
        self.hdr().reader_sleeping.0.store(0, Relaxed);
    }

    /// Producer, right after publishing: issues a `SeqCst` fence and checks
    /// `reader_sleeping`; returns `true` (having cleared it) if the consumer
    /// is asleep or going to sleep and must be signalled. No atomic
    /// read-modify-write and no syscall when it is not.
    pub(crate) fn take_reader_sleeping(&self) -> bool {
        fence(SeqCst);
        let flag = &self.hdr().reader_sleeping.0;
        flag.load(Relaxed) != 0 && flag.swap(0, Relaxed) != 0
    }

    /// Producer, about to sleep because the ring is full: sets
    /// `writer_sleeping`, issues a `SeqCst` fence and re-checks. Returns
    /// `true` if the ring is still full and the reader has not closed (sleep
    /// until signalled), `false` with the flag cleared otherwise.
    pub(crate) fn arm_writer_wait(&self) -> bool {
        let h = self.hdr();
        h.writer_sleeping.0.store(1, Relaxed);
        fence(SeqCst);
        let tail = h.tail.0.load(Relaxed);
        let used = self.head.wrapping_sub(tail);
        if used < self.capacity as u64 || h.reader_closed.0.load(Relaxed) != 0 {
            h.writer_sleeping.0.store(0, Relaxed);
            return false;
        }
        true
    }

    /// Producer: clears `writer_sleeping` after waking up (or giving up).
    pub(crate) fn disarm_writer_wait(&self) {
        self.hdr().writer_sleeping.0.store(0, Relaxed);
    }

    /// Consumer, right after freeing space: issues a `SeqCst` fence and
    /// checks `writer_sleeping`; returns `true` (having cleared it) if the
    /// producer must be signalled.
    pub(crate) fn take_writer_sleeping(&self) -> bool {
        fence(SeqCst);
        let flag = &self.hdr().writer_sleeping.0;
        flag.load(Relaxed) != 0 && flag.swap(0, Relaxed) != 0
    }

    /// Producer: marks the stream finished. Bytes already written stay
    /// readable; once they are drained the consumer sees end of stream. The
    /// caller should then signal the consumer unconditionally.
    pub(crate) fn close(&self) {
        self.hdr().closed.0.store(1, Release);
    }

    /// Whether the producer closed the stream. When `true`, everything it
    /// wrote before closing is visible to the next [`read`](Ring::read).
    pub(crate) fn is_closed(&self) -> bool {
        self.hdr().closed.0.load(Acquire) != 0
    }

    /// Consumer: marks that nothing will be read any more, so a producer
    /// waiting for space should give up. The caller should then signal the
    /// producer unconditionally.
    pub(crate) fn close_reader(&self) {
        self.hdr().reader_closed.0.store(1, Release);
    }

    /// Whether the consumer closed its end.
    pub(crate) fn is_reader_closed(&self) -> bool {
        self.hdr().reader_closed.0.load(Acquire) != 0
    }

    /// # Safety
    /// `src` valid for `n` bytes; stream bytes `pos..pos + n` are owned by
    /// the producer (`n <= capacity`).
    #[cfg(not(loom))]
    unsafe fn copy_in(&self, pos: u64, src: *const u8, n: usize) {
        let idx = (pos & self.mask) as usize;
        let first = n.min(self.capacity - idx);
        let data = self.data.as_ptr();
        // SAFETY: `idx + first <= capacity` and `n - first <= capacity`, so
        // both copies stay inside the data area; the caller owns the bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(src, data.add(idx), first);
            std::ptr::copy_nonoverlapping(src.add(first), data, n - first);
        }
    }

    /// # Safety
    /// `dst` valid for `n` bytes; stream bytes `pos..pos + n` are published
    /// and owned by the consumer (`n <= capacity`).
    #[cfg(not(loom))]
    unsafe fn copy_out(&self, pos: u64, dst: *mut u8, n: usize) {
        let idx = (pos & self.mask) as usize;
        let first = n.min(self.capacity - idx);
        let data = self.data.as_ptr();
        // SAFETY: as in `copy_in`.
        unsafe {
            std::ptr::copy_nonoverlapping(data.add(idx), dst, first);
            std::ptr::copy_nonoverlapping(data, dst.add(first), n - first);
        }
    }

    #[cfg(loom)]
    unsafe fn copy_in(&self, pos: u64, src: *const u8, n: usize) {
        for i in 0..n {
            let at = (pos.wrapping_add(i as u64) & self.mask) as usize;
            // SAFETY: `at < capacity`; `src` is valid for `n` bytes; loom
            // checks the cell access against concurrent reads.
            unsafe {
                let byte = src.add(i).read();
                (*self.data.as_ptr().add(at)).with_mut(|p| p.write(byte));
            }
        }
    }

    #[cfg(loom)]
    unsafe fn copy_out(&self, pos: u64, dst: *mut u8, n: usize) {
        for i in 0..n {
            let at = (pos.wrapping_add(i as u64) & self.mask) as usize;
            // SAFETY: `at < capacity`; `dst` is valid for `n` bytes; loom
            // checks the cell access against concurrent writes.
            unsafe {
                let byte = (*self.data.as_ptr().add(at)).with(|p| p.read());
                dst.add(i).write(byte);
            }
        }
    }
}

/// Under loom: a ring's memory as ordinary (loom-tracked) objects.
#[cfg(loom)]
struct LoomBacking {
    header: Header,
    data: Vec<DataByte>,
}

#[cfg(loom)]
impl Ring {
    /// Two handles (producer, consumer) on a fresh loom-tracked ring.
    pub(crate) fn loom_pair(capacity: usize) -> (Ring, Ring) {
        assert!(capacity.is_power_of_two());
        let backing = std::sync::Arc::new(LoomBacking {
            header: Header::new(capacity as u64),
            data: (0..capacity)
                .map(|_| loom::cell::UnsafeCell::new(0u8))
                .collect(),
        });
        let make = || Ring {
            hdr: NonNull::from(&backing.header),
            data: NonNull::new(backing.data.as_ptr().cast_mut()).expect("vec pointer"),
            capacity,
            mask: capacity as u64 - 1,
            head: 0,
            tail_seen: 0,
            tail: 0,
            head_seen: 0,
            _backing: backing.clone(),
        };
        (make(), make())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::shm::segment::Segment;

    fn ring_in(seg: &Segment, offset: usize, capacity: usize) -> Ring {
        let ptr = NonNull::new(seg.as_ptr()).expect("mapping").as_ptr();
        // SAFETY: `offset + bytes_needed` is inside the mapping (asserted by
        // `init`'s length check), which outlives the ring in each test.
        unsafe {
            Ring::init(
                NonNull::new(ptr.add(offset)).expect("non-null"),
                seg.len() - offset,
                capacity,
            )
        }
        .expect("init")
    }

    #[test]
    fn header_layout_is_fixed() {
        assert_eq!(Ring::HEADER_SIZE, 448);
        assert_eq!(Ring::bytes_needed(4), 448 + 64);
        assert_eq!(Ring::bytes_needed(4096), 448 + 4096);
    }

    #[test]
    fn in_order_with_wrap_around() {
        let seg = Segment::create(Ring::bytes_needed(8), "ring-test").expect("segment");
        let mut ring = ring_in(&seg, 0, 8);
        assert_eq!(ring.capacity(), 8);
        let mut next_in = 0u8;
        let mut next_out = 0u8;
        for round in 0..50usize {
            let chunk: Vec<u8> = (0..(round % 7 + 1))
                .map(|_| {
                    next_in = next_in.wrapping_add(1);
                    next_in
                })
                .collect();
            assert_eq!(ring.write(&chunk), chunk.len());
            let mut out = [0u8; 8];
            let mut got = 0;
            while got < chunk.len() {
                got += ring.read(&mut out[got..chunk.len()]);
            }
            for b in &out[..got] {
                next_out = next_out.wrapping_add(1);
                assert_eq!(*b, next_out);
            }
        }
        assert_eq!(ring.readable(), 0);
    }

    #[test]
    fn partial_writes_when_full_and_empty_reads() {
        let seg = Segment::create(Ring::bytes_needed(16), "ring-test").expect("segment");
        let mut ring = ring_in(&seg, 0, 16);
        let mut buf = [0u8; 32];
        assert_eq!(ring.read(&mut buf), 0);
        assert_eq!(ring.write(&[7; 10]), 10);
        assert_eq!(ring.write(&[8; 10]), 6);
        assert_eq!(ring.write(&[9; 3]), 0);
        assert_eq!(ring.writable(), 0);
        assert_eq!(ring.readable(), 16);
        assert_eq!(ring.read(&mut buf[..4]), 4);
        assert_eq!(ring.writable(), 4);
        assert_eq!(ring.write(&[9; 5]), 4);
        assert_eq!(ring.read(&mut buf), 16);
        assert_eq!(
            &buf[..16],
            &[7, 7, 7, 7, 7, 7, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9]
        );
        assert_eq!(ring.read(&mut buf), 0);
        assert_eq!(ring.write(&[]), 0);
        assert_eq!(ring.read(&mut []), 0);
    }

    #[test]
    fn two_mappings_and_several_rings_per_segment() {
        let per = Ring::bytes_needed(64);
        let seg = Segment::create(2 * per, "ring-test").expect("segment");
        let dup = rustix::io::fcntl_dupfd_cloexec(seg.fd(), 0).expect("dup");
        let other = Segment::open(dup).expect("open");
        let mut a_prod = ring_in(&seg, 0, 64);
        let mut b_prod = ring_in(&seg, per, 64);
        let at = |s: &Segment, off: usize| {
            // SAFETY: inside the mapping, which outlives the rings here.
            unsafe { Ring::attach(NonNull::new(s.as_ptr().add(off)).expect("ptr"), per) }
                .expect("attach")
        };
        let mut a_cons = at(&other, 0);
        let mut b_cons = at(&other, per);
        assert_eq!(a_prod.write(b"hello"), 5);
        assert_eq!(b_prod.write(b"world!"), 6);
        let mut buf = [0u8; 16];
        assert_eq!(a_cons.read(&mut buf), 5);
        assert_eq!(&buf[..5], b"hello");
        assert_eq!(b_cons.read(&mut buf), 6);
        assert_eq!(&buf[..6], b"world!");
        assert!(!a_cons.is_closed());
        a_prod.close();
        assert!(a_cons.is_closed());
        b_cons.close_reader();
        assert!(b_prod.is_reader_closed());
    }

    #[test]
    fn attach_rejects_bad_headers() {
        let per = Ring::bytes_needed(64);
        let seg = Segment::create(per + 64, "ring-test").expect("segment");
        let base = NonNull::new(seg.as_ptr()).expect("ptr");
        // Zeroed memory: bad magic.
        // SAFETY: inside the mapping, which outlives the rings here.
        assert!(unsafe { Ring::attach(base, per) }.is_err());
        let _ = ring_in(&seg, 0, 64);
        // SAFETY: as above.
        assert!(unsafe { Ring::attach(base, per) }.is_ok());
        // Too short for the recorded capacity, or for the header.
        // SAFETY: as above.
        assert!(unsafe { Ring::attach(base, per - 1) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { Ring::attach(base, 10) }.is_err());
        // Misaligned.
        // SAFETY: as above.
        assert!(unsafe { Ring::attach(base.add(8), per) }.is_err());
        let cap_word = seg.as_ptr().wrapping_add(8).cast::<u64>();
        for bad in [0u64, 48, u64::MAX, 1 << 62, 128] {
            // SAFETY: the capacity word of the header; no ring is alive.
            unsafe { cap_word.write_volatile(bad) };
            assert!(
                // SAFETY: as above.
                unsafe { Ring::attach(base, per) }.is_err(),
                "capacity {bad}"
            );
        }
        // SAFETY: the magic word; no ring is alive.
        unsafe {
            cap_word.write_volatile(64);
            seg.as_ptr().cast::<u64>().write_volatile(0x1234);
        }
        // SAFETY: as above.
        let err = unsafe { Ring::attach(base, per) }.expect_err("bad magic");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        // init validates its arguments too.
        // SAFETY: as above.
        assert!(unsafe { Ring::init(base, per, 48) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { Ring::init(base, per, 128) }.is_err());
    }

    #[test]
    fn corrupt_positions_stay_in_bounds() {
        let per = Ring::bytes_needed(16);
        let seg = Segment::create(per, "ring-test").expect("segment");
        let mut ring = ring_in(&seg, 0, 16);
        let head_word = seg.as_ptr().wrapping_add(64).cast::<u64>();
        // A hostile producer claims far more bytes than the capacity.
        // SAFETY: the head word of the header.
        unsafe { head_word.write_volatile(1 << 50) };
        let mut buf = [0u8; 64];
        assert_eq!(ring.read(&mut buf), 16);
        // And a hostile consumer moves `tail` past `head`: the ring is "full".
        let mut other = ring_in(&seg, 0, 16);
        let tail_word = seg.as_ptr().wrapping_add(128).cast::<u64>();
        // SAFETY: the tail word of the header.
        unsafe { tail_word.write_volatile(1 << 50) };
        // (A write larger than the space last seen reloads `tail`.)
        assert_eq!(other.write(&[1; 32]), 0);
        assert_eq!(other.writable(), 0);
    }

    #[test]
    fn sleep_flags() {
        let seg = Segment::create(Ring::bytes_needed(4), "ring-test").expect("segment");
        let mut ring = ring_in(&seg, 0, 4);
        // Empty: the reader may sleep; a publish must then wake it, once.
        assert!(ring.arm_reader_wait());
        assert_eq!(ring.write(&[1]), 1);
        assert!(ring.take_reader_sleeping());
        assert!(!ring.take_reader_sleeping());
        // Data present: no sleep, flag left clear.
        assert!(!ring.arm_reader_wait());
        assert!(!ring.take_reader_sleeping());
        // Full: the writer may sleep; a read must then wake it.
        assert_eq!(ring.write(&[2, 3, 4]), 3);
        assert!(ring.arm_writer_wait());
        let mut b = [0u8; 1];
        assert_eq!(ring.read(&mut b), 1);
        assert!(ring.take_writer_sleeping());
        assert!(!ring.arm_writer_wait());
        ring.disarm_writer_wait();
        ring.disarm_reader_wait();
        // Closed: the reader does not sleep even when empty.
        let mut rest = [0u8; 4];
        assert_eq!(ring.read(&mut rest), 3);
        ring.close();
        assert!(!ring.arm_reader_wait());
        // Reader closed: the writer does not sleep even when full.
        assert_eq!(ring.write(&[0; 4]), 4);
        ring.close_reader();
        assert!(!ring.arm_writer_wait());
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Notify;
    use loom::thread;
    use std::sync::Arc;

    /// (a) Bytes arrive complete and in order through a 4-byte ring that
    /// wraps around, with the producer closing at the end.
    #[test]
    fn bytes_in_order_with_wrap_around() {
        loom::model(|| {
            let (mut tx, mut rx) = Ring::loom_pair(4);
            let producer = thread::spawn(move || {
                let data = [1u8, 2, 3, 4, 5, 6];
                let mut off = 0;
                while off < data.len() {
                    let end = (off + 3).min(data.len());
                    let n = tx.write(&data[off..end]);
                    if n == 0 {
                        thread::yield_now();
                    }
                    off += n;
                }
                tx.close();
            });
            let mut got = Vec::new();
            loop {
                let mut buf = [0u8; 3];
                let n = rx.read(&mut buf);
                got.extend_from_slice(&buf[..n]);
                if n == 0 {
                    if rx.is_closed() {
                        let n = rx.read(&mut buf);
                        got.extend_from_slice(&buf[..n]);
                        if n == 0 {
                            break;
                        }
                    } else {
                        thread::yield_now();
                    }
                }
            }
            assert_eq!(got, [1, 2, 3, 4, 5, 6]);
            producer.join().expect("producer");
        });
    }

    /// (b) The sleep/wake protocol never loses a wake-up. The eventfds are
    /// modelled by `Notify` (a single pending permit, spurious wake-ups
    /// allowed, like an eventfd whose counter is read whole): a side that
    /// decided to sleep blocks in `wait` and is only released by a
    /// `notify`. A lost wake-up leaves both threads blocked, which loom
    /// reports as a deadlock. Both directions are exercised: a 2-byte ring
    /// and 3 bytes make the producer wait for space and the consumer wait
    /// for data, and the final close must wake a sleeping consumer.
    #[test]
    fn no_lost_wake_up() {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(4);
        builder.check(|| {
            let (mut tx, mut rx) = Ring::loom_pair(2);
            let data_ready = Arc::new(Notify::new());
            let space_ready = Arc::new(Notify::new());
            let (data_ready2, space_ready2) = (data_ready.clone(), space_ready.clone());
            let producer = thread::spawn(move || {
                let data = [10u8, 11, 12];
                let mut off = 0;
                while off < data.len() {
                    let n = tx.write(&data[off..]);
                    if n > 0 {
                        off += n;
                        if tx.take_reader_sleeping() {
                            data_ready2.notify();
                        }
                    } else if tx.arm_writer_wait() {
                        space_ready2.wait();
                        tx.disarm_writer_wait();
                    }
                }
                tx.close();
                data_ready2.notify();
            });
            let mut got = Vec::new();
            loop {
                let mut buf = [0u8; 2];
                let n = rx.read(&mut buf);
                if n > 0 {
                    got.extend_from_slice(&buf[..n]);
                    if rx.take_writer_sleeping() {
                        space_ready.notify();
                    }
                    continue;
                }
                if rx.is_closed() {
                    // Closed: everything written before is now visible.
                    let n = rx.read(&mut buf);
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                    continue;
                }
                if rx.arm_reader_wait() {
                    data_ready.wait();
                    rx.disarm_reader_wait();
                }
            }
            assert_eq!(got, [10, 11, 12]);
            producer.join().expect("producer");
        });
    }
}
