//! # ferry-wire
//!
//! Ferry's wire format, sans-IO: no sockets, no async runtime, no libtorch.
//! It defines what crosses a connection and how to check it:
//!
//! - [`TensorDescriptor`]: dtype, shape, strides, storage offset, byte length
//!   and device of a tensor, so a receiver can allocate before bytes arrive;
//! - [`FrameHeader`] and [`Frame`]: the message envelope (kind, request id,
//!   flags, payload length, descriptor table), with [`Limits`] enforced before
//!   any allocation;
//! - [`payload`]: serde values whose tensors are pulled out into an
//!   out-of-band tensor table, wherever they sit in the value;
//! - [`sparse`]: the layout of a sparse COO tensor, which travels as its
//!   indices and values tensors plus a [`SparseCoo`](sparse::SparseCoo)
//!   checked against their descriptors;
//! - [`channel_record`]: what stands in a frame for a tensor's bytes when a
//!   channel other than `inline` carries it (mode byte, `cma` and `mpt`
//!   records), and `cma` release lists; [`mpt_lane`]: the lane hello and
//!   chunk header of the multi-lane channel;
//! - [`Handshake`]: the first message of a connection, with the worker's name,
//!   rank, protocol version and transport/channel offers;
//! - [`PeerText`]: a peer's text (names, error texts) escaped and bounded
//!   for logs and error messages.
//!
//! Every decoder returns `Ok` or a typed [`WireError`] for any input; none
//! panics (proptest suites and cargo-fuzz targets check this).
//!
//! ```
//! use ferry_wire::{DType, Device, Flags, Frame, Limits, MessageKind, TensorDescriptor};
//!
//! let desc = TensorDescriptor::contiguous(DType::F32, &[2, 2], Device::Cpu);
//! let bytes = [0u8; 16];
//! let frame = Frame::encode(MessageKind::REQUEST, Flags::NONE, 7, &[desc.clone()], b"args", &[&bytes]);
//! let (decoded, used) = Frame::decode(&frame, &Limits::default()).unwrap();
//! assert_eq!(used, frame.len());
//! assert_eq!(decoded.header.request_id, 7);
//! assert_eq!(decoded.descriptors, vec![desc]);
//! assert_eq!(decoded.payload, b"args");
//! ```

mod catch;
pub mod channel_record;
mod descriptor;
mod device;
mod dtype;
mod error;
mod frame;
mod handshake;
pub mod kinds;
pub mod mpt_lane;
pub mod payload;
pub mod sparse;
mod text;

pub use descriptor::{contiguous_strides, Dims, TensorDescriptor};
pub use device::Device;
pub use dtype::DType;
pub use error::WireError;
pub use frame::{
    decode_descriptors, encode_descriptors, Flags, Frame, FrameHeader, Limits, MessageKind,
    DEFAULT_FRAME_STALL_TIMEOUT, DEFAULT_MAX_MESSAGE_TENSOR_BYTES, DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_MAX_TENSOR_BYTES, HEADER_LEN, MAGIC, WIRE_VERSION,
};
pub use handshake::{
    handshake_limits, ChannelChoice, ChannelOffer, DeviceOffer, Handshake, TransportOffer,
    MAX_HANDSHAKE_BYTES, MAX_UCX_ADDRESS_BYTES, PROTOCOL_VERSION,
};
pub use payload::{Encoded, IncomingTensor, OutgoingTensor};
pub use text::{needs_escape, PeerText, MAX_PEER_TEXT_CHARS};
