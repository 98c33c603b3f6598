//! The healing side of live recovery: fetching a checkpoint from a source
//! replica's [`CheckpointServer`](super::CheckpointServer), streaming its
//! chunks straight into their destinations.

use std::any::Any;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use ferry_transport::{Allocator, PeerConnection, RawTensor, RecvBuffer, Storage, TransportError};
use ferry_wire::{payload, DType, Device, TensorDescriptor};
use tokio::task::JoinSet;
use tracing::{debug, info, info_span, Instrument};

use super::error::RecoveryError;
use super::link::{self, ConnectError, ReadError};
use super::protocol::{
    check_stream_request, ChunkHeader, ChunkPlan, ChunkSpec, Manifest, Refusal, Reply, Request,
    KIND_CHUNK, KIND_REPLY, KIND_REQUEST,
};
use super::CheckpointState;

/// How a healing replica fetches a checkpoint.
///
/// ```
/// use std::time::Duration;
/// use ferry_ft::recovery::FetchOptions;
///
/// let options = FetchOptions::new("replica_b").with_lanes(4).with_io_timeout(Duration::from_secs(5));
/// assert_eq!(options.lanes, 4);
/// ```
#[derive(Debug, Clone)]
pub struct FetchOptions {
    /// The healing replica group (in handshakes, spans and logs).
    pub replica_id: String,
    /// Connections the chunks are spread over (1 to 64; fewer when the
    /// checkpoint has fewer chunks). Default 2.
    pub lanes: u32,
    /// Chunk size in bytes: a multiple of 16 from 4 KiB to 1 GiB. Default
    /// 8 MiB.
    pub chunk_bytes: u64,
    /// How long resolving, connecting and the handshake may take, per
    /// lane. Default 10 s.
    pub connect_timeout: Duration,
    /// How long the source may send nothing before the fetch fails. Default
    /// 30 s.
    pub io_timeout: Duration,
    /// How long the source may wait for its checkpoint to be allowed before
    /// it answers (it serves the step once it has its own quorum result).
    /// Default 30 s.
    pub wait: Duration,
    /// The largest checkpoint accepted, in bytes (a bound on what a
    /// manifest can make this side allocate). Default 64 GiB.
    pub max_state_bytes: u64,
    /// The group's shared secret, for a source whose checkpoint server
    /// holds one ([`CheckpointServerOptions::auth`](super::CheckpointServerOptions::auth)).
    /// Default none.
    pub auth: Option<ferry_transport::auth::Secret>,
}

impl FetchOptions {
    /// The defaults for replica group `replica_id`.
    pub fn new(replica_id: impl Into<String>) -> Self {
        Self {
            replica_id: replica_id.into(),
            lanes: 2,
            chunk_bytes: 8 << 20,
            connect_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(30),
            wait: Duration::from_secs(30),
            max_state_bytes: 64 << 30,
            auth: None,
        }
    }

    /// Sets [`auth`](Self::auth).
    pub fn with_auth_secret(mut self, secret: ferry_transport::auth::Secret) -> Self {
        self.auth = Some(secret);
        self
    }

    /// Sets [`lanes`](Self::lanes).
    pub fn with_lanes(mut self, lanes: u32) -> Self {
        self.lanes = lanes;
        self
    }

    /// Sets [`chunk_bytes`](Self::chunk_bytes).
    pub fn with_chunk_bytes(mut self, chunk_bytes: u64) -> Self {
        self.chunk_bytes = chunk_bytes;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout).
    pub fn with_connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self
    }

    /// Sets [`io_timeout`](Self::io_timeout).
    pub fn with_io_timeout(mut self, io_timeout: Duration) -> Self {
        self.io_timeout = io_timeout;
        self
    }

    /// Sets [`wait`](Self::wait).
    pub fn with_wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets [`max_state_bytes`](Self::max_state_bytes).
    pub fn with_max_state_bytes(mut self, max_state_bytes: u64) -> Self {
        self.max_state_bytes = max_state_bytes;
        self
    }
}

