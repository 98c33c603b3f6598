//! Tensor-channel records: what stands in a frame for a tensor's bytes when
//! a channel other than `inline` carries it, and the release lists that
//! let a `cma` sender free what the receiver has copied. Pure functions
//! over byte buffers; the transport's frame reader and writer only move
//! these bytes.
//!
//! # Bytes
//!
//! After a frame's payload come its tensors, in table order. A tensor whose
//! selected channel is `inline` is just its bytes. Any other channel starts
//! with one mode byte ([`Mode`]):
//!
//! | mode | then |
//! |---|---|
//! | 0 ([`Mode::Inline`]) | the tensor's bytes (a tensor below the connection's small-tensor size costs less on the stream than a channel's bookkeeping) |
//! | 1 ([`Mode::Channel`]) | the channel's record ([`ChannelRecord`]) |
//!
//! | channel ([`RecordFormat`]) | record | the bytes go |
//! |---|---|---|
//! | `cma` | address `u64` LE, release token `u64` LE (16 bytes, [`CmaRecord`]) | pulled by the receiver from the sender's memory |
//! | `shm` | nothing | through the shared-memory ring, in order |
//! | `mpt` | transfer sequence number `u64` LE (8 bytes, [`MptRecord`]) | over the lanes |
//! | `ucx` | transfer sequence number `u64` LE (8 bytes, [`UcxRecord`]; the UCX tag) | as one UCX tag message, straight into the destination |
//! | `cuda_staged` | magic `CDS1`, the target device: tag `u8` (0 cpu, 1 cuda), index `u16` LE (7 bytes, [`CudaStagedRecord`]) | on the stream after the record, staged through pinned host memory on each side |
//! | `cuda_ipc` | magic `CDI1`, the target device (as `cuda_staged`'s), release token `u64` LE, then 144 bytes of CUDA IPC handles (159 bytes, [`CudaIpcRecord`]) | copied device to device by the receiver from the sender's exported allocation |
//!
//! The CUDA records start with a magic and name the device the sender's
//! device maps send the tensor to. Each end picks a tensor's channel from
//! its own maps (the frame carries only the sender's device), so two
//! workers whose maps disagree could pick different channels for one
//! tensor: the receiver then finds no magic, or another device, and refuses
//! the tensor ([`RecordError::NotCuda`], or the transport's device-map
//! error) instead of misreading the bytes.
//!
//! A `release` frame's payload ([`MessageKind::RELEASE`](crate::MessageKind::RELEASE))
//! is a list of `cma` and `cuda_ipc` release tokens, each `u64` LE, nothing else
//! ([`encode_release`], [`ReleaseList`]).
//!
//! Decoding never panics and never allocates: an unknown mode, a record of
//! the wrong length and a release list of partial tokens are
//! [`RecordError`]s.
//!
//! ```
//! use ferry_wire::channel_record::{ChannelRecord, CmaRecord, Prelude, RecordFormat};
//!
//! let prelude = Prelude::Channel(ChannelRecord::Cma(CmaRecord { addr: 0x7f00_0000, token: 3 }));
//! let mut out = Vec::new();
//! prelude.encode_into(&mut out);
//! assert_eq!(out.len(), 1 + 16);
//! assert_eq!(Prelude::decode(RecordFormat::Cma, &out), Ok(Some((prelude, out.len()))));
//! // Not all of it yet: more bytes needed.
//! assert_eq!(Prelude::decode(RecordFormat::Cma, &out[..5]), Ok(None));
//! ```

use crate::Device;

/// The mode byte of a tensor on a channel other than `inline`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The tensor's bytes follow on the stream.
    Inline,
    /// The channel's record follows; the channel moves the bytes.
    Channel,
}

impl Mode {
    /// The byte of [`Mode::Inline`].
    pub const INLINE_BYTE: u8 = 0;
    /// The byte of [`Mode::Channel`].
    pub const CHANNEL_BYTE: u8 = 1;

