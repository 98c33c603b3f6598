//! The allreduce's data path over a configured group's connections: the
//! reduce-scatter, then the allgather, each segment streamed to its
//! destination in chunks of [`CHUNK`] values.
//!
//! Chunks keep the memory a round touches small and reused. A chunk is
//! staged for sending in (and received into) buffers of the transport's
//! [`BufferPool`], which are resident after the first round, so a large
//! allreduce takes no page faults; it is reduced, or copied into place,
//! while it is still in cache; and no buffer the size of the caller's is
//! made. A sender runs at most [`WINDOW`] chunks ahead of its own
//! receiving, so the two directions of every connection advance together
//! and the staging buffers stay few (and warm). The allreduce ends with a
//! `Done` from every member ([`finish`]): a member returns only once no
//! peer needs anything more from its memory.
//!
//! The arithmetic is [`reduce_in_place`]'s: each chunk of this member's
//! segment is reduced from every member's contribution in replica-rank
//! order, the same bits as
//! [`reduce_in_rank_order`](super::reduce_in_rank_order).

use std::sync::Arc;

use ferry_transport::{BufferPool, IncomingMessage, OutgoingMessage, RawTensor, Storage};
use ferry_wire::{DType, Device, MessageKind, TensorDescriptor};
use futures::future::try_join_all;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::peer::{peer_error, protocol, Peer, Reader, Writer};
use super::reduce::{reduce_in_place, segment, ReduceOp};
use super::CollectiveError;
use crate::recovery::link;

/// One chunk of a segment of an allreduce.
const KIND_DATA: MessageKind = ferry_wire::kinds::FT_COLLECTIVE_DATA;

/// Values per chunk (512 KiB of `f32`): a few chunks fit in a core's L2
/// cache, the staging buffers come from the pool (at least
/// [`POOL_MIN`](ferry_transport::POOL_MIN)), and a `cma` copy this small
/// runs on the task's own thread.
const CHUNK: usize = 128 << 10;

/// Chunks a sender may send beyond those its own side has received.
const WINDOW: usize = 4;

/// The reduce-scatter phase: member `k` receives every segment `k`.
const REDUCE_SCATTER: u8 = 0;
/// The allgather phase: every member receives every reduced segment.
const ALLGATHER: u8 = 1;

/// Names one chunk on the wire: the allreduce (`seq`), its phase, the
/// segment (by the rank that reduces it) and the chunk's index in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct DataHeader {
    seq: u64,
    phase: u8,
    segment: u64,
    chunk: u64,
}

/// A data message's payload.
#[derive(Debug, Serialize, Deserialize)]
enum Data {
    /// One chunk of a segment (its values out of band).
    Chunk(DataHeader, RawTensor),
    /// The sender has received every chunk of allreduce `seq` (and, on the
    /// same connection just before, released them): it needs nothing more
    /// from the receiver's memory.
    Done(u64),
}

/// A peer's sending half.
struct Outgoing<'a> {
    rank: usize,
    replica_id: &'a str,
    writer: &'a mut Writer,
}

/// A peer's receiving half.
struct Incoming<'a> {
    rank: usize,
    replica_id: &'a str,
    reader: &'a mut Reader,
}

/// Allreduce number `seq` of the group: both phases over `peers` (every
/// member but this one, rank `me` of `world_size`, by ascending rank).
pub(super) async fn run_allreduce(
    peers: &mut [Peer],
    (seq, me, world_size): (u64, usize, usize),
    data: &mut [f32],
    op: ReduceOp,
) -> Result<(), CollectiveError> {
    let mut segments = split_segments(data, world_size);
    let mine = std::mem::take(&mut segments[me]);
    // Like `peers`: by ascending rank, without this member.
    let mut theirs: Vec<&mut [f32]> = segments
        .into_iter()
        .enumerate()
        .filter_map(|(rank, values)| (rank != me).then_some(values))
        .collect();
    let mut outgoing = Vec::with_capacity(peers.len());
    let mut incoming = Vec::with_capacity(peers.len());
    for peer in peers {
        let Peer {
            rank,
            replica_id,
            reader,
            writer,
        } = peer;
        outgoing.push(Outgoing {
            rank: *rank,
            replica_id,
            writer,
        });
        incoming.push(Incoming {
            rank: *rank,
            replica_id,
            reader,
        });
    }

    let sources: Vec<&[f32]> = theirs.iter().map(|values| &**values).collect();
    reduce_scatter(&mut outgoing, &mut incoming, (seq, me), mine, &sources, op).await?;
    allgather(&mut outgoing, &mut incoming, (seq, me), mine, &mut theirs).await?;
    finish(&mut outgoing, &mut incoming, seq).await
}

