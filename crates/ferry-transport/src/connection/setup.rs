//! What follows the handshake when the selection needs it: shared memory
//! passed over an abstract Unix socket (the `shm` transport and channel),
//! `mpt` lanes, and the watch on the peer process.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::pin::Pin;
use std::sync::Arc;

use tokio::net::{UnixListener, UnixStream};

use super::{
    property, Agreement, Endpoint, MAX_MPT_LANES, PROP_MPT_ADDR, PROP_MPT_LANES, PROP_SHM_SOCKET,
    SETUP_TIMEOUT,
};
use crate::accept::RefusalWarnings;
use crate::auth::{self, Key, AUTH_TIMEOUT};
use crate::mpt::{connect_lanes_authenticated, Lane, LaneListener};
use crate::shm::{recv_fds, send_fds, ShmLink};
use crate::{channel, TransportError};

/// What the set-up after the handshake produced.
#[derive(Default)]
pub(super) struct Setup {
    /// Rings for the frames (the `shm` transport).
    pub(super) frames: Option<ShmLink>,
    /// Rings for tensor bytes (the `shm` channel).
    pub(super) data: Option<ShmLink>,
    /// Fires when the peer process exits (same host only).
    pub(super) peer_gone: Option<ProcessWatch>,
    /// The peer's process id as the kernel states it (`SO_PEERCRED` of the
    /// Unix socket the shared memory was passed over); never the pid a
    /// handshake claims. Only this process may be read by `cma`.
    pub(super) peer_pid: Option<i32>,
    /// Lanes (incoming, outgoing) for `mpt`.
    pub(super) lanes: Option<(Vec<Lane>, Vec<Lane>)>,
}

/// Connecting side: create the shared memory and pass it; open the lanes.
pub(super) async fn connect_setup(
    agreement: &Agreement,
    local: &Endpoint,
    session: Option<&Key>,
    fail: &impl Fn(String) -> TransportError,
) -> Result<Setup, TransportError> {
    let mut setup = Setup::default();
    let peer = &agreement.peer;
    if agreement.needs_shm() {
        let socket = property(peer, PROP_SHM_SOCKET)
            .ok_or_else(|| fail("shared memory is selected but the peer named no socket".into()))?;
        let mut stream = connect_abstract(socket)
            .map_err(|e| fail(format!("connecting to {socket:?} failed: {e}")))?;
        if let Some(key) = session {
            auth::connect(&mut stream, key, AUTH_TIMEOUT)
                .await
                .map_err(|e| {
                    fail(format!(
                        "authenticating the shared-memory socket failed: {e}"
                    ))
                })?;
        }
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
        let pid = verified_pid(&stream, fail)?;
        setup.peer_gone = Some(ProcessWatch::watch(pid, fail)?);
        setup.peer_pid = Some(pid);
    }
    if agreement.uses(channel::MPT) {
        let addr = property(peer, PROP_MPT_ADDR)
            .ok_or_else(|| fail("mpt is selected but the peer named no lane address".into()))?;
        let (addr, nonce) = addr
            .split_once('/')
            .and_then(|(a, n)| Some((a.parse::<SocketAddr>().ok()?, n.parse::<u64>().ok()?)))
            .ok_or_else(|| fail(format!("bad lane address {addr:?}")))?;
        let n = local.config.mpt_lanes.clamp(1, MAX_MPT_LANES);
        let mut lanes =
            connect_lanes_authenticated(addr, nonce, 2 * n, SETUP_TIMEOUT, session.cloned())
                .await?;
        let incoming = lanes.split_off(n);
        setup.lanes = Some((incoming, lanes));
    }
    Ok(setup)
}

/// Accepting side: take the passed shared memory; accept the lanes.
pub(super) async fn accept_setup(
    agreement: &Agreement,
    shm_listener: Option<UnixListener>,
    lane_listener: Option<LaneListener>,
    nonce: u64,
    session: Option<&Key>,
    fail: &impl Fn(String) -> TransportError,
) -> Result<Setup, TransportError> {
    let mut setup = Setup::default();
    if let Some(listener) = shm_listener {
        let stream = match session {
            // Only the peer of this connection holds its session key: any
            // other process is dropped, and the wait for the peer goes on.
            Some(key) => accept_authenticated(&listener, key, fail).await?,
            None => {
                listener
                    .accept()
                    .await
                    .map_err(|e| fail(format!("accepting the shared-memory socket failed: {e}")))?
                    .0
            }
        };
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
        let pid = verified_pid(&stream, fail)?;
        setup.peer_gone = Some(ProcessWatch::watch(pid, fail)?);
        setup.peer_pid = Some(pid);
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
            .accept_authenticated(nonce, 2 * lanes_each, SETUP_TIMEOUT, session)
            .await?;
        // The connecting side sends on the first half: that is our incoming.
        let outgoing = lanes.split_off(lanes_each);
        setup.lanes = Some((lanes, outgoing));
    }
    Ok(setup)
}

/// Most set-up connections authenticating at once on one socket; more are
/// closed unread until one of them finishes.
const MAX_AUTHENTICATING: usize = 16;

