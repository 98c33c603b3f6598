//! The bound on a replica id the lighthouse accepts.

/// The longest replica id (in bytes) the lighthouse accepts in a quorum
/// request or a heartbeat. torchft's ids are a replica group name and a
/// UUID, well under this.
pub const MAX_REPLICA_ID_BYTES: usize = 1024;

/// A replica id over [`MAX_REPLICA_ID_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a replica id of {len} bytes exceeds the lighthouse's limit of {limit} bytes")]
pub struct ReplicaIdTooLong {
    /// The id's length in bytes.
    pub len: usize,
    /// [`MAX_REPLICA_ID_BYTES`].
    pub limit: usize,
}

/// Checks `replica_id` against [`MAX_REPLICA_ID_BYTES`].
pub fn check_replica_id(replica_id: &str) -> Result<(), ReplicaIdTooLong> {
    if replica_id.len() > MAX_REPLICA_ID_BYTES {
        return Err(ReplicaIdTooLong {
            len: replica_id.len(),
            limit: MAX_REPLICA_ID_BYTES,
        });
    }
    Ok(())
}
