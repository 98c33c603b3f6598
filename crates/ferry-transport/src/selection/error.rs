//! Why a selection could not be computed, used or agreed on.

use std::fmt;

use ferry_wire::{Device, PeerText};

/// Why a channel selection could not be computed, used or agreed on.
///
/// The fields holding the source device are spelled `r#source` in the
/// definition so that `thiserror` does not take them for the error's cause
/// (it treats a field plainly named `source` as one); everywhere else they
/// are written `source` as usual, e.g. `SelectionError::NoChannel { source,
/// target }`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectionError {
    /// One side's offer list names the same channel more than once.
    #[error(
        "channel {:?} is offered more than once in one worker's channel list",
        PeerText::new(.name)
    )]
    DuplicateChannel {
        /// The channel named twice.
        name: String,
    },
    /// One channel offer lists the same device more than once.
    #[error(
        "the offer of channel {:?} lists device {device} more than once",
        PeerText::new(.channel)
    )]
    DuplicateDevice {
        /// The channel whose offer is malformed.
        channel: String,
        /// The device listed twice.
        device: Device,
    },
    /// No channel qualifies for this (source device, target device) pair.
    #[error(
        "no channel carries tensors from {source} on the sender to {target} on the receiver: \
         no channel offered by both workers serves these devices with equal descriptors"
    )]
    NoChannel {
        /// Device of the tensor on the sending worker.
        r#source: Device,
        /// Device of the destination on the receiving worker.
        target: Device,
    },
    /// The two ends of a connection computed different selections.
    #[error(
        "the two ends disagree on the channel for {source} -> {target}: this worker chose {}, \
         the peer chose {}",
        Choice(.local),
        Choice(.remote)
    )]
    Mismatch {
        /// Source device of the first pair (in (source, target) order) on
        /// which the two selections differ.
        r#source: Device,
        /// Target device of that pair.
        target: Device,
        /// The channel this end chose for the pair, if any.
        local: Option<String>,
        /// The channel the peer chose for the pair, if any.
        remote: Option<String>,
    },
    /// A selection list names the same (source, target) pair more than once.
    #[error("the channel selection names the pair {source} -> {target} more than once")]
    DuplicatePair {
        /// Source device of the pair.
        r#source: Device,
        /// Target device of the pair.
        target: Device,
    },
}

/// Shows a possibly absent choice in an error message.
struct Choice<'a>(&'a Option<String>);

impl fmt::Display for Choice<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(name) => write!(f, "channel {:?}", PeerText::new(name)),
            None => f.write_str("no channel"),
        }
    }
}
