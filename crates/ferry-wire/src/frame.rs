//! The message envelope and its framing.
//!
//! A frame on a byte stream is
//!
//! ```text
//! header (32 bytes) | descriptor table | payload | inline tensor bytes
//! ```
//!
//! The fixed header says how long the descriptor table and the payload are and
//! how many tensors follow; each length is checked against [`Limits`] before a
//! reader allocates anything. Tensor bytes that travel on the `inline` channel
//! follow the payload in descriptor order; tensors on other channels do not
//! appear in the frame at all.

use std::time::Duration;

use crate::{TensorDescriptor, WireError};

/// Magic bytes that open every frame.
pub const MAGIC: [u8; 3] = *b"FRY";
/// The wire format version this build speaks (fourth header byte).
pub const WIRE_VERSION: u8 = 1;
/// Size of the fixed frame header.
pub const HEADER_LEN: usize = 32;

/// What a frame carries. Kinds below [`MessageKind::FIRST_SERVICE`] are
/// the agent's own; the layers above (RRef, autograd, ...) have service
/// kinds at or above it. Every kind Ferry uses is defined in
/// [`kinds`](crate::kinds), its one registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageKind(pub u16);

impl MessageKind {
    /// First message on a connection, both ways.
    pub const HANDSHAKE: MessageKind = MessageKind(1);
    /// A call of a registered remote function.
    pub const REQUEST: MessageKind = MessageKind(2);
    /// The successful result of a call.
    pub const RESPONSE: MessageKind = MessageKind(3);
    /// A call that failed on the callee; the payload says why.
    pub const ERROR: MessageKind = MessageKind(4);
    /// Channel bookkeeping between two transports' frame layers: the
    /// receiver's note that tensors it pulled out of band (the `cma`
    /// channel) are copied, so the sender may let them go. Never surfaced
    /// to the layers above.
    pub const RELEASE: MessageKind = MessageKind(5);
    /// First kind available to service layers.
    pub const FIRST_SERVICE: MessageKind = MessageKind(0x100);

    /// Whether this kind belongs to a service layer above the agent.
    pub fn is_service(self) -> bool {
        self >= Self::FIRST_SERVICE
    }
}

impl std::fmt::Display for MessageKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match crate::kinds::lookup(*self) {
            Some(info) => f.write_str(info.name),
            None => write!(f, "kind {:#06x}", self.0),
        }
    }
}

/// Bit flags of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Flags(pub u16);

impl Flags {
    /// No flags.
    pub const NONE: Flags = Flags(0);
    /// The frame answers a request (response or error), rather than asking.
    pub const REPLY: Flags = Flags(1);

    /// Whether every bit of `other` is set.
    pub fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Flags {
    type Output = Flags;
    fn bitor(self, rhs: Flags) -> Flags {
        Flags(self.0 | rhs.0)
    }
}

/// Upper bounds a reader enforces before allocating for a frame.
///
/// Each side of a connection states its own in its [`Handshake`](crate::Handshake),
/// so a sender checks a message against the receiver's limits
/// ([`Limits::check_outgoing`]) before any of it leaves.
///
/// The defaults are sized for a real deployment facing a peer that may lie:
/// a frame's header and descriptors are checked against them before
/// anything is allocated, and the receive path commits memory for a
/// tensor's destination only as its bytes arrive, so the caps bound what one
/// message can make a worker hold, and a descriptor followed by silence
/// costs address space, not memory. PyTorch's TensorPipe agent has no
/// per-tensor cap; Ferry's 4 GiB default fits any single tensor of the
/// paper's workloads and of common models' layers (a 4 GiB fp16 tensor is 2
/// billion elements), while one message can never claim more than 4 GiB of
/// a worker's memory. Raise them (`RpcOptions::limits`, `Endpoint::limits`)
/// for jobs that ship larger tensors in one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    /// Largest serde payload, in bytes.
    pub max_payload_bytes: u32,
    /// Largest descriptor table, in bytes.
    pub max_descriptor_bytes: u32,
    /// Most tensors in one message.
    pub max_tensors: u32,
    /// Most dimensions of one tensor.
    pub max_dims: usize,
    /// Largest single tensor, in bytes.
    pub max_tensor_bytes: u64,
    /// Largest sum of all tensors' bytes in one message.
    pub max_message_tensor_bytes: u64,
    /// Once the first byte of a frame is in, how long the reader waits for
    /// each further piece of it (header, descriptor table, payload, tensor
    /// bytes on any channel) before it closes the connection with a
    /// "stalled" error naming the peer and what it was waiting for. Progress
    /// resets the wait, so a large tensor on a slow link is not cut off; a
    /// connection idle between frames is not subject to it. Keep it above
    /// zero: zero cuts off any frame that is not already buffered whole.
    pub frame_stall_timeout: Duration,
}

