//! The agent's error type.
//!
//! Texts that come from another worker (a callee's error, its registered
//! signature) are kept in the error values exactly as they were raised, up
//! to [`MAX_ERROR_TEXT_BYTES`]; the errors' `Display` shows them escaped
//! with [`PeerText`] (line breaks as `\n`, control characters and ANSI
//! escapes as `\u{1b}`, ...), so that an error put into a log line or
//! printed on a terminal cannot forge lines or hide content.

use std::fmt;
use std::time::Duration;

use ferry_transport::TransportError;
use ferry_wire::PeerText;

use crate::store::StoreError;

/// Most bytes of a remote error's text (a callee's error or panic, a
/// [`RemoteError`]'s message) an error keeps: enough for a Python
/// traceback or a C++ backtrace. A longer text is cut on a character
/// boundary, on the callee before it is sent and again on the caller (a
/// peer's text is not trusted to respect it), and the error says how many
/// bytes were left out ([`RpcError::Remote`]'s `omitted_bytes`, and
/// `…(N more bytes)` at the end of its `Display`).
pub const MAX_ERROR_TEXT_BYTES: usize = 64 * 1024;

/// `text` cut to at most `max` bytes on a character boundary; returns how
/// many bytes were left out.
pub(crate) fn bound_text(text: &mut String, max: usize) -> u64 {
    if text.len() <= max {
        return 0;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let omitted = text.len() - end;
    text.truncate(end);
    omitted as u64
}

/// A peer's text as an error shows it: escaped, then `…(N more bytes)` if
/// `omitted` bytes of it were left out.
struct Shown<'a> {
    text: &'a str,
    omitted: u64,
}

impl<'a> Shown<'a> {
    fn cut(text: &'a str, omitted: &u64) -> Self {
        Self {
            text,
            omitted: *omitted,
        }
    }
}

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        PeerText::bounded(self.text, MAX_ERROR_TEXT_BYTES).fmt(f)?;
        if self.omitted > 0 {
            write!(f, "…({} more bytes)", self.omitted)?;
        }
        Ok(())
    }
}

fn shown(text: &str) -> Shown<'_> {
    Shown { text, omitted: 0 }
}

