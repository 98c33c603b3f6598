//! The lighthouse's access control for torchft's clients, which know no
//! secret: over TLS only clients that trust its certificate's CA get an
//! answer (a plain-text client gets none), and an allow-list of client
//! networks closes connections from elsewhere unread while allowed
//! clients are served. The manager uses the same `Access`, and Ferry's
//! own clients (a rank's `ManagerClient`, the manager's client to the
//! lighthouse) reach both over TLS when they trust the CA, and fail with a
//! typed error when they do not. Certificates are made at test time.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::LazyLock;
use std::time::Duration;

use ferry_ft::access::{Access, AllowList, ClientTls, EndpointError, TlsIdentity};
use ferry_ft::lighthouse::{Lighthouse, LighthouseOptions};
use ferry_ft::manager::{
    Manager, ManagerClient, ManagerClientError, ManagerOptions, QuorumRequest,
};
use ferry_ft::proto::lighthouse_service_client::LighthouseServiceClient;
use ferry_ft::proto::LighthouseHeartbeatRequest;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

use common::Pki;

const BOUND: Duration = Duration::from_secs(20);

/// The servers' CA and identity.
static PKI: LazyLock<Pki> = LazyLock::new(Pki::new);
/// Another CA, which signed nothing the servers hold.
static OTHER: LazyLock<Pki> = LazyLock::new(Pki::new);

fn identity() -> TlsIdentity {
    PKI.server.clone()
}

async fn lighthouse(access: Access) -> Lighthouse {
    Lighthouse::bind("127.0.0.1:0", LighthouseOptions::new(1).with_access(access))
        .await
        .unwrap()
}

/// Sends one heartbeat through `endpoint`; the error text if it fails.
async fn heartbeat(endpoint: Endpoint) -> Result<(), String> {
    let endpoint = endpoint.connect_timeout(BOUND).timeout(BOUND);
    let channel = tokio::time::timeout(BOUND, endpoint.connect())
        .await
        .unwrap()
        .map_err(|e| format!("connect: {e:?}"))?;
    let mut client = LighthouseServiceClient::new(channel);
    tokio::time::timeout(
        BOUND,
        client.heartbeat(LighthouseHeartbeatRequest {
            replica_id: "replica_a".into(),
        }),
    )
    .await
    .unwrap()
    .map(|_| ())
    .map_err(|e| format!("heartbeat: {e:?}"))
}

#[tokio::test]
async fn over_tls_only_clients_trusting_the_ca_are_answered() {
    let lh = lighthouse(Access::default().with_tls(identity())).await;
    assert!(lh.url().starts_with("https://"));
    let port = lh.local_addr().port();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&PKI.ca))
        .domain_name("localhost");
    let trusted = Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(tls)
        .unwrap();
    heartbeat(trusted).await.unwrap();
    // A plain-text client (torchft's default) gets no answer.
    let plain = Endpoint::from_shared(format!("http://127.0.0.1:{port}")).unwrap();
    assert!(heartbeat(plain).await.is_err());
    // A TLS client that does not trust the CA refuses the server.
    let untrusting = Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(ClientTlsConfig::new().domain_name("localhost"))
        .unwrap();
    assert!(heartbeat(untrusting).await.is_err());
}

#[tokio::test]
async fn clients_outside_the_allowed_networks_are_closed_and_allowed_ones_served() {
    let elsewhere: AllowList = "10.0.0.0/8".parse().unwrap();
    let closed = lighthouse(Access::default().with_allow(elsewhere)).await;
    let refused = heartbeat(Endpoint::from_shared(closed.url()).unwrap()).await;
    assert!(refused.is_err());

    let here: AllowList = "10.0.0.0/8,127.0.0.0/8".parse().unwrap();
    let open = lighthouse(Access::default().with_allow(here)).await;
    heartbeat(Endpoint::from_shared(open.url()).unwrap())
        .await
        .unwrap();
}

/// Ferry's clients over TLS: a manager serving TLS heartbeats to a TLS
/// lighthouse trusting its CA (by the certificate's IP name), and a rank's
/// `ManagerClient` trusting the CA (by the name `localhost`) gets a quorum
/// through both. Without the CA an `https://` address is refused before
/// connecting, a client trusting another CA gets `Tls`, and a manager
/// trusting another CA gets no quorum, its error naming TLS.
#[tokio::test]
async fn ferry_clients_reach_tls_servers_when_they_trust_the_ca() {
    let lh = lighthouse(Access::default().with_tls(identity())).await;
    let trust = ClientTls::new(PKI.ca.clone());
    let options = |id: &str, tls: ClientTls| {
        ManagerOptions::new(id, lh.url(), format!("{id}.store:29500"), 1)
            .with_access(Access::default().with_tls(identity()))
            .with_lighthouse_tls(tls)
            .with_heartbeat_interval(Duration::from_millis(20))
            .with_connect_timeout(BOUND)
    };
    let manager = Manager::bind("127.0.0.1:0", options("replica_a", trust.clone()))
        .await
        .unwrap();
    assert!(
        manager.address().starts_with("https://"),
        "{}",
        manager.address()
    );
    tokio::time::timeout(BOUND, manager.wait_for_status(|s| s.heartbeats > 0))
        .await
        .unwrap();

    let by_name = trust.clone().with_domain("localhost");
    let client = ManagerClient::connect_with(manager.address(), BOUND, Some(&by_name))
        .await
        .unwrap();
    let quorum = client
        .quorum(QuorumRequest::new(0, 0), BOUND)
        .await
        .unwrap();
    assert_eq!(quorum.replica_world_size, 1);

    // No CA: an https:// address is refused before anything is sent.
    match ManagerClient::connect_with_timeout(manager.address(), BOUND).await {
        Err(ManagerClientError::InvalidAddress {
            source: EndpointError::HttpsWithoutTls,
            ..
        }) => {}
        other => panic!("expected HttpsWithoutTls, got {other:?}"),
    }
    // Another CA: the handshake fails, and the error says so.
    let other = ClientTls::new(OTHER.ca.clone());
    match ManagerClient::connect_with(manager.address(), BOUND, Some(&other)).await {
        Err(e @ ManagerClientError::Tls { .. }) => {
            assert!(e.to_string().contains("certificate"), "{e}");
        }
        other => panic!("expected a TLS error, got {other:?}"),
    }
    // A manager trusting another CA gets no quorum; its error names TLS.
    let untrusting = Manager::bind("127.0.0.1:0", options("replica_b", other))
        .await
        .unwrap();
    let client = ManagerClient::connect_with(untrusting.address(), BOUND, Some(&trust))
        .await
        .unwrap();
    match client.quorum(QuorumRequest::new(0, 0), BOUND).await {
        Err(e @ ManagerClientError::LighthouseUnreachable { .. }) => {
            assert!(
                e.to_string().contains("TLS with the lighthouse failed"),
                "{e}"
            );
        }
        other => panic!("expected LighthouseUnreachable, got {other:?}"),
    }
    untrusting.shutdown().await.unwrap();
    manager.shutdown().await.unwrap();
    lh.shutdown().await.unwrap();
}
