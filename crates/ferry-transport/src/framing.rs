//! Frame I/O over any byte stream: vectored writes that send tensor bytes
//! from their own memory, and reads that put tensor bytes straight into
//! destinations allocated from their descriptors.
//!
//! # Tensor bytes on the wire
//!
//! After a frame's payload come its tensors, in table order, each as its
//! selected channel carries it: `inline` as the tensor's bytes, any other
//! channel as a mode byte, then the tensor's bytes (mode 0, a small
//! tensor) or the channel's record (mode 1). The bytes of mode bytes,
//! records and release lists are [`ferry_wire::channel_record`]'s: this
//! module reads and writes them around the tensor data, and keeps the
//! per-connection state (pending `cma` tokens, `mpt` sequence numbers).
//!
//! A `cma` sender keeps the tensor alive until the receiver's
//! [`MessageKind::RELEASE`] frame names its token; the reader handles those
//! frames itself and queues its own for the writer ([`ReleaseSignal`]).

use std::collections::HashMap;
use std::future::Future as _;
use std::io::IoSlice;
use std::sync::{Arc, Mutex};

use ferry_wire::channel_record::{
    encode_release, release_len, ChannelRecord, CmaRecord, Mode, MptRecord, Prelude, RecordFormat,
    ReleaseList,
};
use ferry_wire::payload::{IncomingTensor, OutgoingTensor};
use ferry_wire::{
    decode_descriptors, encode_descriptors, Device, Flags, FrameHeader, Limits, MessageKind,
    WireError, HEADER_LEN,
};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::Notify;

use crate::mpt::{MptReceiver, MptSender};
use crate::selection::Selection;
use crate::{
    channel, cma, Allocator, IncomingMessage, OutgoingMessage, RecvBuffer, TransportError,
};

/// Most slices handed to one `writev` call (Linux allows 1024).
const MAX_IOV: usize = 512;
/// Read buffer: small frames are read many at a time.
const READ_BUFFER: usize = 64 << 10;
/// Default for [`ChannelConfig::small_tensor_bytes`].
pub const DEFAULT_SMALL_TENSOR_BYTES: usize = 64 << 10;
/// Tensors at least this large are pulled by `cma` off the async runtime's
/// thread (the copy blocks for milliseconds).
const BLOCKING_COPY_MIN: usize = 1 << 20;
/// Tensor bytes arriving on a stream (inline, or the `shm` ring) are read
/// in steps of this size; each step's memory is made resident
/// ([`RecvBuffer::prepare`]) just before its bytes are read, so memory is
/// committed in step with the bytes that arrive.
const RECV_STEP: usize = 4 << 20;

/// Room for the longest channel record.
const MAX_RECORD_LEN: usize = ferry_wire::channel_record::CudaIpcRecord::LEN;

/// State the reader and the writer of one connection share: `cma` tensors
/// waiting for the peer's release, and releases to send.
#[derive(Default)]
pub(crate) struct Shared {
    pending: Mutex<HashMap<u64, Arc<dyn OutgoingTensor>>>,
    releases: Mutex<Vec<u64>>,
    release_ready: Notify,
}

