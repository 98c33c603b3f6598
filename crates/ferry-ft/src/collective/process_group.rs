//! The process group across the replica groups of a quorum: a full mesh of
//! `ferry-transport` connections, rebuilt for every new quorum, and an
//! allreduce over it.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use ferry_store::{Store, StoreError, TcpStore};
use ferry_transport::{Endpoint, PeerConnection};
use ferry_wire::MessageKind;
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, info_span, warn, Instrument};

use super::allreduce::run_allreduce;
use super::peer::{peer_error, protocol, read_error, Peer};
use super::reduce::{reduce_in_place, ReduceOp};
use super::CollectiveError;
use crate::manager::QuorumResult;
use crate::net::accept_loop;
use crate::recovery::link;

/// First message on a peer connection, connecting side to accepting side.
const KIND_HELLO: MessageKind = ferry_wire::kinds::FT_COLLECTIVE_HELLO;
/// The accepting side's answer to a hello.
const KIND_HELLO_REPLY: MessageKind = ferry_wire::kinds::FT_COLLECTIVE_HELLO_REPLY;

/// A process group's knobs.
///
/// ```
/// use std::time::Duration;
/// use ferry_ft::collective::ProcessGroupOptions;
///
/// let options = ProcessGroupOptions::new("replica_a").with_timeout(Duration::from_secs(5));
/// assert_eq!(options.timeout, Duration::from_secs(5));
/// ```
#[derive(Debug, Clone)]
pub struct ProcessGroupOptions {
    /// This replica group's id, exactly as its manager names it (checked
    /// against the quorum's `replica_ids`).
    pub replica_id: String,
    /// The longest a rendezvous, or one allreduce, may take (torchft's
    /// process group timeout). Default 60 s.
    pub timeout: Duration,
    /// The longest connecting to a peer or the store may take (the store
    /// is retried while nobody listens there yet). Default 10 s.
    pub connect_timeout: Duration,
}

impl ProcessGroupOptions {
    /// The defaults for replica group `replica_id`.
    pub fn new(replica_id: impl Into<String>) -> Self {
        Self {
            replica_id: replica_id.into(),
            timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
        }
    }

    /// Sets [`timeout`](Self::timeout).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout).
    pub fn with_connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self
    }
}

/// Which group a connection belongs to: the quorum and its members.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
struct GroupKey {
    quorum_id: i64,
    membership: u64,
}

/// This replica group's rank in a quorum: `replica_rank`, checked to lie
/// inside the quorum and to name `me` (the group's own replica id); the
/// error says which check failed, for the caller's `InvalidQuorum`.
pub(crate) fn quorum_rank(
    replica_ids: &[String],
    replica_rank: u64,
    me: &str,
    quorum_id: i64,
) -> Result<usize, String> {
    let world_size = replica_ids.len();
    let rank = usize::try_from(replica_rank)
        .ok()
        .filter(|&rank| rank < world_size)
        .ok_or_else(|| format!("replica rank {replica_rank} outside a quorum of {world_size}"))?;
    if replica_ids[rank] != me {
        return Err(format!(
            "rank {rank} of quorum {quorum_id} is {:?}, not this replica group ({me:?})",
            replica_ids[rank]
        ));
    }
    Ok(rank)
}