    /// The mode a byte stands for.
    pub fn decode(byte: u8) -> Result<Mode, RecordError> {
        match byte {
            Self::INLINE_BYTE => Ok(Mode::Inline),
            Self::CHANNEL_BYTE => Ok(Mode::Channel),
            mode => Err(RecordError::UnknownMode { mode }),
        }
    }

    /// The mode's byte.
    pub fn encode(self) -> u8 {
        match self {
            Mode::Inline => Self::INLINE_BYTE,
            Mode::Channel => Self::CHANNEL_BYTE,
        }
    }
}

/// The channels that have a record, each with its record's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordFormat {
    /// `cma`: a [`CmaRecord`].
    Cma,
    /// `shm`: an empty record.
    Shm,
    /// `mpt`: an [`MptRecord`].
    Mpt,
    /// `ucx`: a [`UcxRecord`].
    Ucx,
    /// `cuda_ipc`: a [`CudaIpcRecord`].
    CudaIpc,
    /// `cuda_staged`: a [`CudaStagedRecord`].
    CudaStaged,
}

impl RecordFormat {
    /// The record's length in bytes.
    pub const fn len(self) -> usize {
        match self {
            RecordFormat::Cma => CmaRecord::LEN,
            RecordFormat::Shm => 0,
            RecordFormat::Mpt => MptRecord::LEN,
            RecordFormat::Ucx => UcxRecord::LEN,
            RecordFormat::CudaIpc => CudaIpcRecord::LEN,
            RecordFormat::CudaStaged => CudaStagedRecord::LEN,
        }
    }

    /// Whether the record is empty (`shm`).
    pub const fn is_empty(self) -> bool {
        self.len() == 0
    }

    /// The channel's name (as in the handshake's offers).
    pub const fn channel(self) -> &'static str {
        match self {
            RecordFormat::Cma => "cma",
            RecordFormat::Shm => "shm",
            RecordFormat::Mpt => "mpt",
            RecordFormat::Ucx => "ucx",
            RecordFormat::CudaIpc => "cuda_ipc",
            RecordFormat::CudaStaged => "cuda_staged",
        }
    }
}

/// A `cma` record: where the tensor's bytes sit in the sender's memory and
/// the token the receiver releases once it has copied them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmaRecord {
    /// The bytes' address in the sender's address space.
    pub addr: u64,
    /// The sender's token for the tensor, named in the release list.
    pub token: u64,
}

impl CmaRecord {
    /// Its length on the wire.
    pub const LEN: usize = 16;

    /// The record's bytes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..8].copy_from_slice(&self.addr.to_le_bytes());
        out[8..].copy_from_slice(&self.token.to_le_bytes());
        out
    }

    /// The record of its bytes (every 16 bytes are one).
    pub fn decode(bytes: &[u8; Self::LEN]) -> CmaRecord {
        let (addr, token) = split_u64s(bytes);
        CmaRecord { addr, token }
    }
}

/// An `mpt` record: the transfer's sequence number, which the lanes' chunks
/// carry too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MptRecord {
    /// Transfers are numbered from 0 per connection and direction.
    pub seq: u64,
}

impl MptRecord {
    /// Its length on the wire.
    pub const LEN: usize = 8;

    /// The record's bytes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        self.seq.to_le_bytes()
    }

    /// The record of its bytes (every 8 bytes are one).
    pub fn decode(bytes: &[u8; Self::LEN]) -> MptRecord {
        MptRecord {
            seq: u64::from_le_bytes(*bytes),
        }
    }
}

/// A `ucx` record: the transfer's sequence number, which is the tag of
/// the UCX message carrying the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UcxRecord {
    /// Transfers are numbered from 0 per connection and direction.
    pub seq: u64,
}

impl UcxRecord {
    /// Its length on the wire.
    pub const LEN: usize = 8;

