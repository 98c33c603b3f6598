//! Buffers in shared memory: a sealed memfd mapped by the parent and, once
//! sent over the command socket, by the child, so an allreduce reduces the
//! very memory the training loop wrote its gradients to.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

/// Ids of buffers dropped by the parent, for the child to unmap.
pub(crate) type Released = Arc<Mutex<Vec<u64>>>;

/// Buffer ids, unique within the process.
static NEXT_BUFFER: AtomicU64 = AtomicU64::new(1);

/// Why a shared buffer could not be made or mapped.
#[derive(Debug, thiserror::Error)]
#[error("shared buffer ({what}): {source}")]
pub struct ShmError {
    /// The step that failed.
    pub what: &'static str,
    /// The operating system's error.
    #[source]
    pub source: std::io::Error,
}

fn shm_error(what: &'static str) -> impl FnOnce(rustix::io::Errno) -> ShmError {
    move |errno| ShmError {
        what,
        source: errno.into(),
    }
}

/// A `MAP_SHARED` mapping of a memfd, unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<f32>,
    /// In `f32` values.
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain memory owned by this value; nothing in it is
// tied to a thread. Access to the values goes through `SharedBuffer`'s
// `&`/`&mut` borrows (parent) or one task at a time (child).
unsafe impl Send for Mapping {}
// SAFETY: `&Mapping` hands out only the pointer, length and fd.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// A new zero-filled memfd of `len` `f32` values (at least one page is
    /// made for an empty buffer), sealed against resizing, mapped.
    pub(crate) fn create(len: usize, name: &str) -> Result<Self, ShmError> {
        let bytes = len
            .checked_mul(4)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| ShmError {
                what: "size",
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{len} f32 values do not fit in memory"),
                ),
            })?;
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(shm_error("memfd_create"))?;
        rustix::fs::ftruncate(&fd, bytes.max(1) as u64).map_err(shm_error("ftruncate"))?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(shm_error("seal"))?;
        Self::map(fd, len)
    }

    /// Maps a memfd received from the parent, which must hold at least
    /// `len` `f32` values and be sealed against shrinking (so the parent
    /// cannot truncate it under the mapping).
    pub(crate) fn open(fd: OwnedFd, len: usize) -> Result<Self, ShmError> {
        let invalid = |reason: String| ShmError {
            what: "open",
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, reason),
        };
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(shm_error("get seals"))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(invalid(format!(
                "the memfd is not sealed against shrinking ({seals:?})"
            )));
        }
        let size = rustix::fs::fstat(&fd).map_err(shm_error("fstat"))?.st_size;
        if (size as u128) < (len as u128) * 4 {
            return Err(invalid(format!(
                "the memfd holds {size} bytes, fewer than {len} f32 values"
            )));
        }
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<Self, ShmError> {
        let bytes = (len * 4).max(1);
        // SAFETY: a fresh mapping chosen by the kernel (null hint) aliases
        // no Rust object; it is unmapped exactly once, in `Drop`.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                bytes,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .map_err(shm_error("mmap"))?;
        let ptr = NonNull::new(ptr.cast::<f32>()).ok_or_else(|| ShmError {
            what: "mmap",
            source: std::io::Error::other("mmap returned a null pointer"),
        })?;
        Ok(Self { ptr, len, fd })
    }

    /// The memfd.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The values.
    ///
    /// # Safety
    ///
    /// No mutable reference to the values may be alive in this process
    /// while the slice is, and no other process may write them meanwhile.
    pub(crate) unsafe fn slice(&self) -> &[f32] {
        // SAFETY: the mapping holds `len` f32 values (page-aligned, so
        // aligned for f32) and lives as long as `self`; the absence of
        // writers is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The values, mutably.
    ///
    /// # Safety
    ///
    /// No other reference to the values may be alive in this process while
    /// the slice is, and no other process may access them meanwhile (the
    /// parent hands a buffer to the child only while it gives up its own
    /// access).
    // The mapping is shared memory: exclusivity is a promise of the caller
    // (see Safety), not something a `&mut self` could express across
    // processes.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut(&self) -> &mut [f32] {
        // SAFETY: the mapping holds `len` f32 values (page-aligned, so
        // aligned for f32) and lives as long as `self`; exclusivity is the
        // caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `map`; no slice of it
        // outlives `self`.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), (self.len * 4).max(1)) };
    }
}

/// `f32` values in shared memory, which a
/// [`BabyProcessGroup`](super::BabyProcessGroup) reduces in place in its
/// child, without copying them through the command pipe.
///
/// Make one with [`BabyProcessGroup::buffer`](super::BabyProcessGroup::buffer),
/// write into it (it dereferences to `[f32]`), and hand it to
/// [`allreduce_buffer`](super::BabyProcessGroup::allreduce_buffer), which
/// gives it back when the child is done with it (or dead). While an
/// allreduce holds it, nobody in this process can touch it.
pub struct SharedBuffer {
    id: u64,
    mapping: Arc<Mapping>,
    released: Released,
}

impl fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedBuffer")
            .field("id", &self.id)
            .field("len", &self.mapping.len)
            .finish()
    }
}

impl SharedBuffer {
    pub(crate) fn create(len: usize, released: Released) -> Result<Self, ShmError> {
        let id = NEXT_BUFFER.fetch_add(1, Ordering::Relaxed);
        let mapping = Mapping::create(len, &format!("ferry-ft-baby-{id}"))?;
        Ok(Self {
            id,
            mapping: Arc::new(mapping),
            released,
        })
    }

    /// The buffer's id, as the child knows it.
    pub fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn mapping(&self) -> &Arc<Mapping> {
        &self.mapping
    }
}

impl Deref for SharedBuffer {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        // SAFETY: `SharedBuffer` is the only handle to these values in
        // this process (the `Arc` is shared only with the driver, which
        // sends the fd and never reads the values), and the child only
        // touches them while an allreduce owns this buffer, which it does
        // by value: no `&self` is alive then.
        unsafe { self.mapping.slice() }
    }
}

impl DerefMut for SharedBuffer {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` excludes other borrows.
        unsafe { self.mapping.slice_mut() }
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        self.released
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_zeroed_writable_and_seen_through_its_fd() {
        let released = Released::default();
        let mut buffer = SharedBuffer::create(1000, Arc::clone(&released)).expect("create");
        assert_eq!(buffer.len(), 1000);
        assert!(buffer.iter().all(|&v| v == 0.0));
        buffer[999] = 2.5;
        let fd = buffer.mapping().fd().try_clone_to_owned().expect("dup");
        let other = Mapping::open(fd, 1000).expect("open");
        // SAFETY: only this test touches the values, one view at a time.
        let view = unsafe { other.slice_mut() };
        assert_eq!(view[999], 2.5);
        view[0] = -1.0;
        assert_eq!(buffer[0], -1.0);
        let id = buffer.id();
        drop(buffer);
        assert_eq!(
            *released.lock().unwrap_or_else(PoisonError::into_inner),
            [id]
        );
    }

    #[test]
    fn an_fd_too_small_for_the_length_is_refused() {
        let buffer = SharedBuffer::create(10, Released::default()).expect("create");
        let fd = buffer.mapping().fd().try_clone_to_owned().expect("dup");
        let error = Mapping::open(fd, 1 << 20).expect_err("too small");
        assert_eq!(error.what, "open");
    }

    #[test]
    fn an_empty_buffer_works() {
        let buffer = SharedBuffer::create(0, Released::default()).expect("create");
        assert!(buffer.is_empty());
    }
}
