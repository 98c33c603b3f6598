//! The `ucx` transport: the connection's byte stream as tagged messages.
//!
//! The writer sends each write (at most [`CHUNK`] bytes, copied: the
//! frame layer's buffers are reused as soon as a write returns) as one
//! tag message, numbered per direction; the reader posts the receive of
//! the next number into a [`CHUNK`]-byte buffer: right after a full chunk
//! (more of the same write is on its way, and lands straight in the
//! buffer), otherwise when it next reads, so a short message is handed on
//! without a UCX call in between. An empty message ends the stream
//! ([`UcxWriter`]'s shutdown). UCX's stream API is not used: it lost data
//! when both ends connect to each other by address.
//!
//! The TCP connection of the handshake stays open beside: the reader
//! watches it, so a peer that exits is noticed even where UCX's own
//! transports (shared memory) do not notice it.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use super::worker::Pending;
use super::{UcxLink, FRAME_TAG};

/// Largest chunk of the stream in one tag message.
pub(crate) const CHUNK: usize = 256 << 10;
/// Writes up to this size are copied into the writer's scratch buffer and
/// sent from there (see [`UcxLink::send_or_keep`]).
const SCRATCH_MAX: usize = 8 << 10;
/// Sends not yet completed before a write waits.
const MAX_UNFINISHED_SENDS: usize = 256;
/// After the TCP connection closed, how long the reader still waits for the
/// stream's end marker (it may trail the TCP close on another path).
const DRAIN_AFTER_CLOSE: Duration = Duration::from_millis(500);

fn to_io(e: crate::TransportError) -> io::Error {
    io::Error::other(e.to_string())
}

/// The reading half of the `ucx` transport.
pub struct UcxReader {
    link: UcxLink,
    seq: u64,
    /// The chunk being read (boxed: each receive owns its buffer as a
    /// `Box<dyn Any>`, and this box travels with the receive and comes
    /// back with it, so no receive allocates one).
    #[allow(clippy::box_collection)]
    buf: Box<Vec<u8>>,
    /// The buffer of the next receive, posted as soon as one completes so
    /// the next chunk lands straight in it.
    #[allow(clippy::box_collection)]
    spare: Option<Box<Vec<u8>>>,
    pos: usize,
    end: usize,
    posted: Option<Pending>,
    eof: bool,
    tcp: OwnedReadHalf,
    tcp_closed: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Yield to the tokio scheduler once before the next wait spins.
    yield_first: bool,
}

impl UcxReader {
    /// The next time a read finds no chunk, yield to the tokio scheduler
    /// once before spinning (like
    /// [`ShmReader::yield_before_spin`](crate::shm::ShmReader::yield_before_spin)):
    /// a task this reader's last message woke runs first, on this thread.
    pub fn yield_before_spin(&mut self) {
        self.yield_first = true;
    }

    pub(crate) fn new(link: UcxLink, tcp: OwnedReadHalf) -> Self {
        UcxReader {
            link,
            seq: 0,
            buf: Box::default(),
            spare: None,
            pos: 0,
            end: 0,
            posted: None,
            eof: false,
            tcp,
            tcp_closed: None,
            yield_first: false,
        }
    }

    /// Posts the receive of chunk `seq` into the spare buffer.
    fn post(&mut self) -> io::Result<()> {
        let mut buf = self.spare.take().unwrap_or_default();
        buf.resize(CHUNK, 0);
        let ptr = buf.as_mut_ptr();
        let tag = FRAME_TAG | self.seq;
        // SAFETY: `buf` owns the bytes and moves into the request (a Vec's
        // heap memory does not move with it).
        let posted = unsafe { self.link.recv(tag, ptr, CHUNK, buf) };
        self.posted = Some(posted.map_err(to_io)?);
        Ok(())
    }

    /// The TCP connection beside: it carries nothing after the handshake,
    /// so readable means closed (or a peer breaking the protocol).
    fn poll_tcp(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if self.tcp_closed.is_some() {
            return Ok(());
        }
        let mut byte = [0u8; 1];
        let mut rb = ReadBuf::new(&mut byte);
        match Pin::new(&mut self.tcp).poll_read(cx, &mut rb) {
            Poll::Pending => Ok(()),
            Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                self.tcp_closed = Some(Box::pin(tokio::time::sleep(DRAIN_AFTER_CLOSE)));
                Ok(())
            }
            Poll::Ready(Ok(())) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bytes arrived on TCP after the handshake (the ucx transport carries the frames)",
            )),
            Poll::Ready(Err(_)) => {
                self.tcp_closed = Some(Box::pin(tokio::time::sleep(DRAIN_AFTER_CLOSE)));
                Ok(())
            }
        }
    }
}

