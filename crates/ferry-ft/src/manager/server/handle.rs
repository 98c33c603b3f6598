//! [`Manager`]: binds, serves and heartbeats; the handle the caller keeps.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, ToSocketAddrs};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, info_span, Instrument};

use super::grpc::GrpcService;
use super::options::ManagerOptions;
use super::shared::{run_heartbeats, Shared, State};
use super::status::{ManagerError, ManagerStatus};
use crate::access::client_endpoint;
use crate::grpc::finish_serving;
use crate::manager::{ManagerInfo, QuorumGather, ShouldCommitVotes};
use crate::proto::manager_service_server::ManagerServiceServer;

/// A running manager: `torchft.ManagerService` (`Quorum`,
/// `CheckpointMetadata`, `ShouldCommit`, `Kill`) for the ranks of one
/// replica group, and a heartbeat to the lighthouse.
///
/// [`bind`](Self::bind) binds and returns at once (bind port 0 and read
/// [`local_addr`](Self::local_addr)); the lighthouse need not be up yet.
/// The server runs on the current tokio runtime until
/// [`shutdown`](Self::shutdown) or drop. Quorum requests must carry a gRPC
/// deadline, as torchft requires; it also bounds each lighthouse request.
///
/// ```no_run
/// use ferry_ft::manager::{Manager, ManagerOptions};
///
/// # async fn run() -> Result<(), ferry_ft::manager::ManagerError> {
/// let options = ManagerOptions::new("replica_a", "http://lighthouse:29510", "replica_a:29500", 8);
/// let manager = Manager::bind("[::]:0", options).await?;
/// println!("ranks connect to {}", manager.address());
/// // ... the group's ranks ask it for quorums (ManagerClient) ...
/// manager.shutdown().await?;
/// # Ok(()) }
/// ```
pub struct Manager {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    serve: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
    heartbeat: Option<JoinHandle<()>>,
}

impl fmt::Debug for Manager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Manager")
            .field("local_addr", &self.local_addr)
            .field("address", &self.shared.info.address)
            .field("options", &self.shared.opt)
            .finish_non_exhaustive()
    }
}