impl Shared {
    fn lock_pending(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<dyn OutgoingTensor>>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn lock_releases(&self) -> std::sync::MutexGuard<'_, Vec<u64>> {
        self.releases.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Wakes a connection's writer when its reader has queued releases to send
/// (see [`FrameWriter::release_signal`]).
#[derive(Clone)]
pub struct ReleaseSignal(Arc<Shared>);

impl ReleaseSignal {
    /// Completes when releases wait to be written: write an empty batch then.
    pub async fn wait(&self) {
        loop {
            let notified = self.0.release_ready.notified();
            if !self.0.lock_releases().is_empty() {
                return;
            }
            notified.await;
        }
    }
}

/// How a connection's tensors move besides `inline`: the channel endpoints
/// set up for it and the knobs they share.
#[derive(Clone, Debug)]
pub struct ChannelConfig {
    /// Tensors smaller than this go inline even when another channel is
    /// selected (the sender decides; the mode byte tells the receiver).
    pub small_tensor_bytes: usize,
    /// Threads that pull one large `cma` tensor in parallel.
    pub cma_threads: usize,
    /// `mpt` lanes per direction this side opens when it connects.
    pub mpt_lanes: usize,
    /// Bytes of each ring of the `shm` transport.
    pub shm_transport_ring: usize,
    /// Bytes of each ring of the `shm` channel.
    pub shm_channel_ring: usize,
    /// UCX's transports for the `ucx` channel and transport (`UCX_TLS`,
    /// e.g. `"shm,self"` or `"tcp"`); `None`: UCX's default, or `UCX_TLS`
    /// from the environment.
    pub ucx_tls: Option<String>,
    /// How long a side waiting for a peer on this host polls before it
    /// sleeps: a reader or writer of the `shm` rings (transport and
    /// channel) before it waits on the ring's eventfd, a task waiting for a
    /// UCX request before it waits on the worker's event fd, and, in
    /// `ferry-rpc`, a caller before it parks until its reply. Polling
    /// saves the wake-up when the answer comes within it (the RPC latency
    /// figures rely on the default,
    /// [`SPIN_BUDGET`](crate::shm::SPIN_BUDGET)); a shorter spin leaves the
    /// CPU to other threads sooner, which pays where compute threads
    /// share few cores with the readers (a pipeline stage on a small
    /// host). Zero: one round of checks, then sleep.
    pub spin: std::time::Duration,
    /// Chunk size and staging slots of the `cuda_staged` channel.
    pub cuda_staged: crate::cuda::staged::StagedOptions,
    /// Per peer worker, which of its devices each local device maps to
    /// ([`crate::device_map`]): decides the device a received tensor lands
    /// on and the device pair that selects a tensor's channel.
    pub device_maps: Arc<crate::device_map::DeviceMaps>,
}

impl Default for ChannelConfig {
    fn default() -> Self {
        ChannelConfig {
            small_tensor_bytes: DEFAULT_SMALL_TENSOR_BYTES,
            cma_threads: std::thread::available_parallelism()
                .map(|n| n.get().min(4))
                .unwrap_or(1),
            mpt_lanes: 4,
            shm_transport_ring: 2 << 20,
            shm_channel_ring: 8 << 20,
            ucx_tls: None,
            spin: crate::shm::SPIN_BUDGET,
            cuda_staged: crate::cuda::staged::StagedOptions::default(),
            device_maps: Arc::default(),
        }
    }
}

/// The receiving ends of the out-of-band channels of one connection.
#[derive(Default)]
pub(crate) struct ReadChannels {
    /// The sending process's pid, when `cma` is selected.
    pub(crate) cma_pid: Option<i32>,
    /// The shared-memory data ring, when `shm` is selected.
    pub(crate) shm: Option<Box<dyn AsyncRead + Send + Unpin>>,
    /// The lanes, when `mpt` is selected.
    pub(crate) mpt: Option<MptReceiver>,
    /// The UCX link, when `ucx` is selected.
    #[cfg(feature = "ucx")]
    pub(crate) ucx: Option<crate::ucx::UcxLink>,
    pub(crate) cma_threads: usize,
    /// Device maps and `cuda_staged` chunking.
    pub(crate) cuda: CudaSide,
}

/// What both directions of a connection know about CUDA tensors.
#[derive(Default, Clone)]
pub(crate) struct CudaSide {
    pub(crate) maps: Arc<crate::device_map::DeviceMaps>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) staged: crate::cuda::staged::StagedOptions,
}

impl CudaSide {
    pub(crate) fn new(config: &ChannelConfig) -> Self {
        CudaSide {
            maps: config.device_maps.clone(),
            staged: config.cuda_staged,
        }
    }
}

/// The sending ends of the out-of-band channels of one connection.
#[derive(Default)]
pub(crate) struct WriteChannels {
    pub(crate) cma: bool,
    pub(crate) shm: Option<Box<dyn AsyncWrite + Send + Unpin>>,
    pub(crate) mpt: Option<MptSender>,
    #[cfg(feature = "ucx")]
    pub(crate) ucx: Option<crate::ucx::UcxLink>,
    pub(crate) small_tensor_bytes: usize,
    pub(crate) cuda: CudaSide,
}

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
        }
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
                let landing = crate::cuda::landing(&self.channels.cuda.maps, &self.peer, source)?;
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
                result.map_err(|e| TransportError::Channel {
                    channel: channel::CMA,
                    peer: self.peer.clone(),
                    reason: format!("reading {len} bytes at {addr:#x} failed: {e}"),
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
                self.receive_ucx(seq, dest, what).await
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

impl<W> FrameWriter<W> {
    /// The channel selection for tensors this side sends.
    pub fn selection(&self) -> &Selection {
        &self.selection
    }
}

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
        }
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
                let target = crate::cuda::target(&self.channels.cuda.maps, &self.peer, d.device)?;
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
        Ok(())
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
            return self
                .inner
                .write_all(tensor.bytes())
                .await
                .map_err(|e| TransportError::Io {
                    peer: self.peer.clone(),
                    source: e,
                });
        };
        self.send_from_device(ptr, &tensor.descriptor()).await
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

