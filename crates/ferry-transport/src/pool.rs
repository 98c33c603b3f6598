//! The receive-buffer pool: destinations for incoming tensors from
//! pre-faulted, reused memory.
//!
//! A fresh large allocation costs a page fault per page on first touch
//! (glibc hands big blocks back to the kernel on `free`, so every new
//! 400 MB destination faults again), and on this class of machine the
//! faults cost several times the copy itself. The pool keeps freed
//! destinations, sorted into size classes, and hands them out again: a
//! reused buffer is already resident. New buffers are mapped with
//! transparent huge pages requested (`MADV_HUGEPAGE`) and reserve only
//! address space: [`Storage::prepare`] populates them (`MADV_POPULATE_WRITE`)
//! step by step as the receive path is about to write each part, so a first
//! use takes 2 MiB faults in a few passes instead of 4 KiB faults during the
//! copy, and a destination whose bytes never arrive costs no memory (a peer
//! that announces a 2 GiB tensor and goes silent holds address space only).
//!
//! The pool keeps at most [`BufferPool::limit`] bytes (freed buffers beyond
//! it go back to the kernel) and [`BufferPool::trim`] returns everything it
//! keeps. Buffers below [`POOL_MIN`] come from the ordinary heap: the
//! allocator serves those without faults.
//!
//! ```
//! use ferry_transport::BufferPool;
//!
//! let pool = BufferPool::new(64 << 20);
//! let first = pool.storage(4 << 20)?;
//! let addr = first.as_bytes().as_ptr();
//! drop(first); // back to the pool
//! let again = pool.storage(4 << 20)?;
//! assert_eq!(again.as_bytes().as_ptr(), addr); // the same, already faulted memory
//! assert_eq!(pool.stats().reused, 1);
//! pool.trim(); // nothing kept any more
//! # Ok::<(), ferry_transport::TransportError>(())
//! ```

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use crate::{Storage, TransportError, STORAGE_ALIGN};

/// Buffers smaller than this come from the heap, not the pool.
pub const POOL_MIN: usize = 256 << 10;
/// Default for [`BufferPool::global`]'s limit; `FERRY_RECV_POOL_BYTES`
/// overrides it.
pub const DEFAULT_POOL_LIMIT: usize = 1 << 30;
const HUGE_PAGE: usize = 2 << 20;

/// A pool of reusable receive buffers. Cloning shares the pool.
#[derive(Clone)]
pub struct BufferPool {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    limit: usize,
    kept: usize,
    free: BTreeMap<usize, Vec<Block>>,
    stats: PoolStats,
}

/// Counters of a pool, for tests and benchmarks.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers handed out from kept memory.
    pub reused: u64,
    /// Buffers newly mapped.
    pub mapped: u64,
    /// Bytes kept now, ready for reuse.
    pub kept_bytes: usize,
    /// Buffers given back to the kernel (over the limit, or trimmed).
    pub released: u64,
}

/// One anonymous mapping of `class` usable bytes.
pub(crate) struct Block {
    base: NonNull<u8>,
    map_len: usize,
    ptr: NonNull<u8>,
    class: usize,
    /// Leading bytes known to be resident.
    populated: usize,
}

// SAFETY: a Block exclusively owns its mapping.
unsafe impl Send for Block {}
// SAFETY: no interior mutability; access to the bytes goes through Storage.
unsafe impl Sync for Block {}

/// Asks for transparent huge pages (`MADV_HUGEPAGE`) on the whole 2 MiB
/// pages inside the `len` bytes at `ptr`, memory about to be written: the
/// kernel then faults them in 2 MiB at a time, and a peer reading them
/// with `process_vm_readv` (`cma`) walks 2 MiB pages. The pool's buffers
/// are aligned for it; ferry-tch's allocator advises the tensors it
/// receives into. Where THP is off or unsupported the advice is refused
/// and nothing changes.
///
/// # Safety
///
/// `ptr..ptr + len` must lie inside one live allocation of this process
/// (the advice changes how its pages are backed, never their contents).
pub unsafe fn advise_huge_pages(ptr: *mut u8, len: usize) {
    if let Some((start, end)) = huge_page_span(ptr as usize, len) {
        // SAFETY: [start, end) lies inside the caller's allocation.
        let advised = unsafe {
            rustix::mm::madvise(
                start as *mut c_void,
                end - start,
                rustix::mm::Advice::LinuxHugepage,
            )
        };
        if let Err(e) = advised {
            tracing::trace!(error = %e, "no transparent huge pages for a buffer");
        }
    }
}

/// The whole huge pages `[start, end)` inside `len` bytes at `addr`, if any.
fn huge_page_span(addr: usize, len: usize) -> Option<(usize, usize)> {
    let start = addr.checked_next_multiple_of(HUGE_PAGE)?;
    let end = addr.checked_add(len)? / HUGE_PAGE * HUGE_PAGE;
    (end > start).then_some((start, end))
}

