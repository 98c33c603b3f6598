//! Lane setup: a listener that accepts the lanes of one channel, and the
//! connecting side.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::{LaneHello, HELLO_LEN, MAX_LANES};
use crate::accept::RefusalWarnings;
use crate::auth::{self, Key, RecordReader, RecordWriter, SessionKey, AUTH_TIMEOUT};
use crate::TransportError;

/// One lane: a TCP connection whose bytes, when it was authenticated,
/// travel in records sealed with the lane's own session keys (see
/// [`auth::records`]), its hello included.
pub struct Lane {
    pub(super) reader: RecordReader<OwnedReadHalf>,
    pub(super) writer: RecordWriter<OwnedWriteHalf>,
}

impl Lane {
    /// A lane over `stream`, sealed with `session` when there is one.
    fn new(stream: TcpStream, session: Option<&SessionKey>) -> Lane {
        let (r, w) = stream.into_split();
        match session {
            Some(s) => Lane {
                reader: s.reader(r),
                writer: s.writer(w),
            },
            None => Lane {
                reader: RecordReader::new(r, None),
                writer: RecordWriter::new(w, None),
            },
        }
    }

    /// The lane's socket (for socket options such as keepalive).
    pub fn socket(&self) -> &TcpStream {
        self.reader.get_ref().as_ref()
    }

    /// The lane's TCP stream, as it is underneath any records: what a
    /// record reader or writer had buffered is dropped.
    pub fn into_stream(self) -> TcpStream {
        match self.reader.into_inner().reunite(self.writer.into_inner()) {
            Ok(stream) => stream,
            Err(_) => unreachable!("a lane's halves come from one stream"),
        }
    }

    /// Whether the lane's bytes travel in sealed records.
    pub fn is_sealed(&self) -> bool {
        self.reader.is_sealed()
    }
}

impl From<TcpStream> for Lane {
    /// An unauthenticated lane over `stream` (its hello already exchanged).
    fn from(stream: TcpStream) -> Lane {
        Lane::new(stream, None)
    }
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane")
            .field("sealed", &self.is_sealed())
            .finish_non_exhaustive()
    }
}

/// Socket buffer size asked for on every lane (`SO_SNDBUF` and `SO_RCVBUF`),
/// or `None` to leave Linux's autotuning alone. It is left alone: setting
/// `SO_RCVBUF` turns autotuning off and is capped by `net.core.rmem_max`,
/// and a fixed buffer has not beaten autotuning on loopback.
const SOCKET_BUFFER: Option<usize> = None;

/// Listens for the lanes of multi-lane TCP channels.
///
/// One [`accept`](Self::accept) at a time: connections that carry another
/// nonce are dropped, so concurrent accepts for different channels on one
/// listener would drop each other's lanes.
#[derive(Debug)]
pub struct LaneListener {
    inner: TcpListener,
    local: SocketAddr,
    /// Warnings about lanes that failed authentication, rate-limited (an
    /// outsider can open thousands of connections a second): the first at
    /// once, then at most one line every 10 s counting the others, the
    /// rest when the listener is dropped.
    refusals: RefusalWarnings,
}

impl LaneListener {
    /// Binds an ephemeral port on `ip`.
    pub async fn bind(ip: IpAddr) -> io::Result<Self> {
        let inner = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
        let local = inner.local_addr()?;
        let refusals = RefusalWarnings::new(
            "mpt lane listener",
            "mpt: refused a lane that failed authentication",
        );
        Ok(Self {
            inner,
            local,
            refusals,
        })
    }

    /// The address the other side connects to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Accepts exactly `lanes` connections whose hello carries `nonce` and
    /// this lane count, each placed at its index. Connections with a wrong
    /// magic, nonce or count, an index already taken or out of range, or
    /// that close before their hello, are dropped and the wait goes on.
    /// Fails with [`TransportError::Handshake`] when not every lane arrived
    /// within `timeout`.
    pub async fn accept(
        &self,
        nonce: u64,
        lanes: usize,
        timeout: Duration,
    ) -> Result<Vec<Lane>, TransportError> {
        self.accept_authenticated(nonce, lanes, timeout, None).await
    }

