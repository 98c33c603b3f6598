//! What the server tests share (`lighthouse_server.rs`, `manager_server.rs`,
//! `torchft_interop.rs`, `access.rs`): bounded waits, a lighthouse and
//! managers on 127.0.0.1 with test timings, plain HTTP requests, and TLS
//! certificates made at test time.

// Each test binary uses its own subset.
#![allow(dead_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use ferry_ft::access::TlsIdentity;
use ferry_ft::lighthouse::{Lighthouse, LighthouseOptions, LighthouseStatus};
use ferry_ft::manager::{Manager, ManagerClient, ManagerOptions};
use ferry_ft::proto::manager_service_server::{ManagerService, ManagerServiceServer};
use ferry_ft::proto::{
    CheckpointMetadataRequest, CheckpointMetadataResponse, KillRequest, KillResponse,
    ManagerQuorumRequest, ManagerQuorumResponse, ShouldCommitRequest, ShouldCommitResponse,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

/// Upper bound on any single wait in these tests.
pub(crate) const BOUND: Duration = Duration::from_secs(30);

/// Awaits `future`; panics, naming `what`, if it takes more than [`BOUND`].
pub(crate) async fn bounded<T>(what: &str, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(BOUND, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what}: nothing within {BOUND:?}"),
    }
}

/// torchft's defaults but a 10 ms tick, a 100 ms join timeout and a 60 s
/// heartbeat timeout (a slow machine must not expire heartbeats). Tests
/// with several replica groups set `min_replicas` to their number, so the
/// join timeout never decides who is in; tests of the join timeout set
/// their own.
pub(crate) fn lighthouse_options(min_replicas: u64) -> LighthouseOptions {
    LighthouseOptions::new(min_replicas)
        .with_quorum_tick(Duration::from_millis(10))
        .with_join_timeout(Duration::from_millis(100))
        .with_heartbeat_timeout(Duration::from_secs(60))
}

/// A lighthouse on 127.0.0.1, any free port.
pub(crate) async fn start_lighthouse(options: LighthouseOptions) -> Lighthouse {
    Lighthouse::bind("127.0.0.1:0", options)
        .await
        .expect("bind the lighthouse on 127.0.0.1:0")
}

/// Shuts `lighthouse` down, within [`BOUND`].
pub(crate) async fn stop_lighthouse(lighthouse: Lighthouse) {
    bounded("lighthouse shutdown", lighthouse.shutdown())
        .await
        .expect("lighthouse shutdown");
}

/// Waits until the lighthouse's status satisfies `done`.
pub(crate) async fn wait_lighthouse(
    lighthouse: &Lighthouse,
    what: &str,
    done: impl FnMut(&LighthouseStatus) -> bool,
) -> LighthouseStatus {
    bounded(what, lighthouse.wait_for_status(done)).await
}

/// The store address replica group `replica_id` registers (nothing
/// listens there: the managers only pass it on).
pub(crate) fn store(replica_id: &str) -> String {
    format!("{replica_id}.store:29500")
}

/// A manager's options for tests: heartbeats every 20 ms, a 5 s connect
/// timeout, and a `Kill` hook that only reports (the default exits).
pub(crate) fn manager_options(
    replica_id: &str,
    lighthouse: &str,
    world_size: u64,
) -> (ManagerOptions, mpsc::UnboundedReceiver<String>) {
    let (kills, killed) = mpsc::unbounded_channel();
    let options = ManagerOptions::new(replica_id, lighthouse, store(replica_id), world_size)
        .with_heartbeat_interval(Duration::from_millis(20))
        .with_connect_timeout(Duration::from_secs(5))
        .with_on_kill(move |msg| {
            // The receiver may be gone at the end of a test.
            let _ = kills.send(msg);
        });
    (options, killed)
}

/// A manager on 127.0.0.1 with [`manager_options`].
pub(crate) async fn start_manager(replica_id: &str, lighthouse: &str, world_size: u64) -> Manager {
    let (options, _) = manager_options(replica_id, lighthouse, world_size);
    Manager::bind("127.0.0.1:0", options)
        .await
        .expect("bind the manager on 127.0.0.1:0")
}

