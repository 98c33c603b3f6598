//! [`FrameReader`]: frames from a byte stream, each tensor received over
//! its channel into a destination allocated from its descriptor.

use std::sync::Arc;

use ferry_wire::channel_record::{
    ChannelRecord, CmaRecord, Mode, MptRecord, RecordFormat, ReleaseList,
};
use ferry_wire::payload::IncomingTensor;
use ferry_wire::{
    decode_descriptors, Device, FrameHeader, Limits, MessageKind, WireError, HEADER_LEN,
};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

#[cfg(feature = "cuda")]
use super::stall::StallReader;
use super::stall::{read_with_stall, receive_in_steps, ReadFail};
use super::{ReadChannels, Shared};
use crate::selection::Selection;
use crate::{channel, cma, Allocator, IncomingMessage, RecvBuffer, TransportError};

/// Read buffer: small frames are read many at a time.
const READ_BUFFER: usize = 64 << 10;
/// Tensors at least this large are pulled by `cma` off the async runtime's
/// thread (the copy blocks for milliseconds).
const BLOCKING_COPY_MIN: usize = 1 << 20;

/// Room for the longest channel record.
const MAX_RECORD_LEN: usize = ferry_wire::channel_record::CudaIpcRecord::LEN;

/// Reads frames from a byte stream.
pub struct FrameReader<R> {
    inner: BufReader<R>,
    limits: Limits,
    allocator: Arc<dyn Allocator>,
    selection: Selection,
    peer: String,
    channels: ReadChannels,
    shared: Arc<Shared>,
    next_seq: u64,
    next_ucx_seq: u64,
    /// With a secret: the key of the MAC that follows each `ucx` record
    /// (see [`super::tensor_mac`]).
    tensor_mac: Option<[u8; 32]>,
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
            channels: ReadChannels::default(),
            shared: Arc::default(),
            next_seq: 0,
            next_ucx_seq: 0,
            tensor_mac: None,
        }
    }

    /// Checks each `ucx` tensor against the MAC its record is followed
    /// by, under `key` (an authenticated connection's receiving key).
    pub(crate) fn set_tensor_mac(&mut self, key: Option<[u8; 32]>) {
        self.tensor_mac = key;
    }

    pub(crate) fn set_selection(&mut self, selection: Selection) {
        self.selection = selection;
    }

    /// Replaces the limits checked on every frame read from now on.
    pub(crate) fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    /// The stream the frames are read from.
    pub fn stream_mut(&mut self) -> &mut R {
        self.inner.get_mut()
    }

    /// Replaces the underlying stream, keeping everything else; refused
    /// (with the count) when bytes of the old stream are buffered unread.
    pub(crate) fn map_stream<R2: AsyncRead + Unpin>(
        self,
        f: impl FnOnce(R) -> R2,
    ) -> Result<FrameReader<R2>, usize> {
        let buffered = self.inner.buffer().len();
        if buffered > 0 {
            return Err(buffered);
        }
        Ok(FrameReader {
            inner: BufReader::with_capacity(READ_BUFFER, f(self.inner.into_inner())),
            limits: self.limits,
            allocator: self.allocator,
            selection: self.selection,
            peer: self.peer,
            channels: self.channels,
            shared: self.shared,
            next_seq: self.next_seq,
            next_ucx_seq: self.next_ucx_seq,
            tensor_mac: self.tensor_mac,
        })
    }

    /// Installs the connection's channel endpoints and shared state.
    pub(crate) fn set_channels(&mut self, channels: ReadChannels, shared: Arc<Shared>) {
        self.channels = channels;
        self.shared = shared;
    }

    /// The peer's name, as used in errors.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Replaces the name used in errors (once the handshake names the peer).
    pub fn set_peer(&mut self, peer: impl Into<String>) {
        self.peer = peer.into();
    }

    /// Reads the next frame. `Ok(None)` is a clean end of stream between frames.
    ///
    /// Channel bookkeeping frames ([`MessageKind::RELEASE`]) are handled here
    /// and never returned.
    pub async fn read(&mut self) -> Result<Option<IncomingMessage>, TransportError> {
        loop {
            let at_end = match self.inner.fill_buf().await {
                Ok(buf) => buf.is_empty(),
                Err(e) => return Err(self.io(e)),
            };
            if at_end {
                return Ok(None);
            }
            // From the frame's first byte on, every piece must keep arriving.
            let mut head = [0u8; HEADER_LEN];
            self.read_stream(&mut head, || "the frame header".into())
                .await?;
            let header = FrameHeader::decode(&head, &self.limits).map_err(|e| self.malformed(e))?;
            let mut table = vec![0u8; header.descriptors_len as usize];
            self.read_stream(&mut table, || {
                format!("the descriptor table of a {} frame", header.kind)
            })
            .await?;
            let mut payload = vec![0u8; header.payload_len as usize];
            self.read_stream(&mut payload, || {
                format!(
                    "the {}-byte payload of a {} frame",
                    header.payload_len, header.kind
                )
            })
            .await?;
            if header.kind == MessageKind::RELEASE {
                self.on_release(&header, &payload)?;
                continue;
            }
            let descriptors = decode_descriptors(&table, header.tensor_count, &self.limits)
                .map_err(|e| self.malformed(e))?;
            let mut tensors = Vec::with_capacity(descriptors.len());
            let count = descriptors.len();
            for (index, descriptor) in descriptors.into_iter().enumerate() {
                // Where the tensor lands here: the device maps decide it
                // (CPU stays CPU unless mapped); the allocator gets the
                // descriptor with that device.
                let source = descriptor.device;
                let landing =
                    crate::device_map::landing(&self.channels.cuda.maps, &self.peer, source)?;
                let name = self
                    .selection
                    .channel_for(source, landing)
                    .map_err(|e| crate::cuda::explain(e.into(), source, landing))?;
                let name = channel_name(name);
                let mut descriptor = descriptor;
                descriptor.device = landing;
                let mut dest = self.allocator.allocate(&descriptor)?;
                let on_device = dest.device_ptr().is_some();
                if on_device && name != channel::CUDA_STAGED && name != channel::CUDA_IPC {
                    return Err(TransportError::Alloc(format!(
                        "the allocator returned device memory for a tensor on channel {name}"
                    )));
                }
                if !on_device && dest.as_mut_bytes().len() as u64 != descriptor.byte_len {
                    return Err(TransportError::Alloc(format!(
                        "allocator returned {} bytes for a {}-byte tensor",
                        dest.as_mut_bytes().len(),
                        descriptor.byte_len
                    )));
                }
                let what = TensorWhat {
                    kind: header.kind,
                    index,
                    count,
                    byte_len: descriptor.byte_len,
                    channel: name,
                    device: landing,
                };
                let dest = self.receive_bytes(name, dest, &what).await?;
                tensors.push(IncomingTensor {
                    descriptor,
                    storage: dest.finish()?,
                });
            }
            return Ok(Some(IncomingMessage {
                header,
                payload,
                tensors,
            }));
        }
    }

    /// Fills `dest` with one tensor's bytes, the way channel `name` carries them.
    async fn receive_bytes(
        &mut self,
        name: &'static str,
        mut dest: Box<dyn RecvBuffer>,
        what: &TensorWhat,
    ) -> Result<Box<dyn RecvBuffer>, TransportError> {
        let mode = if name == channel::INLINE {
            Mode::Inline
        } else {
            let mut mode = [0u8; 1];
            self.read_stream(&mut mode, || format!("the mode byte of {what}"))
                .await?;
            Mode::decode(mode[0]).map_err(|e| self.malformed(e.into()))?
        };
        if mode == Mode::Inline {
            if dest.device_ptr().is_some() {
                return Err(self.bad_record(&format!("{what} inline, into device memory")));
            }
            let stall = self.limits.frame_stall_timeout;
            let peer = &self.peer;
            let inner = &mut self.inner;
            receive_in_steps(inner, dest.as_mut(), stall, peer, what, None).await?;
            return Ok(dest);
        }
        let Some(format) = record_format(name) else {
            return Err(self.bad_record(&format!(
                "channel {name:?} has no record format in this build"
            )));
        };
        let mut record = [0u8; MAX_RECORD_LEN];
        let record = &mut record[..format.len()];
        self.read_stream(record, || {
            format!("the {} record of {what}", format.channel())
        })
        .await?;
        match ChannelRecord::decode(format, record).map_err(|e| self.malformed(e.into()))? {
            ChannelRecord::Cma(CmaRecord { addr, token }) => {
                let pid = self
                    .channels
                    .cma_pid
                    .ok_or_else(|| self.bad_record("cma record on a connection without cma"))?;
                let threads = self.channels.cma_threads;
                // The bytes are in the sender's memory already: the copy
                // below fills the whole destination at once.
                let len = dest.as_mut_bytes().len();
                dest.prepare(len);
                let bytes = dest.as_mut_bytes();
                let len = bytes.len();
                let result = if len >= BLOCKING_COPY_MIN && multi_thread_runtime() {
                    tokio::task::block_in_place(|| cma::read_parallel(pid, addr, bytes, threads))
                } else {
                    cma::read_parallel(pid, addr, bytes, threads)
                };
                result.map_err(|e| {
                    if cma::peer_gone(&e) {
                        TransportError::Io {
                            peer: self.peer.clone(),
                            source: std::io::Error::new(
                                e.kind(),
                                format!("its process is gone (reading {len} bytes by cma: {e})"),
                            ),
                        }
                    } else {
                        TransportError::Channel {
                            channel: channel::CMA,
                            peer: self.peer.clone(),
                            reason: format!("reading {len} bytes at {addr:#x} failed: {e}"),
                        }
                    }
                })?;
                self.shared.lock_releases().push(token);
                self.shared.release_ready.notify_one();
                Ok(dest)
            }
            ChannelRecord::Shm => {
                let stall = self.limits.frame_stall_timeout;
                let Some(ring) = self.channels.shm.as_mut() else {
                    return Err(self.bad_record("shm record on a connection without shm"));
                };
                let peer = &self.peer;
                receive_in_steps(ring, dest.as_mut(), stall, peer, what, Some(channel::SHM))
                    .await?;
                Ok(dest)
            }
            ChannelRecord::Mpt(MptRecord { seq }) => {
                if seq != self.next_seq {
                    return Err(self.bad_record(&format!(
                        "mpt transfer {seq} where {} was due",
                        self.next_seq
                    )));
                }
                self.next_seq += 1;
                let lanes = self
                    .channels
                    .mpt
                    .as_ref()
                    .ok_or_else(|| self.bad_record("mpt record on a connection without mpt"))?;
                lanes.receive(seq, dest).await
            }
            ChannelRecord::CudaStaged(record) => {
                self.check_target(record.target, what)?;
                self.receive_staged(dest, what).await
            }
            ChannelRecord::CudaIpc(record) => {
                self.check_target(record.target, what)?;
                self.receive_ipc(&record, dest.as_mut(), what)?;
                self.shared.lock_releases().push(record.token);
                self.shared.release_ready.notify_one();
                Ok(dest)
            }
            ChannelRecord::Ucx(ferry_wire::channel_record::UcxRecord { seq }) => {
                if seq != self.next_ucx_seq {
                    return Err(self.bad_record(&format!(
                        "ucx transfer {seq} where {} was due",
                        self.next_ucx_seq
                    )));
                }
                self.next_ucx_seq += 1;
                let Some(key) = self.tensor_mac else {
                    return self.receive_ucx(seq, dest, what).await;
                };
                let mut tag = [0u8; super::TENSOR_MAC_LEN];
                self.read_stream(&mut tag, || format!("the ucx MAC of {what}"))
                    .await?;
                let mut dest = self.receive_ucx(seq, dest, what).await?;
                if !super::tensor_mac::verify(&key, seq, dest.as_mut_bytes(), &tag) {
                    return Err(TransportError::Integrity {
                        peer: self.peer.clone(),
                        source: crate::auth::RecordError::Tensor {
                            channel: channel::UCX,
                            seq,
                        },
                    });
                }
                Ok(dest)
            }
        }
    }

    /// Receives one tensor over UCX, straight into its destination.
    #[cfg(feature = "ucx")]
    async fn receive_ucx(
        &mut self,
        seq: u64,
        mut dest: Box<dyn RecvBuffer>,
        what: &TensorWhat,
    ) -> Result<Box<dyn RecvBuffer>, TransportError> {
        let Some(link) = self.channels.ucx.as_ref() else {
            return Err(self.bad_record("ucx record on a connection without ucx"));
        };
        let len = dest.as_mut_bytes().len();
        let pending = {
            let ptr = dest.as_mut_bytes().as_mut_ptr();
            // SAFETY: the bytes are the destination's, which moves into the
            // request (a boxed buffer's bytes do not move with the box) and
            // stays owned by it until UCX completed or cancelled it.
            unsafe { link.recv(seq, ptr, len, Box::new(dest)) }?
        };
        let stall = self.limits.frame_stall_timeout;
        let (dest, got) = match tokio::time::timeout(stall, pending).await {
            Ok(r) => {
                let (keep, got) = r?;
                let dest = keep.downcast::<Box<dyn RecvBuffer>>().map_err(|_| {
                    TransportError::Alloc("a UCX receive returned another buffer".into())
                })?;
                (*dest, got)
            }
            Err(_) => {
                return Err(TransportError::Stalled {
                    peer: self.peer.clone(),
                    waiting_for: what.to_string(),
                    got: 0,
                    len: len as u64,
                    after: stall,
                })
            }
        };
        if got != len {
            return Err(TransportError::Channel {
                channel: channel::UCX,
                peer: self.peer.clone(),
                reason: format!("{got} bytes arrived for {what}"),
            });
        }
        Ok(dest)
    }

    /// The device the peer's maps send a tensor to must be the one this
    /// worker's maps land it on: otherwise the two ends chose their
    /// channels for different device pairs.
    fn check_target(&self, target: Device, what: &TensorWhat) -> Result<(), TransportError> {
        if target == what.device {
            return Ok(());
        }
        Err(crate::device_map::DeviceMapError::Disagree {
            worker: self.peer.clone(),
            sent: target,
            here: what.device,
        }
        .into())
    }

    /// Receives a `cuda_staged` tensor: its bytes follow on the stream
    /// after the record, staged into device memory for a device destination.
    async fn receive_staged(
        &mut self,
        mut dest: Box<dyn RecvBuffer>,
        what: &TensorWhat,
    ) -> Result<Box<dyn RecvBuffer>, TransportError> {
        let Some(ptr) = dest.device_ptr() else {
            let stall = self.limits.frame_stall_timeout;
            receive_in_steps(
                &mut self.inner,
                dest.as_mut(),
                stall,
                &self.peer,
                what,
                None,
            )
            .await?;
            return Ok(dest);
        };
        let len = usize::try_from(what.byte_len)
            .map_err(|_| TransportError::Alloc(format!("{} bytes do not fit", what.byte_len)))?;
        self.receive_to_device(ptr, len, what).await?;
        Ok(dest)
    }

    #[cfg(feature = "cuda")]
    async fn receive_to_device(
        &mut self,
        ptr: u64,
        len: usize,
        what: &TensorWhat,
    ) -> Result<(), TransportError> {
        let device = what.device;
        let ctx = crate::cuda::driver::context(device)?;
        let options = self.channels.cuda.staged;
        let stall = self.limits.frame_stall_timeout;
        let peer = self.peer.clone();
        let failed = |reason: String| TransportError::Channel {
            channel: channel::CUDA_STAGED,
            peer: peer.clone(),
            reason: format!("{what}: {reason}"),
        };
        // SAFETY: the allocator returned `len` bytes of device memory on
        // `device` at `ptr`, owned by the destination we hold.
        let mut engine =
            unsafe { crate::cuda::driver::CudaCopyEngine::new(&ctx, ptr, len, &options) }
                .map_err(|e| failed(e.to_string()))?;
        let mut input = StallReader::new(&mut self.inner, stall);
        crate::cuda::staged::receive(&mut engine, len, &options, &mut input)
            .await
            .map_err(|e| failed(e.to_string()))
    }

    #[cfg(not(feature = "cuda"))]
    async fn receive_to_device(
        &mut self,
        _ptr: u64,
        _len: usize,
        _what: &TensorWhat,
    ) -> Result<(), TransportError> {
        Err(crate::cuda::CudaUnavailable::NotBuilt.into())
    }

    /// Copies a `cuda_ipc` tensor from the sender's exported memory into
    /// the device destination, after the sender's event (no host sync
    /// before the copy is queued).
    #[cfg(feature = "cuda")]
    fn receive_ipc(
        &self,
        record: &ferry_wire::channel_record::CudaIpcRecord,
        dest: &mut dyn RecvBuffer,
        what: &TensorWhat,
    ) -> Result<(), TransportError> {
        let Some(ptr) = dest.device_ptr() else {
            return Err(self.bad_record("a cuda_ipc record for a destination in host memory"));
        };
        let Some(handles) = crate::cuda::ipc::IpcRecord::decode(&record.handles) else {
            return Err(self.bad_record("cuda_ipc handles of the wrong length"));
        };
        if handles.len != what.byte_len {
            return Err(self.bad_record(&format!(
                "cuda_ipc handles for {} bytes, the tensor has {}",
                handles.len, what.byte_len
            )));
        }
        let ctx = crate::cuda::driver::context(what.device)?;
        let copy = || {
            // SAFETY: the destination holds `byte_len` bytes of device memory
            // at `ptr`; the sender keeps its memory until our release.
            unsafe { crate::cuda::ipc::receive(&ctx, &handles, ptr) }
        };
        let result = if multi_thread_runtime() {
            tokio::task::block_in_place(copy)
        } else {
            copy()
        };
        result.map_err(|reason| TransportError::Channel {
            channel: channel::CUDA_IPC,
            peer: self.peer.clone(),
            reason: format!("{what}: {reason}"),
        })
    }

    #[cfg(not(feature = "cuda"))]
    fn receive_ipc(
        &self,
        _record: &ferry_wire::channel_record::CudaIpcRecord,
        _dest: &mut dyn RecvBuffer,
        _what: &TensorWhat,
    ) -> Result<(), TransportError> {
        Err(self.bad_record("cuda_ipc record, but this build has no cuda feature"))
    }

    /// Without the `ucx` feature no `ucx` record is expected.
    #[cfg(not(feature = "ucx"))]
    async fn receive_ucx(
        &mut self,
        _seq: u64,
        _dest: Box<dyn RecvBuffer>,
        _what: &TensorWhat,
    ) -> Result<Box<dyn RecvBuffer>, TransportError> {
        Err(self.bad_record("ucx record, but this build has no ucx channel"))
    }

    /// The peer has copied `cma` tensors: let them go.
    fn on_release(&mut self, header: &FrameHeader, payload: &[u8]) -> Result<(), TransportError> {
        if header.tensor_count != 0 {
            return Err(self.bad_record("a release frame must carry no tensors"));
        }
        let list = ReleaseList::decode(payload).map_err(|e| self.malformed(e.into()))?;
        let released: Vec<_> = {
            let mut pending = self.shared.lock_pending();
            list.tokens()
                .map(|token| (token, pending.remove(&token)))
                .collect()
        };
        for (token, tensor) in released {
            if tensor.is_none() {
                return Err(self.bad_record(&format!(
                    "release of token {token}, which names no tensor in flight"
                )));
            }
        }
        Ok(())
    }

    /// Reads exactly `buf.len()` bytes of the frame being read from the
    /// stream; fails with [`TransportError::Stalled`] when no byte comes for
    /// the limits' `frame_stall_timeout`.
    async fn read_stream(
        &mut self,
        buf: &mut [u8],
        what: impl FnOnce() -> String,
    ) -> Result<(), TransportError> {
        let stall = self.limits.frame_stall_timeout;
        match read_with_stall(&mut self.inner, buf, stall).await {
            Ok(()) => Ok(()),
            Err(ReadFail::Io(e)) => Err(self.io(e)),
            Err(ReadFail::Stalled { got }) => Err(TransportError::Stalled {
                peer: self.peer.clone(),
                waiting_for: what(),
                got: got as u64,
                len: buf.len() as u64,
                after: stall,
            }),
        }
    }

    fn bad_record(&self, what: &str) -> TransportError {
        self.malformed(WireError::Channel(what.into()))
    }

    fn io(&self, e: std::io::Error) -> TransportError {
        if let Some(r) = crate::auth::RecordError::of(&e) {
            if !matches!(r, crate::auth::RecordError::Truncated { .. }) {
                return TransportError::Integrity {
                    peer: self.peer.clone(),
                    source: r.clone(),
                };
            }
        }
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

impl<R> FrameReader<R> {
    /// The channel selection for tensors this side receives.
    pub fn selection(&self) -> &Selection {
        &self.selection
    }
}

/// What a reader waits for while it receives one tensor, for errors.
pub(super) struct TensorWhat {
    kind: MessageKind,
    index: usize,
    count: usize,
    byte_len: u64,
    channel: &'static str,
    /// Where the tensor lands.
    device: Device,
}

impl std::fmt::Display for TensorWhat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tensor {} of {} ({} bytes, channel {}) of a {} frame",
            self.index, self.count, self.byte_len, self.channel, self.kind
        )
    }
}