    /// [`accept`](Self::accept), where with `key` every connection must
    /// first pass the [`auth`] handshake with it (the session key of the
    /// connection the lanes belong to) before its hello is read; one that
    /// fails is dropped, and the wait goes on. The warnings about those
    /// are rate-limited per listener ([`RefusalWarnings`]): the first
    /// names its address at once, the others are counted into a line at
    /// most every 10 s (and when the listener is dropped).
    pub async fn accept_authenticated(
        &self,
        nonce: u64,
        lanes: usize,
        timeout: Duration,
        key: Option<&Key>,
    ) -> Result<Vec<Lane>, TransportError> {
        let peer = format!("mpt lane listener {}", self.local);
        check_lanes(&peer, lanes)?;
        let mut slots: Vec<Option<Lane>> = (0..lanes).map(|_| None).collect();
        let mut filled = 0usize;
        let mut hellos: JoinSet<io::Result<(Lane, SocketAddr, [u8; HELLO_LEN])>> = JoinSet::new();
        let work = async {
            while filled < lanes {
                tokio::select! {
                    accepted = self.inner.accept() => match accepted {
                        Ok((stream, from)) => {
                            let key = key.cloned();
                            let refusals = self.refusals.clone();
                            hellos.spawn(async move {
                                let mut stream = stream;
                                let session = match key {
                                    Some(key) => match auth::accept(&mut stream, &key, AUTH_TIMEOUT).await {
                                        Ok(s) => Some(s),
                                        Err(e) => {
                                            let denied = io::Error::new(io::ErrorKind::PermissionDenied, e.to_string());
                                            refusals.refused(from, e);
                                            return Err(denied);
                                        }
                                    },
                                    None => None,
                                };
                                tune(&stream)?;
                                let mut lane = Lane::new(stream, session.as_ref());
                                let mut hello = [0u8; HELLO_LEN];
                                lane.reader.read_exact(&mut hello).await?;
                                Ok((lane, from, hello))
                            });
                        }
                        Err(e) if is_per_connection(&e) => {
                            tracing::debug!(error = %e, "mpt: accept failed for one connection");
                        }
                        Err(e) => {
                            return Err(TransportError::Io { peer: peer.clone(), source: e });
                        }
                    },
                    Some(joined) = hellos.join_next(), if !hellos.is_empty() => {
                        let Ok(Ok((lane, from, bytes))) = joined else {
                            tracing::debug!("mpt: a lane closed before its hello");
                            continue;
                        };
                        match LaneHello::decode(&bytes) {
                            Ok(h)
                                if h.nonce == nonce
                                    && h.count as usize == lanes
                                    && (h.index as usize) < lanes
                                    && slots[h.index as usize].is_none() =>
                            {
                                slots[h.index as usize] = Some(lane);
                                filled += 1;
                            }
                            other => {
                                tracing::debug!(%from, hello = ?other, "mpt: rejected a lane");
                            }
                        }
                    }
                }
            }
            Ok(())
        };
        match tokio::time::timeout(timeout, work).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(TransportError::Handshake {
                    peer,
                    reason: format!(
                        "timed out after {timeout:?} with {filled} of {lanes} lanes accepted"
                    ),
                })
            }
        }
        Ok(slots.into_iter().flatten().collect())
    }
}

/// Connects `lanes` lanes to a [`LaneListener`] at `addr`, sending each its
/// hello. Fails when any lane cannot connect within `timeout`.
pub async fn connect_lanes(
    addr: SocketAddr,
    nonce: u64,
    lanes: usize,
    timeout: Duration,
) -> Result<Vec<Lane>, TransportError> {
    connect_lanes_authenticated(addr, nonce, lanes, timeout, None).await
}

/// [`connect_lanes`], where with `key` each lane first passes the
/// [`auth`] handshake with it before sending its hello.
pub async fn connect_lanes_authenticated(
    addr: SocketAddr,
    nonce: u64,
    lanes: usize,
    timeout: Duration,
    key: Option<Key>,
) -> Result<Vec<Lane>, TransportError> {
    let peer = addr.to_string();
    check_lanes(&peer, lanes)?;
    let work = async {
        let mut set = JoinSet::new();
        for index in 0..lanes {
            let hello = LaneHello {
                nonce,
                index: index as u32,
                count: lanes as u32,
            };
            let key = key.clone();
            set.spawn(async move {
                let mut stream = TcpStream::connect(addr).await?;
                tune(&stream)?;
                let session = match key {
                    Some(key) => Some(
                        auth::connect(&mut stream, &key, AUTH_TIMEOUT)
                            .await
                            .map_err(|e| {
                                io::Error::new(io::ErrorKind::PermissionDenied, e.to_string())
                            })?,
                    ),
                    None => None,
                };
                let mut lane = Lane::new(stream, session.as_ref());
                lane.writer.write_all(&hello.encode()).await?;
                lane.writer.flush().await?;
                Ok::<_, io::Error>((index, lane))
            });
        }
        let mut slots: Vec<Option<Lane>> = (0..lanes).map(|_| None).collect();
        while let Some(joined) = set.join_next().await {
            let (index, stream) = joined
                .map_err(|e| io::Error::other(format!("lane connect task failed: {e}")))??;
            slots[index] = Some(stream);
        }
        Ok::<_, io::Error>(slots.into_iter().flatten().collect())
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(Ok(streams)) => Ok(streams),
        Ok(Err(source)) => Err(TransportError::Io { peer, source }),
        Err(_) => Err(TransportError::Io {
            peer,
            source: io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connecting {lanes} mpt lanes timed out after {timeout:?}"),
            ),
        }),
    }
}

fn check_lanes(peer: &str, lanes: usize) -> Result<(), TransportError> {
    if (1..=MAX_LANES).contains(&lanes) {
        Ok(())
    } else {
        Err(TransportError::Handshake {
            peer: peer.to_owned(),
            reason: format!("{lanes} mpt lanes asked for; 1 to {MAX_LANES} are supported"),
        })
    }
}

/// Errors of `accept` that concern one incoming connection, not the listener.
fn is_per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
    )
}

/// `TCP_NODELAY`, and the socket buffers when [`SOCKET_BUFFER`] asks for them.
fn tune(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    if let Some(size) = SOCKET_BUFFER {
        rustix::net::sockopt::set_socket_send_buffer_size(stream, size)?;
        rustix::net::sockopt::set_socket_recv_buffer_size(stream, size)?;
    }
    Ok(())
}
