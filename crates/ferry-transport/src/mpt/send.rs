//! The sending side: one writer task per lane, fed by a FIFO queue.

use std::io::{self, IoSlice};
use std::sync::{Arc, Mutex};

use ferry_wire::payload::OutgoingTensor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;

use super::{lock, split, ChunkHeader, Failure, Lane, CHUNK_HEADER_LEN};
use crate::auth::RecordWriter;

/// The writing half of a lane.
type LaneWriter = RecordWriter<OwnedWriteHalf>;
use crate::TransportError;

/// Most queue items one writer gathers into a single batch of `writev` calls.
const MAX_BATCH: usize = 64;
/// Most slices handed to one `writev` call (Linux allows 1024).
const MAX_IOV: usize = 512;

/// What a lane's writer task is asked to do.
enum Item {
    /// Write one chunk header and the chunk's bytes from the tensor's memory.
    Chunk {
        header: ChunkHeader,
        tensor: Arc<dyn OutgoingTensor>,
    },
    /// Answer once everything queued before has been written.
    Flush(oneshot::Sender<()>),
}

/// State shared by the sender and its lane tasks.
struct Shared {
    peer: String,
    failure: Mutex<Option<Failure>>,
    tasks: Mutex<Vec<AbortHandle>>,
}

impl Shared {
    fn failure(&self) -> Option<Failure> {
        lock(&self.failure).clone()
    }

    /// The kept error, or `Closed` when none was kept (a task is gone).
    fn error(&self) -> TransportError {
        self.failure()
            .unwrap_or(Failure::Closed)
            .to_error(&self.peer)
    }

    /// Keeps the first failure and stops every lane: the channel is broken.
    fn fail(&self, failure: Failure) {
        {
            let mut kept = lock(&self.failure);
            if kept.is_none() {
                tracing::debug!(peer = %self.peer, ?failure, "mpt sender failed");
                *kept = Some(failure);
            }
        }
        for task in lock(&self.tasks).iter() {
            task.abort();
        }
    }
}

/// Queues of the lanes, behind one lock so that every lane sees the chunks
/// in `seq` order.
struct Queues {
    last_seq: Option<u64>,
    lanes: Vec<mpsc::UnboundedSender<Item>>,
}

/// Sends tensors over the lanes of a multi-lane TCP channel.
///
/// [`send`](Self::send) only queues: each lane's task writes its chunks in
/// order, from the tensor's own memory, and keeps the tensor alive until
/// they are written. Dropping the sender aborts the lane tasks (queued
/// chunks are lost); [`flush`](Self::flush) first for a graceful end.
pub struct MptSender {
    shared: Arc<Shared>,
    queues: Mutex<Queues>,
}

impl MptSender {
    /// Starts one writer task per lane (the lanes come from
    /// [`connect_lanes`](super::connect_lanes) or
    /// [`LaneListener::accept`](super::LaneListener::accept), in index
    /// order). `peer` names the other end in errors. Must be called within a
    /// Tokio runtime.
    pub fn new(lanes: Vec<Lane>, peer: impl Into<String>) -> Self {
        let shared = Arc::new(Shared {
            peer: peer.into(),
            failure: Mutex::new(None),
            tasks: Mutex::new(Vec::with_capacity(lanes.len())),
        });
        let mut senders = Vec::with_capacity(lanes.len());
        {
            // Held while spawning so that a task failing at once finds every
            // handle to abort.
            let mut tasks = lock(&shared.tasks);
            for stream in lanes {
                let (tx, rx) = mpsc::unbounded_channel();
                senders.push(tx);
                let task = tokio::spawn(lane_writer(shared.clone(), stream, rx));
                tasks.push(task.abort_handle());
            }
        }
        if senders.is_empty() {
            shared.fail(Failure::Invalid(
                "an mpt sender needs at least one lane".into(),
            ));
        }
        Self {
            shared,
            queues: Mutex::new(Queues {
                last_seq: None,
                lanes: senders,
            }),
        }
    }

    /// The peer's name, as used in errors.
    pub fn peer(&self) -> &str {
        &self.shared.peer
    }

    /// Number of lanes.
    pub fn lanes(&self) -> usize {
        lock(&self.queues).lanes.len()
    }

    /// The error that stopped the sender, if any.
    pub fn error(&self) -> Option<TransportError> {
        self.shared.failure().map(|f| f.to_error(&self.shared.peer))
    }

