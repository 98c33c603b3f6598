//! Connections: a handshaken link to one peer, split into a frame reader
//! and a frame writer, with the transport and channels both ends selected.
//!
//! Every connection starts on TCP. After the handshake both ends know the
//! selected transport and channels, and set up what they need:
//! - the `shm` transport or `shm` channel: the accepting side listens on a
//!   fresh abstract Unix socket named in its handshake; the connecting side
//!   creates the shared-memory segments and passes their descriptors over it;
//! - the `cma` channel: nothing more (each handshake names the process);
//! - the `mpt` channel: the accepting side listens on a fresh TCP port named
//!   in its handshake, the connecting side opens the lanes (one set per
//!   direction).
//!
//! With the `shm` transport the frames then travel through the shared
//! rings; the TCP connection stays open unused beside them.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use ferry_wire::{
    ChannelChoice, ChannelOffer, Flags, Handshake, Limits, MessageKind, TransportOffer,
    PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpStream, UnixListener, UnixStream};

use crate::framing::{ReadChannels, Shared, WriteChannels};
use crate::mpt::{connect_lanes, LaneListener, MptReceiver, MptSender};
use crate::selection::{select_channels, select_transport, verify, Selection};
use crate::shm::{recv_fds, send_fds, ShmLink, ShmReader, ShmWriter};
use crate::{
    channel, Allocator, ChannelConfig, FrameReader, FrameWriter, OutgoingMessage, RawAllocator,
    TransportError,
};

/// Handshake property: the sender's process id.
const PROP_PID: &str = "pid";
/// Handshake property: the abstract Unix socket for shared-memory setup.
const PROP_SHM_SOCKET: &str = "shm.socket";
/// Handshake property: the TCP address for `mpt` lanes.
const PROP_MPT_ADDR: &str = "mpt.addr";
/// Handshake property: how many lanes per direction the connecting side opens.
const PROP_MPT_LANES: &str = "mpt.lanes";
/// Most `mpt` lanes per direction accepted from a peer.
pub const MAX_MPT_LANES: usize = 64;
/// How long the accepting side waits for the connecting side to finish
/// setting up shared memory or lanes.
const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

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
    /// Channel settings (small-tensor size, copy threads, lanes, ring sizes).
    pub config: ChannelConfig,
}

impl Endpoint {
    /// An endpoint offering every known transport and channel that is
    /// viable in this process, default limits and the [`RawAllocator`].
    pub fn new(worker_name: impl Into<String>, rank: u32) -> Self {
        Self {
            worker_name: worker_name.into(),
            rank,
            transports: channel::default_transports(),
            channels: channel::default_channels(),
            limits: Limits::default(),
            allocator: Arc::new(RawAllocator),
            config: ChannelConfig::default(),
        }
    }

    fn handshake(
        &self,
        selection: Vec<ChannelChoice>,
        properties: Vec<(String, String)>,
    ) -> Handshake {
        let mut properties = properties;
        properties.push((PROP_PID.into(), std::process::id().to_string()));
        Handshake {
            protocol_version: PROTOCOL_VERSION,
            worker_name: self.worker_name.clone(),
            rank: self.rank,
            transports: self.transports.clone(),
            channels: self.channels.clone(),
            selection,
            properties,
        }
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("worker_name", &self.worker_name)
            .field("rank", &self.rank)
            .field("transports", &self.transports)
            .field("channels", &self.channels)
            .finish_non_exhaustive()
    }
}

/// A handshaken connection over stream halves `R` and `W`.
pub struct Connection<R, W> {
    /// The peer's handshake.
    pub peer: Handshake,
    /// The transport the frames travel on (`"tcp"` or `"shm"`).
    pub transport: &'static str,
    /// Reads frames from the peer.
    pub reader: FrameReader<R>,
    /// Writes frames to the peer.
    pub writer: FrameWriter<W>,
}

impl<R, W> Connection<R, W> {
    /// The channel chosen for each device pair of tensors this side sends.
    pub fn outgoing_channels(&self) -> &[ChannelChoice] {
        self.writer.selection().choices()
    }
    /// The channel chosen for each device pair of tensors this side receives.
    pub fn incoming_channels(&self) -> &[ChannelChoice] {
        self.reader.selection().choices()
    }
}

/// A connection to a peer process: TCP, or shared-memory rings on one host.
pub type PeerConnection = Connection<PeerReader, PeerWriter>;