impl Block {
    fn map(class: usize) -> Result<Block, TransportError> {
        let map_len = class + HUGE_PAGE;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let base = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                map_len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::NORESERVE,
            )
        }
        .map_err(|e| TransportError::Alloc(format!("mapping {class} bytes failed: {e}")))?;
        let base = NonNull::new(base.cast::<u8>())
            .ok_or_else(|| TransportError::Alloc("mmap returned null".into()))?;
        // Align the usable part to a huge page so it can be backed by them.
        let offset = base.as_ptr().align_offset(HUGE_PAGE);
        // SAFETY: offset < HUGE_PAGE, and the mapping is class + HUGE_PAGE long.
        let ptr = unsafe { NonNull::new_unchecked(base.as_ptr().add(offset)) };
        // SAFETY: the range lies inside our own live mapping.
        unsafe { advise_huge_pages(ptr.as_ptr(), class) };
        Ok(Block {
            base,
            map_len,
            ptr,
            class,
            populated: 0,
        })
    }

    /// Makes the first `len` bytes resident before they are written.
    pub(crate) fn populate(&mut self, len: usize) {
        if len <= self.populated {
            return;
        }
        let start = self.populated & !(HUGE_PAGE - 1);
        let end = len.div_ceil(4096) * 4096;
        let end = end.min(self.class);
        // SAFETY: the range lies inside our mapping. MADV_POPULATE_WRITE
        // (Linux 5.14) faults the pages in writable; it does not change their
        // contents. On older kernels it fails and the pages fault on first use.
        let _ = unsafe {
            libc::madvise(
                self.ptr.as_ptr().add(start).cast::<c_void>(),
                end - start,
                libc::MADV_POPULATE_WRITE,
            )
        };
        self.populated = end;
    }

    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `map`, which nothing
        // references any more (the Storage holding it is gone).
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast::<c_void>(), self.map_len) };
    }
}

/// The size class serving `len` bytes: `len` rounded up to a page, then to
/// one of eight steps between consecutive powers of two (at most 12.5%
/// unused address space; only the bytes asked for are made resident).
fn size_class(len: usize) -> usize {
    let len = len.max(POOL_MIN).div_ceil(4096) * 4096;
    let pow = len.next_power_of_two();
    if pow == len {
        return len;
    }
    let step = (pow / 2) / 8;
    len.div_ceil(step) * step
}

