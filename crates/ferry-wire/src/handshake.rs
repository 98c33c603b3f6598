//! The handshake each side of a connection sends first.
//!
//! It names the worker, states the protocol version, and lists the transports
//! and tensor channels the worker offers. Offers are open lists of named
//! entries with per-device descriptor strings, so a new transport or channel
//! slots in without a change of format: a peer that does not know a name
//! simply never selects it.

use serde::{Deserialize, Serialize};

use crate::{Device, Limits, WireError};

/// Version of the connection protocol spoken after the handshake.
///
/// Version 2 added [`Handshake::ucx_address`]; version 3 the UCX check
/// after the handshake (when `ucx` is selected, each side sends a second
/// handshake with its `ucx.check` property, and the accepting side's holds
/// the selection without UCX should either check have failed).
pub const PROTOCOL_VERSION: u32 = 3;

/// A transport (a way to carry control messages) a worker can use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportOffer {
    /// Transport name, e.g. `"tcp"`.
    pub name: String,
    /// Higher wins.
    pub priority: i32,
    /// Where this transport can reach: two workers can use it only if their
    /// descriptors are equal (e.g. a boot id for same-host transports).
    pub descriptor: String,
}

/// What a channel offers for one local device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceOffer {
    /// The device.
    pub device: Device,
    /// Domain descriptor: the channel connects two devices only if their
    /// descriptors are equal (TensorPipe's rule).
    pub descriptor: String,
}

/// A tensor channel (a way to move tensor bytes) a worker can use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelOffer {
    /// Channel name, e.g. `"inline"`.
    pub name: String,
    /// Higher wins.
    pub priority: i32,
    /// The local devices the channel serves, each with its descriptor.
    pub devices: Vec<DeviceOffer>,
}

/// The channel chosen for one (source device, target device) pair.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChannelChoice {
    /// Device of the tensor on the sending worker.
    pub source: Device,
    /// Device of the destination on the receiving worker.
    pub target: Device,
    /// The chosen channel's name.
    pub channel: String,
}

/// The first message on every connection, in both directions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handshake {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub protocol_version: u32,
    /// Name of the sending worker.
    pub worker_name: String,
    /// Rank of the sending worker.
    pub rank: u32,
    /// Transports the sender offers.
    pub transports: Vec<TransportOffer>,
    /// Channels the sender offers.
    pub channels: Vec<ChannelOffer>,
    /// In the accepting side's reply: the channel selection it computed for
    /// this connection, which the connecting side checks against its own.
    pub selection: Vec<ChannelChoice>,
    /// Free-form properties for extensions (name, value).
    pub properties: Vec<(String, String)>,
    /// The limits the sender enforces on what it reads: the other side
    /// checks its messages against them before writing
    /// ([`Limits::check_outgoing`]), so an oversized message fails at its
    /// sender with a size error instead of closing the connection.
    pub limits: Limits,
    /// The sender's UCX worker address (opaque bytes UCX packed), when it
    /// offers a `ucx` transport or channel: from the connecting side always
    /// then, from the accepting side only when its selection uses UCX.
    /// At most [`MAX_UCX_ADDRESS_BYTES`] (checked by [`Handshake::decode`]).
    pub ucx_address: Option<Vec<u8>>,
}

/// Longest UCX worker address accepted in a handshake.
pub const MAX_UCX_ADDRESS_BYTES: usize = 16 << 10;

/// Largest encoded handshake accepted.
pub const MAX_HANDSHAKE_BYTES: usize = 64 << 10;

/// The limits a reader applies to the first frame of a connection, before
/// the handshake: a payload of at most [`MAX_HANDSHAKE_BYTES`] and no
/// descriptor table or tensors, so a frame header announcing more is
/// refused before anything else is read or allocated.
pub fn handshake_limits() -> Limits {
    Limits {
        max_payload_bytes: MAX_HANDSHAKE_BYTES as u32,
        max_descriptor_bytes: 0,
        max_tensors: 0,
        max_dims: 0,
        max_tensor_bytes: 0,
        max_message_tensor_bytes: 0,
        frame_stall_timeout: crate::frame::DEFAULT_FRAME_STALL_TIMEOUT,
    }
}

impl Handshake {
    /// Encodes the handshake as a postcard payload.
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        postcard::to_stdvec(self).map_err(|e| WireError::Handshake(e.to_string()))
    }

    /// Decodes a handshake payload and checks its protocol version.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        if bytes.len() > MAX_HANDSHAKE_BYTES {
            return Err(WireError::TooLarge {
                what: "handshake",
                len: bytes.len() as u64,
                max: MAX_HANDSHAKE_BYTES as u64,
            });
        }
        let (h, rest): (Handshake, _) =
            postcard::take_from_bytes(bytes).map_err(|e| WireError::Handshake(e.to_string()))?;
        if !rest.is_empty() {
            return Err(WireError::Trailing {
                what: "handshake",
                count: rest.len() as u64,
            });
        }
        if let Some(a) = &h.ucx_address {
            if a.len() > MAX_UCX_ADDRESS_BYTES {
                return Err(WireError::TooLarge {
                    what: "UCX worker address",
                    len: a.len() as u64,
                    max: MAX_UCX_ADDRESS_BYTES as u64,
                });
            }
        }
        if h.protocol_version != PROTOCOL_VERSION {
            return Err(WireError::Handshake(format!(
                "peer {:?} speaks protocol version {}, this build speaks {}",
                crate::PeerText::new(&h.worker_name),
                h.protocol_version,
                PROTOCOL_VERSION
            )));
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Flags, FrameHeader, MessageKind, HEADER_LEN};

    fn header(payload_len: u32, descriptors_len: u32, tensor_count: u32) -> [u8; HEADER_LEN] {
        FrameHeader {
            kind: MessageKind::HANDSHAKE,
            flags: Flags::NONE,
            request_id: 0,
            payload_len,
            descriptors_len,
            tensor_count,
        }
        .encode()
    }

    #[test]
    fn the_first_frame_is_checked_against_the_handshake_cap() {
        let limits = handshake_limits();
        let max = MAX_HANDSHAKE_BYTES as u32;
        assert!(FrameHeader::decode(&header(max, 0, 0), &limits).is_ok());
        let err = FrameHeader::decode(&header(256 << 20, 0, 0), &limits).unwrap_err();
        assert_eq!(
            err.to_string(),
            WireError::TooLarge {
                what: "payload length",
                len: 256 << 20,
                max: max.into()
            }
            .to_string()
        );
        assert!(FrameHeader::decode(&header(10, 24, 1), &limits).is_err());
    }
}
