//! Frame I/O over any byte stream: vectored writes that send tensor bytes
//! from their own memory, and reads that put tensor bytes straight into
//! destinations allocated from their descriptors.

use std::io::IoSlice;
use std::sync::Arc;

use ferry_wire::payload::IncomingTensor;
use ferry_wire::{decode_descriptors, encode_descriptors, Device, FrameHeader, Limits, HEADER_LEN};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use crate::selection::Selection;
use crate::{channel, Allocator, IncomingMessage, OutgoingMessage, TransportError};

/// Most slices handed to one `writev` call (Linux allows 1024).
const MAX_IOV: usize = 512;
/// Read buffer: small frames are read many at a time.
const READ_BUFFER: usize = 64 << 10;

/// Reads frames from a byte stream.
pub struct FrameReader<R> {
    inner: BufReader<R>,
    limits: Limits,
    allocator: Arc<dyn Allocator>,
    selection: Selection,
    peer: String,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// Wraps a stream. `selection` is the channel choice for tensors this
    /// side receives; `peer` names the other end in errors.
    pub fn new(
        inner: R,
        limits: Limits,
        allocator: Arc<dyn Allocator>,
        selection: Selection,
        peer: impl Into<String>,
    ) -> Self {
        Self {
            inner: BufReader::with_capacity(READ_BUFFER, inner),
            limits,
            allocator,
            selection,
            peer: peer.into(),
        }
    }

    /// The peer's name, as used in errors.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Replaces the channel selection (once the handshake has fixed it).
    pub fn with_selection(mut self, selection: Selection) -> Self {
        self.selection = selection;
        self
    }

    /// Replaces the name used in errors (once the handshake names the peer).
    pub fn set_peer(&mut self, peer: impl Into<String>) {
        self.peer = peer.into();
    }

    /// Reads the next frame. `Ok(None)` is a clean end of stream between frames.
    pub async fn read(&mut self) -> Result<Option<IncomingMessage>, TransportError> {
        let at_end = match self.inner.fill_buf().await {
            Ok(buf) => buf.is_empty(),
            Err(e) => return Err(self.io(e)),
        };
        if at_end {
            return Ok(None);
        }
        let mut head = [0u8; HEADER_LEN];
        self.inner
            .read_exact(&mut head)
            .await
            .map_err(|e| self.io(e))?;
        let header = FrameHeader::decode(&head, &self.limits).map_err(|e| self.malformed(e))?;
        let mut table = vec![0u8; header.descriptors_len as usize];
        self.inner
            .read_exact(&mut table)
            .await
            .map_err(|e| self.io(e))?;
        let mut payload = vec![0u8; header.payload_len as usize];
        self.inner
            .read_exact(&mut payload)
            .await
            .map_err(|e| self.io(e))?;
        let descriptors = decode_descriptors(&table, header.tensor_count, &self.limits)
            .map_err(|e| self.malformed(e))?;
        let mut tensors = Vec::with_capacity(descriptors.len());
        for descriptor in descriptors {
            let name = self.selection.channel_for(descriptor.device, Device::Cpu)?;
            if name != channel::INLINE {
                return Err(channel::not_implemented(name));
            }
            let mut dest = self.allocator.allocate(&descriptor)?;
            let bytes = dest.as_mut_bytes();
            if bytes.len() as u64 != descriptor.byte_len {
                return Err(TransportError::Alloc(format!(
                    "allocator returned {} bytes for a {}-byte tensor",
                    bytes.len(),
                    descriptor.byte_len
                )));
            }
            self.inner.read_exact(bytes).await.map_err(|e| self.io(e))?;
            tensors.push(IncomingTensor {
                descriptor,
                storage: dest.finish()?,
            });
        }
        Ok(Some(IncomingMessage {
            header,
            payload,
            tensors,
        }))
    }

    fn io(&self, e: std::io::Error) -> TransportError {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            TransportError::Closed {
                peer: self.peer.clone(),
            }
        } else {
            TransportError::Io {
                peer: self.peer.clone(),
                source: e,
            }
        }
    }

    fn malformed(&self, source: ferry_wire::WireError) -> TransportError {
        TransportError::Malformed {
            peer: self.peer.clone(),
            source,
        }
    }
}

/// Writes frames to a byte stream.
pub struct FrameWriter<W> {
    inner: W,
    selection: Selection,
    peer: String,
    head: Vec<u8>,
}