/// The channel's name as a constant of this build (selection only yields
/// names both ends offered, so unknown names cannot occur; they map to a
/// name that has no record format and fails cleanly).
fn channel_name(name: &str) -> &'static str {
    match name {
        channel::INLINE => channel::INLINE,
        channel::CMA => channel::CMA,
        channel::SHM => channel::SHM,
        channel::MPT => channel::MPT,
        channel::UCX => channel::UCX,
        channel::CUDA_STAGED => channel::CUDA_STAGED,
        channel::CUDA_IPC => channel::CUDA_IPC,
        _ => "unknown",
    }
}

/// The record layout of channel `name` (`None`: `inline`, or a channel
/// with no record format in this build).
fn record_format(name: &str) -> Option<RecordFormat> {
    match name {
        channel::CMA => Some(RecordFormat::Cma),
        channel::SHM => Some(RecordFormat::Shm),
        channel::MPT => Some(RecordFormat::Mpt),
        #[cfg(feature = "ucx")]
        channel::UCX => Some(RecordFormat::Ucx),
        #[cfg(feature = "cuda")]
        channel::CUDA_IPC => Some(RecordFormat::CudaIpc),
        #[cfg(feature = "cuda")]
        channel::CUDA_STAGED => Some(RecordFormat::CudaStaged),
        _ => None,
    }
}

fn multi_thread_runtime() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}