/// Default [`Limits::max_payload_bytes`]: 256 MiB.
pub const DEFAULT_MAX_PAYLOAD_BYTES: u32 = 256 << 20;
/// Default [`Limits::max_tensor_bytes`]: 4 GiB.
pub const DEFAULT_MAX_TENSOR_BYTES: u64 = 4 << 30;
/// Default [`Limits::max_message_tensor_bytes`]: 4 GiB.
pub const DEFAULT_MAX_MESSAGE_TENSOR_BYTES: u64 = 4 << 30;
/// Default [`Limits::frame_stall_timeout`]: 30 seconds.
pub const DEFAULT_FRAME_STALL_TIMEOUT: Duration = Duration::from_secs(30);

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            max_descriptor_bytes: 16 << 20,
            max_tensors: 1 << 16,
            max_dims: 64,
            max_tensor_bytes: DEFAULT_MAX_TENSOR_BYTES,
            max_message_tensor_bytes: DEFAULT_MAX_MESSAGE_TENSOR_BYTES,
            frame_stall_timeout: DEFAULT_FRAME_STALL_TIMEOUT,
        }
    }
}

impl Limits {
    /// Checks a message a sender is about to write (its payload length and
    /// its tensors' descriptors) against these limits, the receiver's: the
    /// same checks, in the same order, as the receiver's
    /// [`FrameHeader::decode`] and [`decode_descriptors`] make. An `Err`
    /// means the receiver would refuse the frame and close the connection;
    /// the sender is to keep it and report the error instead.
    pub fn check_outgoing(
        &self,
        payload_len: usize,
        descriptors: &[TensorDescriptor],
    ) -> Result<(), WireError> {
        check(
            "payload length",
            payload_len as u64,
            self.max_payload_bytes.into(),
        )?;
        let table: u64 = descriptors.iter().map(|d| d.encoded_len() as u64).sum();
        check(
            "descriptor table length",
            table,
            self.max_descriptor_bytes.into(),
        )?;
        check(
            "tensor count",
            descriptors.len() as u64,
            self.max_tensors.into(),
        )?;
        let mut total: u64 = 0;
        for d in descriptors {
            check(
                "tensor dimension count",
                d.shape.len() as u64,
                self.max_dims as u64,
            )?;
            check("tensor byte length", d.byte_len, self.max_tensor_bytes)?;
            total = total.saturating_add(d.byte_len);
        }
        check("message tensor bytes", total, self.max_message_tensor_bytes)
    }
}

/// The fixed 32-byte header of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame carries.
    pub kind: MessageKind,
    /// Bit flags.
    pub flags: Flags,
    /// Matches a reply to its request; chosen by the requester.
    pub request_id: u64,
    /// Length of the serde payload.
    pub payload_len: u32,
    /// Length of the encoded descriptor table.
    pub descriptors_len: u32,
    /// Number of tensors described by the table.
    pub tensor_count: u32,
}

