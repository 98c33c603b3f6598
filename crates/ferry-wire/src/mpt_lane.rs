//! The bytes on an `mpt` lane (one of the TCP connections of the
//! multi-lane tensor channel, `ferry_transport::mpt`): the hello that opens
//! every lane and the header in front of every chunk of tensor bytes. Pure
//! functions over fixed-size arrays; the transport reads and writes them.
//!
//! All integers are little-endian.
//!
//! Lane hello, once per lane, connector to acceptor ([`HELLO_LEN`] = 24 bytes):
//!
//! | bytes  | field                          |
//! |--------|--------------------------------|
//! | 0..8   | magic [`LANE_MAGIC`] `FERRYLN1` |
//! | 8..16  | nonce (u64)                    |
//! | 16..20 | lane index (u32)               |
//! | 20..24 | lane count (u32)               |
//!
//! Chunk, sender to receiver ([`CHUNK_HEADER_LEN`] = 24 bytes, then `len`
//! bytes of the tensor starting at `offset`):
//!
//! | bytes  | field        |
//! |--------|--------------|
//! | 0..8   | seq (u64)    |
//! | 8..16  | offset (u64) |
//! | 16..24 | len (u64)    |
//!
//! Nothing travels from receiver to sender on a lane. Whether a hello's
//! nonce, index and count, or a chunk's `seq`, offset and length, fit the
//! channel is for the transport to check; the bytes themselves only fail
//! on a wrong magic ([`LaneError`]).
//!
//! ```
//! use ferry_wire::mpt_lane::{ChunkHeader, LaneHello};
//!
//! let hello = LaneHello { nonce: 42, index: 1, count: 4 };
//! assert_eq!(LaneHello::decode(&hello.encode()), Ok(hello));
//! let chunk = ChunkHeader { seq: 7, offset: 4096, len: 512 };
//! assert_eq!(ChunkHeader::decode(&chunk.encode()), chunk);
//! ```

/// The first bytes of every lane hello (the last one is the format version).
pub const LANE_MAGIC: [u8; 8] = *b"FERRYLN1";
/// Length of the lane hello.
pub const HELLO_LEN: usize = 24;
/// Length of a chunk header.
pub const CHUNK_HEADER_LEN: usize = 24;

/// The first message on every lane: which channel and which lane it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneHello {
    /// Shared secret of this channel, agreed over the main connection.
    pub nonce: u64,
    /// Index of this lane, `0..count`.
    pub index: u32,
    /// Number of lanes of the channel.
    pub count: u32,
}

impl LaneHello {
    /// The hello's bytes.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..8].copy_from_slice(&LANE_MAGIC);
        b[8..16].copy_from_slice(&self.nonce.to_le_bytes());
        b[16..20].copy_from_slice(&self.index.to_le_bytes());
        b[20..24].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    /// Decodes a hello; a wrong magic (not a Ferry lane, or another
    /// version of it) is [`LaneError::BadMagic`].
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, LaneError> {
        let magic: [u8; 8] = array(&b[0..8]);
        if magic != LANE_MAGIC {
            return Err(LaneError::BadMagic { found: magic });
        }
        Ok(Self {
            nonce: u64::from_le_bytes(array(&b[8..16])),
            index: u32::from_le_bytes(array(&b[16..20])),
            count: u32::from_le_bytes(array(&b[20..24])),
        })
    }
}

/// The header in front of every chunk on a lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    /// The tensor's sequence number.
    pub seq: u64,
    /// Where the chunk starts in the tensor's bytes.
    pub offset: u64,
    /// Length of the chunk (the bytes that follow the header).
    pub len: u64,
}

impl ChunkHeader {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; CHUNK_HEADER_LEN] {
        let mut b = [0u8; CHUNK_HEADER_LEN];
        b[0..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a header (any bytes decode; the receiver checks the values
    /// against its chunk plan).
    pub fn decode(b: &[u8; CHUNK_HEADER_LEN]) -> Self {
        Self {
            seq: u64::from_le_bytes(array(&b[0..8])),
            offset: u64::from_le_bytes(array(&b[8..16])),
            len: u64::from_le_bytes(array(&b[16..24])),
        }
    }
}

/// Why bytes are not a lane hello.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaneError {
    /// The hello does not start with [`LANE_MAGIC`].
    #[error("bad mpt lane magic {found:02x?}: not a Ferry lane of this version")]
    BadMagic {
        /// The first eight bytes found instead.
        found: [u8; 8],
    },
}

/// The `N` bytes of a slice of exactly `N` bytes.
fn array<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(b);
    a
}
