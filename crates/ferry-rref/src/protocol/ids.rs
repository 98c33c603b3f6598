//! Globally unique ids: an RRef's [`RRefId`] and each user's [`ForkId`].

use std::fmt;

use serde::{Deserialize, Serialize};

/// A worker's id: its rank in the group.
pub type WorkerId = u32;

/// A globally unique id: the worker that created it and a counter local to
/// that worker. [`RRefId`]s and [`ForkId`]s come from the same counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GloballyUniqueId {
    /// The worker that created the id.
    pub created_on: WorkerId,
    /// The creator's counter value.
    pub local_id: u64,
}

impl fmt::Display for GloballyUniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.created_on, self.local_id)
    }
}

/// The id of one RRef: the same on the owner and on every user.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RRefId(pub GloballyUniqueId);

/// The id of one user of an RRef (one node of its fork tree).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ForkId(pub GloballyUniqueId);

impl fmt::Display for RRefId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RRef({})", self.0)
    }
}

impl fmt::Display for ForkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fork({})", self.0)
    }
}
