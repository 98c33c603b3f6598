//! [`FrameWriter`]: frames to a byte stream, each tensor sent over its
//! channel from its own memory.

use std::io::IoSlice;
use std::sync::Arc;

use ferry_wire::channel_record::{
    encode_release, release_len, ChannelRecord, CmaRecord, MptRecord, Prelude,
};
use ferry_wire::payload::OutgoingTensor;
use ferry_wire::{
    encode_descriptors, Device, Flags, FrameHeader, Limits, MessageKind, WireError, HEADER_LEN,
};
use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::{ReleaseSignal, Shared, WriteChannels};
use crate::selection::Selection;
use crate::{channel, OutgoingMessage, TransportError};

/// Most slices handed to one `writev` call (Linux allows 1024).
const MAX_IOV: usize = 512;

/// Writes frames to a byte stream.
pub struct FrameWriter<W> {
    inner: W,
    selection: Selection,
    peer: String,
    /// The limits the peer stated in its handshake (`None` before one).
    peer_limits: Option<Limits>,
    head: Vec<u8>,
    channels: WriteChannels,
    shared: Arc<Shared>,
    next_token: u64,
    next_seq: u64,
    next_ucx_seq: u64,
    /// Flush the stream after each write: it buffers (sealed records).
    flush: bool,
    /// With a secret: the key of the MAC that follows each `ucx` record
    /// (see [`super::tensor_mac`]).
    tensor_mac: Option<[u8; 32]>,
}

impl<W> FrameWriter<W> {
    /// The channel selection for tensors this side sends.
    pub fn selection(&self) -> &Selection {
        &self.selection
    }
}

/// One piece of a batch: a range of the head buffer, a tensor's bytes on
/// the stream, or a tensor's bytes into the shared-memory ring.
enum Piece {
    Head(usize, usize),
    Tensor(usize, usize),
    Ring(usize, usize),
    /// A `cuda_staged` tensor's bytes on the stream, staged from its device.
    Staged(usize, usize),
}

