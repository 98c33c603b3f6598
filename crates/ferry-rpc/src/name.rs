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
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, crate::Schema)]
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
///
/// Ranks convert from any integer type, so literals need no suffix; names
/// from `&str` and `String`.
///
/// ```
/// use ferry_rpc::WorkerRef;
///
/// assert_eq!(WorkerRef::from(1), WorkerRef::Rank(1));
/// assert_eq!(WorkerRef::from(2usize), WorkerRef::Rank(2));
/// assert_eq!(WorkerRef::from("worker1"), WorkerRef::Name("worker1".into()));
/// // A rank no worker can have is kept as it is, for the call's error.
/// assert_eq!(WorkerRef::from(-1), WorkerRef::OutOfRange(-1));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerRef {
    /// By worker name.
    Name(String),
    /// By rank.
    Rank(u32),
    /// A rank outside `u32` (negative, or too large): a call to it fails
    /// with [`RpcError::RankOutOfRange`].
    OutOfRange(i128),
}

macro_rules! rank_from {
    ($($t:ty),*) => {
        $(impl From<$t> for WorkerRef {
            fn from(r: $t) -> Self {
                match u32::try_from(r) {
                    Ok(r) => WorkerRef::Rank(r),
                    Err(_) => WorkerRef::OutOfRange(r as i128),
                }
            }
        })*
    };
}
rank_from!(i8, i16, i32, i64, isize, u8, u16, u64, usize);

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