impl AsyncRead for UcxReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.pos < this.end {
                let n = (this.end - this.pos).min(out.remaining());
                out.put_slice(&this.buf[this.pos..this.pos + n]);
                this.pos += n;
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            if std::mem::take(&mut this.yield_first) {
                // Before the receive is posted, so the task this reader
                // woke (which may answer the message) runs first.
                std::task::ready!(crate::spin::yield_once(cx));
            }
            if this.posted.is_none() {
                this.post()?;
            }
            let Some(posted) = this.posted.as_mut() else {
                continue;
            };
            match posted.poll_done(cx) {
                Poll::Ready(Ok((keep, len))) => {
                    this.posted = None;
                    let done = keep
                        .downcast::<Vec<u8>>()
                        .map_err(|_| io::Error::other("a UCX receive returned another buffer"))?;
                    this.spare = Some(std::mem::replace(&mut this.buf, done));
                    this.seq += 1;
                    this.pos = 0;
                    this.end = len;
                    if len == 0 {
                        this.eof = true;
                    } else if len == CHUNK {
                        // Part of a longer write: the next chunk is likely
                        // on its way, so it should land straight in the
                        // spare buffer. After a shorter one the next read
                        // posts, once these bytes are handed on.
                        this.post()?;
                    }
                }
                Poll::Ready(Err(e)) => {
                    this.posted = None;
                    return Poll::Ready(Err(to_io(e)));
                }
                Poll::Pending => {
                    this.poll_tcp(cx)?;
                    if let Some(deadline) = this.tcp_closed.as_mut() {
                        if deadline.as_mut().poll(cx).is_ready() {
                            return Poll::Ready(Err(io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                "the peer closed the connection without ending the ucx stream",
                            )));
                        }
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

/// The writing half of the `ucx` transport.
pub struct UcxWriter {
    link: UcxLink,
    seq: u64,
    /// Where the slices of a small vectored write are joined.
    scratch: Vec<u8>,
    tcp: OwnedWriteHalf,
    ended: bool,
}

impl UcxWriter {
    pub(crate) fn new(link: UcxLink, tcp: OwnedWriteHalf) -> Self {
        UcxWriter {
            link,
            seq: 0,
            scratch: Vec::new(),
            tcp,
            ended: false,
        }
    }

    fn send(&mut self, chunk: Vec<u8>) -> io::Result<()> {
        let tag = FRAME_TAG | self.seq;
        self.seq += 1;
        let (ptr, len) = (chunk.as_ptr(), chunk.len());
        // SAFETY: `chunk` owns the bytes and is kept until UCX is done.
        unsafe { self.link.send_kept(tag, ptr, len, Box::new(chunk)) }.map_err(to_io)
    }

    /// Waits while more than `limit` sends are unfinished (the progress
    /// task's sweep wakes this task when one finishes).
    fn poll_room(&mut self, cx: &mut Context<'_>, limit: usize) -> Poll<io::Result<()>> {
        self.link.poll_in_flight_at_most(cx, limit).map_err(to_io)
    }
}

impl AsyncWrite for UcxWriter {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        std::task::ready!(this.poll_room(cx, MAX_UNFINISHED_SENDS))?;
        // A small write is joined into the reused scratch buffer and sent
        // from there in one UCX call, which completes at once when UCX
        // copies it into its own buffers (small messages, room in its
        // queues): no allocation. Should UCX keep the bytes instead, the
        // scratch buffer goes with the send and a new one is grown.
        if total <= SCRATCH_MAX {
            this.scratch.clear();
            for b in bufs {
                this.scratch.extend_from_slice(b);
            }
            let tag = FRAME_TAG | this.seq;
            this.seq += 1;
            let scratch = &mut this.scratch;
            let (ptr, len) = (scratch.as_ptr(), scratch.len());
            // SAFETY: the scratch bytes are not touched during the call;
            // if UCX keeps them, the Vec moves into the send (its heap
            // bytes do not move) and is held until UCX is done.
            unsafe {
                this.link
                    .send_or_keep(tag, ptr, len, || Box::new(std::mem::take(scratch)))
            }
            .map_err(to_io)?;
            return Poll::Ready(Ok(total));
        }
        let n = total.min(CHUNK);
        let mut chunk = Vec::with_capacity(n);
        for b in bufs {
            let take = (n - chunk.len()).min(b.len());
            chunk.extend_from_slice(&b[..take]);
            if chunk.len() == n {
                break;
            }
        }
        this.send(chunk)?;
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_room(cx, 0)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.ended {
            std::task::ready!(this.poll_room(cx, 0))?;
            this.send(Vec::new())?;
            this.ended = true;
        }
        std::task::ready!(this.poll_room(cx, 0))?;
        Pin::new(&mut this.tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::{UcxReader, UcxWriter, CHUNK, SCRATCH_MAX};
    use crate::ucx::worker::tests::linked;

    /// Writes of `sizes`, each of bytes numbered from where it starts in
    /// the stream.
    fn payload(sizes: &[usize]) -> Vec<Vec<u8>> {
        let mut at = 0usize;
        sizes
            .iter()
            .map(|&n| {
                let w = (at..at + n).map(|i| (i % 251) as u8).collect();
                at += n;
                w
            })
            .collect()
    }

    /// A writer on one link and a reader on the other, with the TCP
    /// connection each watches.
    async fn stream(tls: &str) -> Option<(UcxWriter, UcxReader)> {
        let (a, b) = linked(tls)?;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (dialed, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (_, write_half) = dialed.unwrap().into_split();
        let (read_half, _) = accepted.unwrap().0.into_split();
        Some((UcxWriter::new(a, write_half), UcxReader::new(b, read_half)))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_of_every_size_around_a_chunk_arrive_whole_and_in_order() {
        let sizes = [
            1,
            100,
            SCRATCH_MAX,
            SCRATCH_MAX + 1,
            CHUNK - 1,
            CHUNK,
            CHUNK + 1,
            3 * CHUNK + 7,
            5,
        ];
        for tls in ["shm,self", "tcp"] {
            let Some((mut writer, mut reader)) = stream(tls).await else {
                return;
            };
            let writes = payload(&sizes);
            let expected: Vec<u8> = writes.concat();
            let send = async {
                for w in &writes {
                    writer.write_all(w).await.unwrap();
                }
                writer.shutdown().await.unwrap();
            };
            // Reads of an odd size, so chunks are handed on in pieces.
            let recv = async {
                let mut got = Vec::new();
                let mut buf = vec![0u8; 1000];
                loop {
                    let n = reader.read(&mut buf).await.unwrap();
                    if n == 0 {
                        break got;
                    }
                    got.extend_from_slice(&buf[..n]);
                }
            };
            let ((), got) = tokio::join!(send, recv);
            assert_eq!(got.len(), expected.len(), "UCX_TLS={tls}: length");
            assert!(got == expected, "UCX_TLS={tls}: the bytes differ");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_next_receive_is_posted_at_once_only_after_a_full_chunk() {
        let Some((mut writer, mut reader)) = stream("shm,self").await else {
            return;
        };
        // A short write: handed on with no receive posted behind it.
        writer.write_all(&[7u8; 10]).await.unwrap();
        let mut buf = vec![0u8; 10];
        reader.read_exact(&mut buf).await.unwrap();
        assert_eq!(buf, [7u8; 10]);
        assert!(
            reader.posted.is_none(),
            "a receive was posted after a short chunk"
        );
        // A full chunk: the next one is expected, and its receive is posted
        // before these bytes are handed on.
        writer.write_all(&vec![9u8; CHUNK]).await.unwrap();
        let mut buf = vec![0u8; CHUNK];
        reader.read_exact(&mut buf).await.unwrap();
        assert!(buf.iter().all(|&b| b == 9));
        assert!(
            reader.posted.is_some(),
            "no receive was posted after a full chunk"
        );
        // And the stream still ends cleanly.
        writer.shutdown().await.unwrap();
        assert_eq!(reader.read(&mut buf).await.unwrap(), 0);
    }
}