/// Fetches the checkpoint at `step` from the checkpoint server at `address`
/// (the source replica's checkpoint metadata), allocating one destination
/// per tensor from the manifest and streaming the chunks straight into them.
///
/// Fails with [`RecoveryError::StepMismatch`] if the source serves another
/// step, [`RecoveryError::SourceUnreachable`] / [`RecoveryError::SourceLost`]
/// if it is dead or dies, [`RecoveryError::Malformed`] if it sends anything
/// off protocol, and [`RecoveryError::Timeout`] if it stalls.
pub async fn fetch_checkpoint(
    address: &str,
    step: i64,
    options: &FetchOptions,
) -> Result<CheckpointState, RecoveryError> {
    fetch(address, step, None, options).await
}

/// Like [`fetch_checkpoint`], but the chunks land in the tensors of `into`
/// (the healing replica's own state, already allocated): same names in the
/// same order, same dtypes and shapes, contiguous, and not shared (their
/// storage is written in place). Returns them, filled, with the step set.
/// On error the destinations are dropped: their contents would be partial.
pub async fn fetch_checkpoint_into(
    address: &str,
    step: i64,
    into: CheckpointState,
    options: &FetchOptions,
) -> Result<CheckpointState, RecoveryError> {
    fetch(address, step, Some(into), options).await
}

async fn fetch(
    address: &str,
    step: i64,
    into: Option<CheckpointState>,
    options: &FetchOptions,
) -> Result<CheckpointState, RecoveryError> {
    let span = info_span!(
        "recover",
        replica_id = %options.replica_id,
        source = %address,
        step
    );
    fetch_in_span(address, step, into, options)
        .instrument(span)
        .await
}

async fn fetch_in_span(
    address: &str,
    step: i64,
    into: Option<CheckpointState>,
    options: &FetchOptions,
) -> Result<CheckpointState, RecoveryError> {
    check_stream_request(0, options.lanes, options.chunk_bytes)
        .map_err(|reason| RecoveryError::InvalidOptions { reason })?;
    let started = Instant::now();
    let addr = link::resolve(address, options.connect_timeout)
        .await
        .map_err(|error| RecoveryError::InvalidAddress {
            address: address.to_owned(),
            reason: error.to_string(),
        })?;
    let ctx = LaneContext {
        address: address.to_owned(),
        addr,
        step,
        options: options.clone(),
    };

    // Lane 0 asks for the manifest first.
    let lane0 = Arc::new(LaneAllocator::default());
    let mut conn0 = ctx.connect(Arc::clone(&lane0)).await?;
    let wait_ms = u64::try_from(options.wait.as_millis()).unwrap_or(u64::MAX);
    ctx.send(&mut conn0, &Request::Manifest { step, wait_ms })
        .await?;
    let reply = ctx
        .read_reply(
            &mut conn0,
            options.wait + options.io_timeout,
            "the manifest",
        )
        .await?;
    let manifest = match reply {
        Reply::Manifest(manifest) => manifest,
        Reply::Refused(refusal) => return Err(ctx.refused(refusal)),
        Reply::End { .. } => return Err(ctx.malformed("end of stream instead of a manifest")),
    };
    let total = manifest
        .validate(step, options.max_state_bytes)
        .map_err(|reason| ctx.malformed(reason))?;

    let storages = match into {
        Some(state) => destinations_from(&manifest, state)?,
        None => allocate_destinations(&manifest)?,
    };
    let landing = Arc::new(Landing::new(&manifest, storages)?);
    let byte_lens: Vec<u64> = manifest.tensors.iter().map(|t| t.byte_len).collect();
    let plan = ChunkPlan::new(&byte_lens, options.chunk_bytes);
    let lanes = options.lanes.min(plan.len().max(1) as u32);
    debug!(
        tensors = manifest.tensors.len(),
        bytes = total,
        chunks = plan.len(),
        lanes,
        "manifest received"
    );

    let mut tasks = JoinSet::new();
    lane0.arm(&landing, plan.lane(0, lanes));
    let expected = plan.lane(0, lanes).count() as u64;
    {
        let ctx = ctx.clone();
        tasks.spawn(async move { ctx.stream(conn0, 0, lanes, expected).await }.in_current_span());
    }
    for lane in 1..lanes {
        let allocator = Arc::new(LaneAllocator::default());
        allocator.arm(&landing, plan.lane(lane, lanes));
        let expected = plan.lane(lane, lanes).count() as u64;
        let ctx = ctx.clone();
        tasks.spawn(
            async move {
                let conn = ctx.connect(allocator).await?;
                ctx.stream(conn, lane, lanes, expected).await
            }
            .in_current_span(),
        );
    }
    drop(lane0);
    while let Some(result) = tasks.join_next().await {
        match result {
            Ok(Ok(())) => {}
            // Dropping `tasks` aborts the other lanes.
            Ok(Err(error)) => return Err(error),
            Err(error) => return Err(RecoveryError::Task(error)),
        }
    }
    drop(tasks);

    let landing = Arc::try_unwrap(landing).map_err(|_| RecoveryError::Destination {
        reason: "a finished lane still holds the destinations (internal error)".to_owned(),
    })?;
    let mut state = CheckpointState::new(step);
    for (meta, tensor) in manifest.tensors.into_iter().zip(landing.tensors) {
        let descriptor = TensorDescriptor::contiguous(meta.dtype, &meta.shape, Device::Cpu);
        let raw = RawTensor::from_storage(tensor.storage, descriptor)
            .map_err(|error| ctx.malformed(format!("tensor {:?}: {error}", meta.name)))?;
        state.tensors.push((meta.name, raw));
    }
    let elapsed = started.elapsed();
    info!(
        bytes = total,
        lanes,
        elapsed_ms = elapsed.as_secs_f64() * 1e3,
        gb_per_s = total as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9,
        "checkpoint fetched"
    );
    Ok(state)
}