/// The reading half of a [`PeerConnection`]'s transport.
pub enum PeerReader {
    /// Frames arrive on the TCP connection.
    Tcp(OwnedReadHalf),
    /// Frames arrive through a shared-memory ring (the TCP connection is
    /// held open beside it).
    Shm(ShmReader, OwnedReadHalf),
}

/// The writing half of a [`PeerConnection`]'s transport.
pub enum PeerWriter {
    /// Frames leave on the TCP connection.
    Tcp(OwnedWriteHalf),
    /// Frames leave through a shared-memory ring.
    Shm(ShmWriter, OwnedWriteHalf),
}

impl AsyncRead for PeerReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PeerReader::Tcp(r) => Pin::new(r).poll_read(cx, buf),
            PeerReader::Shm(r, _) => Pin::new(r).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for PeerWriter {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            PeerWriter::Tcp(w) => Pin::new(w).poll_write(cx, buf),
            PeerWriter::Shm(w, _) => Pin::new(w).poll_write(cx, buf),
        }
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            PeerWriter::Tcp(w) => Pin::new(w).poll_write_vectored(cx, bufs),
            PeerWriter::Shm(w, _) => Pin::new(w).poll_write_vectored(cx, bufs),
        }
    }
    fn is_write_vectored(&self) -> bool {
        match self {
            PeerWriter::Tcp(w) => w.is_write_vectored(),
            PeerWriter::Shm(w, _) => w.is_write_vectored(),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PeerWriter::Tcp(w) => Pin::new(w).poll_flush(cx),
            PeerWriter::Shm(w, _) => Pin::new(w).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PeerWriter::Tcp(w) => Pin::new(w).poll_shutdown(cx),
            PeerWriter::Shm(w, _) => Pin::new(w).poll_shutdown(cx),
        }
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

/// What the two ends agreed on in the handshake.
struct Agreement {
    peer: Handshake,
    outgoing: Vec<ChannelChoice>,
    incoming: Vec<ChannelChoice>,
    transport: &'static str,
}

impl Agreement {
    /// Both directions' channels and the transport, as both ends compute them.
    fn compute(local: &Endpoint, peer: Handshake) -> Result<Agreement, TransportError> {
        Ok(Agreement {
            outgoing: select_channels(&local.channels, &peer.channels)?,
            incoming: select_channels(&peer.channels, &local.channels)?,
            transport: transport_name(select_transport(&local.transports, &peer.transports)),
            peer,
        })
    }

    fn uses(&self, name: &str) -> bool {
        self.outgoing
            .iter()
            .chain(&self.incoming)
            .any(|c| c.channel == name)
    }
    fn needs_shm(&self) -> bool {
        self.transport == channel::SHM_TRANSPORT || self.uses(channel::SHM)
    }
}

fn transport_name(name: Option<&str>) -> &'static str {
    match name {
        Some(channel::SHM_TRANSPORT) => channel::SHM_TRANSPORT,
        _ => channel::TCP,
    }
}

fn property<'a>(h: &'a Handshake, key: &str) -> Option<&'a str> {
    h.properties
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