/// Why an RPC call, an init or a shutdown failed. Every variant names what
/// was wrong: the worker, the function, the limit.
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    /// No agent is running in this process (before `ferry::init_rpc` or
    /// [`set_process_agent`](crate::set_process_agent), or after shutdown),
    /// or the agent a call names has stopped.
    #[error(
        "RPC is not initialized: start the worker first (ferry::init_rpc), or it was shut down"
    )]
    NotInitialized,
    /// A worker was started, or made the process's, while another agent
    /// runs as the process's.
    #[error("RPC is already initialized in this process as worker {name:?}")]
    AlreadyInitialized {
        /// Name of the running worker.
        name: String,
    },
    /// A worker name breaks the naming rules.
    #[error("invalid worker name {name:?}: {reason}")]
    InvalidName {
        /// The name given.
        name: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// Two workers registered the same name.
    #[error("duplicate worker name {name:?} used by ranks {ranks:?}")]
    DuplicateName {
        /// The name.
        name: String,
        /// The ranks that claimed it.
        ranks: Vec<u32>,
    },
    /// A rank outside `0..world_size`.
    #[error("invalid rank {rank}: world size is {world_size}")]
    InvalidRank {
        /// The rank given.
        rank: u32,
        /// The world size.
        world_size: u32,
    },
    /// A rank given as a number no rank can be (negative, or over `u32`).
    #[error("invalid rank {rank}: world size is {world_size}")]
    RankOutOfRange {
        /// The rank given.
        rank: i128,
        /// The world size.
        world_size: u32,
    },
    /// No worker has this name.
    #[error("unknown worker {0:?}")]
    UnknownWorker(String),
    /// The callee has no function registered under this name.
    #[error("worker {worker:?} has no function {function:?} registered")]
    UnknownFunction {
        /// The callee.
        worker: String,
        /// The name called.
        function: String,
    },
    /// The arguments or result type of a call do not match the callee's
    /// registration. Both signatures are written the same way: as their
    /// declared shapes when both sides are typed (`by_schema`; e.g.
    /// `fn((RRef<Log { lines: [String] }>, u64)) -> u64`), otherwise as
    /// their type names without module paths (`fn((RRef<i64>, String)) -> i64`),
    /// which is what was compared. `Display` shows them escaped.
    #[error(
        "wrong type calling {function:?} on worker {worker:?}: it takes {}, the call sent {}",
        shown(.expected),
        shown(.got)
    )]
    WrongType {
        /// The callee.
        worker: String,
        /// The function.
        function: String,
        /// The signature registered on the callee.
        expected: String,
        /// The signature the caller used.
        got: String,
        /// Whether the signatures were compared, and are written, by their
        /// declared shapes (both sides typed) rather than by type names.
        by_schema: bool,
    },
    /// The remote function failed (returned an error or panicked).
    ///
    /// `message` is the callee's text exactly as raised (line breaks and
    /// all; a panic reads `panicked: {payload}`), up to
    /// [`MAX_ERROR_TEXT_BYTES`]; `Display` shows it escaped on one line
    /// (`\n`, `\u{1b}`, ...), safe to log, followed by `…(N more bytes)`
    /// when it was cut.
    #[error(
        "function {function:?} failed on worker {worker:?}: {}",
        Shown::cut(.message, .omitted_bytes)
    )]
    Remote {
        /// The callee.
        worker: String,
        /// The function.
        function: String,
        /// The error's text as raised on the callee (at most
        /// [`MAX_ERROR_TEXT_BYTES`]).
        message: String,
        /// How many bytes of the raised text were left out after
        /// `message` (0: `message` is the whole text).
        omitted_bytes: u64,
    },
    /// The call did not complete in time; a late reply is dropped.
    #[error("call of {function:?} on worker {worker:?} timed out after {after:?}")]
    Timeout {
        /// The callee.
        worker: String,
        /// The function.
        function: String,
        /// The timeout that expired.
        after: Duration,
    },
    /// The connection to a worker failed or was lost with the call outstanding.
    #[error("worker {worker:?} is unreachable: {reason}")]
    PeerUnreachable {
        /// The peer.
        worker: String,
        /// What happened.
        reason: String,
    },
    /// The call is over a limit the callee stated in its handshake (e.g.
    /// its largest message): it was not sent, and the connection and the
    /// other calls on it are unaffected.
    #[error(
        "call of {function:?} on worker {worker:?} not sent: its {what} of {len} exceeds the worker's limit of {max}"
    )]
    TooLarge {
        /// The callee.
        worker: String,
        /// The function.
        function: String,
        /// Which length (`"message tensor bytes"`, `"payload length"`, ...).
        what: &'static str,
        /// The call's length.
        len: u64,
        /// The callee's limit.
        max: u64,
    },
    /// The call was cut short by an immediate shutdown.
    #[error("call of {function:?} on worker {worker:?} aborted: RPC is shutting down")]
    ShutDown {
        /// The callee.
        worker: String,
        /// The function.
        function: String,
    },
    /// Arguments or a result could not be encoded or decoded.
    #[error("cannot {action} for {function:?}: {message}")]
    Codec {
        /// "encode the arguments", "decode the result", ...
        action: &'static str,
        /// The function.
        function: String,
        /// The codec's error.
        message: String,
    },
    /// Rendezvous through the store failed.
    #[error("rendezvous failed: {0}")]
    Rendezvous(#[from] StoreError),
    /// A transport failure outside any single call.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// Options are missing or inconsistent.
    #[error("invalid RPC options: {0}")]
    Config(String),
    /// Graceful shutdown could not complete.
    #[error("graceful shutdown failed: {0}")]
    Join(String),
    /// Graceful shutdown ended without these workers: they did not take
    /// part (killed, stopped, or silent for the shutdown timeout), so the
    /// group cannot agree that no call is outstanding. The agent stopped
    /// all the same. The worker that finds them absent tells the others
    /// through the store, so every worker still in shutdown ends with this
    /// error too, naming the same workers.
    #[error("graceful shutdown failed: workers {workers:?} did not take part: {how}")]
    Absent {
        /// The absent workers, by rank.
        workers: Vec<String>,
        /// How they were found absent.
        how: Absence,
    },
}

