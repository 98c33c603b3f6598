//! The byte streams under a [`PeerConnection`](super::PeerConnection):
//! the TCP connection, or shared-memory rings with the TCP connection held
//! open beside them.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use crate::auth::{RecordReader, RecordWriter};
use crate::shm::{ShmReader, ShmWriter};

/// The reading half of a connection's TCP stream: with a secret, its
/// records are checked ([`crate::auth::records`]).
pub type TcpReader = RecordReader<OwnedReadHalf>;
/// The writing half of a connection's TCP stream: with a secret, its
/// records are sealed.
pub type TcpWriter = RecordWriter<OwnedWriteHalf>;

/// The reading half of a [`PeerConnection`](super::PeerConnection)'s transport.
pub enum PeerReader {
    /// Frames arrive on the TCP connection.
    Tcp(TcpReader),
    /// Frames arrive through a shared-memory ring (the TCP connection is
    /// held open beside it).
    Shm(ShmReader, TcpReader),
    /// Frames arrive as UCX tag messages (the TCP connection is held open
    /// beside them, and watched for the peer's exit).
    #[cfg(feature = "ucx")]
    Ucx(RecordReader<crate::ucx::UcxReader>),
}

/// The writing half of a [`PeerConnection`](super::PeerConnection)'s transport.
pub enum PeerWriter {
    /// Frames leave on the TCP connection.
    Tcp(TcpWriter),
    /// Frames leave through a shared-memory ring.
    Shm(ShmWriter, TcpWriter),
    /// Frames leave as UCX tag messages.
    #[cfg(feature = "ucx")]
    Ucx(RecordWriter<crate::ucx::UcxWriter>),
}

impl PeerReader {
    /// See [`ShmReader::yield_before_spin`] (the `ucx` transport's reader
    /// does the same); nothing on TCP, whose reads do not spin.
    pub fn yield_before_spin(&mut self) {
        match self {
            PeerReader::Shm(r, _) => r.yield_before_spin(),
            #[cfg(feature = "ucx")]
            PeerReader::Ucx(r) => r.get_mut().yield_before_spin(),
            PeerReader::Tcp(_) => {}
        }
    }
}

impl AsyncRead for PeerReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PeerReader::Tcp(r) => Pin::new(r).poll_read(cx, buf),
            PeerReader::Shm(r, _) => Pin::new(r).poll_read(cx, buf),
            #[cfg(feature = "ucx")]
            PeerReader::Ucx(r) => Pin::new(r).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for PeerWriter {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            PeerWriter::Tcp(w) => Pin::new(w).poll_write(cx, buf),
            PeerWriter::Shm(w, _) => Pin::new(w).poll_write(cx, buf),
            #[cfg(feature = "ucx")]
            PeerWriter::Ucx(w) => Pin::new(w).poll_write(cx, buf),
        }
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            PeerWriter::Tcp(w) => Pin::new(w).poll_write_vectored(cx, bufs),
            PeerWriter::Shm(w, _) => Pin::new(w).poll_write_vectored(cx, bufs),
            #[cfg(feature = "ucx")]
            PeerWriter::Ucx(w) => Pin::new(w).poll_write_vectored(cx, bufs),
        }
    }
    fn is_write_vectored(&self) -> bool {
        match self {
            PeerWriter::Tcp(w) => w.is_write_vectored(),
            PeerWriter::Shm(w, _) => w.is_write_vectored(),
            #[cfg(feature = "ucx")]
            PeerWriter::Ucx(w) => w.is_write_vectored(),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PeerWriter::Tcp(w) => Pin::new(w).poll_flush(cx),
            PeerWriter::Shm(w, _) => Pin::new(w).poll_flush(cx),
            #[cfg(feature = "ucx")]
            PeerWriter::Ucx(w) => Pin::new(w).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PeerWriter::Tcp(w) => Pin::new(w).poll_shutdown(cx),
            PeerWriter::Shm(w, _) => Pin::new(w).poll_shutdown(cx),
            #[cfg(feature = "ucx")]
            PeerWriter::Ucx(w) => Pin::new(w).poll_shutdown(cx),
        }
    }
}
