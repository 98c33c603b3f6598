//! # ferry-transport
//!
//! Connections and tensor channels, with no libtorch and no RPC layer: the
//! crate another system embeds to move tensors between processes.
//!
//! - [`TcpConnection`]: a TCP connection (`TCP_NODELAY`) that starts with a
//!   [`Handshake`](ferry_wire::Handshake) and then carries frames; writes are
//!   vectored, so tensor bytes go to the socket from their own memory, and
//!   reads put tensor bytes straight into destinations allocated from their
//!   descriptors by an [`Allocator`] (the receive hook).
//! - Channels: `inline` (bytes follow the frame on the connection) for now;
//!   [`selection`] picks, per (source device, target device) pair, the
//!   highest-priority channel both ends accept, and both ends check they
//!   computed the same choice.
//! - [`RawTensor`]: a host tensor type with views (shape, strides, offset)
//!   that the layers above wrap; it travels out of band inside any serde
//!   payload.
//!
//! ```no_run
//! # async fn demo() -> Result<(), ferry_transport::TransportError> {
//! use std::sync::Arc;
//! use ferry_transport::{Endpoint, OutgoingMessage, RawTensor, TcpConnection};
//! use ferry_wire::{payload, Flags, MessageKind};
//!
//! let addr = "127.0.0.1:29500".parse().unwrap();
//! let mut conn = TcpConnection::connect(addr, &Endpoint::new("client", 0)).await?;
//! let tensor = RawTensor::from_slice(&[1.0f32, 2.0, 3.0], &[3])?;
//! let encoded = payload::encode(&("scale", tensor))?;
//! conn.writer
//!     .write(&OutgoingMessage {
//!         kind: MessageKind::REQUEST,
//!         flags: Flags::NONE,
//!         request_id: 1,
//!         payload: encoded.payload,
//!         tensors: encoded.tensors,
//!     })
//!     .await?;
//! let reply = conn.reader.read().await?.expect("a reply");
//! let (_, doubled): (String, RawTensor) = payload::decode(&reply.payload, reply.tensors)?;
//! # let _ = doubled; Ok(()) }
//! ```
//!
//! See `examples/echo.rs` for a complete server and client.

mod alloc;
pub mod channel;
mod connection;
mod error;
mod framing;
mod message;
pub mod selection;
mod tensor;

pub use alloc::{Allocator, RawAllocator, RecvBuffer};
pub use connection::{Connection, Endpoint, Role, TcpConnection};
pub use error::TransportError;
pub use framing::{FrameReader, FrameWriter};
pub use message::{IncomingMessage, OutgoingMessage};
pub use tensor::{Element, RawTensor, Storage, STORAGE_ALIGN};
