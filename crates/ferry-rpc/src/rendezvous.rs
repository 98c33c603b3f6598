//! Rendezvous: every worker publishes its name and listening address in the
//! store (hosted by rank 0 unless a store is given, or by torchrun's agent
//! under torchrun), then reads everyone's.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tracing::debug;

use crate::store::{C10dStore, PrefixStore, Store, StoreLimits, TcpStore, TcpStoreServer};
use crate::{RpcError, RpcOptions, TorchElastic, WorkerInfo};

/// Key namespace of the agent in the store.
pub(crate) const NAMESPACE: &str = "ferry/rpc";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct WorkerRecord {
    name: String,
    addr: SocketAddr,
}

pub(crate) struct Rendezvous {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) server: Option<TcpStoreServer>,
    pub(crate) workers: Vec<WorkerInfo>,
    pub(crate) addrs: Vec<SocketAddr>,
    pub(crate) listener: TcpListener,
}

pub(crate) async fn rendezvous(o: &RpcOptions) -> Result<Rendezvous, RpcError> {
    let agent_store = o.torchelastic.as_ref().is_some_and(|t| t.use_agent_store);
    let (base, server): (Arc<dyn Store>, Option<TcpStoreServer>) = match &o.store {
        Some(s) => (s.clone(), None),
        // torchrun's agent (node rank 0's) hosts a c10d store for its workers.
        None if agent_store => {
            if o.auth.is_some() {
                // torch's store knows no secret: only the RPC ports are
                // authenticated (docs/reference/authentication.md).
                tracing::warn!(
                    store = %o.master_addr,
                    "an auth secret is set, but torchrun's agent store cannot authenticate: \
                     the rendezvous keys are unprotected, the RPC ports are"
                );
            }
            (
                Arc::new(C10dStore::connect(o.master_addr, o.init_timeout).await?),
                None,
            )
        }
        None if o.rank == 0 => {
            let server = TcpStoreServer::bind_authenticated(
                o.master_addr,
                StoreLimits::default(),
                o.auth.clone(),
            )
            .await?;
            let client = TcpStore::connect_authenticated(
                server.local_addr(),
                o.init_timeout,
                o.auth.clone(),
            )
            .await?;
            (Arc::new(client), Some(server))
        }
        None => (
            Arc::new(
                TcpStore::connect_authenticated(o.master_addr, o.init_timeout, o.auth.clone())
                    .await?,
            ),
            None,
        ),
    };
    // Under torchrun, each attempt meets in a namespace of its own: a
    // restarted group never reads the keys an earlier attempt left. Each
    // worker also says, outside it, which attempt it is in: if the group
    // does not form, the error can say who is elsewhere.
    let run_store = base.clone();
    if let Some(t) = &o.torchelastic {
        run_store
            .set(
                &restart_key(&t.run_id, o.rank),
                t.restart_count.to_string().into_bytes(),
            )
            .await?;
    }
    let base: Arc<dyn Store> = match &o.torchelastic {
        Some(t) => Arc::new(PrefixStore::new(t.namespace(), base)),
        None => base,
    };
    let store: Arc<dyn Store> = Arc::new(PrefixStore::new(NAMESPACE, base));

    let listener = TcpListener::bind((o.listen_ip, 0))
        .await
        .map_err(|e| RpcError::Config(format!("cannot listen on {}: {e}", o.listen_ip)))?;
    let mut addr = listener
        .local_addr()
        .map_err(|e| RpcError::Config(format!("listener has no address: {e}")))?;
    if addr.ip().is_unspecified() {
        addr.set_ip(route_to(o.master_addr).unwrap_or(o.master_addr.ip()));
    }
    let record = record(&o.name, addr)?;
    let key = |r: u32| format!("worker/{r}");
    let stored = store
        .compare_set(&key(o.rank), None, record.clone())
        .await?;
    if stored != record {
        return Err(RpcError::Config(format!(
            "rank {} is already taken by another process",
            o.rank
        )));
    }
    let keys: Vec<String> = (0..o.world_size).map(key).collect();
    if let Err(e) = store.wait(&keys, o.init_timeout).await {
        return Err(match (&e, &o.torchelastic) {
            (crate::store::StoreError::Timeout { .. }, Some(t)) => {
                elsewhere(run_store.as_ref(), t, o.world_size)
                    .await
                    .unwrap_or(e.into())
            }
            _ => e.into(),
        });
    }
    let mut workers = Vec::with_capacity(keys.len());
    let mut addrs = Vec::with_capacity(keys.len());
    for (rank, k) in keys.iter().enumerate() {
        let bytes = store.get(k).await?;
        let r: WorkerRecord = postcard::from_bytes(&bytes)
            .map_err(|e| RpcError::Config(format!("corrupt rendezvous record {k}: {e}")))?;
        workers.push(WorkerInfo {
            name: r.name,
            id: rank as u32,
        });
        addrs.push(r.addr);
    }
    // Rank 0 keeps the store up until everyone has read the table. It
    // may close it as soon as the last `ready` is stored (when it fails
    // the rendezvous too, e.g. on a duplicate name, and its process
    // exits), before the reply to that `set` reaches this worker: the
    // store closing here, after the table was read, changes nothing. Seen
    // across hosts: "the store connection is closed" where every rank
    // should have failed with the duplicate name.
    match store.set(&format!("ready/{}", o.rank), Vec::new()).await {
        Ok(()) => {}
        Err(crate::store::StoreError::Closed) if o.rank != 0 => {
            debug!("the store closed after the rendezvous table was read");
        }
        Err(e) => return Err(e.into()),
    }
    if o.rank == 0 {
        let ready: Vec<String> = (0..o.world_size).map(|r| format!("ready/{r}")).collect();
        store.wait(&ready, o.init_timeout).await?;
    }
    check_unique(&workers)?;
    debug!(?addr, "rendezvous complete");
    Ok(Rendezvous {
        store,
        server,
        workers,
        addrs,
        listener,
    })
}