/// What every lane of one fetch shares.
#[derive(Clone)]
struct LaneContext {
    address: String,
    addr: SocketAddr,
    step: i64,
    options: FetchOptions,
}

impl LaneContext {
    async fn connect(
        &self,
        allocator: Arc<LaneAllocator>,
    ) -> Result<PeerConnection, RecoveryError> {
        let mut endpoint = link::streaming_endpoint(&self.options.replica_id);
        endpoint.allocator = allocator;
        endpoint.auth = self.options.auth.clone();
        link::connect(self.addr, &endpoint, self.options.connect_timeout)
            .await
            .map_err(|error| RecoveryError::SourceUnreachable {
                address: self.address.clone(),
                reason: match error {
                    ConnectError::Transport { source, .. } => source.to_string(),
                    other => other.to_string(),
                },
            })
    }

    async fn send(
        &self,
        conn: &mut PeerConnection,
        request: &Request,
    ) -> Result<(), RecoveryError> {
        let message = link::message(KIND_REQUEST, request).map_err(|error| {
            RecoveryError::InvalidOptions {
                reason: format!("cannot encode the request: {error}"),
            }
        })?;
        match tokio::time::timeout(self.options.io_timeout, conn.writer.write(&message)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(self.transport(error)),
            Err(_) => Err(RecoveryError::Timeout {
                address: self.address.clone(),
                waiting_for: "a request to be sent",
                timeout: self.options.io_timeout,
            }),
        }
    }

