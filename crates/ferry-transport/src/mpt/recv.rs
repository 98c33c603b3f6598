//! The receiving side: one reader task per lane, writing chunks straight
//! into registered destinations.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use ferry_wire::WireError;
use tokio::io::AsyncReadExt;
use tokio::net::tcp::OwnedReadHalf;

use super::Lane;
use crate::auth::RecordReader;
use tokio::sync::{oneshot, watch};
use tokio::task::AbortHandle;

use super::{lock, split, ChunkHeader, Failure, CHUNK_HEADER_LEN};
use crate::{RecvBuffer, TransportError};

type Reply = oneshot::Sender<Result<Box<dyn RecvBuffer>, TransportError>>;

/// A registered destination, shared by the lane tasks that write into it.
///
/// The buffer is held as a raw pointer taken from its `Box`, and its bytes
/// as a raw pointer taken once from `as_mut_bytes`: lane tasks write
/// disjoint ranges through the latter while nothing else touches the buffer.
/// The buffer goes back into a `Box` only when the `Dest` is the last
/// reference (every lane task is done with it), or is dropped with it.
struct Dest {
    buffer: NonNull<dyn RecvBuffer>,
    bytes: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is `Send`, and is only touched (turned back into a Box,
// or dropped) by whoever holds the last `Arc<Dest>`, i.e. with exclusive
// access. Shared access only writes bytes, each range by one lane task
// (`chunk_bytes`).
unsafe impl Send for Dest {}
// SAFETY: see above; `&Dest` gives nothing but the disjoint-range writes.
unsafe impl Sync for Dest {}

impl Dest {
    fn new(buffer: Box<dyn RecvBuffer>) -> Self {
        let raw = Box::into_raw(buffer);
        // SAFETY: `raw` comes from `Box::into_raw`, so it is valid and
        // unaliased; the `&mut` lives only for this call.
        let bytes = unsafe { (*raw).as_mut_bytes() };
        let len = bytes.len();
        let bytes = NonNull::new(bytes.as_mut_ptr()).unwrap_or(NonNull::dangling());
        // SAFETY: `Box::into_raw` never returns null.
        let buffer = unsafe { NonNull::new_unchecked(raw) };
        Self { buffer, bytes, len }
    }

    /// The bytes `offset..offset + len` of the destination, to be written.
    ///
    /// # Safety
    ///
    /// The range must be in bounds, and no other live slice from this
    /// `Dest` may overlap it (each lane writes only the range the chunk plan
    /// gives it, and lanes of one tensor are distinct).
    #[allow(clippy::mut_from_ref)]
    unsafe fn chunk_bytes(&self, offset: usize, len: usize) -> &mut [u8] {
        debug_assert!(offset.checked_add(len).is_some_and(|end| end <= self.len));
        // SAFETY: in bounds of the `len` bytes `as_mut_bytes` returned (by
        // the caller's promise), which the buffer (owned by this Dest, so
        // alive while `&self` is) keeps valid; disjoint from every other
        // live slice (the caller's promise), so the `&mut` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.bytes.as_ptr().add(offset), len) }
    }

    fn into_box(self) -> Box<dyn RecvBuffer> {
        let me = ManuallyDrop::new(self);
        // SAFETY: the pointer came from `Box::into_raw` and, `self` being
        // consumed without running Drop, is turned back into a Box once.
        unsafe { Box::from_raw(me.buffer.as_ptr()) }
    }
}

impl Drop for Dest {
    fn drop(&mut self) {
        // SAFETY: as in `into_box`; Drop runs at most once and only when
        // `into_box` did not.
        drop(unsafe { Box::from_raw(self.buffer.as_ptr()) });
    }
}

/// A tensor registered and not yet complete.
struct Entry {
    dest: Arc<Dest>,
    byte_len: u64,
    /// Bit `l` set: lane `l` still has to deliver its chunk.
    remaining: u64,
    reply: Option<Reply>,
}

struct State {
    pending: BTreeMap<u64, Entry>,
    last_registered: Option<u64>,
    /// Bit `l` set: lane `l` ended cleanly (its sender closed it).
    ended: u64,
    failure: Option<Failure>,
}

struct Shared {
    peer: String,
    lanes: usize,
    state: Mutex<State>,
    /// Bumped after every registration and on failure; lane tasks that wait
    /// for a registration watch it.
    changed: watch::Sender<u64>,
    tasks: Mutex<Vec<AbortHandle>>,
}

/// Why a lane task stops.
enum Stop {
    /// The receiver failed already (its error is kept).
    Stopped,
    /// This lane found the failure.
    Fail(Failure),
}

impl From<Failure> for Stop {
    fn from(f: Failure) -> Self {
        Stop::Fail(f)
    }
}

impl Shared {
    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Keeps the first failure, fails every pending receive, and stops the
    /// lane tasks.
    fn fail(&self, failure: Failure) {
        let pending = {
            let mut st = lock(&self.state);
            if st.failure.is_none() {
                tracing::debug!(peer = %self.peer, ?failure, "mpt receiver failed");
                st.failure = Some(failure);
            }
            std::mem::take(&mut st.pending)
        };
        let failure = self.failure().unwrap_or(Failure::Closed);
        for (_, entry) in pending {
            if let Some(reply) = entry.reply {
                let _ = reply.send(Err(failure.to_error(&self.peer)));
            }
            // A lane task still writing into `entry.dest` holds its own
            // reference: the buffer is freed only once that task is gone.
        }
        self.bump();
        for task in lock(&self.tasks).iter() {
            task.abort();
        }
    }

    fn failure(&self) -> Option<Failure> {
        lock(&self.state).failure.clone()
    }

    fn register(&self, seq: u64, dest: Box<dyn RecvBuffer>) -> Result<Registered, TransportError> {
        let dest = Dest::new(dest);
        let byte_len = dest.len as u64;
        let mut needed = 0u64;
        for chunk in split(seq, byte_len, self.lanes) {
            needed |= 1 << chunk.lane;
        }
        let mut st = lock(&self.state);
        if let Some(failure) = &st.failure {
            return Err(failure.to_error(&self.peer));
        }
        if let Some(last) = st.last_registered {
            if seq <= last {
                return Err(TransportError::Io {
                    peer: self.peer.clone(),
                    source: io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("mpt seq {seq} registered after seq {last}: seqs must increase"),
                    ),
                });
            }
        }
        st.last_registered = Some(seq);
        if needed & st.ended != 0 {
            drop(st);
            self.fail(Failure::Closed);
            return Err(TransportError::Closed {
                peer: self.peer.clone(),
            });
        }
        if needed == 0 {
            drop(st);
            self.bump();
            return Ok(Registered::Done(dest.into_box()));
        }
        let (tx, rx) = oneshot::channel();
        st.pending.insert(
            seq,
            Entry {
                dest: Arc::new(dest),
                byte_len,
                remaining: needed,
                reply: Some(tx),
            },
        );
        drop(st);
        self.bump();
        Ok(Registered::Pending(rx))
    }

    /// Waits until `head.seq` is registered, checks the header against the
    /// plan, and returns the destination.
    async fn destination(
        &self,
        changed: &mut watch::Receiver<u64>,
        lane: usize,
        head: ChunkHeader,
    ) -> Result<Arc<Dest>, Stop> {
        let bit = 1u64 << lane;
        loop {
            changed.borrow_and_update();
            {
                let st = lock(&self.state);
                if st.failure.is_some() {
                    return Err(Stop::Stopped);
                }
                if let Some((&skipped, _)) = st
                    .pending
                    .range(..head.seq)
                    .find(|(_, e)| e.remaining & bit != 0)
                {
                    return Err(malformed(format!(
                        "mpt lane {lane} sent a chunk of tensor {} before its chunk of tensor {skipped}",
                        head.seq
                    )));
                }
                if st.last_registered.is_some_and(|last| last >= head.seq) {
                    let entry = st
                        .pending
                        .get(&head.seq)
                        .filter(|e| e.remaining & bit != 0)
                        .ok_or_else(|| {
                            malformed(format!(
                                "mpt lane {lane} sent a chunk of tensor {} that it does not carry \
                                 (or carried already)",
                                head.seq
                            ))
                        })?;
                    let expected = split(head.seq, entry.byte_len, self.lanes)
                        .find(|c| c.lane == lane)
                        .ok_or_else(|| malformed("mpt chunk plan disagrees with itself".into()))?;
                    if head
                        .offset
                        .checked_add(head.len)
                        .is_none_or(|end| end > entry.byte_len)
                    {
                        return Err(Stop::Fail(Failure::Malformed(WireError::TooLarge {
                            what: "mpt chunk end",
                            len: head.offset.saturating_add(head.len),
                            max: entry.byte_len,
                        })));
                    }
                    if (head.offset, head.len) != (expected.offset, expected.len) {
                        return Err(malformed(format!(
                            "mpt lane {lane} sent bytes {}..{} of tensor {}; the plan gives it {}..{}",
                            head.offset,
                            head.offset + head.len,
                            head.seq,
                            expected.offset,
                            expected.offset + expected.len
                        )));
                    }
                    return Ok(entry.dest.clone());
                }
            }
            if changed.changed().await.is_err() {
                return Err(Stop::Stopped);
            }
        }
    }

    /// Marks lane `lane`'s chunk of `seq` in, handing the destination back
    /// when it was the last one.
    fn chunk_done(&self, lane: usize, seq: u64, dest: Arc<Dest>) -> Result<(), Stop> {
        // Dropped before the count goes down, so that whoever sees the count
        // reach zero holds the only other reference.
        drop(dest);
        let done = {
            let mut st = lock(&self.state);
            let Some(entry) = st.pending.get_mut(&seq) else {
                return Err(Stop::Stopped);
            };
            entry.remaining &= !(1u64 << lane);
            if entry.remaining != 0 {
                return Ok(());
            }
            st.pending.remove(&seq)
        };
        let Some(mut entry) = done else {
            return Ok(());
        };
        let dest = Arc::try_unwrap(entry.dest).map_err(|_| {
            Failure::Invalid("an mpt destination is still shared after its last chunk".into())
        })?;
        if let Some(reply) = entry.reply.take() {
            // The receive future may be gone: the buffer is dropped then.
            let _ = reply.send(Ok(dest.into_box()));
        }
        Ok(())
    }

    /// Lane `lane` ended between chunks: fine unless a tensor still needs it.
    fn lane_ended(&self, lane: usize) -> Result<(), Stop> {
        let bit = 1u64 << lane;
        let mut st = lock(&self.state);
        st.ended |= bit;
        if st.pending.values().any(|e| e.remaining & bit != 0) {
            return Err(Stop::Fail(Failure::Closed));
        }
        Ok(())
    }
}

fn malformed(msg: String) -> Stop {
    Stop::Fail(Failure::Malformed(WireError::InvalidDescriptor(msg)))
}

enum Registered {
    Done(Box<dyn RecvBuffer>),
    Pending(oneshot::Receiver<Result<Box<dyn RecvBuffer>, TransportError>>),
}

/// Receives tensors from the lanes of a multi-lane TCP channel, writing each
/// chunk straight into the destination registered for its tensor.
///
/// Dropping the receiver fails every pending receive with
/// [`TransportError::Closed`] and aborts the lane tasks; a destination that
/// a lane task is writing into stays alive until that task is gone.
pub struct MptReceiver {
    shared: Arc<Shared>,
}

impl MptReceiver {
    /// Starts one reader task per lane (in index order, as
    /// [`LaneListener::accept`](super::LaneListener::accept) or
    /// [`connect_lanes`](super::connect_lanes) return them). `peer` names
    /// the other end in errors. Must be called within a Tokio runtime.
    ///
    /// No lane ever allocates: every chunk header is checked against a
    /// destination already allocated (under the main connection's limits),
    /// so the receiver takes no limits of its own.
    pub fn new(lanes: Vec<Lane>, peer: impl Into<String>) -> Self {
        let (changed, _) = watch::channel(0u64);
        let shared = Arc::new(Shared {
            peer: peer.into(),
            lanes: lanes.len(),
            state: Mutex::new(State {
                pending: BTreeMap::new(),
                last_registered: None,
                ended: 0,
                failure: None,
            }),
            changed,
            tasks: Mutex::new(Vec::with_capacity(lanes.len())),
        });
        if lanes.is_empty() || lanes.len() > super::MAX_LANES {
            shared.fail(Failure::Invalid(format!(
                "an mpt receiver needs 1 to {} lanes, got {}",
                super::MAX_LANES,
                lanes.len()
            )));
            return Self { shared };
        }
        {
            // Held while spawning so that a task failing at once finds every
            // handle to abort.
            let mut tasks = lock(&shared.tasks);
            for (lane, stream) in lanes.into_iter().enumerate() {
                let task = tokio::spawn(lane_reader(shared.clone(), lane, stream));
                tasks.push(task.abort_handle());
            }
        }
        Self { shared }
    }

