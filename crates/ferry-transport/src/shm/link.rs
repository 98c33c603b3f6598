//! A bidirectional shared-memory link: one segment, two rings, four eventfds.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use super::io::{Gone, PeerGone, ShmReader, ShmWriter};
use super::ring::{Ring, MAX_RING_CAPACITY};
use super::segment::Segment;
use super::wake::{eventfd, Signal, Wait};
use crate::TransportError;

const PEER: &str = "shm peer";

fn io_err(source: io::Error) -> TransportError {
    TransportError::Io {
        peer: PEER.to_owned(),
        source,
    }
}

fn invalid(msg: String) -> TransportError {
    io_err(io::Error::new(io::ErrorKind::InvalidData, msg))
}

/// One side of a same-host, bidirectional byte link between two processes:
/// a memfd segment holding two rings (one per direction) and four
/// eventfds for wake-ups.
///
/// One process calls [`create`](ShmLink::create) and sends the returned fds
/// to the other (e.g. with [`send_fds`](super::send_fds)), which calls
/// [`open`](ShmLink::open) on them; then each side calls
/// [`split`](ShmLink::split) to get its [`ShmReader`] and [`ShmWriter`].
#[derive(Debug)]
pub struct ShmLink {
    segment: Arc<Segment>,
    tx: Ring,
    rx: Ring,
    /// Signalled by us after writing to `tx`.
    tx_data: OwnedFd,
    /// Waited on by us when `tx` is full.
    tx_space: OwnedFd,
    /// Waited on by us when `rx` is empty.
    rx_data: OwnedFd,
    /// Signalled by us after reading from `rx`.
    rx_space: OwnedFd,
}

impl ShmLink {
    /// How many fds [`create`](ShmLink::create) hands out for the peer and
    /// [`open`](ShmLink::open) expects, in this order:
    ///
    /// 0. the memfd holding both rings (ring A at offset 0, ring B right
    ///    after it, each a ring header followed by `capacity` data bytes
    ///    rounded up to 64);
    /// 1. ring A's data-available eventfd;
    /// 2. ring A's space-available eventfd;
    /// 3. ring B's data-available eventfd;
    /// 4. ring B's space-available eventfd.
    ///
    /// Ring A carries bytes from the creator to the opener, ring B from the
    /// opener to the creator.
    pub const FD_COUNT: usize = 5;