    /// The record's bytes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        self.seq.to_le_bytes()
    }

    /// The record of its bytes (every 8 bytes are one).
    pub fn decode(bytes: &[u8; Self::LEN]) -> UcxRecord {
        UcxRecord {
            seq: u64::from_le_bytes(*bytes),
        }
    }
}

/// A device on the wire in 3 bytes: tag (0 cpu, 1 cuda) and index `u16` LE.
fn encode_device(device: Device) -> [u8; 3] {
    let (tag, index) = device.encode();
    let i = index.to_le_bytes();
    [tag, i[0], i[1]]
}

fn decode_device(bytes: [u8; 3]) -> Result<Device, RecordError> {
    let (tag, index) = (bytes[0], u16::from_le_bytes([bytes[1], bytes[2]]));
    Device::decode(tag, index).map_err(|_| RecordError::Device { tag, index })
}

/// The magic that starts a `cuda_staged` record.
pub const CUDA_STAGED_MAGIC: [u8; 4] = *b"CDS1";
/// The magic that starts a `cuda_ipc` record.
pub const CUDA_IPC_MAGIC: [u8; 4] = *b"CDI1";

/// A `cuda_staged` record: the device the sender's device maps send the
/// tensor to (its bytes follow on the stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaStagedRecord {
    /// The receiver's device, as the sender's maps say.
    pub target: Device,
}

impl CudaStagedRecord {
    /// Its length on the wire.
    pub const LEN: usize = 7;

    /// The record's bytes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..4].copy_from_slice(&CUDA_STAGED_MAGIC);
        out[4..].copy_from_slice(&encode_device(self.target));
        out
    }

    /// The record of its bytes; another magic is a [`RecordError::NotCuda`],
    /// an unknown device tag or a `cpu` with an index a
    /// [`RecordError::Device`].
    pub fn decode(bytes: &[u8; Self::LEN]) -> Result<CudaStagedRecord, RecordError> {
        if bytes[..4] != CUDA_STAGED_MAGIC {
            return Err(RecordError::NotCuda {
                channel: "cuda_staged",
            });
        }
        Ok(CudaStagedRecord {
            target: decode_device([bytes[4], bytes[5], bytes[6]])?,
        })
    }
}

/// A `cuda_ipc` record: the token the receiver releases once it has copied
/// the bytes, the device the sender's maps send the tensor to, and the
/// sender's CUDA IPC handles (memory handle, event handle, offset and
/// length; opaque here, laid out by the transport).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaIpcRecord {
    /// The sender's token for the tensor, named in the release list.
    pub token: u64,
    /// The receiver's device, as the sender's maps say.
    pub target: Device,
    /// The IPC handles.
    pub handles: [u8; CudaIpcRecord::HANDLES_LEN],
}

impl CudaIpcRecord {
    /// Bytes of the handles.
    pub const HANDLES_LEN: usize = 144;
    /// Its length on the wire.
    pub const LEN: usize = 4 + 3 + 8 + Self::HANDLES_LEN;

    /// The record's bytes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..4].copy_from_slice(&CUDA_IPC_MAGIC);
        out[4..7].copy_from_slice(&encode_device(self.target));
        out[7..15].copy_from_slice(&self.token.to_le_bytes());
        out[15..].copy_from_slice(&self.handles);
        out
    }

    /// The record of its bytes; another magic is a [`RecordError::NotCuda`],
    /// a bad device a [`RecordError::Device`].
    pub fn decode(bytes: &[u8; Self::LEN]) -> Result<CudaIpcRecord, RecordError> {
        if bytes[..4] != CUDA_IPC_MAGIC {
            return Err(RecordError::NotCuda {
                channel: "cuda_ipc",
            });
        }
        let target = decode_device([bytes[4], bytes[5], bytes[6]])?;
        let mut t = [0u8; 8];
        t.copy_from_slice(&bytes[7..15]);
        let mut handles = [0u8; Self::HANDLES_LEN];
        handles.copy_from_slice(&bytes[15..]);
        Ok(CudaIpcRecord {
            token: u64::from_le_bytes(t),
            target,
            handles,
        })
    }
}

