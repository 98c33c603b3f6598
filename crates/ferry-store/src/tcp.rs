//! The store over TCP: a server serving a [`MemoryStore`] and a client
//! multiplexing requests over one connection.
//!
//! Every message is a frame: its length as a `u32` little-endian, then
//! the body ([`format`](crate::format) encodes and decodes both; this
//! module only moves frames over sockets). A request carries an id, which its
//! response repeats; responses come back in any order, so a blocking
//! `get` or `wait` (waited for on the server) never holds up another
//! request on the same connection.

mod client;
pub(crate) mod connect;
mod frames;
pub(crate) mod served;
mod server;

pub use client::TcpStore;
pub use server::TcpStoreServer;
