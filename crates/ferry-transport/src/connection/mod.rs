//! Connections: a handshaken link to one peer, split into a frame reader
//! and a frame writer, with the transport and channels both ends selected.
//!
//! Every connection starts on TCP. After the handshake both ends know the
//! selected transport and channels, and set up what they need:
//! - the `shm` transport or `shm` channel: the accepting side listens on a
//!   fresh abstract Unix socket named in its handshake; the connecting side
//!   creates the shared-memory segments and passes their descriptors over it;
//! - the `cma` channel: only with the `shm` transport, whose set-up names
//!   the peer process through the kernel (`SO_PEERCRED` on the Unix
//!   socket); `cma` reads from that process only;
//! - the `mpt` channel: the accepting side listens on a fresh TCP port named
//!   in its handshake, the connecting side opens the lanes (one set per
//!   direction).
//!
//! With the `shm` transport the frames then travel through the shared
//! rings; the TCP connection stays open unused beside them.

use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use ferry_wire::{
    handshake_limits, ChannelChoice, ChannelOffer, Flags, Handshake, Limits, MessageKind, PeerText,
    TransportOffer, PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::framing::{ReadChannels, Shared, WriteChannels};
use crate::mpt::{LaneListener, MptReceiver, MptSender};
use crate::selection::{
    disclosed_channels, disclosed_transports, select_channels, select_transport, verify, Selection,
};
use crate::{
    channel, Allocator, ChannelConfig, FrameReader, FrameWriter, Keepalive, OutgoingMessage,
    RawAllocator, TransportError,
};

/// Handshake property: the abstract Unix socket for shared-memory setup.
const PROP_SHM_SOCKET: &str = "shm.socket";
/// Handshake property: the TCP address for `mpt` lanes.
const PROP_MPT_ADDR: &str = "mpt.addr";
/// Handshake property: how many lanes per direction the connecting side opens.
const PROP_MPT_LANES: &str = "mpt.lanes";
/// Handshake property of the UCX check (see [`UcxFallback`]): `ok`, or
/// `endpoint: <why>` / `exchange: <why>`.
const PROP_UCX_CHECK: &str = "ucx.check";
/// Handshake property: the address of the accepting side's UCX listener
/// (see [`UcxWorker::listen`]), where the connecting side connects through
/// UCX's connection manager instead of to the worker address.
const PROP_UCX_LISTENER: &str = "ucx.listener";
/// Handshake property of the connecting side: `1` when it can connect to
/// a UCX listener (its UCX transports include a network one, see
/// [`UcxWorker::may_detect_peer_failure`]); the accepting side listens only
/// then.
const PROP_UCX_CLIENT_SERVER: &str = "ucx.client_server";
/// How long each side waits for the peer's UCX probe.
const UCX_CHECK_TIMEOUT: Duration = Duration::from_secs(10);
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
    /// TCP keepalive and `TCP_USER_TIMEOUT` of the connection's socket.
    pub keepalive: Keepalive,
    /// The group's shared secret: with one, each side proves it holds it
    /// ([`auth`](crate::auth)) before either reads a frame, and the
    /// shared-memory socket and `mpt` lanes set up for the connection are
    /// authenticated with the connection's session key. `None`: no
    /// authentication (both ends must agree).
    pub auth: Option<crate::auth::Secret>,
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
            keepalive: Keepalive::default(),
            auth: None,
        }
    }

    /// This side's handshake. The accepting side passes the peer's
    /// (already accepted) handshake and shows only the offers whose domain
    /// descriptors the peer gave too ([`disclosed_channels`]): boot ids,
    /// namespace and user ids reach only a peer that has them already.
    fn handshake(
        &self,
        peer: Option<&Handshake>,
        selection: Vec<ChannelChoice>,
        properties: Vec<(String, String)>,
        ucx_address: Option<Vec<u8>>,
    ) -> Handshake {
        let (transports, channels) = match peer {
            Some(p) => (
                disclosed_transports(&self.transports, &p.transports),
                disclosed_channels(&self.channels, &p.channels),
            ),
            None => (self.transports.clone(), self.channels.clone()),
        };
        Handshake {
            protocol_version: PROTOCOL_VERSION,
            worker_name: self.worker_name.clone(),
            rank: self.rank,
            transports,
            channels,
            selection,
            properties,
            limits: self.limits,
            ucx_address,
        }
    }

    /// Whether this side offers a `ucx` transport or channel.
    fn offers_ucx(&self) -> bool {
        self.transports
            .iter()
            .any(|t| t.name == channel::UCX_TRANSPORT)
            || self.channels.iter().any(|c| c.name == channel::UCX)
    }

    /// This endpoint without its `ucx` offers.
    fn without_ucx(&self) -> Endpoint {
        let mut e = self.clone();
        e.transports.retain(|t| t.name != channel::UCX_TRANSPORT);
        e.channels.retain(|c| c.name != channel::UCX);
        e
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("worker_name", &self.worker_name)
            .field("rank", &self.rank)
            .field("transports", &self.transports)
            .field("channels", &self.channels)
            .field("keepalive", &self.keepalive)
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
    /// Why UCX was left out after the selection picked it, if it was.
    pub ucx_fallback: Option<UcxFallback>,
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

/// Why UCX, though selected for a connection, could not be used by one side.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UcxUnusable {
    /// No endpoint to the peer's UCX worker: the peer sent no worker
    /// address, or UCX found none of its transports reaching it (e.g. the
    /// two sides' `UCX_TLS` have nothing in common).
    #[error("no UCX endpoint to the peer's worker: {}", PeerText::new(.0))]
    Endpoint(String),
    /// The endpoint exists, but the first UCX exchange (a probe each way)
    /// failed or did not arrive in time.
    #[error("the first UCX exchange failed: {}", PeerText::new(.0))]
    Exchange(String),
}

