//! A small key-value store over `ferry-transport` for rendezvous (torchft
//! hands its process groups a `TCPStore` address per quorum; this is
//! Ferry's, libtorch-free): `set` a key, `get` a key waiting until some
//! member sets it.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use ferry_transport::{Endpoint, TcpConnection};
use ferry_wire::{Limits, MessageKind};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, info, info_span, warn, Instrument};

use super::CollectiveError;
use crate::recovery::link::{self, ReadError};

const KIND_STORE_REQUEST: MessageKind = MessageKind(0x0f10);
const KIND_STORE_REPLY: MessageKind = MessageKind(0x0f11);

/// Most keys a store holds; sets beyond are refused.
const MAX_KEYS: usize = 1 << 20;
/// Largest value.
const MAX_VALUE_BYTES: usize = 1 << 20;
/// The longest a `get` may wait on the server.
const MAX_WAIT: Duration = Duration::from_secs(600);
/// How long a connection may sit idle between requests.
const IDLE_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Serialize, Deserialize)]
enum StoreRequest {
    Set { key: String, value: Vec<u8> },
    Get { key: String, wait_ms: u64 },
}

#[derive(Debug, Serialize, Deserialize)]
enum StoreReply {
    Done,
    Value(Vec<u8>),
    Missing,
    Refused(String),
}

struct Shared {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changes: watch::Sender<u64>,
}