impl PeerConnection {
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
        let io_err = |source| TransportError::Io {
            peer: peer_addr.clone(),
            source,
        };
        stream.set_nodelay(true).map_err(io_err)?;
        let local_ip = stream.local_addr().map_err(io_err)?.ip();
        let (r, w) = stream.into_split();
        let mut reader = FrameReader::new(
            PeerReader::Tcp(r),
            local.limits,
            local.allocator.clone(),
            Selection::default(),
            peer_addr.clone(),
        );
        let mut writer =
            FrameWriter::new(PeerWriter::Tcp(w), Selection::default(), peer_addr.clone());
        let fail = |reason: String| TransportError::Handshake {
            peer: peer_addr.clone(),
            reason,
        };
        let nonce = fresh_nonce();
        let (agreement, setup) = match role {
            Role::Connect => {
                let lanes = local.config.mpt_lanes.clamp(1, MAX_MPT_LANES);
                let props = vec![(PROP_MPT_LANES.into(), lanes.to_string())];
                writer
                    .write(&handshake_message(local.handshake(Vec::new(), props))?)
                    .await?;
                let peer = read_handshake(&mut reader, &fail).await?;
                let agreement = Agreement::compute(local, peer)?;
                verify(&agreement.outgoing, &agreement.peer.selection)?;
                let setup = connect_setup(&agreement, local, &fail).await?;
                (agreement, setup)
            }
            Role::Accept => {
                let peer = read_handshake(&mut reader, &fail).await?;
                let agreement = Agreement::compute(local, peer)?;
                let mut props = Vec::new();
                let shm_listener = if agreement.needs_shm() {
                    let name = format!("ferry/{}/{nonce:016x}", std::process::id());
                    let listener = bind_abstract(&name).map_err(&io_err)?;
                    props.push((PROP_SHM_SOCKET.into(), name));
                    Some(listener)
                } else {
                    None
                };
                let lane_listener = if agreement.uses(channel::MPT) {
                    let l = LaneListener::bind(local_ip).await.map_err(&io_err)?;
                    props.push((PROP_MPT_ADDR.into(), format!("{}/{nonce}", l.local_addr())));
                    Some(l)
                } else {
                    None
                };
                writer
                    .write(&handshake_message(
                        local.handshake(agreement.incoming.clone(), props),
                    )?)
                    .await?;
                let setup = tokio::time::timeout(
                    SETUP_TIMEOUT,
                    accept_setup(&agreement, shm_listener, lane_listener, nonce, &fail),
                )
                .await
                .map_err(|_| fail("the peer did not finish setting up its channels".into()))??;
                (agreement, setup)
            }
        };
        let Agreement {
            peer,
            outgoing,
            incoming,
            transport,
        } = agreement;
        let name = peer.worker_name.clone();
        let peer_pid: Option<i32> = property(&peer, PROP_PID).and_then(|p| p.parse().ok());
        let uses_cma_in = incoming.iter().any(|c| c.channel == channel::CMA);
        let uses_cma_out = outgoing.iter().any(|c| c.channel == channel::CMA);
        if uses_cma_in && peer_pid.is_none() {
            return Err(fail(
                "cma is selected but the peer did not name its process".into(),
            ));
        }
        let gone = setup.peer_gone;
        let (frames, data) = (setup.frames, setup.data);
        let (data_reader, data_writer) = match data {
            Some(link) => {
                let (r, w) = link.split(gone.clone().map(|g| g.future()));
                (
                    Some(Box::new(r) as Box<dyn AsyncRead + Send + Unpin>),
                    Some(Box::new(w) as Box<dyn AsyncWrite + Send + Unpin>),
                )
            }
            None => (None, None),
        };
        let (mpt_in, mpt_out) = match setup.lanes {
            Some((incoming_lanes, outgoing_lanes)) => (
                Some(MptReceiver::new(incoming_lanes, name.clone())),
                Some(MptSender::new(outgoing_lanes, name.clone())),
            ),
            None => (None, None),
        };
        let shared = Arc::new(Shared::default());
        if let Some(link) = frames {
            // From here on frames travel through the rings. Nothing may be
            // buffered from the TCP stream: both ends send nothing on it
            // after the handshake when the shm transport is selected.
            let (sr, sw) = link.split(gone.map(|g| g.future()));
            reader = reader
                .map_stream(|r| match r {
                    PeerReader::Tcp(tcp) | PeerReader::Shm(_, tcp) => PeerReader::Shm(sr, tcp),
                })
                .map_err(|n| fail(format!("{n} bytes arrived on TCP after the handshake")))?;
            writer = writer.map_stream(|w| match w {
                PeerWriter::Tcp(tcp) | PeerWriter::Shm(_, tcp) => PeerWriter::Shm(sw, tcp),
            });
        }
        reader.set_selection(Selection::new(incoming));
        reader.set_peer(name.clone());
        writer.set_selection(Selection::new(outgoing));
        writer.set_peer(name.clone());
        reader.set_channels(
            ReadChannels {
                cma_pid: if uses_cma_in { peer_pid } else { None },
                shm: data_reader,
                mpt: mpt_in,
                cma_threads: local.config.cma_threads,
            },
            shared.clone(),
        );
        writer.set_channels(
            WriteChannels {
                cma: uses_cma_out,
                shm: data_writer,
                mpt: mpt_out,
                small_tensor_bytes: local.config.small_tensor_bytes,
            },
            shared,
        );
        Ok(Connection {
            peer,
            transport,
            reader,
            writer,
        })
    }
}