/// Why a connection fell back from UCX to the next viable transport and
/// channels: what each side's UCX check found (at least one failed).
///
/// When the selection picks the `ucx` transport or channel, both sides
/// connect their UCX endpoints and send each other a probe; each reports
/// the result over TCP. Should either fail, both compute the selection
/// again without UCX (e.g. `mpt` over `tcp`), log a warning with this
/// reason and record it in [`Connection::ucx_fallback`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("UCX is unusable with this peer ({})", Sides(.local, .peer))]
pub struct UcxFallback {
    /// What this side found, if it failed.
    pub local: Option<UcxUnusable>,
    /// What the peer reported, if it failed.
    pub peer: Option<UcxUnusable>,
}

/// Shows both sides' failures.
struct Sides<'a>(&'a Option<UcxUnusable>, &'a Option<UcxUnusable>);

impl std::fmt::Display for Sides<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.0, self.1) {
            (Some(l), Some(p)) => write!(f, "this side: {l}; the peer: {p}"),
            (Some(l), None) => write!(f, "this side: {l}"),
            (None, Some(p)) => write!(f, "the peer: {p}"),
            (None, None) => f.write_str("no side failed"),
        }
    }
}

/// Connects `worker` to the peer's worker and exchanges the probe. With
/// `accept_from` (the accepting side, listening), it accepts the peer's
/// connection from that address on this side's listener; otherwise it
/// connects to the listener the peer's handshake names, or else to the
/// peer's worker address.
async fn ucx_check(
    worker: Option<UcxWorker>,
    peer: &Handshake,
    nonce: u64,
    accept_from: Option<IpAddr>,
) -> Result<UcxLink, UcxUnusable> {
    let worker =
        worker.ok_or_else(|| UcxUnusable::Endpoint("this side has no UCX worker".into()))?;
    let name = PeerText::new(&peer.worker_name).to_string();
    let link = match (accept_from, property(peer, PROP_UCX_LISTENER)) {
        (Some(from), _) => worker.accept(from, &name, UCX_CHECK_TIMEOUT).await,
        (None, Some(text)) => {
            let addr: SocketAddr = text.parse().map_err(|_| {
                UcxUnusable::Endpoint(format!(
                    "the peer's UCX listener address {:?} is not an IP address and port",
                    PeerText::new(text)
                ))
            })?;
            worker.connect_to_listener(addr, &name)
        }
        (None, None) => {
            let address = peer.ucx_address.as_deref().ok_or_else(|| {
                UcxUnusable::Endpoint("the peer sent no UCX worker address".into())
            })?;
            worker.connect(address, &name)
        }
    }
    .map_err(|e| UcxUnusable::Endpoint(e.to_string()))?;
    link.probe(nonce, UCX_CHECK_TIMEOUT)
        .await
        .map_err(UcxUnusable::Exchange)?;
    Ok(link)
}