    async fn read(
        &self,
        conn: &mut PeerConnection,
        timeout: Duration,
        waiting_for: &'static str,
    ) -> Result<ferry_transport::IncomingMessage, RecoveryError> {
        link::read_message(&mut conn.reader, timeout)
            .await
            .map_err(|error| match error {
                ReadError::Timeout => RecoveryError::Timeout {
                    address: self.address.clone(),
                    waiting_for,
                    timeout,
                },
                ReadError::Closed => RecoveryError::SourceLost {
                    address: self.address.clone(),
                    reason: format!("connection closed while waiting for {waiting_for}"),
                },
                ReadError::Transport(error) => self.transport(error),
            })
    }

    async fn read_reply(
        &self,
        conn: &mut PeerConnection,
        timeout: Duration,
        waiting_for: &'static str,
    ) -> Result<Reply, RecoveryError> {
        let message = self.read(conn, timeout, waiting_for).await?;
        self.reply(message)
    }

    fn reply(&self, message: ferry_transport::IncomingMessage) -> Result<Reply, RecoveryError> {
        if message.header.kind != KIND_REPLY {
            return Err(self.malformed(format!(
                "expected a reply, got a {} message",
                message.header.kind
            )));
        }
        link::decode(message).map_err(|error| self.malformed(format!("bad reply: {error}")))
    }

    /// Sends the stream request of `lane` and receives its chunks (landing
    /// in place through the connection's allocator) up to the end marker.
    async fn stream(
        &self,
        mut conn: PeerConnection,
        lane: u32,
        lanes: u32,
        expected: u64,
    ) -> Result<(), RecoveryError> {
        let request = Request::Stream {
            step: self.step,
            lane,
            lanes,
            chunk_bytes: self.options.chunk_bytes,
        };
        self.send(&mut conn, &request).await?;
        let mut received = 0u64;
        loop {
            let message = self
                .read(&mut conn, self.options.io_timeout, "checkpoint chunks")
                .await?;
            if message.header.kind == KIND_CHUNK {
                let header: ChunkHeader = payload::decode(&message.payload, Vec::new())
                    .map_err(|error| self.malformed(format!("bad chunk header: {error}")))?;
                let landed = match message.tensors.as_slice() {
                    [tensor] => tensor.storage.downcast_ref::<Landed>().copied(),
                    _ => None,
                };
                let landed = landed.ok_or_else(|| {
                    self.malformed(format!(
                        "chunk {} carries {} tensors, expected 1",
                        header.index,
                        message.tensors.len()
                    ))
                })?;
                if (header.index, header.tensor as usize, header.offset)
                    != (landed.index, landed.tensor, landed.offset)
                {
                    return Err(self.malformed(format!(
                        "chunk header {header:?} does not match the planned chunk {landed:?}"
                    )));
                }
                received += 1;
                continue;
            }
            match self.reply(message)? {
                Reply::End { chunks } if chunks == received && received == expected => {
                    debug!(lane, chunks, "lane complete");
                    return Ok(());
                }
                Reply::End { chunks } => {
                    return Err(self.malformed(format!(
                        "lane {lane} ended after {chunks} chunks (received {received}, \
                         planned {expected})"
                    )))
                }
                Reply::Refused(refusal) => return Err(self.refused(refusal)),
                Reply::Manifest(_) => {
                    return Err(self.malformed("a manifest in the middle of a stream"))
                }
            }
        }
    }

    fn transport(&self, error: TransportError) -> RecoveryError {
        if link::is_connection_loss(&error) {
            RecoveryError::SourceLost {
                address: self.address.clone(),
                reason: error.to_string(),
            }
        } else {
            self.malformed(error.to_string())
        }
    }

    fn malformed(&self, reason: impl Into<String>) -> RecoveryError {
        RecoveryError::Malformed {
            address: self.address.clone(),
            reason: reason.into(),
        }
    }

    fn refused(&self, refusal: Refusal) -> RecoveryError {
        let address = self.address.clone();
        match refusal {
            Refusal::StepMismatch { requested, serving } => RecoveryError::StepMismatch {
                address,
                requested,
                serving,
            },
            Refusal::NotServing { requested } => RecoveryError::NotServing {
                address,
                requested,
                waited: self.options.wait,
            },
            Refusal::BadRequest { reason } => RecoveryError::Refused { address, reason },
        }
    }
}

