//! Errors of connections and channels.

use ferry_wire::WireError;

use crate::selection::SelectionError;

/// Why a connection or a transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// A socket operation failed.
    #[error("i/o error with {peer}: {source}")]
    Io {
        /// The peer (address or worker name).
        peer: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Bytes of an authenticated connection failed their integrity check
    /// ([`crate::auth::records`]): something between the two ends
    /// injected, dropped, reordered, replayed or altered them. The
    /// connection is closed and nothing of the refused record was used.
    #[cfg(not(loom))]
    #[error("connection with {peer} tampered with: {source}")]
    Integrity {
        /// The peer.
        peer: String,
        /// Which record failed, and how.
        #[source]
        source: crate::auth::RecordError,
    },
    /// The peer sent bytes that are not a valid frame.
    #[error("malformed frame from {peer}: {source}")]
    Malformed {
        /// The peer.
        peer: String,
        /// What was wrong.
        #[source]
        source: WireError,
    },
    /// The handshake failed.
    #[error("handshake with {peer} failed: {reason}")]
    Handshake {
        /// The peer.
        peer: String,
        /// What was wrong.
        reason: String,
    },
    /// Channel selection failed or the two ends disagree.
    #[error(transparent)]
    Selection(#[from] SelectionError),
    /// The connection was closed.
    #[error("connection to {peer} closed")]
    Closed {
        /// The peer.
        peer: String,
    },
    /// A channel failed to move a tensor's bytes.
    #[error("channel {channel} with {peer} failed: {reason}")]
    Channel {
        /// The channel's name.
        channel: &'static str,
        /// The peer.
        peer: String,
        /// What went wrong.
        reason: String,
    },
    /// A message the peer would refuse (over the limits it stated in its
    /// handshake) was kept back: nothing of it was written, and the
    /// connection is intact.
    #[error("{peer} would refuse this message: {source}")]
    Refused {
        /// The peer.
        peer: String,
        /// Which of the peer's limits the message exceeds, by how much.
        #[source]
        source: WireError,
    },
    /// A frame stopped arriving: after its first byte, no further byte of
    /// it came within the limits' `frame_stall_timeout`. The connection is
    /// closed.
    #[error(
        "{peer} stalled mid-frame: {got} of {len} bytes of {waiting_for} arrived, then nothing for {after:?}"
    )]
    Stalled {
        /// The peer.
        peer: String,
        /// The piece of the frame that stopped arriving.
        waiting_for: String,
        /// Bytes of that piece that did arrive.
        got: u64,
        /// Bytes of that piece expected.
        len: u64,
        /// The stall timeout that ran out.
        after: std::time::Duration,
    },
    /// A destination could not be allocated.
    #[error("cannot allocate tensor destination: {0}")]
    Alloc(String),
    /// A tensor's view or data is inconsistent.
    #[error("invalid tensor: {0}")]
    InvalidTensor(String),
    /// A wire-format error while encoding.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// A library a transport or channel needs is not usable in this
    /// process (e.g. `UCX not available: <the dynamic loader's error>`).
    #[error("{what} not available: {reason}")]
    Unavailable {
        /// What is missing, e.g. "UCX".
        what: &'static str,
        /// Why, as the loader or the library said it.
        reason: String,
    },
    /// A CUDA tensor was to be sent or received, or a CUDA device named,
    /// where CUDA cannot be used ("CUDA not available on this host: …").
    #[error(transparent)]
    CudaUnavailable(#[from] crate::cuda::CudaUnavailable),
    /// A device map is invalid, or a tensor's device has no mapping.
    #[error(transparent)]
    DeviceMap(#[from] crate::device_map::DeviceMapError),
    /// An option named something that does not exist.
    #[error("unknown {what} {name:?}; known: {known}")]
    Unknown {
        /// "transport" or "channel".
        what: &'static str,
        /// The name given.
        name: String,
        /// The names that exist.
        known: String,
    },
}
