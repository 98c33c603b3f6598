//! What the protocol puts on the wire: fork data inside user messages, and
//! the control messages the workers exchange about forks.

use serde::{Deserialize, Serialize};

use super::ids::{ForkId, RRefId, WorkerId};

/// An RRef as it travels inside a message (an argument or a result): enough
/// for the receiver to build its own handle and tell the right workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkData {
    /// The worker that holds the value.
    pub owner: WorkerId,
    /// The RRef.
    pub rref_id: RRefId,
    /// The new user this message creates on its receiver.
    pub fork_id: ForkId,
    /// The sender: it keeps its own handle alive until the child is
    /// confirmed (G2).
    pub parent: WorkerId,
}

/// A control message. All of them are idempotent at the receiver (it drops
/// a copy it has seen by its sequence number) and retried by the sender
/// until acknowledged; none carries a user function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Control {
    /// A new user asks the owner to record it. The acknowledgement confirms
    /// the user.
    ForkRequest {
        /// The RRef.
        rref_id: RRefId,
        /// The new user.
        fork_id: ForkId,
    },
    /// A confirmed child tells its parent it may let go (G2).
    ChildAccept {
        /// The child.
        fork_id: ForkId,
    },
    /// A user is gone (G1).
    UserDelete {
        /// The RRef.
        rref_id: RRefId,
        /// The user.
        fork_id: ForkId,
    },
}

/// A control message with its per-destination sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    /// Increases by one per message from one sender to one receiver,
    /// starting at 1; a retry reuses it.
    pub seq: u64,
    /// The message.
    pub control: Control,
}

/// A control message the driver must deliver to `to`, retrying until the
/// receiver acknowledges it, then report with
/// [`RRefProtocol::handle_ack`](super::RRefProtocol::handle_ack).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// The receiver.
    pub to: WorkerId,
    /// The message.
    pub envelope: Envelope,
}