impl FrameHeader {
    /// Encodes the header (little-endian).
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..3].copy_from_slice(&MAGIC);
        h[3] = WIRE_VERSION;
        h[4..6].copy_from_slice(&self.kind.0.to_le_bytes());
        h[6..8].copy_from_slice(&self.flags.0.to_le_bytes());
        h[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        h[16..20].copy_from_slice(&self.payload_len.to_le_bytes());
        h[20..24].copy_from_slice(&self.descriptors_len.to_le_bytes());
        h[24..28].copy_from_slice(&self.tensor_count.to_le_bytes());
        h
    }

    /// Decodes and checks a header against `limits`. Nothing is allocated.
    pub fn decode(h: &[u8; HEADER_LEN], limits: &Limits) -> Result<Self, WireError> {
        if h[..3] != MAGIC {
            return Err(WireError::BadMagic {
                found: [h[0], h[1], h[2]],
            });
        }
        if h[3] != WIRE_VERSION {
            return Err(WireError::UnsupportedVersion {
                found: h[3],
                supported: WIRE_VERSION,
            });
        }
        let u16_at = |i: usize| u16::from_le_bytes([h[i], h[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let mut id = [0u8; 8];
        id.copy_from_slice(&h[8..16]);
        let header = FrameHeader {
            kind: MessageKind(u16_at(4)),
            flags: Flags(u16_at(6)),
            request_id: u64::from_le_bytes(id),
            payload_len: u32_at(16),
            descriptors_len: u32_at(20),
            tensor_count: u32_at(24),
        };
        let reserved = u32_at(28);
        if reserved != 0 {
            return Err(WireError::ReservedNotZero(reserved));
        }
        check(
            "payload length",
            header.payload_len.into(),
            limits.max_payload_bytes.into(),
        )?;
        check(
            "descriptor table length",
            header.descriptors_len.into(),
            limits.max_descriptor_bytes.into(),
        )?;
        check(
            "tensor count",
            header.tensor_count.into(),
            limits.max_tensors.into(),
        )?;
        // Each descriptor takes at least 24 bytes: a count that cannot fit is malformed.
        if u64::from(header.tensor_count) * 24 > u64::from(header.descriptors_len) {
            return Err(WireError::Truncated {
                what: "descriptor table",
                needed: u64::from(header.tensor_count) * 24,
                available: header.descriptors_len.into(),
            });
        }
        Ok(header)
    }

    /// Length of the variable part before tensor bytes (descriptor table and payload).
    pub fn body_len(&self) -> usize {
        self.descriptors_len as usize + self.payload_len as usize
    }
}

fn check(what: &'static str, len: u64, max: u64) -> Result<(), WireError> {
    if len > max {
        Err(WireError::TooLarge { what, len, max })
    } else {
        Ok(())
    }
}

/// Encodes a descriptor table.
pub fn encode_descriptors(descriptors: &[TensorDescriptor], out: &mut Vec<u8>) {
    for d in descriptors {
        d.encode(out);
    }
}

/// Decodes a descriptor table of exactly `count` descriptors, each validated,
/// and checks the sum of their byte lengths against the limits.
pub fn decode_descriptors(
    table: &[u8],
    count: u32,
    limits: &Limits,
) -> Result<Vec<TensorDescriptor>, WireError> {
    if count > limits.max_tensors {
        return Err(WireError::TooLarge {
            what: "tensor count",
            len: count.into(),
            max: limits.max_tensors.into(),
        });
    }
    let mut out = Vec::with_capacity((count as usize).min(table.len() / 24));
    let mut at = 0;
    let mut total: u64 = 0;
    for _ in 0..count {
        let (d, used) = TensorDescriptor::decode(&table[at..], limits)?;
        at += used;
        total = total.saturating_add(d.byte_len);
        out.push(d);
    }
    if at != table.len() {
        return Err(WireError::Trailing {
            what: "descriptor table",
            count: (table.len() - at) as u64,
        });
    }
    check(
        "message tensor bytes",
        total,
        limits.max_message_tensor_bytes,
    )?;
    Ok(out)
}

/// A whole frame decoded from one contiguous buffer, borrowing from it.
///
/// Stream readers decode the header and the body separately (so tensor bytes
/// can go straight into their destinations); this form serves in-memory
/// transports, tests and the fuzz target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame<'a> {
    /// The header.
    pub header: FrameHeader,
    /// The tensor descriptors.
    pub descriptors: Vec<TensorDescriptor>,
    /// The serde payload.
    pub payload: &'a [u8],
    /// Inline tensor bytes, one slice per descriptor.
    pub tensors: Vec<&'a [u8]>,
}

impl<'a> Frame<'a> {
    /// Decodes a frame whose tensors all travel inline. Returns the frame and
    /// the number of bytes it occupied.
    pub fn decode(input: &'a [u8], limits: &Limits) -> Result<(Self, usize), WireError> {
        let head: &[u8; HEADER_LEN] = input
            .get(..HEADER_LEN)
            .and_then(|h| h.try_into().ok())
            .ok_or(WireError::Truncated {
                what: "frame header",
                needed: HEADER_LEN as u64,
                available: input.len() as u64,
            })?;
        let header = FrameHeader::decode(head, limits)?;
        let body_end = HEADER_LEN + header.body_len();
        let body = input
            .get(HEADER_LEN..body_end)
            .ok_or(WireError::Truncated {
                what: "frame body",
                needed: body_end as u64,
                available: input.len() as u64,
            })?;
        let (table, payload) = body.split_at(header.descriptors_len as usize);
        let descriptors = decode_descriptors(table, header.tensor_count, limits)?;
        let mut at = body_end;
        let mut tensors = Vec::with_capacity(descriptors.len());
        for d in &descriptors {
            let end = usize::try_from(d.byte_len)
                .ok()
                .and_then(|n| at.checked_add(n))
                .filter(|&end| end <= input.len())
                .ok_or(WireError::Truncated {
                    what: "inline tensor bytes",
                    needed: (at as u64).saturating_add(d.byte_len),
                    available: input.len() as u64,
                })?;
            tensors.push(&input[at..end]);
            at = end;
        }
        Ok((
            Frame {
                header,
                descriptors,
                payload,
                tensors,
            },
            at,
        ))
    }

    /// Encodes a frame with inline tensors into one buffer (tests and
    /// in-memory use; stream writers use vectored writes instead).
    pub fn encode(
        kind: MessageKind,
        flags: Flags,
        request_id: u64,
        descriptors: &[TensorDescriptor],
        payload: &[u8],
        tensors: &[&[u8]],
    ) -> Vec<u8> {
        let mut table = Vec::new();
        encode_descriptors(descriptors, &mut table);
        let header = FrameHeader {
            kind,
            flags,
            request_id,
            payload_len: payload.len() as u32,
            descriptors_len: table.len() as u32,
            tensor_count: descriptors.len() as u32,
        };
        let mut out = header.encode().to_vec();
        out.extend_from_slice(&table);
        out.extend_from_slice(payload);
        for t in tensors {
            out.extend_from_slice(t);
        }
        out
    }
}