/// How graceful shutdown found workers absent ([`RpcError::Absent`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Absence {
    /// Their connection with this worker closed and a new connection to
    /// their address was refused: their process, or its agent, is gone.
    /// Found as soon as both happened.
    Gone,
    /// They wrote no shutdown record within the shutdown timeout
    /// ([`RpcOptions::shutdown_timeout`](crate::RpcOptions::shutdown_timeout))
    /// of the group's last progress: dead on a host that does not answer,
    /// cut off, or not calling `shutdown`.
    Silent {
        /// The timeout.
        after: Duration,
    },
    /// Another worker found them absent and told the group.
    Reported {
        /// The worker that found them absent.
        by: String,
    },
}

impl fmt::Display for Absence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Absence::Gone => f.write_str("their connection closed and a new one was refused"),
            Absence::Silent { after } => write!(
                f,
                "no shutdown record from them within {after:?} (the shutdown timeout)"
            ),
            Absence::Reported { by } => write!(f, "worker {by:?} found them absent"),
        }
    }
}

impl RpcError {
    /// The error of a call to `function` on `worker` that a check against
    /// the worker's limits refused.
    pub(crate) fn too_large(worker: String, function: String, e: ferry_wire::WireError) -> Self {
        match e {
            ferry_wire::WireError::TooLarge { what, len, max } => RpcError::TooLarge {
                worker,
                function,
                what,
                len,
                max,
            },
            other => RpcError::Codec {
                action: "check the call against the worker's limits",
                function,
                message: other.to_string(),
            },
        }
    }
}

/// An error that started on one worker and reached this one through a
/// chain of others (a backward pass that failed three workers away, a
/// call made from inside a call): the worker where it started and its
/// message, with the workers it crossed kept as context.
///
/// ```
/// use ferry_rpc::RemoteError;
///
/// let e = RemoteError::new("worker2", "the engine failed")
///     .relayed_by("worker0")
///     .relayed_by("worker3");
/// assert_eq!(e.origin(), "worker2");
/// assert_eq!(e.message(), "the engine failed");
/// assert_eq!(e.hops(), ["worker2", "worker0", "worker3"]);
/// assert_eq!(
///     e.to_string(),
///     "error on worker worker2: the engine failed (relayed by worker0 -> worker3)"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, crate::Schema)]
pub struct RemoteError {
    origin: String,
    message: String,
    hops: Vec<String>,
}

impl RemoteError {
    /// An error raised on `origin` with `message` (the error proper, not
    /// prefixed with the worker's name).
    pub fn new(origin: impl Into<String>, message: impl Into<String>) -> Self {
        let origin = origin.into();
        Self {
            hops: vec![origin.clone()],
            origin,
            message: message.into(),
        }
    }

    /// The same error, passed on by `worker` (added once to the hops).
    #[must_use]
    pub fn relayed_by(mut self, worker: impl Into<String>) -> Self {
        let worker = worker.into();
        if self.hops.last() != Some(&worker) {
            self.hops.push(worker);
        }
        self
    }

    /// The worker where the error started.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The error as raised on its origin.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The workers the error crossed: its origin first, then each worker
    /// that passed it on, the one that reported it here last.
    pub fn hops(&self) -> &[String] {
        &self.hops
    }
}

/// Shows the message escaped (as [`RpcError::Remote`] does): the error
/// may come from another worker.
impl std::fmt::Display for RemoteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "error on worker {}: {}",
            PeerText::new(&self.origin),
            shown(&self.message)
        )?;
        for (i, hop) in self.hops.iter().enumerate().skip(1) {
            f.write_str(if i == 1 { " (relayed by " } else { " -> " })?;
            PeerText::new(hop).fmt(f)?;
        }
        if self.hops.len() > 1 {
            f.write_str(")")?;
        }
        Ok(())
    }
}

impl std::error::Error for RemoteError {}
