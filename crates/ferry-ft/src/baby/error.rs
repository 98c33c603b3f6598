//! Errors of the Baby process group.

use std::path::PathBuf;
use std::time::Duration;

use super::protocol::FailureKind;

/// Why a [`BabyProcessGroup`](super::BabyProcessGroup) operation failed.
/// Any of them means the step must not be committed; every variant about
/// a child means that child has been killed (and reaped), and the next
/// quorum's [`configure`](super::BabyProcessGroup::configure) starts a
/// fresh one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BabyError {
    /// No program to run as the child was found.
    #[error(
        "no `ferry-ft-baby` program for the Baby process group (looked at {searched:?}): \
         set FERRY_FT_BABY_BIN to its path, install it next to this executable or on PATH \
         (`cargo install ferry-ft --bin ferry-ft-baby`), or use ChildProgram::CurrentExe \
         with ferry_ft::baby::run_child_if_requested() at the start of main"
    )]
    ChildNotFound {
        /// Where it was looked for.
        searched: Vec<PathBuf>,
    },
    /// The child could not be started.
    #[error("replica {replica_id}: cannot start the Baby child {program:?}: {reason}")]
    Spawn {
        /// The replica group.
        replica_id: String,
        /// The program.
        program: PathBuf,
        /// What failed.
        reason: String,
    },
    /// The child exited (or was killed by someone else) with operations
    /// outstanding or before answering.
    #[error("replica {replica_id}: Baby child {pid} died during {during} ({status})")]
    ChildDied {
        /// The replica group.
        replica_id: String,
        /// The child's process id.
        pid: u32,
        /// What it was doing.
        during: String,
        /// How it ended, as the OS reports it.
        status: String,
    },
    /// The child did not answer in time (hung, stopped, or its collective
    /// deadlocked); it was killed with SIGKILL.
    #[error(
        "replica {replica_id}: Baby child {pid} did not finish {during} within {waited:?}; killed"
    )]
    ChildHung {
        /// The replica group.
        replica_id: String,
        /// The child's process id.
        pid: u32,
        /// What it was doing.
        during: String,
        /// How long it was given.
        waited: Duration,
    },
    /// The child's collective failed (a peer lost, a timeout in the
    /// collective, the store, ...); the child was then killed.
    #[error("replica {replica_id}: Baby child {pid}: {during} failed ({kind}): {message}")]
    ChildFailed {
        /// The replica group.
        replica_id: String,
        /// The child's process id.
        pid: u32,
        /// What it was doing.
        during: String,
        /// The kind of failure.
        kind: FailureKind,
        /// The child's description.
        message: String,
    },
    /// The child sent something off protocol; it was killed.
    #[error("replica {replica_id}: Baby child {pid} broke the command protocol: {reason}")]
    ChildProtocol {
        /// The replica group.
        replica_id: String,
        /// The child's process id.
        pid: u32,
        /// What was wrong.
        reason: String,
    },
    /// The operation was abandoned before the child finished it: the group
    /// was reconfigured for another quorum, shut down, or an earlier
    /// operation failed and the child was killed.
    #[error("replica {replica_id}: Baby child {pid}: {during} aborted: {reason}")]
    Aborted {
        /// The replica group.
        replica_id: String,
        /// The child's process id.
        pid: u32,
        /// What it was doing.
        during: String,
        /// Why.
        reason: String,
    },
    /// No group is configured yet.
    #[error("the Baby process group is not configured: call configure with a quorum first")]
    NotConfigured,
    /// The quorum cannot be used (a rank outside the world, another
    /// replica's id at this rank).
    #[error("invalid quorum for the Baby process group: {reason}")]
    InvalidQuorum {
        /// What is wrong.
        reason: String,
    },
    /// The group of this quorum failed earlier; the next quorum rebuilds
    /// it.
    #[error(
        "the Baby process group of quorum {quorum_id} failed earlier ({reason}); \
         it is rebuilt with the next quorum"
    )]
    Broken {
        /// The quorum of the failed group.
        quorum_id: i64,
        /// The first failure.
        reason: String,
    },
    /// A shared-memory buffer could not be made.
    #[error("Baby process group buffer: {reason}")]
    Buffer {
        /// What failed.
        reason: String,
    },
}

impl BabyError {
    /// Whether the error comes from the child's side (it died, hung,
    /// failed or was abandoned), as opposed to a misuse or setup problem.
    pub fn is_child_failure(&self) -> bool {
        matches!(
            self,
            BabyError::ChildDied { .. }
                | BabyError::ChildHung { .. }
                | BabyError::ChildFailed { .. }
                | BabyError::ChildProtocol { .. }
                | BabyError::Aborted { .. }
        )
    }
}
