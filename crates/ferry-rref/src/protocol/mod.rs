//! The RRef reference-counting protocol as a sans-IO state machine, after
//! PyTorch's [Remote Reference Protocol](https://pytorch.org/docs/stable/rpc/rref.html).
//!
//! Each worker has one [`RRefProtocol`]. An RRef has one owner (the worker
//! that holds the value) and any number of users, each identified by a
//! [`ForkId`]; the users form a tree rooted at the owner. Two guarantees
//! make deletion safe under reordering:
//!
//! - **G1**: when the last handle to a user is dropped, the owner is sent a
//!   [`Control::UserDelete`].
//! - **G2**: a parent user is not deleted until the owner has confirmed
//!   each child it forked ([`Control::ForkRequest`] acknowledged, then
//!   [`Control::ChildAccept`] back to the parent).
//!
//! Control messages carry a per-destination sequence number; receivers drop
//! copies they have seen, senders retry until acknowledged, so the network
//! may delay, reorder, duplicate and drop them.
//!
//! One addition to PyTorch's protocol: a creator whose `remote` call timed out sends
//! its deletion without a confirmation, and an owner that gets a deletion
//! for a user it does not know yet keeps it until the creating message
//! arrives ([`RRefProtocol::remote_failed`]).
//!
//! Another: a message carrying a fork that its receiver certainly never
//! decoded (it failed to encode or send, or was refused before its
//! arguments were read) has its fork undone by the sender
//! ([`RRefProtocol::fork_not_delivered`]), so a failed call leaves nothing
//! referenced.

mod dedup;
mod ids;
mod message;
mod state;

pub use ids::{ForkId, GloballyUniqueId, RRefId, WorkerId};
pub use message::{Control, Envelope, ForkData, Transmit};
pub use state::{Counts, Event, ForkError, Holder, RRefProtocol};