/// The `ucx.check` property for a check's result.
fn check_text<T>(result: &Result<T, UcxUnusable>) -> String {
    match result {
        Ok(_) => "ok".into(),
        Err(UcxUnusable::Endpoint(why)) => format!("endpoint: {why}"),
        Err(UcxUnusable::Exchange(why)) => format!("exchange: {why}"),
    }
}

/// The peer's check result from its `ucx.check` property: `None` when it
/// succeeded.
fn parse_check(
    h: &Handshake,
    fail: &impl Fn(String) -> TransportError,
) -> Result<Option<UcxUnusable>, TransportError> {
    let text = property(h, PROP_UCX_CHECK)
        .ok_or_else(|| fail("the peer sent no UCX check result".into()))?;
    if text == "ok" {
        return Ok(None);
    }
    if let Some(why) = text.strip_prefix("endpoint: ") {
        return Ok(Some(UcxUnusable::Endpoint(why.into())));
    }
    if let Some(why) = text.strip_prefix("exchange: ") {
        return Ok(Some(UcxUnusable::Exchange(why.into())));
    }
    Err(fail(format!(
        "the peer's UCX check result {:?} is none of ok, endpoint: ..., exchange: ...",
        PeerText::new(text)
    )))
}

fn warn_fallback(peer: &Handshake, why: &UcxFallback) {
    tracing::warn!(
        peer = %PeerText::new(&peer.worker_name),
        reason = %why,
        "UCX selected but unusable: falling back to the next viable transport and channels"
    );
}

/// What the accepting side listens on for the set-up after the handshake.
#[derive(Default)]
struct Listeners {
    shm: Option<tokio::net::UnixListener>,
    lanes: Option<LaneListener>,
}

/// Binds what `agreement` needs set up (the shared-memory socket, the
/// `mpt` lane listener) and the handshake properties that name them.
async fn bind_listeners(
    agreement: &Agreement,
    nonce: u64,
    local_ip: IpAddr,
) -> std::io::Result<(Vec<(String, String)>, Listeners)> {
    let mut props = Vec::new();
    let mut listeners = Listeners::default();
    if agreement.needs_shm() {
        // No pid in the name: the peer learns nothing it does not need.
        let name = format!("ferry/{nonce:016x}{:016x}", fresh_nonce());
        listeners.shm = Some(bind_abstract(&name)?);
        props.push((PROP_SHM_SOCKET.into(), name));
    }
    if agreement.uses(channel::MPT) {
        let l = LaneListener::bind(local_ip).await?;
        props.push((PROP_MPT_ADDR.into(), format!("{}/{nonce}", l.local_addr())));
        listeners.lanes = Some(l);
    }
    Ok((props, listeners))
}

/// A connection to a peer process: TCP, or shared-memory rings on one host.
pub type PeerConnection = Connection<PeerReader, PeerWriter>;

mod setup;
mod stream;

#[cfg(feature = "ucx")]
use crate::ucx::{UcxLink, UcxWorker};
#[cfg(not(feature = "ucx"))]
use no_ucx::{UcxLink, UcxWorker};
use setup::{accept_setup, bind_abstract, connect_setup, fresh_nonce};

/// Stand-ins for a build without the `ucx` feature: never constructed.
#[cfg(not(feature = "ucx"))]
mod no_ucx {
    use crate::TransportError;

    pub(super) enum UcxWorker {}
    pub(super) enum UcxLink {}

