//! The allreduce's data path over a configured group's connections: the
//! reduce-scatter and the allgather, each an exchange of segments with
//! every peer.

use ferry_transport::{IncomingMessage, OutgoingMessage, RawTensor};
use ferry_wire::{DType, MessageKind};
use serde::{Deserialize, Serialize};

use super::process_group::{peer_error, protocol, Group, Peer};
use super::reduce::{reduce_in_rank_order, segment, ReduceOp};
use super::CollectiveError;
use crate::recovery::link;

/// One segment of an allreduce.
const KIND_DATA: MessageKind = ferry_wire::kinds::FT_COLLECTIVE_DATA;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct DataHeader {
    seq: u64,
    phase: u8,
    segment: u64,
}

/// Both phases of the allreduce over the group's peers.
pub(super) async fn run_allreduce(
    group: &mut Group,
    data: &mut [f32],
    op: ReduceOp,
) -> Result<(), CollectiveError> {
    let me = group.rank;
    let world_size = group.replica_ids.len();
    let len = data.len();
    let seq = group.seq;
    let mine = segment(len, world_size, me);

    // Reduce-scatter: everyone sends member p its segment p.
    let mut outgoing = Vec::with_capacity(group.peers.len());
    for peer in &group.peers {
        let range = segment(len, world_size, peer.rank);
        outgoing.push(data_message(seq, 0, peer.rank, &data[range])?);
    }
    let received = exchange(&mut group.peers, outgoing, seq, 0, |_| (me, mine.len())).await?;
    let own = data[mine.clone()].to_vec();
    let mut contributions: Vec<&[f32]> = Vec::with_capacity(world_size);
    // `received` is in ascending peer rank: slot this member's own part in.
    for (peer, tensor) in &received {
        if contributions.len() == me {
            contributions.push(&own);
        }
        contributions.push(values(group, *peer, tensor, mine.len())?);
    }
    if contributions.len() == me {
        contributions.push(&own);
    }
    reduce_in_rank_order(&contributions, op, &mut data[mine.clone()]);

    // Allgather: everyone sends everyone its reduced segment.
    let reduced =
        RawTensor::from_slice(&data[mine.clone()], &[mine.len() as i64]).map_err(|error| {
            CollectiveError::InvalidQuorum {
                reason: format!("cannot wrap the reduced segment: {error}"),
            }
        })?;
    let mut outgoing = Vec::with_capacity(group.peers.len());
    for _ in &group.peers {
        let header = DataHeader {
            seq,
            phase: 1,
            segment: me as u64,
        };
        outgoing.push(
            link::message(KIND_DATA, &(header, &reduced)).map_err(|error| {
                CollectiveError::InvalidQuorum {
                    reason: format!("cannot encode a segment: {error}"),
                }
            })?,
        );
    }
    let received = exchange(&mut group.peers, outgoing, seq, 1, |peer| {
        (peer, segment(len, world_size, peer).len())
    })
    .await?;
    for (peer, tensor) in &received {
        let range = segment(len, world_size, *peer);
        let values = values(group, *peer, tensor, range.len())?;
        data[range].copy_from_slice(values);
    }
    Ok(())
}

/// A received segment's values, `len` of them.
fn values<'a>(
    group: &Group,
    peer: usize,
    tensor: &'a RawTensor,
    len: usize,
) -> Result<&'a [f32], CollectiveError> {
    tensor
        .as_slice::<f32>()
        .filter(|values| values.len() == len)
        .ok_or_else(|| {
            protocol(
                peer,
                group.replica_ids.get(peer).map_or("", String::as_str),
                format!("segment is not {len} contiguous f32 values"),
            )
        })
}

fn data_message(
    seq: u64,
    phase: u8,
    segment: usize,
    values: &[f32],
) -> Result<OutgoingMessage, CollectiveError> {
    let tensor = RawTensor::from_slice(values, &[values.len() as i64]).map_err(|error| {
        CollectiveError::InvalidQuorum {
            reason: format!("cannot wrap a segment: {error}"),
        }
    })?;
    let header = DataHeader {
        seq,
        phase,
        segment: segment as u64,
    };
    link::message(KIND_DATA, &(header, tensor)).map_err(|error| CollectiveError::InvalidQuorum {
        reason: format!("cannot encode a segment: {error}"),
    })
}

/// Sends `outgoing[i]` to `peers[i]` and receives one segment from each,
/// all at once; `due(peer rank)` is the (segment, length) due from that
/// peer. Returns the segments by ascending peer rank.
async fn exchange(
    peers: &mut [Peer],
    outgoing: Vec<OutgoingMessage>,
    seq: u64,
    phase: u8,
    due: impl Fn(usize) -> (usize, usize),
) -> Result<Vec<(usize, RawTensor)>, CollectiveError> {
    let transfers = peers.iter_mut().zip(outgoing).map(|(peer, message)| {
        let (segment, len) = due(peer.rank);
        let Peer {
            rank,
            replica_id,
            reader,
            writer,
        } = peer;
        let rank = *rank;
        let replica_id: &str = replica_id;
        async move {
            let send = async {
                writer
                    .write(&message)
                    .await
                    .map_err(|error| peer_error(rank, replica_id, error))
            };
            let receive = async {
                let message = match reader.read().await {
                    Ok(Some(message)) => message,
                    Ok(None) => {
                        return Err(CollectiveError::PeerLost {
                            rank: rank as u64,
                            replica_id: replica_id.to_owned(),
                            reason: "connection closed".to_owned(),
                        })
                    }
                    Err(error) => return Err(peer_error(rank, replica_id, error)),
                };
                let expected = DataHeader {
                    seq,
                    phase,
                    segment: segment as u64,
                };
                parse_segment(message, expected, len)
                    .map_err(|reason| protocol(rank, replica_id, reason))
            };
            let ((), tensor) = tokio::try_join!(send, receive)?;
            // Segments pulled out of band (the `cma` channel) are copied:
            // let the peer free them now rather than with its next write.
            writer
                .write_batch(&[])
                .await
                .map_err(|error| peer_error(rank, replica_id, error))?;
            Ok((rank, tensor))
        }
    });
    futures::future::try_join_all(transfers).await
}

fn parse_segment(
    message: IncomingMessage,
    expected: DataHeader,
    len: usize,
) -> Result<RawTensor, String> {
    if message.header.kind != KIND_DATA {
        return Err(format!(
            "expected a segment, got a {} message",
            message.header.kind
        ));
    }
    let (header, tensor): (DataHeader, RawTensor) =
        link::decode(message).map_err(|error| format!("bad segment: {error}"))?;
    if header != expected {
        return Err(format!("got {header:?}, expected {expected:?}"));
    }
    if tensor.dtype() != DType::F32 || tensor.shape() != [len as i64] || !tensor.is_contiguous() {
        return Err(format!(
            "segment is {} {:?}, expected f32 [{len}]",
            tensor.dtype(),
            tensor.shape()
        ));
    }
    Ok(tensor)
}