impl Shared {
    fn values(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        self.values.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A rendezvous store: one per replica group, its address the group's
/// `store_address` (what the lighthouse hands to the quorum's members as
/// the primary's store).
///
/// Keys live as long as the server; callers put the quorum id in their
/// keys, so keys of different quorums never mix.
pub struct StoreServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreServer")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

impl StoreServer {
    /// Binds `addr` (e.g. `"127.0.0.1:0"`) and serves on the current tokio
    /// runtime until dropped.
    pub async fn bind(addr: impl ToSocketAddrs + fmt::Display) -> Result<Self, CollectiveError> {
        let bind_error = |source| CollectiveError::Bind {
            what: "store",
            addr: addr.to_string(),
            source,
        };
        let listener = TcpListener::bind(&addr).await.map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let shared = Arc::new(Shared {
            values: Mutex::new(HashMap::new()),
            changes: watch::channel(0).0,
        });
        let span = info_span!("store", addr = %local_addr);
        let accept = tokio::spawn(accept_loop(Arc::clone(&shared), listener).instrument(span));
        info!(addr = %local_addr, "store listening");
        Ok(Self {
            local_addr,
            shared,
            accept,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// `host:port`: the store address to give the manager.
    pub fn address(&self) -> String {
        self.local_addr.to_string()
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.shared.values().len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let span = info_span!("store_connection", %peer);
                    connections.spawn(serve(Arc::clone(&shared), stream).instrument(span));
                }
                Err(error) => {
                    warn!("store: accept failed: {error}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn serve(shared: Arc<Shared>, stream: TcpStream) {
    let mut endpoint = Endpoint::new("store", 0);
    endpoint.limits = Limits {
        max_payload_bytes: (MAX_VALUE_BYTES + (64 << 10)) as u32,
        max_tensors: 0,
        max_tensor_bytes: 0,
        max_message_tensor_bytes: 0,
        ..Limits::default()
    };
    let conn = match tokio::time::timeout(
        Duration::from_secs(30),
        TcpConnection::accept(stream, &endpoint),
    )
    .await
    {
        Ok(Ok(conn)) => conn,
        Ok(Err(error)) => {
            debug!("store handshake failed: {error}");
            return;
        }
        Err(_) => return,
    };
    let TcpConnection {
        mut reader,
        mut writer,
        ..
    } = conn;
    loop {
        let message = match link::read_message(&mut reader, IDLE_TIMEOUT).await {
            Ok(message) => message,
            Err(ReadError::Closed | ReadError::Timeout) => return,
            Err(ReadError::Transport(error)) => {
                debug!("store connection failed: {error}");
                return;
            }
        };
        let reply = if message.header.kind != KIND_STORE_REQUEST {
            StoreReply::Refused(format!("unexpected {} message", message.header.kind))
        } else {
            match link::decode::<StoreRequest>(message) {
                Ok(request) => handle(&shared, request).await,
                Err(error) => StoreReply::Refused(format!("bad request: {error}")),
            }
        };
        let message = match link::message(KIND_STORE_REPLY, &reply) {
            Ok(message) => message,
            Err(error) => {
                warn!("store: cannot encode a reply: {error}");
                return;
            }
        };
        if writer.write(&message).await.is_err() {
            return;
        }
    }
}

async fn handle(shared: &Shared, request: StoreRequest) -> StoreReply {
    match request {
        StoreRequest::Set { key, value } => {
            if value.len() > MAX_VALUE_BYTES {
                return StoreReply::Refused(format!("value of {} bytes is too large", value.len()));
            }
            {
                let mut values = shared.values();
                if values.len() >= MAX_KEYS && !values.contains_key(&key) {
                    return StoreReply::Refused(format!("store full ({MAX_KEYS} keys)"));
                }
                values.insert(key, value);
            }
            shared.changes.send_modify(|version| *version += 1);
            StoreReply::Done
        }
        StoreRequest::Get { key, wait_ms } => {
            let deadline =
                tokio::time::Instant::now() + Duration::from_millis(wait_ms).min(MAX_WAIT);
            let mut changes = shared.changes.subscribe();
            loop {
                changes.borrow_and_update();
                if let Some(value) = shared.values().get(&key) {
                    return StoreReply::Value(value.clone());
                }
                match tokio::time::timeout_at(deadline, changes.changed()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) | Err(_) => return StoreReply::Missing,
                }
            }
        }
    }
}

/// A connection to a [`StoreServer`].
pub struct StoreClient {
    address: String,
    conn: TcpConnection,
}

impl fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreClient")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

impl StoreClient {
    /// Connects to the store at `address` (`host:port`) within `timeout`,
    /// as `name` (in its logs).
    pub async fn connect(
        address: &str,
        name: &str,
        timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        let store_error = |reason: String| CollectiveError::Store {
            address: address.to_owned(),
            reason,
        };
        let addr = link::resolve(address, timeout)
            .await
            .map_err(|error| store_error(error.to_string()))?;
        let conn = link::connect(addr, &Endpoint::new(name, 0), timeout)
            .await
            .map_err(|error| store_error(error.to_string()))?;
        Ok(Self {
            address: address.to_owned(),
            conn,
        })
    }

    /// Sets `key` to `value`.
    pub async fn set(
        &mut self,
        key: &str,
        value: &[u8],
        timeout: Duration,
    ) -> Result<(), CollectiveError> {
        let request = StoreRequest::Set {
            key: key.to_owned(),
            value: value.to_vec(),
        };
        match self.call(&request, timeout).await? {
            StoreReply::Done => Ok(()),
            other => Err(self.unexpected(other)),
        }
    }

    /// The value of `key`, waiting up to `wait` for someone to set it.
    pub async fn get(&mut self, key: &str, wait: Duration) -> Result<Vec<u8>, CollectiveError> {
        let request = StoreRequest::Get {
            key: key.to_owned(),
            wait_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
        };
        // The server answers `Missing` at the end of the wait; allow for the
        // answer to travel.
        match self.call(&request, wait + Duration::from_secs(5)).await? {
            StoreReply::Value(value) => Ok(value),
            StoreReply::Missing => Err(CollectiveError::StoreTimeout {
                address: self.address.clone(),
                key: key.to_owned(),
                waited: wait,
            }),
            other => Err(self.unexpected(other)),
        }
    }

    async fn call(
        &mut self,
        request: &StoreRequest,
        timeout: Duration,
    ) -> Result<StoreReply, CollectiveError> {
        let store_error = |reason: String| CollectiveError::Store {
            address: self.address.clone(),
            reason,
        };
        let message = link::message(KIND_STORE_REQUEST, request)
            .map_err(|error| store_error(format!("cannot encode the request: {error}")))?;
        let exchange = async {
            self.conn
                .writer
                .write(&message)
                .await
                .map_err(|error| error.to_string())?;
            match link::read_message(&mut self.conn.reader, timeout).await {
                Ok(reply) if reply.header.kind == KIND_STORE_REPLY => {
                    link::decode::<StoreReply>(reply).map_err(|error| format!("bad reply: {error}"))
                }
                Ok(reply) => Err(format!("unexpected {} message", reply.header.kind)),
                Err(ReadError::Timeout) => Err(format!("no answer within {timeout:?}")),
                Err(ReadError::Closed) => Err("connection closed".to_owned()),
                Err(ReadError::Transport(error)) => Err(error.to_string()),
            }
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(result) => result.map_err(store_error),
            Err(_) => Err(store_error(format!("no answer within {timeout:?}"))),
        }
    }

    fn unexpected(&self, reply: StoreReply) -> CollectiveError {
        CollectiveError::Store {
            address: self.address.clone(),
            reason: match reply {
                StoreReply::Refused(reason) => format!("refused: {reason}"),
                other => format!("unexpected reply {other:?}"),
            },
        }
    }
}