/// What a reader waits for while it receives one tensor, for errors.
struct TensorWhat {
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

/// Why a read of frame bytes stopped.
enum ReadFail {
    Io(std::io::Error),
    /// No byte came within the stall timeout; `got` bytes of the buffer are in.
    Stalled {
        got: usize,
    },
}

/// Fills `buf` from `r`, each read bounded by `stall` (progress resets it).
async fn read_with_stall<R: AsyncRead + Unpin + ?Sized>(
    r: &mut R,
    buf: &mut [u8],
    stall: std::time::Duration,
) -> Result<(), ReadFail> {
    let mut got = 0;
    while got < buf.len() {
        match tokio::time::timeout(stall, r.read(&mut buf[got..])).await {
            Ok(Ok(0)) => {
                return Err(ReadFail::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            Ok(Ok(n)) => got += n,
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Ok(Err(e)) => return Err(ReadFail::Io(e)),
            Err(_) => return Err(ReadFail::Stalled { got }),
        }
    }
    Ok(())
}

/// A reader whose every read fails with `TimedOut` when no byte comes
/// within the stall timeout (for pipelines that read with `read_exact`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct StallReader<'a, R> {
    inner: &'a mut R,
    stall: std::time::Duration,
    sleep: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl<'a, R> StallReader<'a, R> {
    fn new(inner: &'a mut R, stall: std::time::Duration) -> Self {
        StallReader {
            inner,
            stall,
            sleep: None,
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for StallReader<'_, R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = &mut *self;
        match std::pin::Pin::new(&mut *this.inner).poll_read(cx, buf) {
            std::task::Poll::Ready(r) => {
                this.sleep = None;
                std::task::Poll::Ready(r)
            }
            std::task::Poll::Pending => {
                let stall = this.stall;
                let sleep = this
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
                match sleep.as_mut().poll(cx) {
                    std::task::Poll::Ready(()) => std::task::Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no byte arrived for {stall:?}"),
                    ))),
                    std::task::Poll::Pending => std::task::Poll::Pending,
                }
            }
        }
    }
}

/// Fills a tensor's destination from a stream in [`RECV_STEP`] steps,
/// making each step's memory resident only as its bytes are about to
/// arrive. `channel` names the channel in errors of a channel's own stream
/// (`None`: the connection's stream).
async fn receive_in_steps<R: AsyncRead + Unpin + ?Sized>(
    r: &mut R,
    dest: &mut dyn RecvBuffer,
    stall: std::time::Duration,
    peer: &str,
    what: &TensorWhat,
    channel: Option<&'static str>,
) -> Result<(), TransportError> {
    let len = dest.as_mut_bytes().len();
    let mut at = 0;
    while at < len {
        let end = (at + RECV_STEP).min(len);
        dest.prepare(end);
        match read_with_stall(r, &mut dest.as_mut_bytes()[at..end], stall).await {
            Ok(()) => at = end,
            Err(ReadFail::Stalled { got }) => {
                return Err(TransportError::Stalled {
                    peer: peer.to_owned(),
                    waiting_for: what.to_string(),
                    got: (at + got) as u64,
                    len: len as u64,
                    after: stall,
                })
            }
            Err(ReadFail::Io(e)) => {
                return Err(match channel {
                    Some(channel) => TransportError::Channel {
                        channel,
                        peer: peer.to_owned(),
                        reason: e.to_string(),
                    },
                    None if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        TransportError::Closed {
                            peer: peer.to_owned(),
                        }
                    }
                    None => TransportError::Io {
                        peer: peer.to_owned(),
                        source: e,
                    },
                })
            }
        }
    }
    Ok(())
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

fn len_u32(what: &'static str, len: usize) -> Result<u32, TransportError> {
    u32::try_from(len).map_err(|_| {
        TransportError::Wire(ferry_wire::WireError::TooLarge {
            what,
            len: len as u64,
            max: u32::MAX.into(),
        })
    })
}

/// Checked when this compiles: a connection's reads and writes are
/// futures that may move between tokio's worker threads (as
/// `tokio::spawn` needs), on streams that are only `Send`.
#[allow(dead_code)]
fn reads_and_writes_are_send(
    reader: &mut FrameReader<Box<dyn AsyncRead + Send + Unpin>>,
    writer: &mut FrameWriter<Box<dyn AsyncWrite + Send + Unpin>>,
    message: &OutgoingMessage,
) {
    fn send<T: Send>(_: T) {}
    send(reader.read());
    send(writer.write(message));
}
