//! Multi-lane TCP (`mpt`): a tensor channel that splits each tensor's bytes
//! into chunks sent in parallel over N TCP connections ("lanes") and written
//! in place into the receiver's destination.
//!
//! The main connection carries frames (and so every tensor's descriptor);
//! the lanes carry only tensor bytes. Both ends number the tensors they move
//! with a `seq` (strictly increasing per sender, given by the caller), and
//! both ends compute the same chunk plan from `(seq, byte_len, lanes)` with
//! [`split`], so no lane ever says which tensor it carries beyond the `seq`
//! in each chunk header, which the receiver checks against the plan.
//!
//! # Setup
//!
//! One side binds a [`LaneListener`] (ephemeral port) and tells the other
//! side its address and a nonce (over the main connection); the other side
//! calls [`connect_lanes`], the first side [`LaneListener::accept`]. Every
//! lane starts with a [`LaneHello`]; connections with a wrong magic, nonce or
//! lane count, a duplicate index, or no hello before the deadline are
//! dropped. Both calls take a timeout.
//!
//! # Wire format
//!
//! Every lane opens with a [`LaneHello`] (magic, nonce, lane index and
//! count), then carries chunks, each a [`ChunkHeader`] (`seq`, offset,
//! length) and that many bytes of the tensor. Their bytes are
//! [`ferry_wire::mpt_lane`]'s (re-exported here); nothing travels from
//! receiver to sender on a lane.
//!
//! # Chunk plan
//!
//! [`split`]`(seq, byte_len, lanes)`: a tensor of 0 bytes has no chunk (and
//! no lane traffic). Otherwise it is cut into
//! `want = clamp(byte_len / MIN_CHUNK, 1, lanes)` pieces of
//! `size = round_up(ceil(byte_len / want), CHUNK_ALIGN)` bytes (the last one
//! shorter), so every boundary is a multiple of 4096 and no piece but the
//! last is under 256 KiB; chunk `i` covers
//! `[i * size, min((i + 1) * size, byte_len))` and travels on lane
//! `(seq + i) % lanes`, so that a stream of small tensors spreads over all
//! lanes. A lane carries at most one chunk per tensor, and the chunks of a
//! lane come in `seq` order.
//!
//! # Ordering and failures
//!
//! The receiver registers each destination with [`MptReceiver::receive`] in
//! `seq` order (the main connection's reader does this as it reads
//! descriptors). A lane reader that gets a chunk header waits until its
//! `seq` is registered, checks it against the plan and reads the bytes
//! straight into the destination. A chunk for a `seq` that was skipped, a
//! second chunk, a range not in the plan: the receiver fails with
//! [`TransportError::Malformed`]. A lane that ends mid-chunk, or ends while
//! a registered tensor still needs it: [`TransportError::Closed`]. After a
//! failure every pending and later `receive` fails with that error (naming
//! the peer), and the lane tasks stop.
//!
//! On the sending side, a lane whose write fails (or whose peer closes it)
//! fails the sender: every later [`MptSender::send`] returns the error.
//!
//! Dropping an [`MptSender`] or [`MptReceiver`] aborts its lane tasks at
//! once; call [`MptSender::flush`] first to let queued chunks reach the
//! kernel (closing a lane after that still delivers them).

mod lanes;
mod recv;
mod send;

use std::io;

use ferry_wire::WireError;

use crate::TransportError;

pub use ferry_wire::mpt_lane::{
    ChunkHeader, LaneError, LaneHello, CHUNK_HEADER_LEN, HELLO_LEN, LANE_MAGIC,
};
pub use lanes::{connect_lanes, connect_lanes_authenticated, Lane, LaneListener};
pub use recv::MptReceiver;
pub use send::MptSender;

/// Most lanes one channel may use.
pub const MAX_LANES: usize = 64;
/// Tensors get one chunk per this many bytes (at most one per lane).
pub const MIN_CHUNK: u64 = 256 << 10;
/// Every chunk boundary is a multiple of this.
pub const CHUNK_ALIGN: u64 = 4096;

/// One chunk of a tensor's bytes and the lane that carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// The lane, `0..lanes`.
    pub lane: usize,
    /// First byte of the chunk in the tensor's bytes.
    pub offset: u64,
    /// Length of the chunk (never 0).
    pub len: u64,
}