    /// Creates a link whose two rings each hold `capacity` bytes (a power of
    /// two, at most 1 TiB). Returns this side and the
    /// [`FD_COUNT`](Self::FD_COUNT) fds (in the order documented there) to send to the
    /// peer; they are close-on-exec duplicates, and this side keeps its own.
    pub fn create(capacity: usize) -> Result<(ShmLink, Vec<OwnedFd>), TransportError> {
        if !capacity.is_power_of_two() || capacity > MAX_RING_CAPACITY {
            return Err(io_err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "ring capacity {capacity} is not a power of two in 1..={MAX_RING_CAPACITY}"
                ),
            )));
        }
        let per_ring = Ring::bytes_needed(capacity);
        let segment = Arc::new(Segment::create(2 * per_ring, "ferry-shm-link")?);
        let base = NonNull::new(segment.as_ptr()).ok_or_else(|| invalid("null mapping".into()))?;
        // SAFETY: the segment holds two regions of `per_ring` bytes, page
        // (hence 64-byte) aligned and 64-byte multiples; it lives as long as
        // the rings (the reader and writer keep the `Arc`). Only this side's
        // writer writes A and only its reader reads B; the peer takes the
        // other roles.
        let (tx, rx) = unsafe {
            (
                Ring::init(base, per_ring, capacity),
                Ring::init(base.add(per_ring), per_ring, capacity),
            )
        };
        let (tx, rx) = (tx.map_err(io_err)?, rx.map_err(io_err)?);
        let [tx_data, tx_space, rx_data, rx_space] = [eventfd(), eventfd(), eventfd(), eventfd()];
        let (tx_data, tx_space, rx_data, rx_space) = (
            tx_data.map_err(io_err)?,
            tx_space.map_err(io_err)?,
            rx_data.map_err(io_err)?,
            rx_space.map_err(io_err)?,
        );
        let dup = |fd: &dyn AsFd| {
            rustix::io::fcntl_dupfd_cloexec(fd.as_fd(), 0).map_err(|e| io_err(e.into()))
        };
        let fds = vec![
            dup(&segment.fd())?,
            dup(&tx_data)?,
            dup(&tx_space)?,
            dup(&rx_data)?,
            dup(&rx_space)?,
        ];
        let link = ShmLink {
            segment,
            tx,
            rx,
            tx_data,
            tx_space,
            rx_data,
            rx_space,
        };
        Ok((link, fds))
    }

    /// Opens the peer's side of a link from the [`FD_COUNT`](Self::FD_COUNT) fds that
    /// [`create`](ShmLink::create) returned over there (same order). Checks
    /// the fd count, the segment (a sealed memfd of two equal ring regions)
    /// and both ring headers; anything unexpected is an error, not a panic.
    pub fn open(fds: Vec<OwnedFd>) -> Result<ShmLink, TransportError> {
        let [memfd, a_data, a_space, b_data, b_space]: [OwnedFd; Self::FD_COUNT] =
            fds.try_into().map_err(|fds: Vec<OwnedFd>| {
                invalid(format!(
                    "a shm link needs {} fds, received {}",
                    Self::FD_COUNT,
                    fds.len()
                ))
            })?;
        let segment = Arc::new(Segment::open(memfd)?);
        let len = segment.len();
        if len % 2 != 0 {
            return Err(invalid(format!("shm link segment has an odd size ({len})")));
        }
        let per_ring = len / 2;
        let base = NonNull::new(segment.as_ptr()).ok_or_else(|| invalid("null mapping".into()))?;
        // SAFETY: both regions are inside the mapping, which lives as long as
        // the rings; `attach` checks alignment and that each header's
        // capacity fits its region. The creator writes A and reads B; we
        // take the other roles.
        let (rx, tx) = unsafe {
            (
                Ring::attach(base, per_ring),
                Ring::attach(base.add(per_ring), per_ring),
            )
        };
        let (rx, tx) = (rx.map_err(io_err)?, tx.map_err(io_err)?);
        for ring in [&rx, &tx] {
            if Ring::bytes_needed(ring.capacity()) != per_ring {
                return Err(invalid(format!(
                    "ring capacity {} does not match its {per_ring}-byte region",
                    ring.capacity()
                )));
            }
        }
        for fd in [&a_data, &a_space, &b_data, &b_space] {
            // Whatever the peer sent, never let a blocking read stall the runtime.
            rustix::io::ioctl_fionbio(fd, true).map_err(|e| io_err(e.into()))?;
        }
        Ok(ShmLink {
            segment,
            tx,
            rx,
            tx_data: b_data,
            tx_space: b_space,
            rx_data: a_data,
            rx_space: a_space,
        })
    }

    /// The capacity of each ring in bytes.
    pub fn capacity(&self) -> usize {
        self.tx.capacity()
    }

    /// Splits the link into its reading and writing halves. `peer_gone`, if
    /// given, makes a waiting read or write fail once it completes (see
    /// [`PeerGone`]); the two halves share it.
    ///
    /// The eventfds are registered with tokio on first use, so the halves
    /// must be polled inside a tokio runtime with I/O enabled (polling them
    /// elsewhere fails with an error).
    pub fn split(self, peer_gone: Option<PeerGone>) -> (ShmReader, ShmWriter) {
        let ShmLink {
            segment,
            tx,
            rx,
            tx_data,
            tx_space,
            rx_data,
            rx_space,
        } = self;
        let (reader_gone, writer_gone) = Gone::pair(peer_gone);
        let reader = ShmReader::new(
            segment.clone(),
            rx,
            Wait::new(rx_data),
            Signal::new(rx_space),
            reader_gone,
        );
        let writer = ShmWriter::new(
            segment,
            tx,
            Signal::new(tx_data),
            Wait::new(tx_space),
            writer_gone,
        );
        (reader, writer)
    }
}