/// Shuts `manager` down, within [`BOUND`].
pub(crate) async fn stop_manager(manager: Manager) {
    bounded("manager shutdown", manager.shutdown())
        .await
        .expect("manager shutdown");
}

/// A rank's client of `manager`.
pub(crate) async fn connect(manager: &Manager) -> ManagerClient {
    bounded("connect", ManagerClient::connect(manager.address()))
        .await
        .expect("connect to the manager")
}

/// A plain HTTP/1.1 request over a fresh TCP connection:
/// (status code, head, body).
pub(crate) async fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String, String) {
    http_with(addr, method, path, "").await
}

/// [`http`] with extra header lines (each ending in `\r\n`).
pub(crate) async fn http_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
) -> (u16, String, String) {
    bounded("http", async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Connection: close\r\nContent-Length: 0\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.expect("send");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.expect("receive");
        let text = String::from_utf8(raw).expect("utf-8 answer");
        let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
        let code = head
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .expect("a status line");
        (code, head.to_owned(), body.to_owned())
    })
    .await
}

/// A CA and a server certificate it signed for `localhost` and 127.0.0.1,
/// made at test time (PEM).
pub(crate) struct Pki {
    /// The CA's certificate: what a client trusts.
    pub(crate) ca: String,
    /// The server's certificate chain and key.
    pub(crate) server: TlsIdentity,
}

impl Pki {
    /// A fresh CA and server certificate (each call: another CA).
    pub(crate) fn new() -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_key = KeyPair::generate().expect("CA key");
        let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().expect("server key");
        let server = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
            .expect("server params")
            .signed_by(&key, &issuer)
            .expect("server certificate");
        Pki {
            ca: ca.pem(),
            server: TlsIdentity {
                cert_pem: server.pem().into_bytes(),
                key_pem: key.serialize_pem().into_bytes(),
            },
        }
    }
}

// ---------------------------------------------------------------------------
// A fake manager: only Kill is implemented; it reports each Kill it gets.

pub(crate) struct FakeManager {
    kills: mpsc::UnboundedSender<String>,
}

#[tonic::async_trait]
impl ManagerService for FakeManager {
    async fn quorum(
        &self,
        _: Request<ManagerQuorumRequest>,
    ) -> Result<Response<ManagerQuorumResponse>, Status> {
        Err(Status::unimplemented("fake manager: Kill only"))
    }

    async fn checkpoint_metadata(
        &self,
        _: Request<CheckpointMetadataRequest>,
    ) -> Result<Response<CheckpointMetadataResponse>, Status> {
        Err(Status::unimplemented("fake manager: Kill only"))
    }

    async fn should_commit(
        &self,
        _: Request<ShouldCommitRequest>,
    ) -> Result<Response<ShouldCommitResponse>, Status> {
        Err(Status::unimplemented("fake manager: Kill only"))
    }

    async fn kill(&self, request: Request<KillRequest>) -> Result<Response<KillResponse>, Status> {
        // The receiver may be gone at the end of a test; nothing to report to.
        let _ = self.kills.send(request.into_inner().msg);
        Ok(Response::new(KillResponse {}))
    }
}

pub(crate) struct RunningManager {
    /// Where the lighthouse reaches it.
    pub(crate) url: String,
    /// Each Kill it got, in order.
    pub(crate) kills: mpsc::UnboundedReceiver<String>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl RunningManager {
    /// Serves on 127.0.0.1, port 0.
    pub(crate) async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fake manager");
        let url = format!("http://{}", listener.local_addr().expect("local addr"));
        let (kills_tx, kills) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(
            Server::builder()
                .add_service(ManagerServiceServer::new(FakeManager { kills: kills_tx }))
                .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
                    let _ = stopped.await;
                }),
        );
        Self {
            url,
            kills,
            stop: Some(stop),
            task,
        }
    }

    /// Stops it and waits until it has.
    pub(crate) async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        bounded("fake manager shutdown", &mut self.task)
            .await
            .expect("fake manager task")
            .expect("fake manager server");
    }
}
