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
//!
//! The protocol of the set-up (authentication, records, handshake frames,
//! agreement, UCX check and fallback, its bounds and errors) is
//! [`machine::SetupMachine`], a pure state machine; `establish` is its
//! I/O shell, and `assemble` turns its outcome into the connection.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use ferry_wire::{
    ChannelChoice, ChannelOffer, Handshake, Limits, PeerText, TransportOffer, PROTOCOL_VERSION,
};

use crate::mpt::LaneListener;
use crate::selection::{disclosed_channels, disclosed_transports};
use crate::{
    channel, Allocator, ChannelConfig, FrameReader, FrameWriter, Keepalive, RawAllocator,
    TransportError,
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

/// Binds what the set-up needs (the shared-memory socket, the `mpt` lane
/// listener; see [`machine::Action::BindListeners`]) and the handshake
/// properties that name them.
async fn bind_listeners(
    shm: bool,
    mpt: bool,
    nonce: u64,
    local_ip: IpAddr,
) -> std::io::Result<(Vec<(String, String)>, Listeners)> {
    let mut props = Vec::new();
    let mut listeners = Listeners::default();
    if shm {
        // No pid in the name: the peer learns nothing it does not need.
        let name = format!("ferry/{nonce:016x}{:016x}", fresh_nonce());
        listeners.shm = Some(bind_abstract(&name)?);
        props.push((PROP_SHM_SOCKET.into(), name));
    }
    if mpt {
        let l = LaneListener::bind(local_ip).await?;
        props.push((PROP_MPT_ADDR.into(), format!("{}/{nonce}", l.local_addr())));
        listeners.lanes = Some(l);
    }
    Ok((props, listeners))
}

/// A connection to a peer process: TCP, or shared-memory rings on one host.
pub type PeerConnection = Connection<PeerReader, PeerWriter>;

mod agreement;
mod assemble;
mod establish;
pub mod machine;
mod setup;
mod stream;

use agreement::Agreement;
use machine::SETUP_TIMEOUT;

#[cfg(feature = "ucx")]
use crate::ucx::{UcxLink, UcxWorker};
#[cfg(not(feature = "ucx"))]
use no_ucx::{UcxLink, UcxWorker};
use setup::{bind_abstract, fresh_nonce};

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

fn property<'a>(h: &'a Handshake, key: &str) -> Option<&'a str> {
    h.properties
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
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