/// One channel's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelRecord {
    /// A `cma` record.
    Cma(CmaRecord),
    /// The (empty) `shm` record.
    Shm,
    /// An `mpt` record.
    Mpt(MptRecord),
    /// A `ucx` record.
    Ucx(UcxRecord),
    /// A `cuda_ipc` record.
    CudaIpc(CudaIpcRecord),
    /// A `cuda_staged` record.
    CudaStaged(CudaStagedRecord),
}

impl ChannelRecord {
    /// The layout of this record.
    pub fn format(&self) -> RecordFormat {
        match self {
            ChannelRecord::Cma(_) => RecordFormat::Cma,
            ChannelRecord::Shm => RecordFormat::Shm,
            ChannelRecord::Mpt(_) => RecordFormat::Mpt,
            ChannelRecord::Ucx(_) => RecordFormat::Ucx,
            ChannelRecord::CudaIpc(_) => RecordFormat::CudaIpc,
            ChannelRecord::CudaStaged(_) => RecordFormat::CudaStaged,
        }
    }

    /// Decodes a record of `format` from exactly its bytes.
    pub fn decode(format: RecordFormat, bytes: &[u8]) -> Result<ChannelRecord, RecordError> {
        let wrong = || RecordError::RecordLength {
            channel: format.channel(),
            expected: format.len(),
            got: bytes.len(),
        };
        match format {
            RecordFormat::Cma => bytes
                .try_into()
                .map(|b| ChannelRecord::Cma(CmaRecord::decode(b)))
                .map_err(|_| wrong()),
            RecordFormat::Shm if bytes.is_empty() => Ok(ChannelRecord::Shm),
            RecordFormat::Shm => Err(wrong()),
            RecordFormat::Mpt => bytes
                .try_into()
                .map(|b| ChannelRecord::Mpt(MptRecord::decode(b)))
                .map_err(|_| wrong()),
            RecordFormat::Ucx => bytes
                .try_into()
                .map(|b| ChannelRecord::Ucx(UcxRecord::decode(b)))
                .map_err(|_| wrong()),
            RecordFormat::CudaIpc => {
                let b = bytes.try_into().map_err(|_| wrong())?;
                CudaIpcRecord::decode(b).map(ChannelRecord::CudaIpc)
            }
            RecordFormat::CudaStaged => {
                let b = bytes.try_into().map_err(|_| wrong())?;
                CudaStagedRecord::decode(b).map(ChannelRecord::CudaStaged)
            }
        }
    }

    /// Appends the record's bytes to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            ChannelRecord::Cma(r) => out.extend_from_slice(&r.encode()),
            ChannelRecord::Shm => {}
            ChannelRecord::Mpt(r) => out.extend_from_slice(&r.encode()),
            ChannelRecord::Ucx(r) => out.extend_from_slice(&r.encode()),
            ChannelRecord::CudaIpc(r) => out.extend_from_slice(&r.encode()),
            ChannelRecord::CudaStaged(r) => out.extend_from_slice(&r.encode()),
        }
    }
}

/// What precedes a tensor on a channel other than `inline`: the mode byte
/// and, for [`Mode::Channel`], the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prelude {
    /// Mode 0: the bytes follow on the stream.
    Inline,
    /// Mode 1 and the channel's record.
    Channel(ChannelRecord),
}

