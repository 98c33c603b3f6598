//! The dashboard's guard against DNS rebinding, over real sockets
//! (127.0.0.1, port 0): a request whose `Host` is not one of the
//! lighthouse's names (a page of another site, its name rebound to the
//! lighthouse's address) gets 421 and neither the page, its kill token,
//! the status nor a kill; the lighthouse's own names, and the names its
//! operator adds, work as before; gRPC is not checked.
//!
//! Nothing sleeps to wait for state: a refused kill is answered before it
//! could reach a manager, and a kill that goes through is answered after
//! the manager got it.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use ferry_ft::lighthouse::{Lighthouse, LighthouseError, LighthouseOptions};
use ferry_ft::proto::lighthouse_service_client::LighthouseServiceClient;
use ferry_ft::proto::{LighthouseHeartbeatRequest, LighthouseQuorumRequest, QuorumMember};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Endpoint;
use tonic::Request;

use common::{bounded, lighthouse_options, start_lighthouse, stop_lighthouse, RunningManager};

/// A name another site might rebind to the lighthouse's address.
const EVIL: &str = "evil.example";

/// One HTTP request over a fresh TCP connection to `addr`, with `Host:
/// host` (none when `None`), `version` (`HTTP/1.1`, `HTTP/1.0`) and extra
/// header lines (each ending in `\r\n`): (status code, body).
async fn request(
    addr: SocketAddr,
    version: &str,
    host: Option<&str>,
    method: &str,
    path: &str,
    headers: &str,
) -> (u16, String) {
    bounded("http", async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let host = host.map(|h| format!("Host: {h}\r\n")).unwrap_or_default();
        let request = format!(
            "{method} {path} {version}\r\n{host}{headers}Connection: close\r\nContent-Length: 0\r\n\r\n"
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
        (code, body.to_owned())
    })
    .await
}

/// An HTTP/1.1 request with `Host: host`.
async fn http_as(addr: SocketAddr, host: &str, method: &str, path: &str) -> (u16, String) {
    request(addr, "HTTP/1.1", Some(host), method, path, "").await
}

