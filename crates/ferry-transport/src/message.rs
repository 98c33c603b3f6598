//! Messages as the transport sees them: a kind, a request id, a payload and
//! a tensor table.

use std::sync::Arc;

use ferry_wire::payload::{IncomingTensor, OutgoingTensor};
use ferry_wire::{Flags, FrameHeader, Limits, MessageKind, WireError};

/// A message to send. The tensors stay owned by the message (and so alive)
/// until the writer has put their bytes on the wire.
pub struct OutgoingMessage {
    /// What the message carries.
    pub kind: MessageKind,
    /// Frame flags.
    pub flags: Flags,
    /// Request id (matches replies to requests).
    pub request_id: u64,
    /// Serde payload (tensors replaced by table indices).
    pub payload: Vec<u8>,
    /// The tensor table; each tensor's bytes are sent from its own memory.
    pub tensors: Vec<Arc<dyn OutgoingTensor>>,
}

impl OutgoingMessage {
    /// Checks the message against a receiver's `limits` (those its
    /// handshake stated): `Err` names the limit it exceeds and by how much.
    pub fn check(&self, limits: &Limits) -> Result<(), WireError> {
        let descriptors: Vec<_> = self.tensors.iter().map(|t| t.descriptor()).collect();
        limits.check_outgoing(self.payload.len(), &descriptors)
    }
}

impl std::fmt::Debug for OutgoingMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutgoingMessage")
            .field("kind", &self.kind)
            .field("request_id", &self.request_id)
            .field("payload_len", &self.payload.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// A received message: the header, the payload, and every tensor already
/// in the destination the receiver's allocator provided.
#[derive(Debug)]
pub struct IncomingMessage {
    /// The frame header.
    pub header: FrameHeader,
    /// Serde payload.
    pub payload: Vec<u8>,
    /// Received tensors, in table order.
    pub tensors: Vec<IncomingTensor>,
}