    impl UcxWorker {
        pub(super) fn new(
            _tls: Option<&str>,
            _spin: std::time::Duration,
        ) -> Result<Self, TransportError> {
            Err(TransportError::Unavailable {
                what: "UCX",
                reason: "this build has no `ucx` feature".into(),
            })
        }
        pub(super) fn address(&self) -> &[u8] {
            match *self {}
        }
        pub(super) fn connect(self, _: &[u8], _: &str) -> Result<UcxLink, TransportError> {
            match self {}
        }
        pub(super) fn connect_to_listener(
            self,
            _: std::net::SocketAddr,
            _: &str,
        ) -> Result<UcxLink, TransportError> {
            match self {}
        }
        pub(super) fn may_detect_peer_failure(&self) -> bool {
            match *self {}
        }
        pub(super) fn listen(
            &mut self,
            _: std::net::IpAddr,
        ) -> Result<std::net::SocketAddr, TransportError> {
            match *self {}
        }
        pub(super) async fn accept(
            self,
            _: std::net::IpAddr,
            _: &str,
            _: std::time::Duration,
        ) -> Result<UcxLink, TransportError> {
            match self {}
        }
    }

    impl UcxLink {
        pub(super) async fn probe(&self, _: u64, _: std::time::Duration) -> Result<(), String> {
            match *self {}
        }
    }
}
pub use stream::{PeerReader, PeerWriter, TcpReader, TcpWriter};

