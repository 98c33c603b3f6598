//! The one error type of the wire format.

/// Why a frame, descriptor, handshake or payload could not be encoded or decoded.
///
/// Every decoding path returns one of these for bad input; none panics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The frame did not start with Ferry's magic bytes.
    #[error("bad magic {found:02x?}: not a Ferry frame")]
    BadMagic {
        /// The first bytes that were found instead.
        found: [u8; 3],
    },
    /// The frame uses a wire format version this build does not speak.
    #[error("unsupported wire format version {found} (this build speaks {supported})")]
    UnsupportedVersion {
        /// Version in the frame.
        found: u8,
        /// Version of this build.
        supported: u8,
    },
    /// A length field exceeds the configured limit; nothing was allocated.
    #[error("{what} of {len} exceeds the limit of {max}")]
    TooLarge {
        /// Which length.
        what: &'static str,
        /// The length found.
        len: u64,
        /// The configured maximum.
        max: u64,
    },
    /// The input ended before a complete item.
    #[error("truncated {what}: need {needed} bytes, have {available}")]
    Truncated {
        /// What was being decoded.
        what: &'static str,
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        available: u64,
    },
    /// Bytes were left over after a complete item.
    #[error("{count} trailing bytes after {what}")]
    Trailing {
        /// What was decoded.
        what: &'static str,
        /// How many bytes were left.
        count: u64,
    },
    /// A reserved header field was not zero.
    #[error("reserved header field is {0:#x}, must be 0")]
    ReservedNotZero(u32),
    /// Unknown element type code.
    #[error("unknown dtype code {0}")]
    UnknownDType(u8),
    /// Unknown device tag.
    #[error("unknown device tag {0}")]
    UnknownDevice(u8),
    /// A tensor descriptor is inconsistent (negative size, view outside its bytes, ...).
    #[error("invalid tensor descriptor: {0}")]
    InvalidDescriptor(String),
    /// The serde payload could not be encoded or decoded.
    #[error("payload: {0}")]
    Payload(String),
    /// A tensor's channel record or a release list is not well formed
    /// (see [`channel_record`](crate::channel_record)).
    #[error("channel record: {0}")]
    Record(#[from] crate::channel_record::RecordError),
    /// A tensor's channel record (what replaces its bytes in the frame when
    /// a channel other than `inline` carries it) does not fit the
    /// connection's state (a channel not set up, an out-of-order transfer,
    /// a token that names nothing).
    #[error("channel record: {0}")]
    Channel(String),
    /// The handshake could not be decoded or was inconsistent.
    #[error("handshake: {0}")]
    Handshake(String),
}