    /// Queues `tensor`'s bytes as tensor number `seq`, split by
    /// [`split`]; returns at once. `seq` must be greater than
    /// every `seq` sent before, and `tensor.bytes()` must return the same
    /// bytes until they are written. Fails with the kept error once a lane
    /// has failed.
    pub fn send(&self, seq: u64, tensor: Arc<dyn OutgoingTensor>) -> Result<(), TransportError> {
        if let Some(failure) = self.shared.failure() {
            return Err(failure.to_error(&self.shared.peer));
        }
        let byte_len = tensor.bytes().len() as u64;
        let mut queues = lock(&self.queues);
        if let Some(last) = queues.last_seq {
            if seq <= last {
                return Err(TransportError::Io {
                    peer: self.shared.peer.clone(),
                    source: io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("mpt seq {seq} sent after seq {last}: seqs must increase"),
                    ),
                });
            }
        }
        queues.last_seq = Some(seq);
        for chunk in split(seq, byte_len, queues.lanes.len()) {
            let item = Item::Chunk {
                header: ChunkHeader {
                    seq,
                    offset: chunk.offset,
                    len: chunk.len,
                },
                tensor: tensor.clone(),
            };
            if queues.lanes[chunk.lane].send(item).is_err() {
                return Err(self.shared.error());
            }
        }
        Ok(())
    }

    /// Waits until every chunk queued before the call has been written to
    /// its socket. Fails with the kept error once a lane has failed.
    pub async fn flush(&self) -> Result<(), TransportError> {
        let waits = {
            let queues = lock(&self.queues);
            let mut waits = Vec::with_capacity(queues.lanes.len());
            for lane in &queues.lanes {
                let (tx, rx) = oneshot::channel();
                if lane.send(Item::Flush(tx)).is_err() {
                    return Err(self.shared.error());
                }
                waits.push(rx);
            }
            waits
        };
        for wait in waits {
            if wait.await.is_err() {
                return Err(self.shared.error());
            }
        }
        match self.shared.failure() {
            Some(failure) => Err(failure.to_error(&self.shared.peer)),
            None => Ok(()),
        }
    }
}

impl Drop for MptSender {
    fn drop(&mut self) {
        for task in lock(&self.shared.tasks).iter() {
            task.abort();
        }
    }
}

impl std::fmt::Debug for MptSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MptSender")
            .field("peer", &self.shared.peer)
            .field("lanes", &self.lanes())
            .field("failure", &self.shared.failure())
            .finish()
    }
}

/// A lane's writer: writes queued chunks in order and watches the read side
/// (the receiver never writes, so readable means closed or broken).
async fn lane_writer(shared: Arc<Shared>, lane: Lane, mut queue: mpsc::UnboundedReceiver<Item>) {
    let Lane {
        reader: mut read,
        writer: mut write,
    } = lane;
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut probe = [0u8; 1];
    loop {
        tokio::select! {
            biased;
            item = queue.recv() => {
                let Some(item) = item else { break };
                batch.push(item);
                while batch.len() < MAX_BATCH {
                    match queue.try_recv() {
                        Ok(item) => batch.push(item),
                        Err(_) => break,
                    }
                }
                if let Err(failure) = write_batch(&mut write, &batch).await {
                    shared.fail(failure);
                    return;
                }
                for item in batch.drain(..) {
                    if let Item::Flush(done) = item {
                        let _ = done.send(());
                    }
                }
            }
            read = read.read(&mut probe) => {
                shared.fail(match read {
                    Ok(0) => Failure::Closed,
                    Ok(_) => Failure::Io(
                        io::ErrorKind::InvalidData,
                        "the receiver wrote on an mpt lane".into(),
                    ),
                    Err(e) => Failure::io(&e),
                });
                return;
            }
        }
    }
    let _ = write.shutdown().await;
}

/// Writes a batch's chunks (headers and bytes) with vectored writes.
async fn write_batch(write: &mut LaneWriter, batch: &[Item]) -> Result<(), Failure> {
    let mut heads = Vec::with_capacity(batch.len());
    for item in batch {
        if let Item::Chunk { header, .. } = item {
            heads.push(header.encode());
        }
    }
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(heads.len() * 2);
    let mut heads_iter = heads.iter();
    for item in batch {
        let Item::Chunk { header, tensor } = item else {
            continue;
        };
        let bytes = usize::try_from(header.offset)
            .ok()
            .zip(usize::try_from(header.offset + header.len).ok())
            .and_then(|(start, end)| tensor.bytes().get(start..end))
            .ok_or_else(|| {
                Failure::Invalid(format!(
                    "tensor {} shrank to {} bytes while queued for sending",
                    header.seq,
                    tensor.bytes().len()
                ))
            })?;
        let head: &[u8; CHUNK_HEADER_LEN] = heads_iter
            .next()
            .ok_or_else(|| Failure::Invalid("mpt chunk header missing".into()))?;
        slices.push(IoSlice::new(head));
        slices.push(IoSlice::new(bytes));
    }
    let mut rest: &mut [IoSlice<'_>] = &mut slices;
    while !rest.is_empty() {
        let n = rest.len().min(MAX_IOV);
        let written = write
            .write_vectored(&rest[..n])
            .await
            .map_err(|e| Failure::io(&e))?;
        if written == 0 {
            return Err(Failure::Closed);
        }
        IoSlice::advance_slices(&mut rest, written);
    }
    // A sealed lane holds the last record until flushed.
    write.flush().await.map_err(|e| Failure::io(&e))
}