impl<R: AsyncRead + Unpin, W: AsyncWrite + Unpin> Connection<R, W> {
    /// Runs the handshake over any byte stream halves (in-memory pipes in
    /// tests). Only the `inline` channel and the given stream are used: the
    /// same-host and multi-lane set-up needs [`PeerConnection`].
    pub async fn handshake(
        r: R,
        w: W,
        peer_addr: String,
        local: &Endpoint,
        role: Role,
    ) -> Result<Self, TransportError> {
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
        let inline_only: Vec<ChannelOffer> = local
            .channels
            .iter()
            .filter(|c| c.name == channel::INLINE)
            .cloned()
            .collect();
        let mut me = local.clone();
        me.channels = inline_only;
        let (peer, outgoing, incoming) = match role {
            Role::Connect => {
                writer
                    .write(&handshake_message(me.handshake(Vec::new(), Vec::new()))?)
                    .await?;
                let peer = read_handshake(&mut reader, &fail).await?;
                let outgoing = select_channels(&me.channels, &peer.channels)?;
                verify(&outgoing, &peer.selection)?;
                let incoming = select_channels(&peer.channels, &me.channels)?;
                (peer, outgoing, incoming)
            }
            Role::Accept => {
                let peer = read_handshake(&mut reader, &fail).await?;
                let incoming = select_channels(&peer.channels, &me.channels)?;
                let outgoing = select_channels(&me.channels, &peer.channels)?;
                writer
                    .write(&handshake_message(
                        me.handshake(incoming.clone(), Vec::new()),
                    )?)
                    .await?;
                (peer, outgoing, incoming)
            }
        };
        let name = peer.worker_name.clone();
        reader.set_peer(name.clone());
        writer.set_peer(name);
        Ok(Connection {
            peer,
            transport: channel::TCP,
            reader: reader.with_selection(Selection::new(incoming)),
            writer: writer.with_selection(Selection::new(outgoing)),
        })
    }
}

/// What the set-up after the handshake produced.
#[derive(Default)]
struct Setup {
    /// Rings for the frames (the `shm` transport).
    frames: Option<ShmLink>,
    /// Rings for tensor bytes (the `shm` channel).
    data: Option<ShmLink>,
    /// Fires when the peer process exits (same host only).
    peer_gone: Option<ProcessWatch>,
    /// Lanes (incoming, outgoing) for `mpt`.
    lanes: Option<(Vec<TcpStream>, Vec<TcpStream>)>,
}

/// Connecting side: create the shared memory and pass it; open the lanes.
async fn connect_setup(
    agreement: &Agreement,
    local: &Endpoint,
    fail: &impl Fn(String) -> TransportError,
) -> Result<Setup, TransportError> {
    let mut setup = Setup::default();
    let peer = &agreement.peer;
    if agreement.needs_shm() {
        let socket = property(peer, PROP_SHM_SOCKET)
            .ok_or_else(|| fail("shared memory is selected but the peer named no socket".into()))?;
        let stream = connect_abstract(socket)
            .map_err(|e| fail(format!("connecting to {socket:?} failed: {e}")))?;
        let mut fds: Vec<OwnedFd> = Vec::new();
        let mut kinds = [0u8; 2];
        if agreement.transport == channel::SHM_TRANSPORT {
            let (link, f) = ShmLink::create(local.config.shm_transport_ring)?;
            setup.frames = Some(link);
            fds.extend(f);
            kinds[0] = 1;
        }
        if agreement.uses(channel::SHM) {
            let (link, f) = ShmLink::create(local.config.shm_channel_ring)?;
            setup.data = Some(link);
            fds.extend(f);
            kinds[1] = 1;
        }
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        send_fds(&stream, &kinds, &borrowed)
            .await
            .map_err(|e| fail(format!("passing shared memory failed: {e}")))?;
        setup.peer_gone = Some(ProcessWatch::watch(peer, fail)?);
    }
    if agreement.uses(channel::MPT) {
        let addr = property(peer, PROP_MPT_ADDR)
            .ok_or_else(|| fail("mpt is selected but the peer named no lane address".into()))?;
        let (addr, nonce) = addr
            .split_once('/')
            .and_then(|(a, n)| Some((a.parse::<SocketAddr>().ok()?, n.parse::<u64>().ok()?)))
            .ok_or_else(|| fail(format!("bad lane address {addr:?}")))?;
        let n = local.config.mpt_lanes.clamp(1, MAX_MPT_LANES);
        let mut lanes = connect_lanes(addr, nonce, 2 * n, SETUP_TIMEOUT).await?;
        let incoming = lanes.split_off(n);
        setup.lanes = Some((incoming, lanes));
    }
    Ok(setup)
}