/// Fresh destinations, one per tensor of the manifest (zeroed pages: no
/// pass over the bytes before they arrive).
fn allocate_destinations(manifest: &Manifest) -> Result<Vec<Arc<Storage>>, RecoveryError> {
    manifest
        .tensors
        .iter()
        .map(|meta| {
            let len = usize::try_from(meta.byte_len).map_err(|_| RecoveryError::Destination {
                reason: format!("tensor {:?} does not fit in memory", meta.name),
            })?;
            Storage::zeroed(len)
                .map(Arc::new)
                .map_err(|error| RecoveryError::Destination {
                    reason: format!("tensor {:?}: {error}", meta.name),
                })
        })
        .collect()
}

/// The storages of `state`'s tensors, checked against the manifest and
/// taken for exclusive writing.
fn destinations_from(
    manifest: &Manifest,
    state: CheckpointState,
) -> Result<Vec<Arc<Storage>>, RecoveryError> {
    let mismatch = |reason: String| RecoveryError::Destination { reason };
    if state.tensors.len() != manifest.tensors.len() {
        return Err(mismatch(format!(
            "{} destination tensors for a checkpoint of {}",
            state.tensors.len(),
            manifest.tensors.len()
        )));
    }
    let mut storages = Vec::with_capacity(state.tensors.len());
    for ((name, tensor), meta) in state.tensors.into_iter().zip(&manifest.tensors) {
        if name != meta.name || tensor.dtype() != meta.dtype || tensor.shape() != meta.shape {
            return Err(mismatch(format!(
                "destination {name:?} ({} {:?}) where the checkpoint has {:?} ({} {:?})",
                tensor.dtype(),
                tensor.shape(),
                meta.name,
                meta.dtype,
                meta.shape
            )));
        }
        if !tensor.is_contiguous() {
            return Err(mismatch(format!("destination {name:?} is not contiguous")));
        }
        let mut storage = Arc::clone(tensor.storage());
        drop(tensor);
        if Arc::get_mut(&mut storage).is_none() {
            return Err(mismatch(format!(
                "destination {name:?} shares its storage with other tensors"
            )));
        }
        storages.push(storage);
    }
    Ok(storages)
}

/// The destinations of one fetch, written in place by the lanes.
struct Landing {
    tensors: Vec<LandingTensor>,
}

struct LandingTensor {
    /// Keeps the memory alive; nothing else reads or writes it while the
    /// fetch runs.
    storage: Arc<Storage>,
    /// The storage's first byte, taken from exclusive access.
    base: NonNull<u8>,
    dtype: DType,
    len: u64,
}

// SAFETY: `Landing` owns its storages (each `Arc` was exclusively owned
// when `base` was taken, and no other handle to them exists until the
// `Landing` is unwrapped). Writes through `base` happen only through
// `ChunkBuffer`s, and the chunk plan hands every byte range out at most
// once, so concurrent writers on different threads never overlap.
unsafe impl Send for Landing {}
// SAFETY: see above; shared access only hands out disjoint ranges.
unsafe impl Sync for Landing {}

impl Landing {
    fn new(manifest: &Manifest, storages: Vec<Arc<Storage>>) -> Result<Self, RecoveryError> {
        let mut tensors = Vec::with_capacity(storages.len());
        for (meta, mut storage) in manifest.tensors.iter().zip(storages) {
            let exclusive =
                Arc::get_mut(&mut storage).ok_or_else(|| RecoveryError::Destination {
                    reason: format!("destination {:?} is shared", meta.name),
                })?;
            if exclusive.len() as u64 != meta.byte_len {
                return Err(RecoveryError::Destination {
                    reason: format!(
                        "destination {:?} holds {} bytes, the checkpoint {}",
                        meta.name,
                        exclusive.len(),
                        meta.byte_len
                    ),
                });
            }
            let base = NonNull::new(exclusive.as_bytes_mut().as_mut_ptr()).ok_or_else(|| {
                RecoveryError::Destination {
                    reason: format!("destination {:?} has no memory", meta.name),
                }
            })?;
            tensors.push(LandingTensor {
                storage,
                base,
                dtype: meta.dtype,
                len: meta.byte_len,
            });
        }
        Ok(Self { tensors })
    }
}