/// The kill token, read from the page through the lighthouse's address.
async fn kill_token(addr: SocketAddr) -> String {
    let (code, page) = http_as(addr, &addr.to_string(), "GET", "/").await;
    assert_eq!(code, 200, "{page}");
    let (_, rest) = page
        .split_once(r#"<meta name="ferry-kill-token" content=""#)
        .expect("a token in the page");
    let token = rest.split('"').next().expect("token").to_owned();
    assert_eq!(token.len(), 32, "{token:?}");
    token
}

/// Asserts a refusal of `host`: 421, naming it, without the token.
fn assert_refused(what: &str, (code, body): &(u16, String), host: &str, token: &str) {
    assert_eq!(*code, 421, "{what}: {body}");
    assert!(body.contains(host), "{what}: names the host: {body}");
    assert!(body.contains("--allowed-host"), "{what}: {body}");
    assert!(!body.contains(token), "{what}: leaks the token: {body}");
}

/// `replica_id` joins a quorum of one with `manager` as its address, so the
/// dashboard can kill it.
async fn register(lighthouse: &Lighthouse, replica_id: &str, manager: &RunningManager) {
    let mut client = bounded(
        "connect",
        LighthouseServiceClient::connect(lighthouse.url()),
    )
    .await
    .expect("connect to the lighthouse");
    let mut request = Request::new(LighthouseQuorumRequest {
        requester: Some(QuorumMember {
            replica_id: replica_id.to_owned(),
            address: manager.url.clone(),
            store_address: "store.invalid:29500".to_owned(),
            step: 1,
            world_size: 1,
            ..Default::default()
        }),
    });
    request.set_timeout(Duration::from_secs(25));
    bounded("quorum", client.quorum(request))
        .await
        .expect("a quorum");
}

// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebound_host_gets_neither_page_nor_token() {
    let lighthouse = start_lighthouse(lighthouse_options(1)).await;
    let addr = lighthouse.local_addr();
    let port = addr.port();
    let token = kill_token(addr).await;
    let evil = format!("{EVIL}:{port}");

    for path in ["/", "/?page=1", "/status"] {
        let answer = http_as(addr, &evil, "GET", path).await;
        assert_refused(path, &answer, &evil, &token);
        // The name's case or a trailing dot changes nothing.
        let loud = format!("EVIL.example.:{port}");
        assert_refused(
            path,
            &http_as(addr, &loud, "GET", path).await,
            &loud,
            &token,
        );
    }
    // A name that ends like an own one is still another one.
    let tricky = format!("localhost.{EVIL}:{port}");
    assert_refused(
        "suffix",
        &http_as(addr, &tricky, "GET", "/").await,
        &tricky,
        &token,
    );
    // No Host at all (HTTP/1.0 may leave it out): refused too.
    let (code, body) = request(addr, "HTTP/1.0", None, "GET", "/", "").await;
    assert_eq!(code, 421, "{body}");
    assert!(body.contains("no `Host`"), "{body}");
    assert!(!body.contains(&token));
    let (code, body) = request(addr, "HTTP/1.1", None, "GET", "/", "").await;
    assert_ne!(code, 200, "{body}");
    assert!(!body.contains(&token));
    // Two Host headers, one of them ours: refused.
    let ours = format!("Host: {addr}\r\n");
    let (code, body) = request(addr, "HTTP/1.1", Some(&evil), "GET", "/", &ours).await;
    assert_ne!(code, 200, "{body}");
    assert!(!body.contains(&token));
    // An absolute-form target naming another host, with our Host: refused.
    let absolute = format!("http://{evil}/");
    let (code, body) = request(
        addr,
        "HTTP/1.1",
        Some(&addr.to_string()),
        "GET",
        &absolute,
        "",
    )
    .await;
    assert_eq!(code, 421, "{body}");
    assert!(!body.contains(&token));
    stop_lighthouse(lighthouse).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebound_kill_is_refused_and_kills_nothing() {
    let mut manager = RunningManager::start().await;
    let lighthouse = start_lighthouse(lighthouse_options(1)).await;
    register(&lighthouse, "replica_a", &manager).await;
    let addr = lighthouse.local_addr();
    let token = kill_token(addr).await;
    let kill = format!("/replica/replica_a/kill?token={token}");

    // What a rebound page sends: the right token, its own name as Host and
    // as Origin (to the browser it is same-origin).
    let evil = format!("{EVIL}:{}", addr.port());
    let origin = format!("Origin: http://{evil}\r\n");
    let answer = request(addr, "HTTP/1.1", Some(&evil), "POST", &kill, &origin).await;
    assert_refused("kill", &answer, &evil, &token);
    let answer = request(addr, "HTTP/1.1", Some(&evil), "POST", &kill, "").await;
    assert_refused("kill without Origin", &answer, &evil, &token);
    // A refused kill is answered before it could reach the manager.
    assert!(manager.kills.try_recv().is_err(), "no Kill sent");
    assert!(lighthouse.status().last_kill.is_none(), "no kill tried");

    // The same kill for the lighthouse's address goes through.
    let ours = addr.to_string();
    let origin = format!("Origin: http://{ours}\r\n");
    let (code, body) = request(addr, "HTTP/1.1", Some(&ours), "POST", &kill, &origin).await;
    assert_eq!(code, 200, "{body}");
    let outcome: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(outcome["ok"], json!(true), "{outcome}");
    let message = bounded("the Kill", manager.kills.recv())
        .await
        .expect("a Kill");
    assert_eq!(message, "killed from dashboard");
    // A wrong token is still refused, and by the token check (403).
    let wrong = format!("/replica/replica_a/kill?token={}", "0".repeat(32));
    let (code, body) = request(addr, "HTTP/1.1", Some(&ours), "POST", &wrong, "").await;
    assert_eq!(code, 403, "{body}");
    assert!(manager.kills.try_recv().is_err(), "exactly one Kill");
    stop_lighthouse(lighthouse).await;
    manager.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_names_are_answered() {
    let lighthouse = start_lighthouse(lighthouse_options(1)).await;
    let addr = lighthouse.local_addr();
    let port = addr.port();
    for host in [
        addr.to_string(),
        format!("localhost:{port}"),
        format!("LocalHost:{port}"),
        // Any IP address (it cannot be rebound), any port (a port forward).
        format!("[::1]:{port}"),
        "127.0.0.1:8080".to_owned(),
        "localhost:8080".to_owned(),
    ] {
        let (code, page) = http_as(addr, &host, "GET", "/").await;
        assert_eq!(code, 200, "{host}: {page}");
        assert!(page.contains("ferry-kill-token"), "{host}");
        let (code, status) = http_as(addr, &host, "GET", "/status").await;
        assert_eq!(code, 200, "{host}: {status}");
        serde_json::from_str::<Value>(&status).expect("JSON status");
    }
    // The machine's own host name, where it can be read.
    if let Ok(name) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        let host = format!("{}:{port}", name.trim());
        let (code, page) = http_as(addr, &host, "GET", "/").await;
        assert_eq!(code, 200, "{host}: {page}");
    }
    stop_lighthouse(lighthouse).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_names_are_answered() {
    let options = lighthouse_options(1)
        .with_allowed_host("Lighthouse.Example")
        .with_allowed_host("proxy.example:8443");
    let mut manager = RunningManager::start().await;
    let lighthouse = start_lighthouse(options).await;
    register(&lighthouse, "replica_a", &manager).await;
    let addr = lighthouse.local_addr();
    let port = addr.port();
    let token = kill_token(addr).await;

    for host in [
        format!("lighthouse.example:{port}"),
        format!("LIGHTHOUSE.EXAMPLE:{port}"),
        "proxy.example:8443".to_owned(),
    ] {
        let (code, page) = http_as(addr, &host, "GET", "/").await;
        assert_eq!(code, 200, "{host}: {page}");
        assert!(page.contains(&token), "{host}");
    }
    // A name configured with a port: that port only.
    let other_port = "proxy.example:8080";
    assert_refused(
        other_port,
        &http_as(addr, other_port, "GET", "/").await,
        other_port,
        &token,
    );

    // A kill through a configured name, as its browser sends it.
    let host = format!("lighthouse.example:{port}");
    let origin = format!("Origin: http://{host}\r\n");
    let kill = format!("/replica/replica_a/kill?token={token}");
    let (code, body) = request(addr, "HTTP/1.1", Some(&host), "POST", &kill, &origin).await;
    assert_eq!(code, 200, "{body}");
    let message = bounded("the Kill", manager.kills.recv())
        .await
        .expect("a Kill");
    assert_eq!(message, "killed from dashboard");
    stop_lighthouse(lighthouse).await;
    manager.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_is_not_checked() {
    let lighthouse = start_lighthouse(lighthouse_options(1)).await;
    // A gRPC client whose `:authority` is a name the dashboard refuses.
    let channel = Endpoint::from_shared(lighthouse.url())
        .expect("endpoint")
        .origin(format!("http://{EVIL}:1").parse().expect("uri"));
    let channel = bounded("connect", channel.connect())
        .await
        .expect("connect to the lighthouse");
    let mut client = LighthouseServiceClient::new(channel);
    bounded(
        "heartbeat",
        client.heartbeat(LighthouseHeartbeatRequest {
            replica_id: "replica_a".to_owned(),
        }),
    )
    .await
    .expect("a heartbeat through a foreign authority");
    let status = lighthouse.status();
    assert_eq!(status.heartbeats.len(), 1, "{status:?}");
    stop_lighthouse(lighthouse).await;
}

#[tokio::test]
async fn a_bad_allowed_host_is_refused_at_bind() {
    let options = LighthouseOptions::new(1).with_allowed_host("not a name");
    let error = Lighthouse::bind("127.0.0.1:0", options)
        .await
        .expect_err("refused");
    assert!(
        matches!(&error, LighthouseError::AllowedHost(bad) if bad.entry == "not a name"),
        "{error:?}"
    );
    assert!(error.to_string().contains("not a name"), "{error}");
}