/// How one tensor travels.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    Inline,
    SmallInline,
    Cma,
    Shm,
    Mpt,
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    Ucx,
    /// `cuda_staged`: the bytes follow on the stream, as `inline`.
    CudaStaged,
    /// `cuda_ipc`: IPC handles in the record, kept until released.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    CudaIpc,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    /// Wraps a stream. `selection` is the channel choice for tensors this side sends.
    pub fn new(inner: W, selection: Selection, peer: impl Into<String>) -> Self {
        Self {
            inner,
            selection,
            peer: peer.into(),
            peer_limits: None,
            head: Vec::with_capacity(4096),
            channels: WriteChannels::default(),
            shared: Arc::default(),
            next_token: 0,
            next_seq: 0,
            next_ucx_seq: 0,
            flush: false,
            tensor_mac: None,
        }
    }

    /// Follows each `ucx` record with a MAC of the tensor's bytes under
    /// `key` (an authenticated connection's sending key).
    pub(crate) fn set_tensor_mac(&mut self, key: Option<[u8; 32]>) {
        self.tensor_mac = key;
    }

    /// Flush the stream after each write (a stream that buffers, such as
    /// an authenticated connection's [`RecordWriter`](crate::auth::RecordWriter)).
    pub(crate) fn set_flush(&mut self, flush: bool) {
        self.flush = flush;
    }

    pub(crate) fn set_selection(&mut self, selection: Selection) {
        self.selection = selection;
    }

    /// Replaces the underlying stream, keeping everything else.
    pub(crate) fn map_stream<W2: AsyncWrite + Unpin>(
        self,
        f: impl FnOnce(W) -> W2,
    ) -> FrameWriter<W2> {
        FrameWriter {
            inner: f(self.inner),
            selection: self.selection,
            peer: self.peer,
            peer_limits: self.peer_limits,
            head: self.head,
            channels: self.channels,
            shared: self.shared,
            next_token: self.next_token,
            next_seq: self.next_seq,
            next_ucx_seq: self.next_ucx_seq,
            flush: self.flush,
            tensor_mac: self.tensor_mac,
        }
    }

    /// Installs the connection's channel endpoints and shared state.
    pub(crate) fn set_channels(&mut self, channels: WriteChannels, shared: Arc<Shared>) {
        self.channels = channels;
        self.shared = shared;
    }

    /// A handle that wakes when this connection's reader has queued
    /// releases for the peer (`cma` copies done); the writer's owner then
    /// calls [`write_batch`](Self::write_batch) (an empty batch will do),
    /// which sends them. Writing any batch sends them too.
    pub fn release_signal(&self) -> ReleaseSignal {
        ReleaseSignal(self.shared.clone())
    }

    /// `cma` and `cuda_ipc` tensors sent and not yet released by the peer.
    pub fn tensors_in_flight(&self) -> usize {
        self.shared.lock_pending().len()
    }

    fn route(&self, name: &str, len: usize) -> Result<Route, TransportError> {
        if name == channel::INLINE {
            return Ok(Route::Inline);
        }
        if name == channel::CUDA_STAGED {
            return Ok(Route::CudaStaged);
        }
        #[cfg(feature = "cuda")]
        if name == channel::CUDA_IPC {
            return Ok(Route::CudaIpc);
        }
        if len < self.channels.small_tensor_bytes {
            return Ok(Route::SmallInline);
        }
        let missing = |what: &str| TransportError::Malformed {
            peer: self.peer.clone(),
            source: WireError::Channel(format!(
                "channel {what} is selected but not set up on this connection"
            )),
        };
        match name {
            channel::CMA if self.channels.cma => Ok(Route::Cma),
            channel::SHM if self.channels.shm.is_some() => Ok(Route::Shm),
            channel::MPT if self.channels.mpt.is_some() => Ok(Route::Mpt),
            #[cfg(feature = "ucx")]
            channel::UCX if self.channels.ucx.is_some() => Ok(Route::Ucx),
            other => Err(missing(other)),
        }
    }

    /// Replaces the name used in errors.
    pub fn set_peer(&mut self, peer: impl Into<String>) {
        self.peer = peer.into();
    }

    /// The limits the peer stated in its handshake: a message over them is
    /// refused here ([`TransportError::Refused`]) rather than written.
    pub fn peer_limits(&self) -> Option<Limits> {
        self.peer_limits
    }

    pub(crate) fn set_peer_limits(&mut self, limits: Limits) {
        self.peer_limits = Some(limits);
    }

    /// Writes one message.
    pub async fn write(&mut self, message: &OutgoingMessage) -> Result<(), TransportError> {
        self.write_batch(std::slice::from_ref(message)).await
    }

    /// Writes several messages with as few `writev` calls as possible.
    /// Headers, descriptor tables and payloads are gathered into one buffer;
    /// tensor bytes are written from the tensors' own memory (or handed to
    /// their channel). Queued releases go first. An empty batch with no
    /// releases queued writes nothing.
    ///
    /// A message over the peer's limits ([`peer_limits`](Self::peer_limits))
    /// fails the whole batch with [`TransportError::Refused`] before
    /// anything of it is written or handed to a channel; callers that must
    /// keep the others check each message first ([`OutgoingMessage::check`]).
    pub async fn write_batch(&mut self, batch: &[OutgoingMessage]) -> Result<(), TransportError> {
        let descriptors: Vec<Vec<_>> = batch
            .iter()
            .map(|m| m.tensors.iter().map(|t| t.descriptor()).collect())
            .collect();
        if let Some(limits) = &self.peer_limits {
            for (message, descriptors) in batch.iter().zip(&descriptors) {
                limits
                    .check_outgoing(message.payload.len(), descriptors)
                    .map_err(|source| TransportError::Refused {
                        peer: self.peer.clone(),
                        source,
                    })?;
            }
        }
        self.head.clear();
        let mut pieces = Vec::with_capacity(batch.len() * 2 + 1);
        let releases = std::mem::take(&mut *self.shared.lock_releases());
        if !releases.is_empty() {
            let header = FrameHeader {
                kind: MessageKind::RELEASE,
                flags: Flags::NONE,
                request_id: 0,
                payload_len: len_u32("release payload", release_len(releases.len()))?,
                descriptors_len: 0,
                tensor_count: 0,
            };
            self.head.extend_from_slice(&header.encode());
            encode_release(&releases, &mut self.head);
            pieces.push(Piece::Head(0, self.head.len()));
        }
        for (m, (message, descriptors)) in batch.iter().zip(descriptors).enumerate() {
            let mut routes = Vec::with_capacity(descriptors.len());
            for (d, tensor) in descriptors.iter().zip(&message.tensors) {
                let target =
                    crate::device_map::target(&self.channels.cuda.maps, &self.peer, d.device)?;
                let name = self
                    .selection
                    .channel_for(d.device, target)
                    .map_err(|e| crate::cuda::explain(e.into(), d.device, target))?;
                let route = self.route(name, d.byte_len as usize)?;
                if tensor.device_ptr().is_some() != matches!(d.device, Device::Cuda(_)) {
                    return Err(TransportError::InvalidTensor(format!(
                        "a tensor on {} must {}give a device address",
                        d.device,
                        if tensor.device_ptr().is_some() {
                            "not "
                        } else {
                            ""
                        }
                    )));
                }
                if tensor.device_ptr().is_some()
                    && !matches!(route, Route::CudaStaged | Route::CudaIpc)
                {
                    return Err(TransportError::InvalidTensor(format!(
                        "a tensor on {} cannot travel on channel {name}",
                        d.device
                    )));
                }
                routes.push((route, target));
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
            let mut head_from = start;
            for (t, (tensor, &(route, target))) in message.tensors.iter().zip(&routes).enumerate() {
                let route = &route;
                match route {
                    Route::Inline => {}
                    Route::CudaStaged => Prelude::Channel(ChannelRecord::CudaStaged(
                        ferry_wire::channel_record::CudaStagedRecord { target },
                    ))
                    .encode_into(&mut self.head),
                    Route::SmallInline => Prelude::Inline.encode_into(&mut self.head),
                    Route::Cma => {
                        let token = self.next_token;
                        self.next_token += 1;
                        let addr = tensor.bytes().as_ptr() as u64;
                        Prelude::Channel(ChannelRecord::Cma(CmaRecord { addr, token }))
                            .encode_into(&mut self.head);
                        // Registered before the record leaves, so the
                        // release cannot overtake it.
                        self.shared.lock_pending().insert(token, tensor.clone());
                    }
                    Route::Shm => Prelude::Channel(ChannelRecord::Shm).encode_into(&mut self.head),
                    Route::CudaIpc => {
                        let token = self.next_token;
                        self.next_token += 1;
                        let handles = self.export_ipc(token, tensor)?;
                        Prelude::Channel(ChannelRecord::CudaIpc(
                            ferry_wire::channel_record::CudaIpcRecord {
                                token,
                                target,
                                handles,
                            },
                        ))
                        .encode_into(&mut self.head);
                    }
                    Route::Mpt => {
                        let seq = self.next_seq;
                        self.next_seq += 1;
                        Prelude::Channel(ChannelRecord::Mpt(MptRecord { seq }))
                            .encode_into(&mut self.head);
                        if let Some(lanes) = &self.channels.mpt {
                            lanes.send(seq, tensor.clone())?;
                        }
                    }
                    Route::Ucx => {
                        let seq = self.next_ucx_seq;
                        self.next_ucx_seq += 1;
                        Prelude::Channel(ChannelRecord::Ucx(
                            ferry_wire::channel_record::UcxRecord { seq },
                        ))
                        .encode_into(&mut self.head);
                        if let Some(key) = &self.tensor_mac {
                            let tag = super::tensor_mac::tag(key, seq, tensor.bytes());
                            self.head.extend_from_slice(&tag);
                        }
                        self.send_ucx(seq, tensor)?;
                    }
                }
                let carries_bytes = matches!(route, Route::Inline | Route::SmallInline);
                let ring = *route == Route::Shm;
                let staged = *route == Route::CudaStaged;
                if (carries_bytes && !tensor.bytes().is_empty()) || ring || staged {
                    push_head(&mut pieces, head_from, self.head.len());
                    head_from = self.head.len();
                    if staged {
                        pieces.push(Piece::Staged(m, t));
                    } else if ring {
                        pieces.push(Piece::Ring(m, t));
                    } else {
                        pieces.push(Piece::Tensor(m, t));
                    }
                }
            }
            push_head(&mut pieces, head_from, self.head.len());
        }
        let mut from = 0;
        while from < pieces.len() {
            if let Piece::Ring(m, t) = pieces[from] {
                self.write_ring(batch[m].tensors[t].bytes()).await?;
                from += 1;
                continue;
            }
            if let Piece::Staged(m, t) = pieces[from] {
                self.write_staged(&batch[m].tensors[t]).await?;
                from += 1;
                continue;
            }
            let to = pieces[from..]
                .iter()
                .position(|p| matches!(p, Piece::Ring(..) | Piece::Staged(..)))
                .map_or(pieces.len(), |i| from + i);
            self.write_stream(batch, &pieces[from..to]).await?;
            from = to;
        }
        Ok(())
    }

    /// Writes stream pieces with vectored writes.
    async fn write_stream(
        &mut self,
        batch: &[OutgoingMessage],
        pieces: &[Piece],
    ) -> Result<(), TransportError> {
        let head = &self.head;
        let mut slices: Vec<IoSlice<'_>> = pieces
            .iter()
            .filter_map(|p| match *p {
                Piece::Head(s, e) => Some(IoSlice::new(&head[s..e])),
                Piece::Tensor(m, t) => Some(IoSlice::new(batch[m].tensors[t].bytes())),
                Piece::Ring(..) | Piece::Staged(..) => None,
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
        self.flush_if_buffered().await
    }

    /// Flushes the stream when it buffers: what was written must reach
    /// the peer before this side waits on anything else (a ring, the
    /// next message).
    async fn flush_if_buffered(&mut self) -> Result<(), TransportError> {
        if !self.flush {
            return Ok(());
        }
        self.inner.flush().await.map_err(|e| TransportError::Io {
            peer: self.peer.clone(),
            source: e,
        })
    }

    /// Posts one tensor's UCX send, from its own memory; the tensor stays
    /// alive until UCX completed the send.
    #[cfg(feature = "ucx")]
    fn send_ucx(&self, seq: u64, tensor: &Arc<dyn OutgoingTensor>) -> Result<(), TransportError> {
        let Some(link) = &self.channels.ucx else {
            return Err(TransportError::Channel {
                channel: channel::UCX,
                peer: self.peer.clone(),
                reason: "no UCX link on this connection".into(),
            });
        };
        let bytes = tensor.bytes();
        let (ptr, len) = (bytes.as_ptr(), bytes.len());
        // SAFETY: the bytes belong to the tensor, which the kept Arc holds
        // until UCX completed the send.
        unsafe { link.send_kept(seq, ptr, len, Box::new(tensor.clone())) }
    }

    #[cfg(not(feature = "ucx"))]
    fn send_ucx(&self, _seq: u64, _tensor: &Arc<dyn OutgoingTensor>) -> Result<(), TransportError> {
        Err(TransportError::Channel {
            channel: channel::UCX,
            peer: self.peer.clone(),
            reason: "this build has no ucx channel".into(),
        })
    }

    /// Exports a device tensor's memory and an event for `cuda_ipc`, and
    /// keeps both (with the tensor) until the peer releases `token`.
    #[cfg(feature = "cuda")]
    fn export_ipc(
        &self,
        token: u64,
        tensor: &Arc<dyn OutgoingTensor>,
    ) -> Result<[u8; ferry_wire::channel_record::CudaIpcRecord::HANDLES_LEN], TransportError> {
        let d = tensor.descriptor();
        let failed = |reason: String| TransportError::Channel {
            channel: channel::CUDA_IPC,
            peer: self.peer.clone(),
            reason: format!("exporting {} bytes on {}: {reason}", d.byte_len, d.device),
        };
        let Some(ptr) = tensor.device_ptr() else {
            return Err(failed("not a device tensor".into()));
        };
        let ctx = crate::cuda::driver::context(d.device)?;
        let len = usize::try_from(d.byte_len).map_err(|e| failed(e.to_string()))?;
        // SAFETY: the tensor says `len` bytes of its device are at `ptr`;
        // it is kept (in the pending map, with the export) until released.
        let export = unsafe { crate::cuda::ipc::IpcExport::new(&ctx, ptr, len) }.map_err(failed)?;
        let handles = export.record().encode();
        let kept = crate::cuda::ipc::IpcKept {
            tensor: tensor.clone(),
            _export: export,
        };
        // Registered before the record leaves, so the release cannot
        // overtake it.
        self.shared.lock_pending().insert(token, Arc::new(kept));
        Ok(handles)
    }

    #[cfg(not(feature = "cuda"))]
    fn export_ipc(
        &self,
        _token: u64,
        _tensor: &Arc<dyn OutgoingTensor>,
    ) -> Result<[u8; ferry_wire::channel_record::CudaIpcRecord::HANDLES_LEN], TransportError> {
        Err(crate::cuda::CudaUnavailable::NotBuilt.into())
    }

    /// Writes one `cuda_staged` tensor's bytes on the stream: a host
    /// tensor's as they are, a device tensor's staged through pinned
    /// memory in chunks.
    async fn write_staged(
        &mut self,
        tensor: &Arc<dyn OutgoingTensor>,
    ) -> Result<(), TransportError> {
        let Some(ptr) = tensor.device_ptr() else {
            self.inner
                .write_all(tensor.bytes())
                .await
                .map_err(|e| TransportError::Io {
                    peer: self.peer.clone(),
                    source: e,
                })?;
            return self.flush_if_buffered().await;
        };
        self.send_from_device(ptr, &tensor.descriptor()).await?;
        self.flush_if_buffered().await
    }

    #[cfg(feature = "cuda")]
    async fn send_from_device(
        &mut self,
        ptr: u64,
        descriptor: &ferry_wire::TensorDescriptor,
    ) -> Result<(), TransportError> {
        let ctx = crate::cuda::driver::context(descriptor.device)?;
        let options = self.channels.cuda.staged;
        let peer = self.peer.clone();
        let failed = |reason: String| TransportError::Channel {
            channel: channel::CUDA_STAGED,
            peer: peer.clone(),
            reason: format!(
                "sending {} bytes from {}: {reason}",
                descriptor.byte_len, descriptor.device
            ),
        };
        let len = usize::try_from(descriptor.byte_len).map_err(|e| failed(e.to_string()))?;
        // SAFETY: the tensor (kept alive by the batch we borrow) says its
        // `byte_len` bytes are at `ptr` on its device.
        let mut engine =
            unsafe { crate::cuda::driver::CudaCopyEngine::new(&ctx, ptr, len, &options) }
                .map_err(|e| failed(e.to_string()))?;
        crate::cuda::staged::send(&mut engine, len, &options, &mut self.inner)
            .await
            .map_err(|e| failed(e.to_string()))
    }

    #[cfg(not(feature = "cuda"))]
    async fn send_from_device(
        &mut self,
        _ptr: u64,
        _descriptor: &ferry_wire::TensorDescriptor,
    ) -> Result<(), TransportError> {
        Err(crate::cuda::CudaUnavailable::NotBuilt.into())
    }

    /// Pushes one tensor's bytes through the shared-memory data ring.
    async fn write_ring(&mut self, bytes: &[u8]) -> Result<(), TransportError> {
        let peer = self.peer.clone();
        let ring = self
            .channels
            .shm
            .as_mut()
            .ok_or_else(|| TransportError::Channel {
                channel: channel::SHM,
                peer: peer.clone(),
                reason: "no shared-memory ring on this connection".into(),
            })?;
        ring.write_all(bytes)
            .await
            .map_err(|e| TransportError::Channel {
                channel: channel::SHM,
                peer,
                reason: e.to_string(),
            })
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

/// Adds a head range, merged into the previous one when adjacent.
fn push_head(pieces: &mut Vec<Piece>, start: usize, end: usize) {
    if start == end {
        return;
    }
    match pieces.last_mut() {
        Some(Piece::Head(_, e)) if *e == start => *e = end,
        _ => pieces.push(Piece::Head(start, end)),
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
