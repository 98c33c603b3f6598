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
//! On an authenticated connection ([`crate::auth`]) the frames travel in
//! sealed records, and a `ucx` record is followed by a
//! [`TENSOR_MAC_LEN`]-byte MAC of the tensor's bytes ([`tensor_mac`]):
//! those bytes cross outside the records, straight into their
//! destination, and are checked there before the message is handed on.
//! (`mpt` lanes are sealed like the connection; `cma` and `shm` stay on
//! one host.)
//!
//! A `cma` sender keeps the tensor alive until the receiver's
//! [`MessageKind::RELEASE`](ferry_wire::MessageKind::RELEASE) frame names its
//! token; the reader handles those frames itself and queues its own for the
//! writer ([`ReleaseSignal`]).
//!
//! The files: this one holds what both directions share (the channel
//! configuration and endpoints, pending `cma` tokens and releases);
//! `reader` is [`FrameReader`], `writer` is [`FrameWriter`], and `stall`
//! has the stream reads that fail when no byte arrives in time.

mod reader;
mod stall;
pub(crate) mod tensor_mac;
mod writer;

pub(crate) use tensor_mac::TENSOR_MAC_LEN;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ferry_wire::payload::OutgoingTensor;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Notify;

use crate::mpt::{MptReceiver, MptSender};
use crate::OutgoingMessage;

pub use reader::FrameReader;
pub use writer::FrameWriter;

/// Default for [`ChannelConfig::small_tensor_bytes`].
pub const DEFAULT_SMALL_TENSOR_BYTES: usize = 64 << 10;

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
    /// [`SPIN_BUDGET`](crate::spin::SPIN_BUDGET)); a shorter spin leaves the
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
            spin: crate::spin::SPIN_BUDGET,
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