/// One piece of a batch: a range of the head buffer or a tensor's bytes.
enum Piece {
    Head(usize, usize),
    Tensor(usize, usize),
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    /// Wraps a stream. `selection` is the channel choice for tensors this side sends.
    pub fn new(inner: W, selection: Selection, peer: impl Into<String>) -> Self {
        Self {
            inner,
            selection,
            peer: peer.into(),
            head: Vec::with_capacity(4096),
        }
    }

    /// Replaces the channel selection (once the handshake has fixed it).
    pub fn with_selection(mut self, selection: Selection) -> Self {
        self.selection = selection;
        self
    }

    /// Replaces the name used in errors.
    pub fn set_peer(&mut self, peer: impl Into<String>) {
        self.peer = peer.into();
    }

    /// Writes one message.
    pub async fn write(&mut self, message: &OutgoingMessage) -> Result<(), TransportError> {
        self.write_batch(std::slice::from_ref(message)).await
    }

    /// Writes several messages with as few `writev` calls as possible.
    /// Headers, descriptor tables and payloads are gathered into one buffer;
    /// tensor bytes are written from the tensors' own memory.
    pub async fn write_batch(&mut self, batch: &[OutgoingMessage]) -> Result<(), TransportError> {
        self.head.clear();
        let mut pieces = Vec::with_capacity(batch.len() * 2);
        for (m, message) in batch.iter().enumerate() {
            let descriptors: Vec<_> = message.tensors.iter().map(|t| t.descriptor()).collect();
            for d in &descriptors {
                let name = self.selection.channel_for(d.device, Device::Cpu)?;
                if name != channel::INLINE {
                    return Err(channel::not_implemented(name));
                }
            }
            let start = self.head.len();
            self.head.extend_from_slice(&[0u8; HEADER_LEN]);
            encode_descriptors(&descriptors, &mut self.head);
            let descriptors_len = self.head.len() - start - HEADER_LEN;
            self.head.extend_from_slice(&message.payload);
            let header = FrameHeader {
                kind: message.kind,
                flags: message.flags,
                request_id: message.request_id,
                payload_len: len_u32("payload", message.payload.len())?,
                descriptors_len: len_u32("descriptor table", descriptors_len)?,
                tensor_count: len_u32("tensor count", descriptors.len())?,
            };
            self.head[start..start + HEADER_LEN].copy_from_slice(&header.encode());
            let end = self.head.len();
            match pieces.last_mut() {
                Some(Piece::Head(_, e)) if *e == start => *e = end,
                _ => pieces.push(Piece::Head(start, end)),
            }
            for (t, tensor) in message.tensors.iter().enumerate() {
                if !tensor.bytes().is_empty() {
                    pieces.push(Piece::Tensor(m, t));
                }
            }
        }
        let head = &self.head;
        let mut slices: Vec<IoSlice<'_>> = pieces
            .iter()
            .map(|p| match *p {
                Piece::Head(s, e) => IoSlice::new(&head[s..e]),
                Piece::Tensor(m, t) => IoSlice::new(batch[m].tensors[t].bytes()),
            })
            .collect();
        let mut rest: &mut [IoSlice<'_>] = &mut slices;
        while !rest.is_empty() {
            let n = rest.len().min(MAX_IOV);
            let written =
                self.inner
                    .write_vectored(&rest[..n])
                    .await
                    .map_err(|e| TransportError::Io {
                        peer: self.peer.clone(),
                        source: e,
                    })?;
            if written == 0 {
                return Err(TransportError::Closed {
                    peer: self.peer.clone(),
                });
            }
            IoSlice::advance_slices(&mut rest, written);
        }
        Ok(())
    }

    /// Writes raw bytes, bypassing framing (tests of malformed input).
    #[doc(hidden)]
    pub async fn write_raw_for_tests(&mut self, bytes: &[u8]) {
        let _ = self.inner.write_all(bytes).await;
        let _ = self.inner.flush().await;
    }

    /// Flushes and shuts the write side down.
    pub async fn shutdown(&mut self) -> Result<(), TransportError> {
        self.inner.shutdown().await.map_err(|e| TransportError::Io {
            peer: self.peer.clone(),
            source: e,
        })
    }
}

fn len_u32(what: &'static str, len: usize) -> Result<u32, TransportError> {
    u32::try_from(len).map_err(|_| {
        TransportError::Wire(ferry_wire::WireError::TooLarge {
            what,
            len: len as u64,
            max: u32::MAX.into(),
        })
    })
}