/// Accepting side: take the passed shared memory; accept the lanes.
async fn accept_setup(
    agreement: &Agreement,
    shm_listener: Option<UnixListener>,
    lane_listener: Option<LaneListener>,
    nonce: u64,
    fail: &impl Fn(String) -> TransportError,
) -> Result<Setup, TransportError> {
    let mut setup = Setup::default();
    if let Some(listener) = shm_listener {
        let (stream, _) = listener
            .accept()
            .await
            .map_err(|e| fail(format!("accepting the shared-memory socket failed: {e}")))?;
        let mut kinds = [0u8; 2];
        let (n, mut fds) = recv_fds(&stream, &mut kinds, 2 * ShmLink::FD_COUNT)
            .await
            .map_err(|e| fail(format!("receiving shared memory failed: {e}")))?;
        let want_frames = agreement.transport == channel::SHM_TRANSPORT;
        let want_data = agreement.uses(channel::SHM);
        if n != 2 || (kinds[0] == 1) != want_frames || (kinds[1] == 1) != want_data {
            return Err(fail(format!(
                "the peer passed shared memory for {kinds:?}, expected frames={want_frames} data={want_data}"
            )));
        }
        let expected = ShmLink::FD_COUNT * (usize::from(want_frames) + usize::from(want_data));
        if fds.len() != expected {
            return Err(fail(format!(
                "the peer passed {} descriptors, expected {expected}",
                fds.len()
            )));
        }
        let mut rest = fds.split_off(0).into_iter();
        if want_frames {
            setup.frames = Some(ShmLink::open(
                rest.by_ref().take(ShmLink::FD_COUNT).collect(),
            )?);
        }
        if want_data {
            setup.data = Some(ShmLink::open(
                rest.by_ref().take(ShmLink::FD_COUNT).collect(),
            )?);
        }
        setup.peer_gone = Some(ProcessWatch::watch(&agreement.peer, fail)?);
    }
    if let Some(listener) = lane_listener {
        let lanes_each = property(&agreement.peer, PROP_MPT_LANES)
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|n| (1..=MAX_MPT_LANES).contains(n))
            .ok_or_else(|| {
                fail(format!(
                    "the peer asks for no valid lane count (1..={MAX_MPT_LANES})"
                ))
            })?;
        let mut lanes = listener
            .accept(nonce, 2 * lanes_each, SETUP_TIMEOUT)
            .await?;
        // The connecting side sends on the first half: that is our incoming.
        let outgoing = lanes.split_off(lanes_each);
        setup.lanes = Some((lanes, outgoing));
    }
    Ok(setup)
}

/// Fires when the peer process exits: a pidfd, readable once it is gone.
#[derive(Clone)]
struct ProcessWatch {
    fd: Arc<tokio::io::unix::AsyncFd<OwnedFd>>,
}

impl ProcessWatch {
    fn watch(
        peer: &Handshake,
        fail: &impl Fn(String) -> TransportError,
    ) -> Result<Self, TransportError> {
        let pid = property(peer, PROP_PID)
            .and_then(|p| p.parse::<i32>().ok())
            .and_then(rustix::process::Pid::from_raw)
            .ok_or_else(|| fail("the peer did not name its process".into()))?;
        let fd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::NONBLOCK)
            .map_err(|e| fail(format!("cannot watch process {pid:?}: {e}")))?;
        // SAFETY: `fd` is an open pidfd that the AsyncFd owns from here on,
        // so it stays open and the same for the AsyncFd's lifetime.
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
        }
        .map_err(|e| fail(format!("cannot watch process {pid:?}: {e}")))?;
        Ok(ProcessWatch { fd: Arc::new(fd) })
    }

    fn future(self) -> Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(async move {
            // A pidfd becomes readable when the process exits; an error
            // means the watch is broken, which is treated the same way.
            let _ = self.fd.readable().await;
        })
    }
}

fn fresh_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
}

fn bind_abstract(name: &str) -> io::Result<UnixListener> {
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr)?;
    listener.set_nonblocking(true)?;
    UnixListener::from_std(listener)
}

fn connect_abstract(name: &str) -> io::Result<UnixStream> {
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let stream = std::os::unix::net::UnixStream::connect_addr(&addr)?;
    stream.set_nonblocking(true)?;
    UnixStream::from_std(stream)
}

fn handshake_message(h: Handshake) -> Result<OutgoingMessage, TransportError> {
    Ok(OutgoingMessage {
        kind: MessageKind::HANDSHAKE,
        flags: Flags::NONE,
        request_id: 0,
        payload: h.encode()?,
        tensors: Vec::new(),
    })
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