/// The chunk plan of a tensor: a pure function of `(seq, byte_len, lanes)`
/// that both ends compute (see the [module docs](self)). Chunks come in
/// offset order, are non-empty, cover `0..byte_len` exactly, and use
/// distinct lanes. `lanes` of 0 counts as 1.
pub fn split(seq: u64, byte_len: u64, lanes: usize) -> impl Iterator<Item = Chunk> + Clone {
    let lanes = lanes.max(1) as u64;
    let (size, count) = if byte_len == 0 {
        (1, 0)
    } else {
        let want = (byte_len / MIN_CHUNK).clamp(1, lanes);
        let size = byte_len
            .div_ceil(want)
            .div_ceil(CHUNK_ALIGN)
            .saturating_mul(CHUNK_ALIGN);
        (size, byte_len.div_ceil(size))
    };
    (0..count).map(move |i| {
        let offset = i * size;
        Chunk {
            lane: ((seq % lanes + i) % lanes) as usize,
            offset,
            len: size.min(byte_len - offset),
        }
    })
}

/// A failure kept by a sender or receiver and reported to every later call
/// (`TransportError` is not `Clone`).
#[derive(Debug, Clone)]
enum Failure {
    Closed,
    /// A sealed lane's record failed its check.
    Integrity(crate::auth::RecordError),
    Io(io::ErrorKind, String),
    Malformed(WireError),
    Invalid(String),
}

impl Failure {
    fn io(e: &io::Error) -> Self {
        match crate::auth::RecordError::of(e) {
            Some(crate::auth::RecordError::Truncated { .. }) | None => {}
            Some(r) => return Self::Integrity(r.clone()),
        }
        if e.kind() == io::ErrorKind::UnexpectedEof {
            Self::Closed
        } else {
            Self::Io(e.kind(), e.to_string())
        }
    }

    fn to_error(&self, peer: &str) -> TransportError {
        let peer = peer.to_owned();
        match self {
            Self::Closed => TransportError::Closed { peer },
            Self::Integrity(source) => TransportError::Integrity {
                peer,
                source: source.clone(),
            },
            Self::Io(kind, msg) => TransportError::Io {
                peer,
                source: io::Error::new(*kind, msg.clone()),
            },
            Self::Malformed(source) => TransportError::Malformed {
                peer,
                source: source.clone(),
            },
            Self::Invalid(msg) => TransportError::InvalidTensor(msg.clone()),
        }
    }
}

/// Locks a mutex, ignoring poisoning (no code path panics while holding one).
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(seq: u64, byte_len: u64, lanes: usize) {
        let chunks: Vec<_> = split(seq, byte_len, lanes).collect();
        let mut at = 0;
        let mut used = 0u64;
        for c in &chunks {
            assert_eq!(c.offset, at);
            assert!(c.len > 0);
            assert_eq!(c.offset % CHUNK_ALIGN, 0);
            assert!(c.lane < lanes.max(1));
            assert_eq!(used & (1 << c.lane), 0, "lane used twice");
            used |= 1 << c.lane;
            at += c.len;
        }
        assert_eq!(at, byte_len);
        assert!(chunks.len() <= lanes.max(1));
        if byte_len > 0 && byte_len >= MIN_CHUNK * lanes.max(1) as u64 {
            assert_eq!(chunks.len(), lanes.max(1));
        }
    }

    #[test]
    fn split_covers_exactly() {
        for lanes in [0, 1, 2, 3, 4, 7, 8, 64] {
            for len in [
                0,
                1,
                4095,
                4096,
                4097,
                MIN_CHUNK - 1,
                MIN_CHUNK,
                MIN_CHUNK + 1,
                2 * MIN_CHUNK + 1,
                (4 << 20) + 3,
                40 << 20,
                (1 << 32) + 12345,
            ] {
                for seq in [0, 1, 5, u64::MAX] {
                    check(seq, len, lanes);
                }
            }
        }
        for lanes in 1..=64 {
            for k in 0..=(lanes as u64 + 1) {
                for delta in [0u64, 1, 4095, 4096, 200_000] {
                    check(3, k * MIN_CHUNK + delta, lanes);
                }
            }
        }
    }

    #[test]
    fn small_tensors_rotate_lanes() {
        let lanes: Vec<_> = (0..4)
            .map(|s| split(s, 100, 4).next().map(|c| c.lane))
            .collect();
        assert_eq!(lanes, vec![Some(0), Some(1), Some(2), Some(3)]);
    }
}