impl Manager {
    /// Binds `addr` (e.g. `"[::]:0"` or `"127.0.0.1:0"`) and starts serving
    /// and heartbeating on the current tokio runtime. Returns once the
    /// socket is bound; the lighthouse is first contacted by the heartbeat.
    pub async fn bind(
        addr: impl ToSocketAddrs + fmt::Display,
        options: ManagerOptions,
    ) -> Result<Self, ManagerError> {
        let replica_id = options.replica_id.clone();
        if options.world_size == 0 {
            return Err(ManagerError::InvalidOptions {
                replica_id,
                reason: "world_size must be at least 1".to_owned(),
            });
        }
        let (lighthouse, _) =
            client_endpoint(&options.lighthouse_addr, options.lighthouse_tls.as_ref()).map_err(
                |source| ManagerError::InvalidLighthouseAddress {
                    replica_id: replica_id.clone(),
                    address: options.lighthouse_addr.clone(),
                    source,
                },
            )?;
        let lighthouse = lighthouse
            .connect_timeout(options.connect_timeout)
            .tcp_nodelay(true);
        let bind_error = |source| ManagerError::Bind {
            replica_id: replica_id.clone(),
            addr: addr.to_string(),
            source,
        };
        let listener = TcpListener::bind(&addr).await.map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let mut server = options
            .access
            .server()
            .map_err(|e| ManagerError::InvalidOptions {
                replica_id: replica_id.clone(),
                reason: e.to_string(),
            })?;
        let incoming = options.access.incoming(listener, "manager");
        let address = advertised_address(
            options.hostname.as_deref(),
            local_addr,
            options.access.tls.is_some(),
        );

        let (shutdown, shutdown_rx) = watch::channel(false);
        let info = ManagerInfo {
            replica_id: replica_id.clone(),
            address,
            store_address: options.store_address.clone(),
            world_size: options.world_size,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                gather: QuorumGather::new(info.clone()),
                quorum_round: watch::channel(None).0,
                round_task: None,
                votes: ShouldCommitVotes::new(options.world_size),
                commit_round: watch::channel(None).0,
                commit_failures: 0,
            }),
            info,
            opt: options,
            lighthouse,
            lighthouse_client: Mutex::new(None),
            status: watch::channel(ManagerStatus::default()).0,
            shutdown: shutdown_rx.clone(),
        });

        let span = info_span!("manager", replica_id = %replica_id, addr = %local_addr);
        let heartbeat = tokio::spawn(
            run_heartbeats(Arc::clone(&shared), shutdown_rx.clone()).instrument(span.clone()),
        );
        let mut stop = shutdown_rx;
        let signal = async move {
            // Either `true` was sent or the `Manager` is gone: stop.
            let _ = stop.wait_for(|stop| *stop).await;
        };
        let serve = tokio::spawn(
            server
                .add_service(ManagerServiceServer::new(GrpcService {
                    shared: Arc::clone(&shared),
                }))
                .serve_with_incoming_shutdown(incoming, signal)
                .instrument(span),
        );
        info!(
            replica_id = %replica_id,
            lighthouse = %shared.opt.lighthouse_addr,
            world_size = shared.opt.world_size,
            "Manager listening on {}",
            shared.info.address
        );

        Ok(Self {
            local_addr,
            shared,
            shutdown,
            serve: Some(serve),
            heartbeat: Some(heartbeat),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The address the manager advertises to the lighthouse
    /// (`http://host:port`): where its ranks and healing replicas reach it.
    pub fn address(&self) -> &str {
        &self.shared.info.address
    }

    /// The replica group's id.
    pub fn replica_id(&self) -> &str {
        &self.shared.info.replica_id
    }

    /// The options it runs with.
    pub fn options(&self) -> &ManagerOptions {
        &self.shared.opt
    }

    /// What it has done so far.
    pub fn status(&self) -> ManagerStatus {
        self.shared.status.borrow().clone()
    }

    /// Waits until `done` holds for the [status](Self::status), re-checking
    /// it on every change (a rank asking, a lighthouse attempt, a quorum, a
    /// vote, a heartbeat, a kill). Returns the status that satisfied it.
    /// Bound it with a timeout where it might never hold.
    pub async fn wait_for_status(
        &self,
        mut done: impl FnMut(&ManagerStatus) -> bool,
    ) -> ManagerStatus {
        let mut status = self.shared.status.subscribe();
        let found = status
            .wait_for(|status| done(status))
            .await
            .map(|s| s.clone());
        match found {
            Ok(status) => status,
            // Unreachable while `self` holds the sender; never spin.
            Err(_) => std::future::pending().await,
        }
    }

    /// Stops the manager: waiting ranks are told `UNAVAILABLE`, the
    /// heartbeat stops, the listener closes (the port can be bound again
    /// once this returns), open connections get up to 5 s to finish before
    /// they are cut.
    pub async fn shutdown(mut self) -> Result<(), ManagerError> {
        info!(replica_id = %self.shared.info.replica_id, "Manager shutting down");
        self.shutdown.send_replace(true);
        if let Some(heartbeat) = self.heartbeat.take() {
            heartbeat.abort();
        }
        let Some(serve) = self.serve.take() else {
            return Ok(());
        };
        finish_serving(serve, &self.shared.info.replica_id)
            .await
            .map_err(ManagerError::Task)?
            .map_err(ManagerError::Serve)
    }
}

impl Drop for Manager {
    /// Stops the manager as [`shutdown`](Manager::shutdown) does, without
    /// waiting: open connections finish in the background.
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
        if let Some(heartbeat) = self.heartbeat.take() {
            heartbeat.abort();
        }
    }
}

/// `http://host:port` for the manager bound at `local_addr`.
fn advertised_address(hostname: Option<&str>, local_addr: SocketAddr, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    let port = local_addr.port();
    let host = match hostname {
        Some(host) => host.to_owned(),
        None if local_addr.ip().is_unspecified() => machine_hostname(),
        None => return format!("{scheme}://{}", SocketAddr::new(local_addr.ip(), port)),
    };
    match host.parse::<IpAddr>() {
        Ok(ip) => format!("{scheme}://{}", SocketAddr::new(ip, port)),
        Err(_) => format!("{scheme}://{host}:{port}"),
    }
}

/// The machine's host name (what torchft advertises), `localhost` where it
/// cannot be read.
fn machine_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertised_addresses() {
        let v4: SocketAddr = "127.0.0.1:29512".parse().expect("addr");
        let v6: SocketAddr = "[::1]:29512".parse().expect("addr");
        let any: SocketAddr = "0.0.0.0:29512".parse().expect("addr");
        assert_eq!(
            advertised_address(None, v4, false),
            "http://127.0.0.1:29512"
        );
        assert_eq!(advertised_address(None, v6, false), "http://[::1]:29512");
        assert_eq!(
            advertised_address(Some("node7"), any, false),
            "http://node7:29512"
        );
        assert_eq!(
            advertised_address(Some("::1"), any, false),
            "http://[::1]:29512"
        );
        assert_eq!(
            advertised_address(Some("node7"), any, true),
            "https://node7:29512"
        );
        let host = advertised_address(None, any, false);
        assert!(
            host.starts_with("http://") && host.ends_with(":29512") && !host.contains("0.0.0.0"),
            "{host}"
        );
    }
}
