//! Collectives in a killable child process: torchft's `ProcessGroupBaby`.
//!
//! [`BabyProcessGroup`] has [`ProcessGroup`](crate::collective::ProcessGroup)'s
//! interface (configure with each quorum result, allreduce, allreduce_mean),
//! but the process group itself lives in a child process the library
//! starts: a collective that deadlocks or crashes (torchft's motivation is
//! NCCL, which can hang on errors and on abort) takes the child down,
//! never the training process. The child runs Ferry's own CPU allreduce,
//! the very [`ProcessGroup`](crate::collective::ProcessGroup), so the
//! results are bit-identical to the in-process group's; or, chosen with
//! [`BabyOptions::with_backend`] and carried in the child's `Init`,
//! NCCL on a CUDA device ([`Backend::Nccl`], feature `nccl`: `cudarc`'s
//! bindings, the CUDA driver and NCCL loaded at run time, so the default
//! build needs neither; not yet run on a GPU).
//!
//! ## How the pieces talk
//!
//! - **Commands** cross a Unix socket pair (torchft's pipe) in small
//!   length-prefixed frames ([`protocol`], sans-IO): `Init`, `Configure`,
//!   `MapBuffer`, `Allreduce`, `Shutdown`; the child answers `Ready`,
//!   `Done` or `Failed` with the operation's id.
//! - **Buffers** cross through shared memory: a [`SharedBuffer`] is a
//!   sealed memfd the parent maps; its fd is sent once per child with
//!   `SCM_RIGHTS`, and the child reduces the mapping in place. Nothing of
//!   the data goes through the socket.
//!   [`allreduce_buffer`](BabyProcessGroup::allreduce_buffer) copies
//!   nothing more than the in-process allreduce does;
//!   [`allreduce`](BabyProcessGroup::allreduce) on a plain slice adds one
//!   copy in and one out.
//! - **Futures**: [`allreduce_buffer`](BabyProcessGroup::allreduce_buffer)
//!   returns a [`BabyWork`] that does not borrow the group. One driver task
//!   per child owns the process and the socket; it fails every outstanding
//!   operation with a typed [`BabyError`] when the child dies, does not
//!   answer within the timeout plus a margin, reports an error, or breaks
//!   the protocol, and kills the child with SIGKILL and reaps it before the
//!   buffers come back. The parent never blocks on the child.
//! - **Lifecycle**: every new quorum starts a fresh child (an idle one is
//!   asked to exit, a busy one is killed); the same quorum again is a
//!   no-op, or [`BabyError::Broken`] after a failure, which the next
//!   quorum heals. A failed operation means the step must not be
//!   committed: vote `false` in `should_commit`.
//!
//! ## The child program
//!
//! A library cannot hook `main`, and cargo does not build the binaries of
//! dependencies, so the child is found like this ([`ChildProgram::Auto`]):
//!
//! 1. the path in `FERRY_FT_BABY_BIN`, if set;
//! 2. `ferry-ft-baby` next to the current executable, or in its parent
//!    directory (where cargo builds it for this crate's tests and
//!    examples);
//! 3. `ferry-ft-baby` on `PATH`: `cargo install ferry-ft --bin ferry-ft-baby`.
//!
//! A program that depends on `ferry-ft` from crates.io and runs under
//! torchrun either installs `ferry-ft-baby` (and sets `FERRY_FT_BABY_BIN`
//! if it is not on `PATH`), or re-executes itself:
//! [`ChildProgram::CurrentExe`] with [`run_child_if_requested`] as the
//! first line of `main`, which turns the process into the child when the
//! launcher's environment marker (`FERRY_FT_BABY_FD`) is set and returns at
//! once otherwise.
//!
//! The child is forked from one launcher thread that lives as long as the
//! process, arms `PR_SET_PDEATHSIG` (SIGKILL) between fork and exec and
//! then checks that its parent is still the one that forked it (the parent
//! may have died before the signal was armed), so it never outlives its
//! parent, even one killed with SIGKILL. Its stdin and stdout are
//! `/dev/null`; its stderr is the parent's (its logs, with `RUST_LOG`).
//! The groups need a tokio runtime with I/O and time enabled.
//!
//! ```no_run
//! use ferry_ft::baby::{BabyOptions, BabyProcessGroup};
//! use ferry_ft::collective::ReduceOp;
//! use ferry_ft::manager::QuorumResult;
//!
//! # async fn step(pg: &mut BabyProcessGroup, quorum: &QuorumResult)
//! # -> Result<(), ferry_ft::baby::BabyError> {
//! pg.configure(quorum).await?; // a fresh child for a new quorum
//! let mut grads = pg.buffer(1 << 20)?; // shared memory, reused every step
//! grads.fill(1.0);
//! let grads = pg.allreduce_buffer(grads, ReduceOp::Mean).await?; // error: do not commit
//! # let _ = grads; Ok(()) }
//! ```

mod child;
mod driver;
mod error;
mod group;
mod launch;
#[cfg(feature = "nccl")]
mod nccl;
pub mod protocol;
mod shared;
mod shm;

pub use child::{child_main, run_child_if_requested};
pub use error::BabyError;
pub use group::{BabyProcessGroup, BabyWork};
pub use launch::ChildProgram;
#[cfg(feature = "nccl")]
pub use nccl::nccl_availability;
pub use protocol::{Backend, FailureKind};
pub use shared::{BabyFailure, BabyOptions};
pub use shm::{SharedBuffer, ShmError};

/// The environment variable naming the child program
/// ([`ChildProgram::Auto`] looks there first).
pub const CHILD_BIN_ENV: &str = "FERRY_FT_BABY_BIN";
/// The child program's name.
pub const CHILD_BIN_NAME: &str = "ferry-ft-baby";
/// Set in a child's environment: the fd of its command socket (also the
/// marker [`run_child_if_requested`] looks for).
pub const CHILD_FD_ENV: &str = "FERRY_FT_BABY_FD";
/// Set in a child's environment: its parent's process id.
pub const PARENT_PID_ENV: &str = "FERRY_FT_BABY_PARENT";