/// The first connection on `listener` that proves it holds `key`. The
/// handshakes run concurrently, so a connection that never speaks (or
/// speaks slowly) holds up no other: the peer's own connection is served
/// as soon as it arrives. Those that fail are closed, and so are those
/// beyond [`MAX_AUTHENTICATING`]; those still authenticating when the
/// peer's succeeds are dropped with it.
///
/// The warnings about the connections closed are rate-limited
/// ([`RefusalWarnings`], one for each kind, for this socket): the first
/// names its process at once, the others are counted into a line at most
/// every 10 s, and what is left is written when this returns.
async fn accept_authenticated(
    listener: &UnixListener,
    key: &Key,
    fail: &impl Fn(String) -> TransportError,
) -> Result<UnixStream, TransportError> {
    let refused = RefusalWarnings::new(
        "shared-memory set-up socket",
        "refused a shared-memory set-up connection that failed authentication",
    );
    let overflowed = RefusalWarnings::new(
        "shared-memory set-up socket",
        "closed a shared-memory set-up connection: too many are authenticating already",
    );
    let mut authenticating = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (mut stream, _) = accepted
                    .map_err(|e| fail(format!("accepting the shared-memory socket failed: {e}")))?;
                if authenticating.len() >= MAX_AUTHENTICATING {
                    overflowed.refused(
                        PeerProcess::of(&stream),
                        format_args!("{MAX_AUTHENTICATING} are authenticating already"),
                    );
                    continue;
                }
                let key = key.clone();
                authenticating.spawn(async move {
                    let proved = auth::accept(&mut stream, &key, AUTH_TIMEOUT).await;
                    (stream, proved)
                });
            }
            Some(done) = authenticating.join_next(), if !authenticating.is_empty() => match done {
                Ok((stream, Ok(_))) => return Ok(stream),
                Ok((stream, Err(e))) => refused.refused(PeerProcess::of(&stream), e),
                Err(e) => tracing::warn!(error = %e, "a shared-memory set-up handshake task failed"),
            },
        }
    }
}

/// The process at the other end of a set-up connection, for logs: `pid N`,
/// or `unknown process` when the kernel names none.
struct PeerProcess(Option<i32>);

impl PeerProcess {
    fn of(stream: &UnixStream) -> PeerProcess {
        PeerProcess(stream.peer_cred().ok().and_then(|c| c.pid()))
    }
}

impl std::fmt::Display for PeerProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(pid) => write!(f, "pid {pid}"),
            None => f.write_str("unknown process"),
        }
    }
}

/// Fires when the peer process exits: a pidfd, readable once it is gone.
#[derive(Clone)]
pub(super) struct ProcessWatch {
    fd: Arc<tokio::io::unix::AsyncFd<OwnedFd>>,
}

/// The process at the other end of a connected Unix socket, as the kernel
/// recorded it (`SO_PEERCRED`: the connecting process for the accepting
/// side, the listening process for the connecting side). A peer in a PID
/// namespace this process cannot see has pid 0 there: refused.
fn verified_pid(
    stream: &UnixStream,
    fail: &impl Fn(String) -> TransportError,
) -> Result<i32, TransportError> {
    let cred = stream.peer_cred().map_err(|e| {
        fail(format!(
            "cannot read the shared-memory peer's credentials: {e}"
        ))
    })?;
    match cred.pid() {
        Some(pid) if pid > 0 => Ok(pid),
        _ => Err(fail(
            "the kernel names no process for the shared-memory peer (another PID namespace)".into(),
        )),
    }
}

impl ProcessWatch {
    pub(super) fn watch(
        pid: i32,
        fail: &impl Fn(String) -> TransportError,
    ) -> Result<Self, TransportError> {
        let pid = rustix::process::Pid::from_raw(pid)
            .ok_or_else(|| fail(format!("{pid} is not a process id")))?;
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

    pub(super) fn future(self) -> Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(async move {
            // A pidfd becomes readable when the process exits; an error
            // means the watch is broken, which is treated the same way.
            let _ = self.fd.readable().await;
        })
    }
}

pub(super) fn fresh_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
}

pub(super) fn bind_abstract(name: &str) -> io::Result<UnixListener> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Secret;

    fn fail(reason: String) -> TransportError {
        TransportError::Handshake {
            peer: "test".into(),
            reason,
        }
    }

    /// A connection that never speaks is still authenticating (it would
    /// be for `AUTH_TIMEOUT`) when the peer connects: the peer is
    /// accepted at once, and its stream is the one returned.
    #[tokio::test]
    async fn a_silent_connection_does_not_hold_up_the_peer() {
        let name = format!("ferry-test-setup-silent-{}", std::process::id());
        let listener = bind_abstract(&name).unwrap();
        let secret = Secret::new(b"the session key of one connection".to_vec()).unwrap();
        let key = secret.key().clone();
        let silent = connect_abstract(&name).unwrap();
        let peer = async {
            let mut stream = connect_abstract(&name).unwrap();
            auth::connect(&mut stream, &key, AUTH_TIMEOUT)
                .await
                .unwrap();
            stream
        };
        let (accepted, mut peer) = tokio::join!(accept_authenticated(&listener, &key, &fail), peer);
        let mut accepted = accepted.unwrap();
        // The accepted stream is the peer's: a byte crosses it.
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        peer.write_all(b"x").await.unwrap();
        let mut byte = [0u8; 1];
        accepted.read_exact(&mut byte).await.unwrap();
        assert_eq!(&byte, b"x");
        drop(silent);
    }
}
