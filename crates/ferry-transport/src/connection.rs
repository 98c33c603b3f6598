//! Connections: a byte stream after a completed handshake, split into a
//! frame reader and a frame writer.

use std::net::SocketAddr;
use std::sync::Arc;

use ferry_wire::{
    ChannelOffer, Flags, Handshake, Limits, MessageKind, TransportOffer, PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::selection::{select_channels, verify, Selection};
use crate::{
    channel, Allocator, FrameReader, FrameWriter, OutgoingMessage, RawAllocator, TransportError,
};

/// What one side of a connection says about itself and how it reads.
#[derive(Clone)]
pub struct Endpoint {
    /// This worker's name.
    pub worker_name: String,
    /// This worker's rank.
    pub rank: u32,
    /// Transports offered.
    pub transports: Vec<TransportOffer>,
    /// Channels offered.
    pub channels: Vec<ChannelOffer>,
    /// Limits enforced on everything read.
    pub limits: Limits,
    /// The receive hook for incoming tensors.
    pub allocator: Arc<dyn Allocator>,
}

impl Endpoint {
    /// An endpoint offering every known transport and channel, default
    /// limits and the [`RawAllocator`].
    pub fn new(worker_name: impl Into<String>, rank: u32) -> Self {
        Self {
            worker_name: worker_name.into(),
            rank,
            transports: channel::default_transports(),
            channels: channel::default_channels(),
            limits: Limits::default(),
            allocator: Arc::new(RawAllocator),
        }
    }

    fn handshake(&self, selection: Vec<ferry_wire::ChannelChoice>) -> Handshake {
        Handshake {
            protocol_version: PROTOCOL_VERSION,
            worker_name: self.worker_name.clone(),
            rank: self.rank,
            transports: self.transports.clone(),
            channels: self.channels.clone(),
            selection,
            properties: Vec::new(),
        }
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("worker_name", &self.worker_name)
            .field("rank", &self.rank)
            .field("channels", &self.channels)
            .finish_non_exhaustive()
    }
}

/// A handshaken connection over stream `S`.
pub struct Connection<R, W> {
    /// The peer's handshake.
    pub peer: Handshake,
    /// Reads frames from the peer.
    pub reader: FrameReader<R>,
    /// Writes frames to the peer.
    pub writer: FrameWriter<W>,
}

/// A handshaken TCP connection.
pub type TcpConnection = Connection<OwnedReadHalf, OwnedWriteHalf>;

impl TcpConnection {
    /// Connects to `addr` and runs the handshake as the connecting side.
    pub async fn connect(addr: SocketAddr, local: &Endpoint) -> Result<Self, TransportError> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| TransportError::Io {
                peer: addr.to_string(),
                source: e,
            })?;
        Self::establish(stream, local, Role::Connect).await
    }

    /// Runs the handshake as the accepting side on a socket from a listener.
    pub async fn accept(stream: TcpStream, local: &Endpoint) -> Result<Self, TransportError> {
        Self::establish(stream, local, Role::Accept).await
    }

    async fn establish(
        stream: TcpStream,
        local: &Endpoint,
        role: Role,
    ) -> Result<Self, TransportError> {
        let peer_addr = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "unknown peer".into());
        stream.set_nodelay(true).map_err(|e| TransportError::Io {
            peer: peer_addr.clone(),
            source: e,
        })?;
        let (r, w) = stream.into_split();
        Connection::handshake(r, w, peer_addr, local, role).await
    }
}

/// Which side of the handshake this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Sends its handshake first, then checks the reply's selection.
    Connect,
    /// Reads the peer's handshake first, replies with its own and the selection.
    Accept,
}

impl<R: AsyncRead + Unpin, W: AsyncWrite + Unpin> Connection<R, W> {
    /// Runs the handshake over any byte stream halves (TCP, in-memory pipes in tests).
    pub async fn handshake(
        r: R,
        w: W,
        peer_addr: String,
        local: &Endpoint,
        role: Role,
    ) -> Result<Self, TransportError> {
        // The handshake itself carries no tensors: an empty selection suffices.
        let empty = Selection::default();
        let mut reader = FrameReader::new(
            r,
            local.limits,
            local.allocator.clone(),
            empty.clone(),
            peer_addr.clone(),
        );
        let mut writer = FrameWriter::new(w, empty, peer_addr.clone());
        let fail = |reason: String| TransportError::Handshake {
            peer: peer_addr.clone(),
            reason,
        };
        let send = |h: Handshake| -> Result<OutgoingMessage, TransportError> {
            Ok(OutgoingMessage {
                kind: MessageKind::HANDSHAKE,
                flags: Flags::NONE,
                request_id: 0,
                payload: h.encode()?,
                tensors: Vec::new(),
            })
        };
        let (peer, outgoing, incoming) = match role {
            Role::Connect => {
                writer.write(&send(local.handshake(Vec::new()))?).await?;
                let peer = read_handshake(&mut reader, &fail).await?;
                let outgoing = select_channels(&local.channels, &peer.channels)?;
                verify(&outgoing, &peer.selection)?;
                let incoming = select_channels(&peer.channels, &local.channels)?;
                (peer, outgoing, incoming)
            }
            Role::Accept => {
                let peer = read_handshake(&mut reader, &fail).await?;
                let incoming = select_channels(&peer.channels, &local.channels)?;
                let outgoing = select_channels(&local.channels, &peer.channels)?;
                writer
                    .write(&send(local.handshake(incoming.clone()))?)
                    .await?;
                (peer, outgoing, incoming)
            }
        };
        let name = peer.worker_name.clone();
        reader.set_peer(name.clone());
        writer.set_peer(name.clone());
        Ok(Connection {
            peer,
            reader: reader.with_selection(Selection::new(incoming)),
            writer: writer.with_selection(Selection::new(outgoing)),
        })
    }
}

async fn read_handshake<R: AsyncRead + Unpin>(
    reader: &mut FrameReader<R>,
    fail: &impl Fn(String) -> TransportError,
) -> Result<Handshake, TransportError> {
    let msg = reader
        .read()
        .await?
        .ok_or_else(|| fail("connection closed before the handshake".into()))?;
    if msg.header.kind != MessageKind::HANDSHAKE {
        return Err(fail(format!(
            "expected a handshake, got a {} frame",
            msg.header.kind
        )));
    }
    Handshake::decode(&msg.payload).map_err(|e| fail(e.to_string()))
}