    /// The peer's name, as used in errors.
    pub fn peer(&self) -> &str {
        &self.shared.peer
    }

    /// Number of lanes.
    pub fn lanes(&self) -> usize {
        self.shared.lanes
    }

    /// Registers `dest` (whose `as_mut_bytes()` length is the tensor's
    /// `byte_len`) as the destination of tensor `seq`, at once (before the
    /// future is polled); the future completes with the buffer once every
    /// chunk is in, and the caller then calls
    /// [`finish`](RecvBuffer::finish) on it.
    ///
    /// `seq`s must be registered in increasing order. Dropping the future
    /// does not stop the transfer: the lanes still fill the buffer (keeping
    /// the stream in step), which is then dropped. Fails with the kept
    /// error once the receiver has failed.
    pub fn receive(
        &self,
        seq: u64,
        dest: Box<dyn RecvBuffer>,
    ) -> impl Future<Output = Result<Box<dyn RecvBuffer>, TransportError>> + Send + 'static {
        let registered = self.shared.register(seq, dest);
        let peer = self.shared.peer.clone();
        async move {
            match registered? {
                Registered::Done(buffer) => Ok(buffer),
                Registered::Pending(rx) => rx.await.unwrap_or(Err(TransportError::Closed { peer })),
            }
        }
    }

