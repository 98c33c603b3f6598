//! A connection to one peer of a process group, and the errors that name
//! the peer: shared by the group's set-up (`process_group`) and its data
//! path (`allreduce`).

use ferry_transport::{FrameReader, FrameWriter, TransportError};

use super::CollectiveError;
use crate::recovery::link::{self, ReadError};

/// A peer connection's reading half.
pub(super) type Reader = FrameReader<ferry_transport::PeerReader>;
/// A peer connection's writing half.
pub(super) type Writer = FrameWriter<ferry_transport::PeerWriter>;

/// A connection to one peer of the group.
pub(super) struct Peer {
    pub(super) rank: usize,
    pub(super) replica_id: String,
    pub(super) reader: Reader,
    pub(super) writer: Writer,
}

/// A transport error on the connection to `rank`: the peer lost, or a
/// protocol error when the connection is intact.
pub(super) fn peer_error(rank: usize, replica_id: &str, error: TransportError) -> CollectiveError {
    if link::is_connection_loss(&error) {
        CollectiveError::PeerLost {
            rank: rank as u64,
            replica_id: replica_id.to_owned(),
            reason: error.to_string(),
        }
    } else {
        protocol(rank, replica_id, error.to_string())
    }
}

/// Why a read with a deadline from `rank` produced no `what`.
pub(super) fn read_error(
    rank: usize,
    replica_id: &str,
    error: ReadError,
    what: &str,
) -> CollectiveError {
    match error {
        ReadError::Timeout => CollectiveError::PeerLost {
            rank: rank as u64,
            replica_id: replica_id.to_owned(),
            reason: format!("no {what} in time"),
        },
        ReadError::Closed => CollectiveError::PeerLost {
            rank: rank as u64,
            replica_id: replica_id.to_owned(),
            reason: format!("connection closed before {what}"),
        },
        ReadError::Transport(error) => peer_error(rank, replica_id, error),
    }
}

/// `rank` broke the protocol.
pub(super) fn protocol(rank: usize, replica_id: &str, reason: String) -> CollectiveError {
    CollectiveError::Protocol {
        rank: rank as u64,
        replica_id: replica_id.to_owned(),
        reason,
    }
}
