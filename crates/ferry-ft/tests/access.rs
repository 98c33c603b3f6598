//! The lighthouse's access control for torchft's clients, which know no
//! secret: over TLS only clients that trust its certificate's CA get an
//! answer (a plain-text client gets none), and an allow-list of client
//! networks closes connections from elsewhere unread while allowed
//! clients are served. The manager uses the same `Access`.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use ferry_ft::access::{Access, AllowList, TlsIdentity};
use ferry_ft::lighthouse::{Lighthouse, LighthouseOptions};
use ferry_ft::proto::lighthouse_service_client::LighthouseServiceClient;
use ferry_ft::proto::LighthouseHeartbeatRequest;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

const BOUND: Duration = Duration::from_secs(20);
const CA: &[u8] = include_bytes!("fixtures/tls/ca.pem");

fn identity() -> TlsIdentity {
    TlsIdentity {
        cert_pem: include_bytes!("fixtures/tls/server.pem").to_vec(),
        key_pem: include_bytes!("fixtures/tls/server.key").to_vec(),
    }
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
        .ca_certificate(Certificate::from_pem(CA))
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