    /// The error that stopped the receiver, if any.
    pub fn error(&self) -> Option<TransportError> {
        self.shared.failure().map(|f| f.to_error(&self.shared.peer))
    }
}

impl Drop for MptReceiver {
    fn drop(&mut self) {
        self.shared.fail(Failure::Closed);
    }
}

impl std::fmt::Debug for MptReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MptReceiver")
            .field("peer", &self.shared.peer)
            .field("lanes", &self.shared.lanes)
            .field("failure", &self.shared.failure())
            .finish()
    }
}

async fn lane_reader(shared: Arc<Shared>, lane: usize, stream: Lane) {
    match read_lane(&shared, lane, stream.reader).await {
        Ok(()) | Err(Stop::Stopped) => {}
        Err(Stop::Fail(failure)) => shared.fail(failure),
    }
}

async fn read_lane(
    shared: &Shared,
    lane: usize,
    mut stream: RecordReader<OwnedReadHalf>,
) -> Result<(), Stop> {
    let mut changed = shared.changed.subscribe();
    loop {
        let mut head = [0u8; CHUNK_HEADER_LEN];
        // A clean end is only possible before the first byte of a header.
        let first = stream.read(&mut head).await.map_err(|e| Failure::io(&e))?;
        if first == 0 {
            return shared.lane_ended(lane);
        }
        stream
            .read_exact(&mut head[first..])
            .await
            .map_err(|e| Failure::io(&e))?;
        let head = ChunkHeader::decode(&head);
        let dest = shared.destination(&mut changed, lane, head).await?;
        // `destination` checked offset + len <= the destination's length,
        // which is a usize.
        let (offset, len) = (head.offset as usize, head.len as usize);
        {
            // SAFETY: in bounds (checked by `destination`), and the plan gives
            // this range to this lane only, whose single task writes it once
            // (`remaining` bit set, cleared only after this write).
            let bytes = unsafe { dest.chunk_bytes(offset, len) };
            stream
                .read_exact(bytes)
                .await
                .map_err(|e| Failure::io(&e))?;
        }
        shared.chunk_done(lane, head.seq, dest)?;
    }
}
