//! What a Baby group's handle and its child's driver share: the options,
//! the requests the handle sends, how an operation ends, and the running
//! child (its incarnation).

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::launch::ChildProgram;
use super::protocol::Backend;
use super::shm::SharedBuffer;
use super::BabyError;
use crate::collective::ReduceOp;

/// A Baby process group's knobs.
///
/// ```
/// use std::time::Duration;
/// use ferry_ft::baby::BabyOptions;
///
/// let options = BabyOptions::new("replica_a").with_timeout(Duration::from_secs(5));
/// assert_eq!(options.timeout, Duration::from_secs(5));
/// ```
#[derive(Debug, Clone)]
pub struct BabyOptions {
    /// This replica group's id, exactly as its manager names it.
    pub replica_id: String,
    /// Where the child's process group listens for its peers
    /// (`host:port`, default `127.0.0.1:0`; use an address the other
    /// replica groups reach).
    pub bind: String,
    /// The collective's timeout inside the child (rendezvous, one
    /// allreduce), as [`ProcessGroupOptions::timeout`](crate::collective::ProcessGroupOptions::timeout).
    /// Default 60 s.
    pub timeout: Duration,
    /// Connecting to a peer or the store, inside the child. Default 10 s.
    pub connect_timeout: Duration,
    /// How much longer than its own limit the parent waits for the child
    /// to answer before it takes the child for hung and kills it (the
    /// child's own timeout normally answers first, with the cause).
    /// Default 2 s.
    pub watchdog_margin: Duration,
    /// How long a child asked to exit may take before it is killed with
    /// SIGKILL. Default 1 s.
    pub exit_grace: Duration,
    /// Which program runs the child.
    pub child: ChildProgram,
    /// The collective backend the child runs (default Ferry's own).
    pub backend: Backend,
}

impl BabyOptions {
    /// The defaults for replica group `replica_id`.
    pub fn new(replica_id: impl Into<String>) -> Self {
        Self {
            replica_id: replica_id.into(),
            bind: "127.0.0.1:0".to_owned(),
            timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
            watchdog_margin: Duration::from_secs(2),
            exit_grace: Duration::from_secs(1),
            child: ChildProgram::Auto,
            backend: Backend::Ferry,
        }
    }

    /// Sets [`timeout`](Self::timeout).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout).
    pub fn with_connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self
    }

    /// Sets [`watchdog_margin`](Self::watchdog_margin).
    pub fn with_watchdog_margin(mut self, margin: Duration) -> Self {
        self.watchdog_margin = margin;
        self
    }

    /// Sets [`exit_grace`](Self::exit_grace).
    pub fn with_exit_grace(mut self, grace: Duration) -> Self {
        self.exit_grace = grace;
        self
    }

    /// Sets [`bind`](Self::bind).
    pub fn with_bind(mut self, bind: impl Into<String>) -> Self {
        self.bind = bind.into();
        self
    }

    /// Sets [`child`](Self::child).
    pub fn with_child(mut self, child: ChildProgram) -> Self {
        self.child = child;
        self
    }

    /// Sets [`backend`](Self::backend).
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }
}

/// An operation that failed, with its buffer when it could be taken back
/// (the child answered, or is dead).
pub struct BabyFailure {
    /// What went wrong.
    pub error: BabyError,
    /// The buffer the operation held, if any.
    pub buffer: Option<SharedBuffer>,
}

impl fmt::Debug for BabyFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BabyFailure")
            .field("error", &self.error)
            .field("buffer", &self.buffer)
            .finish()
    }
}

impl fmt::Display for BabyFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for BabyFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<BabyFailure> for BabyError {
    fn from(failure: BabyFailure) -> Self {
        failure.error
    }
}

/// How an operation ended, as the driver reports it.
pub(super) type Outcome = Result<Option<SharedBuffer>, BabyFailure>;

/// What the handle asks a driver.
pub(super) enum Request {
    Configure {
        store_address: String,
        quorum_id: i64,
        replica_ids: Vec<String>,
        replica_rank: u64,
        reply: oneshot::Sender<Outcome>,
    },
    Allreduce {
        buffer: SharedBuffer,
        reduce: ReduceOp,
        reply: oneshot::Sender<Outcome>,
    },
    /// Stop the child: politely if idle, with SIGKILL if busy (failing
    /// what is outstanding with `reason`).
    Stop { reason: String },
}

/// One child and its driver task.
pub(super) struct Incarnation {
    pub(super) pid: u32,
    pub(super) requests: mpsc::UnboundedSender<Request>,
    /// The first failure of this child, once it failed.
    pub(super) failure: Arc<Mutex<Option<BabyError>>>,
    pub(super) driver: JoinHandle<()>,
}

impl Incarnation {
    pub(super) fn failure(&self) -> Option<BabyError> {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Asks the driver to stop the child and waits until it is reaped.
    pub(super) async fn stop(self, reason: String) {
        let _ = self.requests.send(Request::Stop { reason });
        drop(self.requests);
        let _ = self.driver.await;
    }
}
