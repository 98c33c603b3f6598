//! A shared-memory segment: a sealed memfd mapped `MAP_SHARED`.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::TransportError;

/// The largest segment [`Segment::create`] makes and [`Segment::open`]
/// accepts (1 TiB): a bound so sizes never overflow offset arithmetic.
pub(crate) const MAX_SEGMENT_LEN: usize = 1 << 40;

/// The seals [`Segment::create`] applies: the size can never change again,
/// so a peer cannot shrink the file under our mapping (which would turn our
/// accesses into `SIGBUS`). [`Segment::open`] requires `SHRINK`.
const REQUIRED_SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// A shared-memory region backed by a memfd, mapped read-write and shared.
///
/// The creator sizes the memfd and seals it against shrinking and growing;
/// another process maps the same memory by receiving the fd (see
/// [`send_fds`](super::send_fds)) and calling [`Segment::open`]. The mapping
/// is removed when the `Segment` is dropped; share it with `Arc` while rings
/// point into it.
#[derive(Debug)]
pub(crate) struct Segment {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory owned by this value; nothing in
// `Segment` is tied to a thread. What is stored in the memory and how it is
// accessed is the business of the code that uses the pointer.
unsafe impl Send for Segment {}
// SAFETY: `&Segment` only hands out the pointer, the length and the fd.
unsafe impl Sync for Segment {}

fn io_err(what: &str, source: io::Error) -> TransportError {
    TransportError::Io {
        peer: format!("shm segment ({what})"),
        source,
    }
}

fn invalid(what: &str, msg: String) -> TransportError {
    io_err(what, io::Error::new(io::ErrorKind::InvalidData, msg))
}

impl Segment {
    /// Creates a zero-filled segment of `len` bytes backed by a new memfd
    /// named `name` (the name is only shown in `/proc/<pid>/fd`; it must not
    /// contain a NUL byte). The memfd is close-on-exec and sealed so its
    /// size never changes.
    pub(crate) fn create(len: usize, name: &str) -> Result<Segment, TransportError> {
        if len == 0 || len > MAX_SEGMENT_LEN {
            return Err(io_err(
                "create",
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("segment length {len} is not in 1..={MAX_SEGMENT_LEN}"),
                ),
            ));
        }
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| io_err("memfd_create", e.into()))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(|e| io_err("ftruncate", e.into()))?;
        rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS)
            .map_err(|e| io_err("add seals", e.into()))?;
        Self::map(fd, len)
    }

    /// Maps a segment received from another process. The size comes from
    /// `fstat`; the fd must be a memfd sealed against shrinking (as
    /// [`Segment::create`] makes them), otherwise this fails: a peer could
    /// otherwise truncate the file and crash us with `SIGBUS`.
    pub(crate) fn open(fd: OwnedFd) -> Result<Segment, TransportError> {
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| {
            invalid(
                "open",
                format!("the fd is not a sealable memfd (F_GET_SEALS: {e})"),
            )
        })?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(invalid(
                "open",
                format!("the memfd is not sealed against shrinking (seals {seals:?})"),
            ));
        }
        let stat = rustix::fs::fstat(&fd).map_err(|e| io_err("fstat", e.into()))?;
        let len = usize::try_from(stat.st_size)
            .ok()
            .filter(|&len| len > 0 && len <= MAX_SEGMENT_LEN)
            .ok_or_else(|| {
                invalid(
                    "open",
                    format!(
                        "segment size {} is not in 1..={MAX_SEGMENT_LEN}",
                        stat.st_size
                    ),
                )
            })?;
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<Segment, TransportError> {
        // SAFETY: a fresh mapping chosen by the kernel (null hint) aliases no
        // Rust object; it is unmapped exactly once, in `Drop`.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .map_err(|e| io_err("mmap", e.into()))?;
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| invalid("mmap", "mmap returned a null pointer".to_owned()))?;
        Ok(Segment { ptr, len, fd })
    }

    /// The memfd, to duplicate or send to the peer.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Start of the mapping (page-aligned). Valid for [`len`](Self::len)
    /// bytes as long as `self` lives; other processes may write it at any
    /// time, so only access it through atomics or raw-pointer copies.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length of the mapping in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in `map`, and it is
        // unmapped only here.
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!("munmap of a shm segment failed: {e}");
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_share_bytes() {
        let a = Segment::create(8192, "ferry-test").expect("create");
        let dup = rustix::io::fcntl_dupfd_cloexec(a.fd(), 0).expect("dup");
        let b = Segment::open(dup).expect("open");
        assert_eq!(b.len(), 8192);
        // SAFETY: both pointers are valid for 8192 bytes; nothing else
        // accesses them in this test.
        unsafe {
            a.as_ptr().add(100).write(42);
            assert_eq!(b.as_ptr().add(100).read(), 42);
        }
    }

    #[test]
    fn open_rejects_unsealed_or_foreign_fds() {
        let plain = rustix::fs::memfd_create("unsealed", MemfdFlags::CLOEXEC).expect("memfd");
        rustix::fs::ftruncate(&plain, 4096).expect("ftruncate");
        assert!(Segment::open(plain).is_err());
        let (r, _w) = rustix::pipe::pipe().expect("pipe");
        assert!(Segment::open(r).is_err());
        assert!(Segment::create(0, "empty").is_err());
        assert!(Segment::create(16, "bad\0name").is_err());
    }
}
