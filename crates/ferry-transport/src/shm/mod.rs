//! Same-host shared memory: the byte rings under Ferry's `shm` transport and
//! `shm` channel.
//!
//! [`PeerConnection`](crate::PeerConnection) sets these links up and uses
//! them by itself; nothing here is needed to send frames or tensors. What
//! is public is the link as a peer process sees it, for a program that
//! acts as a same-host peer without `PeerConnection` (a tool, a test that
//! plays a misbehaving peer): [`ShmLink`], its halves [`ShmReader`] /
//! [`ShmWriter`], the [`PeerGone`] signal, and [`send_fds`] / [`recv_fds`]
//! to pass its file descriptors over a Unix socket. The rings and segments
//! inside stay private.
//!
//! Two processes on one host exchange bytes through a memfd segment that
//! both map. A ring is a lock-free single-producer single-consumer byte
//! ring inside such a segment (header with `head` / `tail` counters and
//! flags, then a power-of-two data area); an [`ShmLink`] puts two rings
//! (one per direction) in one segment and adds four eventfds for
//! wake-ups; [`ShmReader`] / [`ShmWriter`] expose one direction as tokio
//! [`AsyncRead`](tokio::io::AsyncRead) /
//! [`AsyncWrite`](tokio::io::AsyncWrite).
//!
//! ```no_run
//! # async fn demo(sock: tokio::net::UnixStream) -> Result<(), Box<dyn std::error::Error>> {
//! use std::os::fd::AsFd;
//! use ferry_transport::shm::{send_fds, ShmLink};
//! use tokio::io::AsyncWriteExt;
//!
//! let (link, fds) = ShmLink::create(1 << 20)?;
//! let borrowed: Vec<_> = fds.iter().map(|fd| fd.as_fd()).collect();
//! send_fds(&sock, b"shm", &borrowed).await?;
//! let (_reader, mut writer) = link.split(None);
//! writer.write_all(b"hello over shared memory").await?;
//! # Ok(()) }
//! ```
//!
//! # Wake-ups
//!
//! The hot path makes no syscall: the producer copies bytes in and
//! publishes `head` (`Release`), the consumer copies them out after loading
//! `head` (`Acquire`) and publishes `tail`. Only a side that has to wait
//! involves the kernel, through a Dekker-style handshake on a flag:
//!
//! - A consumer that finds the ring empty re-checks `head` for up to
//!   [`SPIN_BUDGET`](crate::spin::SPIN_BUDGET) (rounds of
//!   [`SPIN_ITERATIONS`](crate::spin::SPIN_ITERATIONS) checks with
//!   [`std::hint::spin_loop`], the CPU yielded between rounds), then stores
//!   `reader_sleeping = 1`, issues a `SeqCst` fence and re-checks `head`
//!   (and `closed`); only if the ring is still empty does it wait on the
//!   data-available eventfd.
//! - A producer, after publishing `head`, issues a `SeqCst` fence and loads
//!   `reader_sleeping`; only if it is set does it clear it (`swap`) and
//!   write to the eventfd.
//!
//! The two fences are ordered one way or the other: if the consumer's comes
//! first, the producer's load sees the flag and signals; if the producer's
//! comes first, the consumer's re-check sees the new `head` and does not
//! sleep. So a consumer that sleeps is always signalled for data published
//! after its re-check, and because an eventfd is a counter, a signal sent
//! before the consumer actually blocks is not lost either. Stale signals
//! (for a sleep that ended otherwise) only cause an extra re-check. The
//! producer waiting for space is symmetric (`writer_sleeping`, signalled
//! by the consumer after it publishes `tail`, on the space-available
//! eventfd). Closing (`closed` by the writer, `reader_closed` by the
//! reader) always signals. The protocol is model-checked with loom
//! (`RUSTFLAGS="--cfg loom" cargo test -p ferry-transport --release --lib
//! shm`), where the rings live in loom-tracked memory; under `cfg(loom)`
//! only the ring and the segment are compiled (tokio has no I/O under loom).
//!
//! A crashed peer never sets `closed`; the owner of a link reports its
//! death through [`PeerGone`], which makes a waiting read or write fail
//! instead of hanging.

// Under `--cfg loom` only the ring's model checks use these.
#[cfg_attr(loom, allow(dead_code))]
mod ring;
#[cfg_attr(loom, allow(dead_code))]
mod segment;
mod sync;

#[cfg(not(loom))]
mod fdpass;
#[cfg(not(loom))]
mod io;
#[cfg(not(loom))]
mod link;
#[cfg(not(loom))]
mod wake;

#[cfg(not(loom))]
pub use fdpass::{recv_fds, send_fds, MAX_FDS_PER_MESSAGE};
#[cfg(not(loom))]
pub use io::{PeerGone, ShmReader, ShmWriter};
#[cfg(not(loom))]
pub use link::ShmLink;

#[cfg(all(test, not(loom)))]
mod tests;