/// Tells every peer that this member has everything, and waits until every
/// peer says the same. A peer pulls chunks out of band (the `cma` channel
/// reads this process's staging buffers) after this side has written them:
/// without this exchange a member could return, and exit, while a peer is
/// still copying from it. The releases of the chunks copied here go out
/// with the `Done` (a release precedes the messages of its batch), so the
/// staging buffers go back to the pools before the allreduce returns.
async fn finish(
    outgoing: &mut [Outgoing<'_>],
    incoming: &mut [Incoming<'_>],
    seq: u64,
) -> Result<(), CollectiveError> {
    let done = link::message(KIND_DATA, &Data::Done(seq)).map_err(|error| {
        CollectiveError::InvalidQuorum {
            reason: format!("cannot encode the end of an allreduce: {error}"),
        }
    })?;
    let done = &done;
    let exchanges = outgoing
        .iter_mut()
        .zip(incoming.iter_mut())
        .map(|(to, from)| async move {
            let send = async {
                to.writer
                    .write(done)
                    .await
                    .map_err(|error| peer_error(to.rank, to.replica_id, error))
            };
            let receive = async {
                match receive_data(from).await? {
                    Data::Done(got) if got == seq => Ok(()),
                    other => Err(protocol(
                        from.rank,
                        from.replica_id,
                        format!(
                            "expected the end of allreduce {seq}, got {}",
                            describe(&other)
                        ),
                    )),
                }
            };
            tokio::try_join!(send, receive).map(|_| ())
        });
    try_join_all(exchanges).await?;
    Ok(())
}

/// `data` cut into its `world_size` segments ([`segment`]), in rank order.
fn split_segments(data: &mut [f32], world_size: usize) -> Vec<&mut [f32]> {
    let len = data.len();
    let mut rest = data;
    let mut segments = Vec::with_capacity(world_size);
    for k in 0..world_size {
        let (head, tail) =
            std::mem::take(&mut rest).split_at_mut(segment(len, world_size, k).len());
        segments.push(head);
        rest = tail;
    }
    segments
}

/// Sends every peer its segment of the input (`sources[i]` to
/// `outgoing[i]`), and reduces this member's segment `mine` in place,
/// chunk by chunk, as the chunks of every peer come in.
async fn reduce_scatter(
    outgoing: &mut [Outgoing<'_>],
    incoming: &mut [Incoming<'_>],
    (seq, me): (u64, usize),
    mine: &mut [f32],
    sources: &[&[f32]],
    op: ReduceOp,
) -> Result<(), CollectiveError> {
    let (received, gate) = watch::channel(0usize);
    let sends = outgoing.iter_mut().zip(sources).map(|(peer, values)| {
        let header = DataHeader {
            seq,
            phase: REDUCE_SCATTER,
            segment: peer.rank as u64,
            chunk: 0,
        };
        send_chunks(peer, header, values, gate.clone())
    });
    let receive = async {
        for (index, out) in mine.chunks_mut(CHUNK).enumerate() {
            let header = DataHeader {
                seq,
                phase: REDUCE_SCATTER,
                segment: me as u64,
                chunk: index as u64,
            };
            let len = out.len();
            let chunks = try_join_all(
                incoming
                    .iter_mut()
                    .map(|peer| receive_chunk(peer, header, len)),
            )
            .await?;
            let contributions: Vec<&[f32]> = chunks.iter().map(Chunk::values).collect();
            reduce_in_place(out, me, &contributions, op);
            received.send_replace(index + 1);
        }
        received.send_replace(usize::MAX);
        Ok(())
    };
    tokio::try_join!(try_join_all(sends), receive)?;
    Ok(())
}

/// Sends every peer this member's reduced segment `mine`, and copies each
/// peer's reduced segment into `theirs` (by ascending peer rank), chunk by
/// chunk.
async fn allgather(
    outgoing: &mut [Outgoing<'_>],
    incoming: &mut [Incoming<'_>],
    (seq, me): (u64, usize),
    mine: &[f32],
    theirs: &mut [&mut [f32]],
) -> Result<(), CollectiveError> {
    let transfers = outgoing
        .iter_mut()
        .zip(incoming.iter_mut())
        .zip(theirs.iter_mut())
        .map(|((to, from), dest)| async move {
            let (received, gate) = watch::channel(0usize);
            let header = DataHeader {
                seq,
                phase: ALLGATHER,
                segment: me as u64,
                chunk: 0,
            };
            let send = send_chunks(to, header, mine, gate);
            let receive = async {
                for (index, out) in dest.chunks_mut(CHUNK).enumerate() {
                    let header = DataHeader {
                        seq,
                        phase: ALLGATHER,
                        segment: from.rank as u64,
                        chunk: index as u64,
                    };
                    let chunk = receive_chunk(from, header, out.len()).await?;
                    out.copy_from_slice(chunk.values());
                    received.send_replace(index + 1);
                }
                received.send_replace(usize::MAX);
                Ok(())
            };
            tokio::try_join!(send, receive).map(|_| ())
        });
    try_join_all(transfers).await?;
    Ok(())
}

/// Sends `values` to `peer` in chunks (`header` with each chunk's index),
/// chunk `i` once `received` (this side's progress) is past `i - WINDOW`.
async fn send_chunks(
    peer: &mut Outgoing<'_>,
    header: DataHeader,
    values: &[f32],
    mut received: watch::Receiver<usize>,
) -> Result<(), CollectiveError> {
    for (index, chunk) in values.chunks(CHUNK).enumerate() {
        // The sender lives as long as this future's caller: never an error.
        let _ = received
            .wait_for(|&done| done.saturating_add(WINDOW) > index)
            .await;
        let header = DataHeader {
            chunk: index as u64,
            ..header
        };
        let message = chunk_message(header, chunk)?;
        peer.writer
            .write(&message)
            .await
            .map_err(|error| peer_error(peer.rank, peer.replica_id, error))?;
    }
    Ok(())
}

/// A chunk's message: `values` copied into a staging buffer of the pool,
/// which goes back to the pool once the transport is done with it.
fn chunk_message(header: DataHeader, values: &[f32]) -> Result<OutgoingMessage, CollectiveError> {
    let wrap = |error: ferry_transport::TransportError| CollectiveError::InvalidQuorum {
        reason: format!("cannot stage a chunk: {error}"),
    };
    let mut storage: Storage = BufferPool::global()
        .storage(std::mem::size_of_val(values))
        .map_err(wrap)?;
    // SAFETY: `f32` is plain data without padding: its bytes are
    // initialised, and the view lives no longer than `values`.
    let bytes = unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    };
    storage.as_bytes_mut().copy_from_slice(bytes);
    let descriptor = TensorDescriptor::contiguous(DType::F32, &[values.len() as i64], Device::Cpu);
    let tensor = RawTensor::from_storage(Arc::new(storage), descriptor).map_err(wrap)?;
    link::message(KIND_DATA, &Data::Chunk(header, tensor)).map_err(|error| {
        CollectiveError::InvalidQuorum {
            reason: format!("cannot encode a chunk: {error}"),
        }
    })
}

/// A received chunk, checked to hold contiguous `f32` values.
struct Chunk(RawTensor);

impl Chunk {
    fn values(&self) -> &[f32] {
        // `receive_chunk` checked that the tensor is contiguous `f32`.
        self.0.as_slice::<f32>().unwrap_or_default()
    }
}

/// Receives the chunk `expected` names, `len` values, from `peer`.
async fn receive_chunk(
    peer: &mut Incoming<'_>,
    expected: DataHeader,
    len: usize,
) -> Result<Chunk, CollectiveError> {
    let data = receive_data(peer).await?;
    check_chunk(data, expected, len).map_err(|reason| protocol(peer.rank, peer.replica_id, reason))
}

/// The next data message from `peer`.
async fn receive_data(peer: &mut Incoming<'_>) -> Result<Data, CollectiveError> {
    let message = match peer.reader.read().await {
        Ok(Some(message)) => message,
        Ok(None) => {
            return Err(CollectiveError::PeerLost {
                rank: peer.rank as u64,
                replica_id: peer.replica_id.to_owned(),
                reason: "connection closed".to_owned(),
            })
        }
        Err(error) => return Err(peer_error(peer.rank, peer.replica_id, error)),
    };
    decode(message).map_err(|reason| protocol(peer.rank, peer.replica_id, reason))
}

fn decode(message: IncomingMessage) -> Result<Data, String> {
    if message.header.kind != KIND_DATA {
        return Err(format!(
            "expected allreduce data, got a {} message",
            message.header.kind
        ));
    }
    link::decode(message).map_err(|error| format!("bad allreduce data: {error}"))
}

/// What a data message is, for errors.
fn describe(data: &Data) -> String {
    match data {
        Data::Chunk(header, _) => format!("{header:?}"),
        Data::Done(seq) => format!("the end of allreduce {seq}"),
    }
}

fn check_chunk(data: Data, expected: DataHeader, len: usize) -> Result<Chunk, String> {
    let tensor = match data {
        Data::Chunk(header, tensor) if header == expected => tensor,
        other => return Err(format!("got {}, expected {expected:?}", describe(&other))),
    };
    if tensor.dtype() != DType::F32
        || tensor.shape() != [len as i64]
        || tensor.as_slice::<f32>().is_none()
    {
        return Err(format!(
            "chunk is {} {:?}, expected {len} contiguous f32 values",
            tensor.dtype(),
            tensor.shape()
        ));
    }
    Ok(Chunk(tensor))
}
