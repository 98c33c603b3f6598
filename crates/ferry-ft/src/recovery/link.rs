//! Small helpers over `ferry-transport` shared by live recovery and the
//! replica-group collectives: resolving and connecting with a deadline,
//! reading with a deadline, and serde messages with an out-of-band tensor
//! table.

use std::net::SocketAddr;
use std::time::Duration;

use ferry_transport::{
    channel, Endpoint, IncomingMessage, OutgoingMessage, PeerConnection, TransportError,
};
use ferry_wire::{payload, Flags, MessageKind, WireError};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::AsyncRead;

/// Why a connection could not be made.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectError {
    /// The address does not resolve.
    #[error("cannot resolve {address:?}: {reason}")]
    Resolve {
        /// The address given.
        address: String,
        /// Why.
        reason: String,
    },
    /// Connecting (TCP and handshake) took longer than allowed.
    #[error("connecting to {address} timed out after {timeout:?}")]
    Timeout {
        /// The address.
        address: String,
        /// The limit.
        timeout: Duration,
    },
    /// The socket or the handshake failed.
    #[error("cannot connect to {address}: {source}")]
    Transport {
        /// The address.
        address: String,
        /// The transport's error.
        #[source]
        source: TransportError,
    },
}

/// Resolves `address` (`host:port`) to its first socket address, within
/// `timeout`.
pub(crate) async fn resolve(address: &str, timeout: Duration) -> Result<SocketAddr, ConnectError> {
    lookup(address, timeout)
        .await
        .map_err(|reason| ConnectError::Resolve {
            address: address.to_owned(),
            reason,
        })
}

/// [`resolve`], the error being only why: a literal socket address is
/// parsed, anything else is looked up (`tokio::net::lookup_host` does both).
pub(crate) async fn lookup(address: &str, timeout: Duration) -> Result<SocketAddr, String> {
    let mut addrs = match tokio::time::timeout(timeout, tokio::net::lookup_host(address)).await {
        Ok(Ok(addrs)) => addrs,
        Ok(Err(error)) => return Err(error.to_string()),
        Err(_) => return Err(format!("no answer within {timeout:?}")),
    };
    addrs.next().ok_or_else(|| "no addresses".to_owned())
}

/// Connects to `addr` and runs the handshake, all within `timeout`.
pub(crate) async fn connect(
    addr: SocketAddr,
    local: &Endpoint,
    timeout: Duration,
) -> Result<PeerConnection, ConnectError> {
    match tokio::time::timeout(timeout, PeerConnection::connect(addr, local)).await {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(source)) => Err(ConnectError::Transport {
            address: addr.to_string(),
            source,
        }),
        Err(_) => Err(ConnectError::Timeout {
            address: addr.to_string(),
            timeout,
        }),
    }
}

/// Why a read with a deadline produced no message.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// Nothing within the deadline.
    Timeout,
    /// The peer closed the connection cleanly between frames.
    Closed,
    /// The transport failed (connection lost, malformed frame, ...).
    Transport(TransportError),
}

/// Reads the next message within `timeout`.
pub(crate) async fn read_message<R: AsyncRead + Unpin>(
    reader: &mut ferry_transport::FrameReader<R>,
    timeout: Duration,
) -> Result<IncomingMessage, ReadError> {
    match tokio::time::timeout(timeout, reader.read()).await {
        Ok(Ok(Some(message))) => Ok(message),
        Ok(Ok(None)) => Err(ReadError::Closed),
        Ok(Err(error)) => Err(ReadError::Transport(error)),
        Err(_) => Err(ReadError::Timeout),
    }
}

/// Whether a transport error means the peer is gone (rather than that it
/// sent something invalid).
pub(crate) fn is_connection_loss(error: &TransportError) -> bool {
    matches!(
        error,
        TransportError::Io { .. } | TransportError::Closed { .. }
    )
}

/// A message of `kind` carrying `value` (its tensors, if any, out of band).
pub(crate) fn message<T: Serialize + ?Sized>(
    kind: MessageKind,
    value: &T,
) -> Result<OutgoingMessage, WireError> {
    let encoded = payload::encode(value)?;
    Ok(OutgoingMessage {
        kind,
        flags: Flags::NONE,
        request_id: 0,
        payload: encoded.payload,
        tensors: encoded.tensors,
    })
}

/// Decodes a message's payload (and tensor table) as a `T`.
pub(crate) fn decode<T: DeserializeOwned>(message: IncomingMessage) -> Result<T, WireError> {
    payload::decode(&message.payload, message.tensors)
}

/// An endpoint for recovery connections: TCP and the `inline` channel only.
/// Recovery streams chunks over its own lanes with a deadline on every
/// write, so a healer that stops reading must back up into the socket (and
/// be cut off by the deadline) rather than pin the source's memory with
/// out-of-band transfers that wait for its release.
pub(crate) fn streaming_endpoint(name: &str) -> Endpoint {
    let mut endpoint = Endpoint::new(name, 0);
    endpoint.channels.retain(|c| c.name == channel::INLINE);
    endpoint.transports.retain(|t| t.name == channel::TCP);
    endpoint
}
