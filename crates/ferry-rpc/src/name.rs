//! Worker names and worker references.

use serde::{Deserialize, Serialize};

use crate::RpcError;

/// Longest worker name (exclusive).
pub const MAX_NAME_LEN: usize = 128;

/// Checks a worker name: non-empty, under 128 characters, `[A-Za-z0-9_:-]`.
pub fn validate_name(name: &str) -> Result<(), RpcError> {
    let reason = if name.is_empty() {
        Some("it is empty")
    } else if name.len() >= MAX_NAME_LEN {
        Some("it must be shorter than 128 characters")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b':' | b'-'))
    {
        Some("only letters, digits, '_', ':' and '-' are allowed")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(RpcError::InvalidName {
            name: name.to_string(),
            reason,
        }),
        None => Ok(()),
    }
}

/// A worker of the group: its unique name and its rank (its id).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The worker's name.
    pub name: String,
    /// The worker's rank, `0..world_size`.
    pub id: u32,
}

impl std::fmt::Display for WorkerInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (rank {})", self.name, self.id)
    }
}

/// How a call names its destination: by name, by rank, or by [`WorkerInfo`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerRef {
    /// By worker name.
    Name(String),
    /// By rank.
    Rank(u32),
}

impl From<&str> for WorkerRef {
    fn from(s: &str) -> Self {
        WorkerRef::Name(s.to_string())
    }
}
impl From<String> for WorkerRef {
    fn from(s: String) -> Self {
        WorkerRef::Name(s)
    }
}
impl From<&String> for WorkerRef {
    fn from(s: &String) -> Self {
        WorkerRef::Name(s.clone())
    }
}
impl From<u32> for WorkerRef {
    fn from(r: u32) -> Self {
        WorkerRef::Rank(r)
    }
}
impl From<&WorkerInfo> for WorkerRef {
    fn from(w: &WorkerInfo) -> Self {
        WorkerRef::Rank(w.id)
    }
}
impl From<WorkerInfo> for WorkerRef {
    fn from(w: WorkerInfo) -> Self {
        WorkerRef::Rank(w.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_rules() {
        for ok in ["worker0", "a", "trainer:1", "ps-0_x", &"n".repeat(127)] {
            validate_name(ok).unwrap();
        }
        for bad in [
            "",
            "has space",
            "dot.name",
            "slash/x",
            "ü",
            &"n".repeat(128),
        ] {
            let err = validate_name(bad).unwrap_err();
            assert!(err.to_string().starts_with("invalid worker name"), "{err}");
        }
    }
}