impl BufferPool {
    /// A pool keeping at most `limit` bytes of freed buffers.
    pub fn new(limit: usize) -> Self {
        BufferPool {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    limit,
                    ..State::default()
                }),
            }),
        }
    }

    /// The process-wide pool behind [`RawAllocator`](crate::RawAllocator);
    /// its limit is `FERRY_RECV_POOL_BYTES` when set, else
    /// [`DEFAULT_POOL_LIMIT`].
    pub fn global() -> &'static BufferPool {
        static GLOBAL: OnceLock<BufferPool> = OnceLock::new();
        GLOBAL.get_or_init(|| {
            let limit = std::env::var("FERRY_RECV_POOL_BYTES")
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(DEFAULT_POOL_LIMIT);
            BufferPool::new(limit)
        })
    }

    /// A storage of `len` bytes whose contents are unspecified (stale bytes
    /// of an earlier tensor, or zeros): for destinations that a channel
    /// fills completely. Nothing is made resident yet: call
    /// [`Storage::prepare`] as the bytes are about to be written. Dropping
    /// it gives the memory back to the pool.
    pub fn storage(&self, len: usize) -> Result<Storage, TransportError> {
        if len < POOL_MIN {
            return Storage::zeroed(len);
        }
        let class = size_class(len);
        let reused = {
            let mut state = self.lock();
            let block = state.free.get_mut(&class).and_then(Vec::pop);
            if block.is_some() {
                state.kept -= class;
                state.stats.reused += 1;
            } else {
                state.stats.mapped += 1;
            }
            block
        };
        let block = match reused {
            Some(b) => b,
            None => Block::map(class)?,
        };
        debug_assert_eq!(block.ptr.as_ptr().align_offset(STORAGE_ALIGN), 0);
        Ok(Storage::pooled(block, len, self.clone()))
    }

    /// Takes a block back from a dropped storage: kept if the limit allows.
    pub(crate) fn give_back(&self, block: Block) {
        let mut state = self.lock();
        if state.kept + block.class <= state.limit {
            state.kept += block.class;
            state.free.entry(block.class).or_default().push(block);
        } else {
            state.stats.released += 1;
            drop(state);
            drop(block);
        }
    }

    /// The most bytes this pool keeps for reuse.
    pub fn limit(&self) -> usize {
        self.lock().limit
    }

    /// Changes the limit, giving back to the kernel what no longer fits.
    pub fn set_limit(&self, limit: usize) {
        let released = {
            let mut state = self.lock();
            state.limit = limit;
            let mut out = Vec::new();
            while state.kept > state.limit {
                // Release the largest buffers first.
                let Some(mut entry) = state.free.last_entry() else {
                    break;
                };
                let block = entry.get_mut().pop();
                if entry.get().is_empty() {
                    entry.remove();
                }
                if let Some(b) = block {
                    state.kept -= b.class;
                    state.stats.released += 1;
                    out.push(b);
                }
            }
            out
        };
        drop(released);
    }

    /// Gives every kept buffer back to the kernel.
    pub fn trim(&self) {
        let limit = self.limit();
        self.set_limit(0);
        self.set_limit(limit);
    }

    /// Counters and the bytes kept now.
    pub fn stats(&self) -> PoolStats {
        let state = self.lock();
        PoolStats {
            kept_bytes: state.kept,
            ..state.stats
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave State inconsistent in
        // a way that matters (counters only), so poisoning is ignored.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool")
            .field("limit", &self.limit())
            .field("stats", &self.stats())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_span_is_the_whole_huge_pages_inside_the_range() {
        let mb = 1 << 20;
        // Less than one whole huge page inside: none.
        assert_eq!(huge_page_span(mb, 2 * mb), None);
        // Aligned: all of it.
        assert_eq!(huge_page_span(2 * mb, 4 * mb), Some((2 * mb, 6 * mb)));
        // Unaligned on both ends: the inner whole pages only.
        assert_eq!(
            huge_page_span(2 * mb + 64, 40 * mb),
            Some((4 * mb, 42 * mb))
        );
        // Two pages' worth of bytes straddling three pages: one whole page.
        assert_eq!(huge_page_span(mb, 4 * mb), Some((2 * mb, 4 * mb)));
        // Past the top of the address space: no overflow, no span.
        assert_eq!(huge_page_span(usize::MAX - mb, 4 * mb), None);
    }

    #[test]
    fn size_classes_round_up_by_at_most_an_eighth() {
        assert_eq!(size_class(1), POOL_MIN);
        assert_eq!(size_class(1 << 20), 1 << 20);
        for len in [300_000usize, 4_000_000, 40_000_000, 400_000_000] {
            let c = size_class(len);
            assert!(c >= len, "{len} -> {c}");
            assert!(c - len <= len / 7 + 4096, "{len} -> {c}");
            assert_eq!(size_class(c), c, "a class is its own class");
        }
    }

    #[test]
    fn reuses_within_a_class_and_respects_the_limit() {
        let pool = BufferPool::new(8 << 20);
        let a = pool.storage(3 << 20).expect("map");
        let b = pool.storage(3 << 20).expect("map");
        let c = pool.storage(3 << 20).expect("map");
        assert_eq!(pool.stats().mapped, 3);
        drop((a, b, c));
        // Two 3 MiB buffers fit in 8 MiB, the third goes back to the kernel.
        let s = pool.stats();
        assert_eq!((s.kept_bytes, s.released), (6 << 20, 1));
        let mut d = pool.storage((3 << 20) - 100).expect("reuse");
        assert_eq!(d.len(), (3 << 20) - 100);
        d.as_bytes_mut().fill(7);
        assert_eq!(pool.stats().reused, 1);
        drop(d);
        pool.trim();
        assert_eq!(pool.stats().kept_bytes, 0);
        // Small buffers never touch the pool.
        let small = pool.storage(1000).expect("heap");
        assert!(small.as_bytes().iter().all(|&b| b == 0));
        assert_eq!(pool.stats().mapped, 3);
    }

    /// Pages of `bytes` resident now (`mincore`), counted in 4 KiB pages.
    fn resident_pages(bytes: &[u8]) -> usize {
        let pages = bytes.len().div_ceil(4096);
        let mut vec = vec![0u8; pages];
        // SAFETY: the range is our own mapping (page-aligned start, see
        // Block::map); `vec` has one byte per page.
        let rc = unsafe {
            libc::mincore(
                bytes.as_ptr() as *mut c_void,
                bytes.len(),
                vec.as_mut_ptr().cast(),
            )
        };
        assert_eq!(rc, 0, "mincore failed");
        vec.iter().filter(|&&v| v & 1 == 1).count()
    }

    #[test]
    fn a_new_buffer_commits_memory_only_as_it_is_prepared() {
        let pool = BufferPool::new(0);
        let mut s = pool.storage(256 << 20).expect("map");
        assert_eq!(
            resident_pages(s.as_bytes()),
            0,
            "nothing is resident before the bytes arrive"
        );
        s.prepare(8 << 20);
        let resident = resident_pages(s.as_bytes()) * 4096;
        // MADV_POPULATE_WRITE may be missing (Linux < 5.14): then nothing is.
        assert!(resident <= 8 << 20, "{resident} bytes resident after 8 MiB");
    }

    #[test]
    fn set_limit_releases_what_no_longer_fits() {
        let pool = BufferPool::new(64 << 20);
        let bufs: Vec<_> = (0..4)
            .map(|_| pool.storage(4 << 20).expect("map"))
            .collect();
        drop(bufs);
        assert_eq!(pool.stats().kept_bytes, 16 << 20);
        pool.set_limit(8 << 20);
        assert_eq!(pool.stats().kept_bytes, 8 << 20);
        assert_eq!(pool.limit(), 8 << 20);
    }
}
