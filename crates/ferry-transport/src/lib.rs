//! # ferry-transport
//!
//! Connections and tensor channels, with no libtorch and no RPC layer: the
//! crate another system embeds to move tensors between processes.
//!
//! - [`PeerConnection`]: a link to one peer that starts on TCP with a
//!   [`Handshake`](ferry_wire::Handshake), then carries frames on the
//!   selected *transport*: the TCP connection itself, or (both ends on one
//!   host) a pair of lock-free rings in shared memory ([`shm`]), woken
//!   through eventfds only when the reader sleeps.
//! - *Channels* move tensor bytes ([`channel`]): `cma` (the receiver pulls
//!   them from the sender's memory with one `process_vm_readv`), `shm` (a
//!   shared-memory ring, for hosts that forbid CMA), `mpt` (chunks over
//!   several TCP connections in parallel, [`mpt`]) and `inline` (after the
//!   frame), and with the `ucx` feature `ucx` (UCX tag messages straight
//!   between the tensor's memory and its destination; also a transport for
//!   the frames), and with the `cuda` feature `cuda_staged` and `cuda_ipc`
//!   for CUDA tensors ([`cuda`]; without CUDA a CUDA tensor transfer fails
//!   with "CUDA not available on this host"). [`device_map`]s (PyTorch's)
//!   decide the device each received tensor lands on. [`selection`] picks,
//!   per (source device, target device) pair,
//!   the highest-priority channel both ends accept, and both ends check
//!   they computed the same choice. Options restrict and reorder the lists.
//! - Receiving: an [`Allocator`] (the receive hook) provides each tensor's
//!   destination from its descriptor, and the channel writes the bytes
//!   straight into it. The default one takes destinations from a
//!   [`BufferPool`] of reused memory, made resident step by step as the
//!   bytes arrive.
//! - Sending: writes are vectored, so tensor bytes go out from their own
//!   memory; an out-of-band tensor stays alive until the peer released it.
//! - [`RawTensor`]: a host tensor type with views (shape, strides, offset)
//!   that the layers above wrap; it travels out of band inside any serde
//!   payload.
//!
//! ```no_run
//! # async fn demo() -> Result<(), ferry_transport::TransportError> {
//! use std::sync::Arc;
//! use ferry_transport::{Endpoint, OutgoingMessage, PeerConnection, RawTensor};
//! use ferry_wire::{payload, Flags, MessageKind};
//!
//! let addr = "127.0.0.1:29500".parse().unwrap();
//! let mut conn = PeerConnection::connect(addr, &Endpoint::new("client", 0)).await?;
//! println!("frames over {}, tensors over {:?}", conn.transport, conn.outgoing_channels());
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

#[cfg(not(loom))]
pub mod accept;
mod alloc;
#[cfg(not(loom))]
pub mod auth;
pub mod channel;
mod cma;
pub mod cuda;
pub mod device_map;
// Under `--cfg loom` (the model checks of the shared-memory ring) tokio has
// no I/O, so only the ring and what it needs are built.
#[cfg(not(loom))]
mod connection;
mod error;
#[cfg(not(loom))]
mod framing;
mod keepalive;
mod message;
#[cfg(not(loom))]
pub mod mpt;
mod pool;
pub mod selection;
pub mod shm;
#[cfg(not(loom))]
pub mod spin;
mod tensor;
#[cfg(all(feature = "ucx", not(loom)))]
pub mod ucx;

pub use alloc::{host_destination_len, Allocator, RawAllocator, RecvBuffer};
/// A connection's set-up as a pure state machine (bytes and events in,
/// bytes, actions and an outcome out), which [`PeerConnection`] drives.
#[cfg(not(loom))]
pub use connection::machine as setup_machine;
#[cfg(not(loom))]
pub use connection::{
    Connection, Endpoint, PeerConnection, PeerReader, PeerWriter, TcpReader, TcpWriter,
    UcxFallback, UcxUnusable, MAX_MPT_LANES,
};
pub use error::TransportError;
#[cfg(not(loom))]
pub use framing::{
    ChannelConfig, FrameReader, FrameWriter, ReleaseSignal, DEFAULT_SMALL_TENSOR_BYTES,
};
pub use keepalive::{Keepalive, KeepaliveError};
pub use message::{IncomingMessage, OutgoingMessage};
pub use pool::{advise_huge_pages, BufferPool, PoolStats, DEFAULT_POOL_LIMIT, POOL_MIN};
pub use tensor::{Element, RawTensor, Storage, STORAGE_ALIGN};