impl Prelude {
    /// Appends the mode byte and the record to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            Prelude::Inline => out.push(Mode::Inline.encode()),
            Prelude::Channel(record) => {
                out.push(Mode::Channel.encode());
                record.encode_into(out);
            }
        }
    }

    /// The prelude at the start of `bytes` for a channel whose record is
    /// `format`, with the bytes it takes; `Ok(None)` while `bytes` holds
    /// only part of it.
    pub fn decode(
        format: RecordFormat,
        bytes: &[u8],
    ) -> Result<Option<(Prelude, usize)>, RecordError> {
        let Some((&mode, rest)) = bytes.split_first() else {
            return Ok(None);
        };
        match Mode::decode(mode)? {
            Mode::Inline => Ok(Some((Prelude::Inline, 1))),
            Mode::Channel => match rest.get(..format.len()) {
                None => Ok(None),
                Some(record) => {
                    let record = ChannelRecord::decode(format, record)?;
                    Ok(Some((Prelude::Channel(record), 1 + format.len())))
                }
            },
        }
    }
}

/// The bytes of one release token.
pub const RELEASE_TOKEN_LEN: usize = 8;

/// The length of a release list of `tokens` tokens.
pub const fn release_len(tokens: usize) -> usize {
    tokens * RELEASE_TOKEN_LEN
}

/// Appends a release list of `tokens` to `out` (a `release` frame's
/// payload).
pub fn encode_release(tokens: &[u64], out: &mut Vec<u8>) {
    out.reserve(release_len(tokens.len()));
    for token in tokens {
        out.extend_from_slice(&token.to_le_bytes());
    }
}

/// A `release` frame's payload, checked: iterate it for the tokens
/// (no allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReleaseList<'a> {
    bytes: &'a [u8],
}

impl<'a> ReleaseList<'a> {
    /// Checks that `payload` holds whole tokens.
    pub fn decode(payload: &'a [u8]) -> Result<ReleaseList<'a>, RecordError> {
        if payload.len() % RELEASE_TOKEN_LEN != 0 {
            return Err(RecordError::ReleaseLength { len: payload.len() });
        }
        Ok(ReleaseList { bytes: payload })
    }

    /// How many tokens it holds.
    pub fn len(&self) -> usize {
        self.bytes.len() / RELEASE_TOKEN_LEN
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The tokens, in order.
    pub fn tokens(&self) -> impl ExactSizeIterator<Item = u64> + 'a {
        self.bytes
            .chunks_exact(RELEASE_TOKEN_LEN)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
    }
}

/// Why bytes are not a valid tensor-channel record or release list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// A mode byte other than 0 and 1.
    #[error("unknown mode {mode}")]
    UnknownMode {
        /// The byte found.
        mode: u8,
    },
    /// A record of the wrong length for its channel.
    #[error("a {channel} record is {expected} bytes, not {got}")]
    RecordLength {
        /// The channel.
        channel: &'static str,
        /// Its record's length.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// Where a CUDA channel's record was expected, the bytes do not start
    /// with its magic: the peer sent the tensor on another channel (the two
    /// workers' device maps disagree), or garbage.
    #[error(
        "expected a {channel} record, found none: the peer chose another channel for this \
         tensor (do the two workers' device maps agree?)"
    )]
    NotCuda {
        /// The channel whose record was expected.
        channel: &'static str,
    },
    /// A CUDA record names no device (an unknown tag, or `cpu` with an
    /// index).
    #[error("a CUDA record names no device: tag {tag}, index {index}")]
    Device {
        /// The tag byte.
        tag: u8,
        /// The index.
        index: u16,
    },
    /// A release list that does not hold whole tokens.
    #[error("a release list of {len} bytes does not hold whole {RELEASE_TOKEN_LEN}-byte tokens")]
    ReleaseLength {
        /// The list's length.
        len: usize,
    },
}

/// The two little-endian `u64`s of 16 bytes.
fn split_u64s(bytes: &[u8; 16]) -> (u64, u64) {
    let mut a = [0u8; 8];
    let mut b = [0u8; 8];
    a.copy_from_slice(&bytes[..8]);
    b.copy_from_slice(&bytes[8..]);
    (u64::from_le_bytes(a), u64::from_le_bytes(b))
}