/// Where a received chunk landed (what the receive hook's buffer finishes
/// as).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Landed {
    index: u64,
    tensor: usize,
    offset: u64,
}

/// A lane's receive hook: hands out the place of the next planned chunk.
#[derive(Default)]
struct LaneAllocator {
    plan: Mutex<Option<LanePlan>>,
}

struct LanePlan {
    landing: Arc<Landing>,
    chunks: VecDeque<ChunkSpec>,
}

impl LaneAllocator {
    fn plan(&self) -> MutexGuard<'_, Option<LanePlan>> {
        self.plan.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn arm(&self, landing: &Arc<Landing>, chunks: impl Iterator<Item = ChunkSpec>) {
        *self.plan() = Some(LanePlan {
            landing: Arc::clone(landing),
            chunks: chunks.collect(),
        });
    }
}

impl Allocator for LaneAllocator {
    fn allocate(
        &self,
        descriptor: &TensorDescriptor,
    ) -> Result<Box<dyn RecvBuffer>, TransportError> {
        let mut guard = self.plan();
        let plan = guard.as_mut().ok_or_else(|| {
            TransportError::Alloc("a tensor arrived before the manifest".to_owned())
        })?;
        let chunk = plan.chunks.pop_front().ok_or_else(|| {
            TransportError::Alloc("a chunk arrived after every planned one".to_owned())
        })?;
        let tensor = &plan.landing.tensors[chunk.tensor];
        let element = tensor.dtype.size() as u64;
        let fits = descriptor.device == Device::Cpu
            && descriptor.dtype == tensor.dtype
            && descriptor.byte_len == chunk.len
            && descriptor.shape[..] == [(chunk.len / element) as i64]
            && descriptor.strides[..] == [1]
            && descriptor.storage_offset == 0
            && chunk.offset + chunk.len <= tensor.len;
        if !fits {
            return Err(TransportError::Alloc(format!(
                "chunk {} is not the planned one: got {} {:?} of {} bytes, \
                 planned {} bytes of a {} tensor",
                chunk.index,
                descriptor.dtype,
                descriptor.shape,
                descriptor.byte_len,
                chunk.len,
                tensor.dtype
            )));
        }
        Ok(Box::new(ChunkBuffer {
            landing: Arc::clone(&plan.landing),
            chunk,
        }))
    }
}

/// One chunk's place in its destination tensor.
struct ChunkBuffer {
    landing: Arc<Landing>,
    chunk: ChunkSpec,
}

impl RecvBuffer for ChunkBuffer {
    fn as_mut_bytes(&mut self) -> &mut [u8] {
        let tensor = &self.landing.tensors[self.chunk.tensor];
        // SAFETY: `base` points at `tensor.len` bytes kept alive by the
        // `Arc<Landing>` this buffer holds; `offset + len <= tensor.len` was
        // checked when the buffer was made; the plan gives this range to
        // this buffer alone, and the returned borrow is tied to `&mut self`,
        // so no other reference to these bytes exists while it lives.
        unsafe {
            std::slice::from_raw_parts_mut(
                tensor.base.as_ptr().add(self.chunk.offset as usize),
                self.chunk.len as usize,
            )
        }
    }

    fn finish(self: Box<Self>) -> Result<Box<dyn Any + Send>, TransportError> {
        Ok(Box::new(Landed {
            index: self.chunk.index,
            tensor: self.chunk.tensor,
            offset: self.chunk.offset,
        }))
    }
}