/// Which side of the handshake this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
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
    ///
    /// `cma` takes part only when the frames travel on the `shm` transport:
    /// its records then arrive through rings shared with exactly the process
    /// the kernel names at the other end of the Unix socket they were passed
    /// over (`SO_PEERCRED`), and that is the only process `cma` reads from.
    /// On TCP nothing ties the sender of a record to a process, so a peer
    /// whose frames come over TCP never gets `cma`.
    fn compute(local: &Endpoint, peer: Handshake) -> Result<Agreement, TransportError> {
        log_same_host_ruled_out(local, &peer);
        let transport = transport_name(select_transport(&local.transports, &peer.transports));
        let mine = channels_for(&local.channels, transport);
        let theirs = channels_for(&peer.channels, transport);
        Ok(Agreement {
            outgoing: select_channels(&mine, &theirs)?,
            incoming: select_channels(&theirs, &mine)?,
            transport,
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
    fn needs_ucx(&self) -> bool {
        self.transport == channel::UCX_TRANSPORT || self.uses(channel::UCX)
    }
}

/// Logs each same-host channel or transport both ends offer whose domain
/// descriptors differ, with the typed reason ([`channel::not_same_host`]):
/// why, say, two workers in separate PID namespaces do not use `shm`.
fn log_same_host_ruled_out(local: &Endpoint, peer: &Handshake) {
    let worker = PeerText::new(&peer.worker_name);
    for name in [channel::CMA, channel::SHM] {
        let descriptor = |offers: &[ChannelOffer]| {
            offers
                .iter()
                .find(|o| o.name == name)
                .and_then(|o| {
                    o.devices
                        .iter()
                        .find(|d| d.device == ferry_wire::Device::Cpu)
                })
                .map(|d| d.descriptor.clone())
        };
        if let (Some(a), Some(b)) = (descriptor(&local.channels), descriptor(&peer.channels)) {
            if let Some(reason) = channel::not_same_host(&a, &b) {
                tracing::info!(peer = %worker, channel = name, %reason, "same-host channel ruled out");
            }
        }
    }
    let transport = |offers: &[TransportOffer]| {
        offers
            .iter()
            .find(|o| o.name == channel::SHM_TRANSPORT)
            .map(|o| o.descriptor.clone())
    };
    if let (Some(a), Some(b)) = (transport(&local.transports), transport(&peer.transports)) {
        if let Some(reason) = channel::not_same_host(&a, &b) {
            tracing::info!(peer = %worker, transport = channel::SHM_TRANSPORT, %reason, "same-host transport ruled out");
        }
    }
}

/// The channel offers that may be selected over `transport`: without the
/// `shm` transport, `cma` is left out (see [`Agreement::compute`]).
fn channels_for(offers: &[ChannelOffer], transport: &str) -> Vec<ChannelOffer> {
    offers
        .iter()
        .filter(|o| transport == channel::SHM_TRANSPORT || o.name != channel::CMA)
        .cloned()
        .collect()
}

fn transport_name(name: Option<&str>) -> &'static str {
    match name {
        Some(channel::SHM_TRANSPORT) => channel::SHM_TRANSPORT,
        #[cfg(feature = "ucx")]
        Some(channel::UCX_TRANSPORT) => channel::UCX_TRANSPORT,
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
        mut stream: TcpStream,
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
        // A partitioned peer is noticed by the kernel within bounds.
        local.keepalive.apply(&stream).map_err(io_err)?;
        let local_ip = stream.local_addr().map_err(io_err)?.ip();
        let peer_ip = stream.peer_addr().ok().map(|a| a.ip());
        // With a secret, nothing is read from the peer before it proved it
        // holds the secret too; from then on every byte either way travels
        // in records sealed with this connection's keys, the handshake
        // frames that follow included (names, ranks, offers): a relay that
        // passed the authentication through can neither speak for either
        // side nor alter, drop or reorder what they say.
        let session = match &local.auth {
            Some(secret) => {
                let key = secret.key();
                let t = crate::auth::AUTH_TIMEOUT;
                let proved = match role {
                    Role::Accept => crate::auth::accept(&mut stream, key, t).await,
                    Role::Connect => crate::auth::connect(&mut stream, key, t).await,
                };
                Some(proved.map_err(|e| TransportError::Handshake {
                    peer: peer_addr.clone(),
                    reason: format!("{}: {e}", crate::auth::AUTH_FAILED),
                })?)
            }
            None => None,
        };
        let (r, w) = stream.into_split();
        let (r, w) = match &session {
            Some(s) => (s.reader(r), s.writer(w)),
            None => (
                crate::auth::RecordReader::new(r, None),
                crate::auth::RecordWriter::new(w, None),
            ),
        };
        let session = session.map(|s| s.key());
        // Until the handshake is in, a frame may hold a handshake and nothing
        // more: a header announcing more is refused before its body is read.
        let mut reader = FrameReader::new(
            PeerReader::Tcp(r),
            handshake_limits(),
            local.allocator.clone(),
            Selection::default(),
            peer_addr.clone(),
        );
        let mut writer =
            FrameWriter::new(PeerWriter::Tcp(w), Selection::default(), peer_addr.clone());
        writer.set_flush(session.is_some());
        let fail = |reason: String| TransportError::Handshake {
            peer: peer_addr.clone(),
            reason,
        };
        let nonce = fresh_nonce();
        let mut local: Cow<'_, Endpoint> = Cow::Borrowed(local);
        // The connecting side offers UCX only with a worker whose address
        // it can send; a worker that cannot be created drops the offers.
        let mut ucx_worker: Option<UcxWorker> = None;
        if role == Role::Connect && local.offers_ucx() {
            match UcxWorker::new(local.config.ucx_tls.as_deref(), local.config.spin) {
                Ok(w) => ucx_worker = Some(w),
                Err(e) => {
                    tracing::warn!(error = %e, "UCX offers withdrawn from this connection");
                    local = Cow::Owned(local.without_ucx());
                }
            }
        }
        let lanes = local.config.mpt_lanes.clamp(1, MAX_MPT_LANES);
        let lane_props = vec![(PROP_MPT_LANES.to_owned(), lanes.to_string())];
        let mut ucx: Option<UcxLink> = None;
        let mut ucx_fallback: Option<UcxFallback> = None;
        let (agreement, setup) = match role {
            Role::Connect => {
                let mut first_props = lane_props.clone();
                if ucx_worker
                    .as_ref()
                    .is_some_and(UcxWorker::may_detect_peer_failure)
                {
                    first_props.push((PROP_UCX_CLIENT_SERVER.into(), "1".into()));
                }
                writer
                    .write(&handshake_message(local.handshake(
                        None,
                        Vec::new(),
                        first_props,
                        ucx_worker.as_ref().map(|w| w.address().to_vec()),
                    ))?)
                    .await?;
                let peer = read_handshake(&mut reader, &fail).await?;
                let mut agreement = Agreement::compute(&local, peer)?;
                verify(&agreement.outgoing, &agreement.peer.selection)?;
                if agreement.needs_ucx() {
                    // The UCX check: this side's result first, then the
                    // peer's (with, should either have failed, the peer's
                    // set-up of the selection without UCX).
                    let mine = ucx_check(ucx_worker.take(), &agreement.peer, nonce, None).await;
                    let mut props = lane_props.clone();
                    props.push((PROP_UCX_CHECK.into(), check_text(&mine)));
                    writer
                        .write(&handshake_message(local.handshake(
                            None,
                            Vec::new(),
                            props,
                            None,
                        ))?)
                        .await?;
                    let reply = read_handshake(&mut reader, &fail).await?;
                    let theirs = parse_check(&reply, &fail)?;
                    match (mine, theirs) {
                        (Ok(link), None) => ucx = Some(link),
                        (mine, theirs) => {
                            let why = UcxFallback {
                                local: mine.err(),
                                peer: theirs,
                            };
                            warn_fallback(&agreement.peer, &why);
                            ucx_fallback = Some(why);
                            local = Cow::Owned(local.without_ucx());
                            agreement = Agreement::compute(&local, reply)?;
                            verify(&agreement.outgoing, &agreement.peer.selection)?;
                        }
                    }
                }
                let setup = connect_setup(&agreement, &local, session.as_ref(), &fail).await?;
                (agreement, setup)
            }
            Role::Accept => {
                let peer = read_handshake(&mut reader, &fail).await?;
                let mut agreement = Agreement::compute(&local, peer)?;
                if agreement.needs_ucx() {
                    match UcxWorker::new(local.config.ucx_tls.as_deref(), local.config.spin) {
                        Ok(w) => ucx_worker = Some(w),
                        Err(e) => {
                            // Selected without UCX: the peer sees no UCX
                            // offer in the reply and computes the same.
                            tracing::warn!(error = %e, "UCX offers withdrawn from this connection");
                            local = Cow::Owned(local.without_ucx());
                            agreement = Agreement::compute(&local, agreement.peer)?;
                        }
                    }
                }
                let (mut props, mut listeners) = bind_listeners(&agreement, nonce, local_ip)
                    .await
                    .map_err(&io_err)?;
                // Where UCX's transports include TCP, the peer connects to a
                // listener (see `UcxWorker::listen`); a listener that cannot
                // be opened leaves it the worker address.
                let mut accept_from = None;
                let client_server = property(&agreement.peer, PROP_UCX_CLIENT_SERVER) == Some("1");
                let listening = ucx_worker
                    .as_mut()
                    .filter(|w| client_server && w.may_detect_peer_failure());
                if let (Some(worker), Some(from)) = (listening, peer_ip) {
                    match worker.listen(local_ip) {
                        Ok(addr) => {
                            props.push((PROP_UCX_LISTENER.into(), addr.to_string()));
                            accept_from = Some(from);
                        }
                        Err(e) => tracing::warn!(
                            error = %e,
                            "no UCX listener: the peer connects to the worker address"
                        ),
                    }
                }
                writer
                    .write(&handshake_message(local.handshake(
                        Some(&agreement.peer),
                        agreement.incoming.clone(),
                        props,
                        ucx_worker.as_ref().map(|w| w.address().to_vec()),
                    ))?)
                    .await?;
                if agreement.needs_ucx() {
                    // The peer's verdict may come first: a listener waits
                    // for a connection that a peer whose endpoint failed
                    // never makes, so this side's check then ends at once.
                    let (mine, verdict) = {
                        let check =
                            ucx_check(ucx_worker.take(), &agreement.peer, nonce, accept_from);
                        let read = read_handshake(&mut reader, &fail);
                        tokio::pin!(check, read);
                        tokio::select! {
                            mine = &mut check => (mine, read.await?),
                            verdict = &mut read => {
                                let verdict = verdict?;
                                let mine = match parse_check(&verdict, &fail)? {
                                    None => check.await,
                                    Some(_) => Err(UcxUnusable::Endpoint(
                                        "not connected: the peer's UCX check failed first".into(),
                                    )),
                                };
                                (mine, verdict)
                            }
                        }
                    };
                    let theirs = parse_check(&verdict, &fail)?;
                    match (mine, theirs) {
                        (Ok(link), None) => {
                            ucx = Some(link);
                            props = vec![(PROP_UCX_CHECK.into(), check_text(&Ok(())))];
                        }
                        (mine, theirs) => {
                            let text = check_text(&mine);
                            let why = UcxFallback {
                                local: mine.err(),
                                peer: theirs,
                            };
                            warn_fallback(&agreement.peer, &why);
                            ucx_fallback = Some(why);
                            local = Cow::Owned(local.without_ucx());
                            agreement = Agreement::compute(&local, verdict)?;
                            drop(listeners);
                            (props, listeners) = bind_listeners(&agreement, nonce, local_ip)
                                .await
                                .map_err(&io_err)?;
                            props.push((PROP_UCX_CHECK.into(), text));
                        }
                    }
                    writer
                        .write(&handshake_message(local.handshake(
                            Some(&agreement.peer),
                            agreement.incoming.clone(),
                            props,
                            None,
                        ))?)
                        .await?;
                }
                let setup = tokio::time::timeout(
                    SETUP_TIMEOUT,
                    accept_setup(
                        &agreement,
                        listeners.shm,
                        listeners.lanes,
                        nonce,
                        session.as_ref(),
                        &fail,
                    ),
                )
                .await
                .map_err(|_| fail("the peer did not finish setting up its channels".into()))??;
                (agreement, setup)
            }
        };
        // The `mpt` lanes are TCP connections too: a partition mid-transfer
        // ends them within the same bounds.
        if let Some((incoming_lanes, outgoing_lanes)) = &setup.lanes {
            for lane in incoming_lanes.iter().chain(outgoing_lanes) {
                local.keepalive.apply(lane.socket()).map_err(&io_err)?;
            }
        }
        if agreement.needs_ucx() != ucx.is_some() {
            return Err(fail("ucx is selected but this side has no UCX link".into()));
        }
        let Agreement {
            peer,
            outgoing,
            incoming,
            transport,
        } = agreement;
        // The name the peer states, as errors and logs show it (escaped
        // and bounded: the agent has not yet checked it against its group).
        let name = PeerText::new(&peer.worker_name).to_string();
        // Only the process the kernel vouches for, never a pid a peer states.
        let peer_pid = setup.peer_pid;
        let uses_cma_in = incoming.iter().any(|c| c.channel == channel::CMA);
        let uses_cma_out = outgoing.iter().any(|c| c.channel == channel::CMA);
        if (uses_cma_in || uses_cma_out) && (peer_pid.is_none() || setup.frames.is_none()) {
            return Err(fail(
                "cma is selected without the shm transport's verified peer process".into(),
            ));
        }
        let gone = setup.peer_gone;
        let (frames, data) = (setup.frames, setup.data);
        let (data_reader, data_writer) = match data {
            Some(link) => {
                let (mut r, mut w) = link.split(gone.clone().map(|g| g.future()));
                r.set_spin(local.config.spin);
                w.set_spin(local.config.spin);
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
        if let PeerReader::Tcp(tcp) = reader.stream_mut() {
            if (frames.is_some() || transport == channel::UCX_TRANSPORT) && tcp.buffered() > 0 {
                return Err(fail(format!(
                    "{} bytes arrived on TCP after the handshake",
                    tcp.buffered()
                )));
            }
        }
        if let Some(link) = frames {
            // From here on frames travel through the rings. Nothing may be
            // buffered from the TCP stream: both ends send nothing on it
            // after the handshake when the shm transport is selected.
            let (mut sr, mut sw) = link.split(gone.map(|g| g.future()));
            sr.set_spin(local.config.spin);
            sw.set_spin(local.config.spin);
            reader = reader
                .map_stream(|r| match r {
                    PeerReader::Tcp(tcp) | PeerReader::Shm(_, tcp) => PeerReader::Shm(sr, tcp),
                    #[cfg(feature = "ucx")]
                    PeerReader::Ucx(_) => r,
                })
                .map_err(|n| fail(format!("{n} bytes arrived on TCP after the handshake")))?;
            writer = writer.map_stream(|w| match w {
                PeerWriter::Tcp(tcp) | PeerWriter::Shm(_, tcp) => PeerWriter::Shm(sw, tcp),
                #[cfg(feature = "ucx")]
                PeerWriter::Ucx(_) => w,
            });
        }
        #[cfg(feature = "ucx")]
        if let (channel::UCX_TRANSPORT, Some(link)) = (transport, &ucx) {
            // From here on frames travel as UCX tag messages; the TCP
            // connection stays open beside them (the reader watches it).
            reader = reader
                .map_stream(|r| match r {
                    PeerReader::Tcp(tcp) => {
                        PeerReader::Ucx(crate::ucx::UcxReader::new(link.clone(), tcp.into_inner()))
                    }
                    other => other,
                })
                .map_err(|n| fail(format!("{n} bytes arrived on TCP after the handshake")))?;
            writer = writer.map_stream(|w| match w {
                PeerWriter::Tcp(tcp) => {
                    PeerWriter::Ucx(crate::ucx::UcxWriter::new(link.clone(), tcp.into_inner()))
                }
                other => other,
            });
        }
        #[cfg(feature = "ucx")]
        let uses_ucx_in = incoming.iter().any(|c| c.channel == channel::UCX);
        #[cfg(feature = "ucx")]
        let uses_ucx_out = outgoing.iter().any(|c| c.channel == channel::UCX);
        #[cfg(not(feature = "ucx"))]
        let _ = ucx;
        reader.set_limits(local.limits);
        reader.set_selection(Selection::new(incoming));
        reader.set_peer(name.clone());
        writer.set_selection(Selection::new(outgoing));
        writer.set_peer(name.clone());
        writer.set_peer_limits(peer.limits);
        reader.set_channels(
            ReadChannels {
                cma_pid: if uses_cma_in { peer_pid } else { None },
                shm: data_reader,
                mpt: mpt_in,
                #[cfg(feature = "ucx")]
                ucx: ucx.clone().filter(|_| uses_ucx_in),
                cma_threads: local.config.cma_threads,
                cuda: crate::framing::CudaSide::new(&local.config),
            },
            shared.clone(),
        );
        writer.set_channels(
            WriteChannels {
                cma: uses_cma_out,
                shm: data_writer,
                mpt: mpt_out,
                #[cfg(feature = "ucx")]
                ucx: ucx.filter(|_| uses_ucx_out),
                small_tensor_bytes: local.config.small_tensor_bytes,
                cuda: crate::framing::CudaSide::new(&local.config),
            },
            shared,
        );
        Ok(Connection {
            peer,
            transport,
            reader,
            writer,
            ucx_fallback,
        })
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn with_check(text: Option<&str>) -> Handshake {
        Handshake {
            protocol_version: PROTOCOL_VERSION,
            worker_name: "peer".into(),
            rank: 1,
            transports: Vec::new(),
            channels: Vec::new(),
            selection: Vec::new(),
            properties: text
                .map(|t| vec![(PROP_UCX_CHECK.to_owned(), t.to_owned())])
                .unwrap_or_default(),
            limits: Limits::default(),
            ucx_address: None,
        }
    }

    fn fail(reason: String) -> TransportError {
        TransportError::Handshake {
            peer: "peer".into(),
            reason,
        }
    }

    #[test]
    fn check_results_travel_typed() {
        let results: [Result<(), UcxUnusable>; 3] = [
            Ok(()),
            Err(UcxUnusable::Endpoint("Destination is unreachable".into())),
            Err(UcxUnusable::Exchange(
                "no probe from the peer within 10s".into(),
            )),
        ];
        for r in results {
            let h = with_check(Some(&check_text(&r)));
            assert_eq!(parse_check(&h, &fail).unwrap(), r.err());
        }
    }

    #[test]
    fn a_missing_or_malformed_check_result_fails_the_handshake() {
        for (h, want) in [
            (with_check(None), "sent no UCX check result"),
            (with_check(Some("maybe")), "is none of ok"),
        ] {
            let err = parse_check(&h, &fail).expect_err("refused");
            assert!(err.to_string().contains(want), "{err}");
        }
    }

    #[test]
    fn a_fallback_names_each_side_that_failed() {
        let why = UcxFallback {
            local: None,
            peer: Some(UcxUnusable::Exchange("timed out".into())),
        };
        let text = why.to_string();
        assert!(
            text.contains("the peer: the first UCX exchange failed: timed out"),
            "{text}"
        );
        assert!(!text.contains("this side"), "{text}");
    }
}