/// Where a worker under torchrun says which restart it is in (outside
/// the attempts' namespaces).
fn restart_key(run_id: &str, rank: u32) -> String {
    format!("torchelastic/{run_id}/restart_of/{rank}")
}

/// After a rendezvous timeout under torchrun: an error naming the ranks
/// whose last attempt is not this worker's (torchrun counted their
/// node's restart differently), if there are any.
async fn elsewhere(store: &dyn Store, t: &TorchElastic, world_size: u32) -> Option<RpcError> {
    let mut others = Vec::new();
    for rank in 0..world_size {
        let key = restart_key(&t.run_id, rank);
        if !store.check(std::slice::from_ref(&key)).await.ok()? {
            continue;
        }
        let count = store.get(&key).await.ok()?;
        let count = String::from_utf8_lossy(&count).into_owned();
        if count != t.restart_count.to_string() {
            others.push(format!("rank {rank} at restart {count}"));
        }
    }
    if others.is_empty() {
        return None;
    }
    Some(RpcError::Config(format!(
        "torchrun rendezvous of restart {} (run {:?}) timed out: {} (TORCHELASTIC_RESTART_COUNT differs between nodes: torchrun counts a restart only on a node whose own workers failed, so let a worker whose peer died exit with an error)",
        t.restart_count,
        t.run_id,
        others.join(", ")
    )))
}

/// The rendezvous record of worker `name` listening on `addr` (the value
/// of its `worker/{rank}` key).
pub(crate) fn record(name: &str, addr: SocketAddr) -> Result<Vec<u8>, RpcError> {
    postcard::to_stdvec(&WorkerRecord {
        name: name.to_string(),
        addr,
    })
    .map_err(|e| RpcError::Config(e.to_string()))
}

/// Every worker sees the same table, so every worker fails alike.
fn check_unique(workers: &[WorkerInfo]) -> Result<(), RpcError> {
    for w in workers {
        let ranks: Vec<u32> = workers
            .iter()
            .filter(|o| o.name == w.name)
            .map(|o| o.id)
            .collect();
        if ranks.len() > 1 {
            return Err(RpcError::DuplicateName {
                name: w.name.clone(),
                ranks,
            });
        }
    }
    Ok(())
}

/// The local IP the kernel would use to reach `to` (no packet is sent).
pub(crate) fn route_to(to: SocketAddr) -> Option<IpAddr> {
    let bind: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse().ok()?
    } else {
        "[::]:0".parse().ok()?
    };
    let s = UdpSocket::bind(bind).ok()?;
    s.connect(to).ok()?;
    s.local_addr().ok().map(|a| a.ip())
}