/// FNV-1a over the replica ids (stable across processes, unlike std's
/// hasher); the Baby child's NCCL backend keys its rendezvous with it too.
pub(crate) fn membership(replica_ids: &[String]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for id in replica_ids {
        for byte in id.bytes().chain(std::iter::once(0)) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    key: GroupKey,
    rank: u64,
    world_size: u64,
    replica_id: String,
}

#[derive(Debug, Serialize, Deserialize)]
enum HelloReply {
    Ready,
    Rejected(String),
}

/// A connection accepted and introduced, waiting for its group to be
/// configured here.
struct Pending {
    hello: Hello,
    conn: PeerConnection,
}

struct Shared {
    options: ProcessGroupOptions,
    local_addr: SocketAddr,
    pending: Mutex<HashMap<GroupKey, BTreeMap<u64, Pending>>>,
    arrivals: watch::Sender<u64>,
}

impl Shared {
    fn pending(&self) -> MutexGuard<'_, HashMap<GroupKey, BTreeMap<u64, Pending>>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The configured group of one quorum.
struct Group {
    key: GroupKey,
    rank: usize,
    replica_ids: Vec<String>,
    /// Every other member, by ascending rank.
    peers: Vec<Peer>,
    seq: u64,
    failure: Option<String>,
}

/// A process group spanning the replica groups of the current quorum
/// (torchft's cross-replica process group, over `ferry-transport`).
///
/// Bind it once per replica group; then, after every quorum,
/// [`configure`](Self::configure) it with the quorum result. A quorum with
/// another id (or other members) than the configured one rebuilds the
/// group: every member publishes its address in the store of the quorum's
/// primary (`store_address`, where a `ferry-store`
/// [`TcpStoreServer`](ferry_store::TcpStoreServer) listens) under the
/// quorum id, connects to the members of lower rank and is connected
/// to by those of higher rank, each connection introduced and acknowledged
/// with the quorum id, the membership and both replica ids. The same
/// quorum again is a no-op.
///
/// [`allreduce`](Self::allreduce) reduces a flat `f32` buffer across the
/// group so that every member ends with bit-identical values. Any failure
/// (a peer that died, stalled past the timeout, or sent garbage) is an
/// error, never a hang; the group is then *broken* until the next quorum,
/// and its connections are closed at once so the other members fail fast
/// too. A failed step must not be committed.
pub struct ProcessGroup {
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
    group: Option<Group>,
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("replica_id", &self.shared.options.replica_id)
            .field("local_addr", &self.shared.local_addr)
            .field("quorum_id", &self.quorum_id())
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .finish_non_exhaustive()
    }
}

impl ProcessGroup {
    /// Binds the listener peers connect to (e.g. `"127.0.0.1:0"`) and
    /// accepts on the current tokio runtime until dropped. No group is
    /// configured yet.
    pub async fn bind(
        addr: impl ToSocketAddrs + fmt::Display,
        options: ProcessGroupOptions,
    ) -> Result<Self, CollectiveError> {
        let bind_error = |source| CollectiveError::Bind {
            addr: addr.to_string(),
            source,
        };
        let listener = TcpListener::bind(&addr).await.map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let span = info_span!(
            "process_group",
            replica_id = %options.replica_id,
            addr = %local_addr
        );
        let shared = Arc::new(Shared {
            options,
            local_addr,
            pending: Mutex::new(HashMap::new()),
            arrivals: watch::channel(0).0,
        });
        let accept = {
            let shared = Arc::clone(&shared);
            tokio::spawn(
                accept_loop(listener, "process group", move |stream, _| {
                    introduce(Arc::clone(&shared), stream)
                })
                .instrument(span),
            )
        };
        Ok(Self {
            shared,
            accept,
            group: None,
        })
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local_addr
    }

    /// The quorum the group is configured for.
    pub fn quorum_id(&self) -> Option<i64> {
        self.group.as_ref().map(|g| g.key.quorum_id)
    }

    /// This replica group's rank in the configured group.
    pub fn rank(&self) -> Option<u64> {
        self.group.as_ref().map(|g| g.rank as u64)
    }

    /// Members of the configured group.
    pub fn world_size(&self) -> Option<u64> {
        self.group.as_ref().map(|g| g.replica_ids.len() as u64)
    }

    /// Whether an operation of the configured group failed.
    pub fn is_broken(&self) -> bool {
        self.group.as_ref().is_some_and(|g| g.failure.is_some())
    }

    /// Configures the group for `quorum` (the manager's answer to this
    /// replica group's quorum request): rebuilt when the quorum id or the
    /// members changed, kept otherwise. Fails if the group of this very
    /// quorum is broken (it heals with the next quorum id, which the failed
    /// commit brings).
    pub async fn configure(&mut self, quorum: &QuorumResult) -> Result<(), CollectiveError> {
        self.configure_with(
            &quorum.store_address,
            quorum.quorum_id,
            &quorum.replica_ids,
            quorum.replica_rank,
        )
        .await
    }

    /// [`configure`](Self::configure) from the parts of a quorum result:
    /// the primary's store address, the quorum id, the members' replica ids
    /// in replica-rank order, and this replica group's rank.
    pub async fn configure_with(
        &mut self,
        store_address: &str,
        quorum_id: i64,
        replica_ids: &[String],
        replica_rank: u64,
    ) -> Result<(), CollectiveError> {
        let world_size = replica_ids.len();
        let me = &self.shared.options.replica_id;
        let rank = quorum_rank(replica_ids, replica_rank, me, quorum_id)
            .map_err(|reason| CollectiveError::InvalidQuorum { reason })?;
        let key = GroupKey {
            quorum_id,
            membership: membership(replica_ids),
        };
        if let Some(group) = &self.group {
            if group.key == key && group.rank == rank {
                return match &group.failure {
                    Some(reason) => Err(CollectiveError::Broken {
                        quorum_id,
                        reason: reason.clone(),
                    }),
                    None => Ok(()),
                };
            }
        }
        // A new quorum: drop the old connections and the stale introductions.
        self.group = None;
        self.shared
            .pending()
            .retain(|pending, _| pending.quorum_id > quorum_id);
        let span = info_span!(
            "configure",
            replica_id = %me,
            quorum_id,
            rank,
            world_size
        );
        let peers = if world_size == 1 {
            Vec::new()
        } else {
            if store_address.is_empty() {
                return Err(CollectiveError::InvalidQuorum {
                    reason: "no store address to rendezvous at".to_owned(),
                });
            }
            let options = &self.shared.options;
            let timeout = options.timeout;
            let deadline = Instant::now() + timeout;
            // Connecting is part of the rendezvous: bounded by both limits.
            let store = connect_store(store_address, options.connect_timeout.min(timeout))
                .instrument(span.clone())
                .await?;
            let rendezvous =
                rendezvous(&self.shared, &store, store_address, key, replica_ids, rank);
            match tokio::time::timeout_at(deadline, rendezvous.instrument(span.clone())).await {
                Ok(result) => result?,
                Err(_) => {
                    return Err(CollectiveError::Timeout {
                        what: "process group rendezvous",
                        timeout,
                    })
                }
            }
        };
        span.in_scope(|| info!("process group configured"));
        self.group = Some(Group {
            key,
            rank,
            replica_ids: replica_ids.to_vec(),
            peers,
            seq: 0,
            failure: None,
        });
        Ok(())
    }

    /// Reduces `data` across the group in place: afterwards every member
    /// holds the same bits, the element-wise sum (or mean) of every
    /// member's `data`, all of the same length.
    ///
    /// The buffer is cut into one segment per rank
    /// ([`segment`](super::segment)); each member sends every other member
    /// its segment of the input, reduces the segment it owns from all
    /// contributions in replica-rank order
    /// ([`reduce_in_rank_order`](super::reduce_in_rank_order)), and sends
    /// the result to everyone: each element is computed once, by one
    /// member, in a fixed order. Segments travel in chunks, each reduced
    /// as it arrives, so no copy of the buffer is made.
    pub async fn allreduce(
        &mut self,
        data: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let timeout = self.shared.options.timeout;
        let group = self.group.as_mut().ok_or(CollectiveError::NotConfigured)?;
        if let Some(reason) = &group.failure {
            return Err(CollectiveError::Broken {
                quorum_id: group.key.quorum_id,
                reason: reason.clone(),
            });
        }
        if group.peers.is_empty() {
            reduce_in_place(data, 0, &[], op);
            return Ok(());
        }
        group.seq += 1;
        let span = info_span!(
            "allreduce",
            replica_id = %self.shared.options.replica_id,
            quorum_id = group.key.quorum_id,
            rank = group.rank,
            seq = group.seq,
            len = data.len()
        );
        let result = match tokio::time::timeout(
            timeout,
            run_allreduce(
                &mut group.peers,
                (group.seq, group.rank, group.replica_ids.len()),
                data,
                op,
            ),
        )
        .instrument(span.clone())
        .await
        {
            Ok(result) => result,
            Err(_) => Err(CollectiveError::Timeout {
                what: "allreduce",
                timeout,
            }),
        };
        if let Err(error) = &result {
            span.in_scope(|| warn!("allreduce failed, closing the group: {error}"));
            group.failure = Some(error.to_string());
            // Closing every connection tells the other members at once.
            group.peers.clear();
        }
        result
    }

    /// [`allreduce`](Self::allreduce) with [`ReduceOp::Mean`]: gradient
    /// averaging.
    pub async fn allreduce_mean(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        self.allreduce(data, ReduceOp::Mean).await
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// A peer connection accepted: handshake, hello, then parked in `pending`
/// until the group it names is configured here.
async fn introduce(shared: Arc<Shared>, stream: TcpStream) {
    let limit = shared.options.connect_timeout;
    let endpoint = Endpoint::new(shared.options.replica_id.clone(), 0);
    let mut conn =
        match tokio::time::timeout(limit, PeerConnection::accept(stream, &endpoint)).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(error)) => {
                debug!("peer handshake failed: {error}");
                return;
            }
            Err(_) => return,
        };
    let hello = match link::read_message(&mut conn.reader, limit).await {
        Ok(message) if message.header.kind == KIND_HELLO => link::decode::<Hello>(message),
        Ok(message) => {
            debug!("expected a hello, got a {} message", message.header.kind);
            return;
        }
        Err(_) => return,
    };
    let hello = match hello {
        Ok(hello) => hello,
        Err(error) => {
            debug!("bad hello: {error}");
            return;
        }
    };
    debug!(
        quorum_id = hello.key.quorum_id,
        rank = hello.rank,
        peer = %hello.replica_id,
        "peer introduced"
    );
    shared
        .pending()
        .entry(hello.key)
        .or_default()
        .insert(hello.rank, Pending { hello, conn });
    shared.arrivals.send_modify(|n| *n += 1);
}

/// Connects to the quorum's store at `address` (`host:port`), retrying
/// while nobody listens there yet, for at most `timeout`.
async fn connect_store(address: &str, timeout: Duration) -> Result<TcpStore, CollectiveError> {
    let unusable = |reason| CollectiveError::StoreAddress {
        address: address.to_owned(),
        reason,
    };
    let addr = link::lookup(address, timeout).await.map_err(unusable)?;
    TcpStore::connect(addr, timeout)
        .await
        .map_err(|error| store_error(address, error))
}

fn store_error(address: &str, error: StoreError) -> CollectiveError {
    match error {
        StoreError::Timeout { keys, after } => CollectiveError::StoreTimeout {
            address: address.to_owned(),
            keys,
            waited: after,
        },
        source => CollectiveError::Store {
            address: address.to_owned(),
            source,
        },
    }
}

/// Publishes this member's address in `store` (at `store_address`),
/// connects to the lower ranks and takes the connections of the higher
/// ones.
async fn rendezvous(
    shared: &Arc<Shared>,
    store: &TcpStore,
    store_address: &str,
    key: GroupKey,
    replica_ids: &[String],
    rank: usize,
) -> Result<Vec<Peer>, CollectiveError> {
    let options = &shared.options;
    let failed = |error| store_error(store_address, error);
    let prefix = format!("ferry_ft/pg/{}/{:016x}", key.quorum_id, key.membership);
    let address = shared.local_addr.to_string().into_bytes();
    store
        .set(&format!("{prefix}/{rank}"), address)
        .await
        .map_err(failed)?;
    let lower = async {
        let keys: Vec<String> = (0..rank).map(|peer| format!("{prefix}/{peer}")).collect();
        store.wait(&keys, options.timeout).await.map_err(failed)?;
        let mut addrs = Vec::with_capacity(rank);
        for (peer, key) in keys.iter().enumerate() {
            let value = store.get(key).await.map_err(failed)?;
            let addr = std::str::from_utf8(&value)
                .ok()
                .and_then(|text| text.parse::<SocketAddr>().ok())
                .ok_or_else(|| {
                    protocol(
                        peer,
                        &replica_ids[peer],
                        format!(
                            "published {:?} as its address, not a socket address",
                            String::from_utf8_lossy(&value)
                        ),
                    )
                })?;
            addrs.push(addr);
        }
        futures::future::try_join_all(
            addrs
                .into_iter()
                .enumerate()
                .map(|(peer, addr)| connect_peer(shared, key, replica_ids, rank, peer, addr)),
        )
        .await
    };
    let higher = accept_peers(shared, key, replica_ids, rank);
    let (mut peers, higher) = tokio::try_join!(lower, higher)?;
    peers.extend(higher);
    Ok(peers)
}

async fn connect_peer(
    shared: &Shared,
    key: GroupKey,
    replica_ids: &[String],
    rank: usize,
    peer: usize,
    addr: SocketAddr,
) -> Result<Peer, CollectiveError> {
    let options = &shared.options;
    let connect_error = |reason: String| CollectiveError::Connect {
        rank: peer as u64,
        address: addr.to_string(),
        reason,
    };
    let endpoint = Endpoint::new(
        options.replica_id.clone(),
        u32::try_from(rank).unwrap_or(u32::MAX),
    );
    let mut conn = link::connect(addr, &endpoint, options.connect_timeout)
        .await
        .map_err(|error| connect_error(error.to_string()))?;
    let replica_id = replica_ids[peer].clone();
    let hello = Hello {
        key,
        rank: rank as u64,
        world_size: replica_ids.len() as u64,
        replica_id: options.replica_id.clone(),
    };
    let message = link::message(KIND_HELLO, &hello)
        .map_err(|error| connect_error(format!("cannot encode the hello: {error}")))?;
    conn.writer
        .write(&message)
        .await
        .map_err(|error| peer_error(peer, &replica_id, error))?;
    // The peer answers once it configures this quorum too.
    let reply = link::read_message(&mut conn.reader, options.timeout)
        .await
        .map_err(|error| read_error(peer, &replica_id, error, "the hello reply"))?;
    if reply.header.kind != KIND_HELLO_REPLY {
        return Err(protocol(
            peer,
            &replica_id,
            format!(
                "expected a hello reply, got a {} message",
                reply.header.kind
            ),
        ));
    }
    match link::decode::<HelloReply>(reply) {
        Ok(HelloReply::Ready) => {}
        Ok(HelloReply::Rejected(reason)) => {
            return Err(connect_error(format!("rejected: {reason}")))
        }
        Err(error) => {
            return Err(protocol(
                peer,
                &replica_id,
                format!("bad hello reply: {error}"),
            ))
        }
    }
    if conn.peer.worker_name != replica_id {
        return Err(protocol(
            peer,
            &replica_id,
            format!("answered as {:?}", conn.peer.worker_name),
        ));
    }
    Ok(Peer {
        rank: peer,
        replica_id,
        reader: conn.reader,
        writer: conn.writer,
    })
}

/// Waits for the hellos of every higher rank of the group, checks who they
/// are and acknowledges them.
async fn accept_peers(
    shared: &Shared,
    key: GroupKey,
    replica_ids: &[String],
    rank: usize,
) -> Result<Vec<Peer>, CollectiveError> {
    let world_size = replica_ids.len();
    let needed: Vec<u64> = (rank as u64 + 1..world_size as u64).collect();
    if needed.is_empty() {
        return Ok(Vec::new());
    }
    let mut arrivals = shared.arrivals.subscribe();
    let taken = loop {
        arrivals.borrow_and_update();
        {
            let mut pending = shared.pending();
            let complete = pending
                .get(&key)
                .is_some_and(|arrived| needed.iter().all(|r| arrived.contains_key(r)));
            if complete {
                break pending.remove(&key).unwrap_or_default();
            }
        }
        if arrivals.changed().await.is_err() {
            // Unreachable while `shared` holds the sender; never spin.
            std::future::pending::<()>().await;
        }
    };
    let mut peers = Vec::with_capacity(needed.len());
    for (peer_rank, Pending { hello, mut conn }) in taken {
        let peer = peer_rank as usize;
        let expected = replica_ids.get(peer).cloned().unwrap_or_default();
        let verdict = if peer <= rank || peer >= world_size {
            Err(format!(
                "rank {peer_rank} is not a higher rank of this group"
            ))
        } else if hello.world_size != world_size as u64 || hello.replica_id != expected {
            Err(format!(
                "{:?} introduced itself as rank {peer_rank} of {}, expected {expected:?} of {world_size}",
                hello.replica_id, hello.world_size
            ))
        } else {
            Ok(())
        };
        let reply = match &verdict {
            Ok(()) => HelloReply::Ready,
            Err(reason) => HelloReply::Rejected(reason.clone()),
        };
        let message = link::message(KIND_HELLO_REPLY, &reply).map_err(|error| {
            protocol(peer, &expected, format!("cannot encode the reply: {error}"))
        })?;
        conn.writer
            .write(&message)
            .await
            .map_err(|error| peer_error(peer, &expected, error))?;
        if let Err(reason) = verdict {
            return Err(protocol(peer, &hello.replica_id, reason));
        }
        peers.push(Peer {
            rank: peer,
            replica_id: expected,
            reader: conn.reader,
            writer: conn.writer,
        });
    }
    Ok(peers)
}
