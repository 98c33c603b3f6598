//! The lighthouse server over real sockets (127.0.0.1, port 0): quorums
//! through the generated tonic client with deadlines, requests refused as
//! torchft refuses them, heartbeats, the join timeout, a replica left out
//! re-joining, restarts, the dashboard (HTML, JSON, kill reaching a fake
//! manager), the `ferry-lighthouse` binary, and the dashboard in headless
//! Chromium.
//!
//! Nothing sleeps to wait for state: tests wait on responses, or on
//! [`Lighthouse::wait_for_status`], which is woken by every state change;
//! every wait is bounded by a tokio timeout.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use ferry_ft::lighthouse::{Lighthouse, LighthouseStatus};
use ferry_ft::proto::lighthouse_service_client::LighthouseServiceClient;
use ferry_ft::proto::{LighthouseHeartbeatRequest, LighthouseQuorumRequest, Quorum, QuorumMember};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

use common::{
    bounded, http, http_with, lighthouse_options, start_lighthouse, stop_lighthouse,
    wait_lighthouse, RunningManager,
};

/// The gRPC deadline quorum requests carry.
const DEADLINE: Duration = Duration::from_secs(25);
const HOUR: Duration = Duration::from_secs(60 * 60);

type Client = LighthouseServiceClient<Channel>;

async fn client(url: String) -> Client {
    bounded("connect", LighthouseServiceClient::connect(url))
        .await
        .expect("connect to the lighthouse")
}

fn member(replica_id: &str, step: i64) -> QuorumMember {
    QuorumMember {
        replica_id: replica_id.to_owned(),
        address: format!("http://{replica_id}.invalid:29512"),
        store_address: format!("{replica_id}.invalid:29500"),
        step,
        world_size: 1,
        ..Default::default()
    }
}

/// One quorum request with a deadline, as torchft's managers send it.
async fn ask(mut client: Client, requester: QuorumMember) -> Result<Quorum, Status> {
    let mut request = Request::new(LighthouseQuorumRequest {
        requester: Some(requester),
    });
    request.set_timeout(DEADLINE);
    let response = client.quorum(request).await?;
    Ok(response
        .into_inner()
        .quorum
        .expect("a quorum in the response"))
}

/// [`ask`] on a task of its own, so several replicas wait at once.
fn spawn_ask(
    client: &Client,
    requester: QuorumMember,
) -> tokio::task::JoinHandle<Result<Quorum, Status>> {
    tokio::spawn(ask(client.clone(), requester))
}

async fn answer(
    what: &str,
    task: tokio::task::JoinHandle<Result<Quorum, Status>>,
) -> Result<Quorum, Status> {
    bounded(what, task).await.expect("the request task")
}

async fn heartbeat(client: &Client, replica_id: &str) {
    let mut client = client.clone();
    bounded(
        "heartbeat",
        client.heartbeat(LighthouseHeartbeatRequest {
            replica_id: replica_id.to_owned(),
        }),
    )
    .await
    .expect("heartbeat");
}

fn ids(quorum: &Quorum) -> Vec<&str> {
    quorum
        .participants
        .iter()
        .map(|p| p.replica_id.as_str())
        .collect()
}

fn participant_ids(status: &LighthouseStatus) -> Vec<&str> {
    status
        .participants
        .iter()
        .map(|p| p.replica_id.as_str())
        .collect()
}

/// The dashboard's kill token, read from its page as a browser would.
async fn kill_token(addr: SocketAddr) -> String {
    let (code, _, page) = http(addr, "GET", "/").await;
    assert_eq!(code, 200, "{page}");
    let (_, rest) = page
        .split_once(r#"<meta name="ferry-kill-token" content=""#)
        .expect("a token in the page");
    rest.split('"').next().expect("token").to_owned()
}

async fn status_json(addr: SocketAddr) -> Value {
    let (code, head, body) = http(addr, "GET", "/status").await;
    assert_eq!(code, 200, "{head}\n{body}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    serde_json::from_str(&body).expect("JSON status")
}

fn managed_member(replica_id: &str, step: i64, manager: &RunningManager) -> QuorumMember {
    QuorumMember {
        address: manager.url.clone(),
        ..member(replica_id, step)
    }
}

// ---------------------------------------------------------------------------
// Quorums.

/// `n` replicas join at once and get one quorum. The join timeout is an
/// hour: with no straggler heartbeating, nobody waits for it.
async fn form_quorum(n: usize) {
    let lighthouse = start_lighthouse(lighthouse_options(n as u64).with_join_timeout(HOUR)).await;
    let client = client(lighthouse.url()).await;
    let names: Vec<String> = (0..n).map(|i| format!("replica_{i}")).collect();
    let tasks: Vec<_> = names
        .iter()
        .enumerate()
        .map(|(i, name)| spawn_ask(&client, member(name, 10 + i as i64)))
        .collect();
    let mut quorums = Vec::new();
    for task in tasks {
        quorums.push(answer("quorum", task).await.expect("a quorum"));
    }
    let first = &quorums[0];
    assert_eq!(first.quorum_id, 1);
    assert_eq!(
        ids(first),
        names.iter().map(String::as_str).collect::<Vec<_>>()
    );
    assert_eq!(
        first
            .participants
            .iter()
            .map(|p| p.step)
            .collect::<Vec<_>>(),
        (0..n).map(|i| 10 + i as i64).collect::<Vec<_>>()
    );
    assert!(first.created.is_some(), "quorums are stamped");
    for quorum in &quorums {
        assert_eq!(quorum, first, "every replica gets the same quorum");
    }
    let status = lighthouse.status();
    assert_eq!(status.quorum_id, 1);
    assert_eq!(status.num_participants, n as i64);
    assert!(status.participants.is_empty());
    stop_lighthouse(lighthouse).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_form_a_quorum() {
    form_quorum(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_form_a_quorum() {
    form_quorum(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_deadline_or_requester_are_invalid() {
    let lighthouse = start_lighthouse(lighthouse_options(1)).await;
    let mut client = client(lighthouse.url()).await;

    // No deadline: torchft refuses, since a quorum request may wait long.
    let request = Request::new(LighthouseQuorumRequest {
        requester: Some(member("a", 1)),
    });
    let error = bounded("no deadline", client.quorum(request))
        .await
        .expect_err("refused");
    assert_eq!(error.code(), Code::InvalidArgument, "{error:?}");
    assert!(error.message().contains("missing timeout"), "{error:?}");

    // A malformed deadline.
    let mut request = Request::new(LighthouseQuorumRequest {
        requester: Some(member("a", 1)),
    });
    request
        .metadata_mut()
        .insert("grpc-timeout", "soon".parse().expect("ascii"));
    let error = bounded("bad deadline", client.quorum(request))
        .await
        .expect_err("refused");
    assert_eq!(error.code(), Code::InvalidArgument, "{error:?}");

    // No requester.
    let mut request = Request::new(LighthouseQuorumRequest { requester: None });
    request.set_timeout(DEADLINE);
    let error = bounded("no requester", client.quorum(request))
        .await
        .expect_err("refused");
    assert_eq!(error.code(), Code::InvalidArgument, "{error:?}");
    assert!(error.message().contains("missing requester"), "{error:?}");

    // None of them joined.
    let status = lighthouse.status();
    assert!(status.participants.is_empty() && status.heartbeats.is_empty());

    // With a deadline, the same request is answered.
    let quorum = ask(client, member("a", 1)).await.expect("a quorum");
    assert_eq!(ids(&quorum), ["a"]);
    stop_lighthouse(lighthouse).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_are_recorded() {
    let lighthouse = start_lighthouse(lighthouse_options(2)).await;
    let client = client(lighthouse.url()).await;
    heartbeat(&client, "hb_a").await;
    heartbeat(&client, "hb_b").await;

    let status = status_json(lighthouse.local_addr()).await;
    let heartbeats = status["heartbeats"].as_array().expect("heartbeats");
    let seen: Vec<&str> = heartbeats
        .iter()
        .map(|h| h["replica_id"].as_str().expect("replica_id"))
        .collect();
    assert_eq!(seen, ["hb_a", "hb_b"]);
    for h in heartbeats {
        assert_eq!(h["healthy"], json!(true), "{h}");
        assert!(h["age_ms"].as_u64().expect("age") < 60_000, "{h}");
    }
    // Heartbeating is not joining.
    assert_eq!(status["participants"], json!([]));
    assert_eq!(status["quorum_id"], json!(0));
    assert!(
        status["quorum_status"]
            .as_str()
            .expect("reason")
            .contains("[0/0 participants healthy][2 heartbeating]"),
        "{status}"
    );

    let (code, _, page) = http(lighthouse.local_addr(), "GET", "/").await;
    assert_eq!(code, 200);
    assert!(page.contains(r#"data-replica="hb_a""#), "{page}");
    assert!(page.contains(r#"data-replica="hb_b""#), "{page}");
    stop_lighthouse(lighthouse).await;
}

/// A replica that heartbeats but does not join holds the quorum back until
/// the join timeout, then the quorum forms without it; when it joins later,
/// the next round includes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_timeout_waits_for_heartbeating_stragglers() {
    let join_timeout = Duration::from_millis(1500);
    let lighthouse = start_lighthouse(lighthouse_options(1).with_join_timeout(join_timeout)).await;
    let client = client(lighthouse.url()).await;
    heartbeat(&client, "straggler").await;

    let asked = Instant::now();
    let a = spawn_ask(&client, member("a", 3));
    let b = spawn_ask(&client, member("b", 3));
    let waiting = wait_lighthouse(&lighthouse, "a and b joined", |s| {
        s.participants.len() == 2 || s.quorum_id > 0
    })
    .await;
    assert_eq!(waiting.quorum_id, 0, "no quorum before the join timeout");
    assert!(
        waiting.quorum_status.contains(
            "Valid quorum with 2 participants, waiting for 1 healthy but not participating stragglers due to join timeout"
        ),
        "{}",
        waiting.quorum_status
    );

    let qa = answer("a", a).await.expect("quorum for a");
    let qb = answer("b", b).await.expect("quorum for b");
    assert!(
        asked.elapsed() >= join_timeout,
        "answered after {:?}, before the join timeout",
        asked.elapsed()
    );
    assert_eq!(qa, qb);
    assert_eq!(qa.quorum_id, 1);
    assert_eq!(ids(&qa), ["a", "b"]);

    // The straggler joins: alone it is not more than half of the three
    // heartbeating replicas, so it waits for a and b's next round.
    let straggler = spawn_ask(&client, member("straggler", 0));
    let waiting = wait_lighthouse(&lighthouse, "straggler joined", |s| {
        participant_ids(s) == ["straggler"]
    })
    .await;
    assert!(
        waiting
            .quorum_status
            .contains("need at least half of 3 healthy workers"),
        "{}",
        waiting.quorum_status
    );
    let a = spawn_ask(&client, member("a", 4));
    let b = spawn_ask(&client, member("b", 4));
    let qs = answer("straggler", straggler)
        .await
        .expect("quorum for the straggler");
    assert_eq!(answer("a", a).await.expect("a"), qs);
    assert_eq!(answer("b", b).await.expect("b"), qs);
    assert_eq!(qs.quorum_id, 2, "membership changed");
    assert_eq!(ids(&qs), ["a", "b", "straggler"]);
    stop_lighthouse(lighthouse).await;
}

/// A replica left out of a delivered quorum (a newcomer while a member asks
/// for shrink_only) keeps waiting and is part of the next round, as in
/// torchft's server loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn left_out_replica_rejoins_the_next_round() {
    let lighthouse = start_lighthouse(lighthouse_options(1).with_join_timeout(HOUR)).await;
    let client = client(lighthouse.url()).await;

    // Both heartbeat first, so that the first to join waits for the other
    // (alone it would be a valid quorum of min_replicas 1).
    heartbeat(&client, "a").await;
    heartbeat(&client, "b").await;
    let a = spawn_ask(&client, member("a", 1));
    let b = spawn_ask(&client, member("b", 1));
    let q1 = answer("a", a).await.expect("a");
    assert_eq!(answer("b", b).await.expect("b"), q1);
    assert_eq!((q1.quorum_id, ids(&q1)), (1, vec!["a", "b"]));

    let c = spawn_ask(&client, member("c", 0));
    wait_lighthouse(&lighthouse, "c joined", |s| participant_ids(s) == ["c"]).await;
    let a = spawn_ask(
        &client,
        QuorumMember {
            shrink_only: true,
            ..member("a", 2)
        },
    );
    let b = spawn_ask(&client, member("b", 2));
    let q2 = answer("a", a).await.expect("a");
    assert_eq!(answer("b", b).await.expect("b"), q2);
    assert_eq!(ids(&q2), ["a", "b"], "shrink_only drops the newcomer");
    assert_eq!(q2.quorum_id, 1, "same membership, same quorum id");

    // c's request is still open and c joined the next round by itself.
    let status = wait_lighthouse(&lighthouse, "c re-joined", |s| participant_ids(s) == ["c"]).await;
    assert_eq!(
        status.prev_quorum.as_ref().map(|q| q.members.len()),
        Some(2)
    );
    assert!(!c.is_finished());

    let a = spawn_ask(&client, member("a", 3));
    let b = spawn_ask(&client, member("b", 3));
    let q3 = answer("c", c).await.expect("c gets the next quorum");
    assert_eq!(answer("a", a).await.expect("a"), q3);
    assert_eq!(answer("b", b).await.expect("b"), q3);
    assert_eq!((q3.quorum_id, ids(&q3)), (2, vec!["a", "b", "c"]));
    let status = lighthouse.status();
    let members = &status.prev_quorum.as_ref().expect("a quorum").members;
    assert_eq!(
        members.iter().map(|m| m.recovering).collect::<Vec<_>>(),
        [false, false, true],
        "c at step 0 is behind max step 3"
    );
    stop_lighthouse(lighthouse).await;
}

/// Stop the lighthouse (a waiting request is told UNAVAILABLE), start a new
/// one on the same port: the same clients form a new quorum with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lighthouse_restart_on_the_same_port() {
    let first = start_lighthouse(lighthouse_options(2).with_join_timeout(HOUR)).await;
    let addr = first.local_addr();
    let client_a = client(first.url()).await;
    let client_b = client(first.url()).await;

    let a = spawn_ask(&client_a, member("a", 5));
    let b = spawn_ask(&client_b, member("b", 5));
    let q1 = answer("a", a).await.expect("a");
    assert_eq!(answer("b", b).await.expect("b"), q1);
    assert_eq!((q1.quorum_id, ids(&q1)), (1, vec!["a", "b"]));

    // a alone waits (min_replicas 2) until the lighthouse stops.
    let a = spawn_ask(&client_a, member("a", 6));
    wait_lighthouse(&first, "a joined", |s| participant_ids(s) == ["a"]).await;
    stop_lighthouse(first).await;
    let error = answer("a during shutdown", a)
        .await
        .expect_err("no quorum from a stopped lighthouse");
    assert_eq!(error.code(), Code::Unavailable, "{error:?}");

    let second = Lighthouse::bind(addr, lighthouse_options(2).with_join_timeout(HOUR))
        .await
        .expect("bind the same port again");
    assert_eq!(second.local_addr(), addr);
    let a = spawn_ask(&client_a, member("a", 6));
    let b = spawn_ask(&client_b, member("b", 6));
    let q = answer("a", a).await.expect("a after the restart");
    assert_eq!(answer("b", b).await.expect("b after the restart"), q);
    assert_eq!(q.quorum_id, 1, "a new lighthouse starts counting again");
    assert_eq!(ids(&q), ["a", "b"]);
    assert_eq!(q.participants[0].step, 6);
    stop_lighthouse(second).await;
}

/// Dropping the lighthouse stops it too: a waiting request is told
/// UNAVAILABLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_lighthouse_stops_it() {
    let lighthouse = start_lighthouse(lighthouse_options(2)).await;
    let client = client(lighthouse.url()).await;
    let a = spawn_ask(&client, member("a", 1));
    wait_lighthouse(&lighthouse, "a joined", |s| participant_ids(s) == ["a"]).await;
    drop(lighthouse);
    let error = answer("a after drop", a).await.expect_err("stopped");
    assert_eq!(error.code(), Code::Unavailable, "{error:?}");
}

// ---------------------------------------------------------------------------
// Dashboard.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_kill_reaches_the_manager() {
    let mut manager_a = RunningManager::start().await;
    let manager_b = RunningManager::start().await;
    let lighthouse = start_lighthouse(lighthouse_options(2).with_join_timeout(HOUR)).await;
    let client = client(lighthouse.url()).await;
    let a = spawn_ask(&client, managed_member("replica_a", 7, &manager_a));
    let b = spawn_ask(&client, managed_member("replica_b", 7, &manager_b));
    answer("a", a).await.expect("a");
    answer("b", b).await.expect("b");
    let addr = lighthouse.local_addr();
    let token = kill_token(addr).await;

    // Without the token, with a wrong one, or from another origin (a
    // cross-site form post): refused, nothing sent to the manager.
    let with_token = format!("/replica/replica_a/kill?token={token}");
    for (path, headers) in [
        ("/replica/replica_a/kill", ""),
        ("/replica/replica_a/kill?token=0123", ""),
        (with_token.as_str(), "Origin: http://evil.example\r\n"),
        (with_token.as_str(), "Sec-Fetch-Site: cross-site\r\n"),
        (
            "/replica/replica_a/kill",
            &format!("Origin: http://{addr}\r\n"),
        ),
    ] {
        let (code, _, body) = http_with(addr, "POST", path, headers).await;
        assert_eq!(code, 403, "{path} {headers:?}: {body}");
        let outcome: Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(outcome["ok"], json!(false));
    }
    assert!(manager_a.kills.try_recv().is_err(), "no Kill yet");

    let same_origin = format!("Origin: http://{addr}\r\n");
    let (code, _, body) = http_with(addr, "POST", &with_token, &same_origin).await;
    assert_eq!(code, 200, "{body}");
    let outcome: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(outcome["ok"], json!(true), "{outcome}");
    assert_eq!(outcome["replica_id"], json!("replica_a"));
    assert_eq!(outcome["address"], json!(manager_a.url));
    let message = bounded("Kill at manager a", manager_a.kills.recv())
        .await
        .expect("a Kill");
    assert_eq!(message, "killed from dashboard");
    let status = status_json(addr).await;
    assert_eq!(status["last_kill"]["replica_id"], json!("replica_a"));
    assert_eq!(status["last_kill"]["ok"], json!(true));

    // An unknown replica: 404 with the reason, nothing sent.
    let (code, _, body) = http(addr, "POST", &format!("/replica/nobody/kill?token={token}")).await;
    assert_eq!(code, 404, "{body}");
    let outcome: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(outcome["ok"], json!(false));
    assert!(
        outcome["error"]
            .as_str()
            .expect("error")
            .contains("not found"),
        "{outcome}"
    );

    // A manager that is gone: 502 with the reason, shown on the page.
    let b_url = manager_b.url.clone();
    manager_b.stop().await;
    let (code, _, body) = http(
        addr,
        "POST",
        &format!("/replica/replica_b/kill?token={token}"),
    )
    .await;
    assert_eq!(code, 502, "{body}");
    let outcome: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(outcome["ok"], json!(false));
    let error = outcome["error"].as_str().expect("error");
    assert!(
        error.contains(&format!("cannot connect to manager at {b_url}")),
        "{error}"
    );
    let (_, _, page) = http(addr, "GET", "/").await;
    assert!(
        page.contains("Last kill: replica_b failed: cannot connect"),
        "{page}"
    );

    // GET on the kill route is not a kill.
    let (code, _, _) = http(addr, "GET", "/replica/replica_a/kill").await;
    assert_eq!(code, 405);
    assert!(manager_a.kills.try_recv().is_err(), "exactly one Kill");
    stop_lighthouse(lighthouse).await;
    manager_a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_page_shows_the_quorum() {
    let evil = r#"<script>alert("x&y")</script>"#;
    let lighthouse = start_lighthouse(lighthouse_options(3).with_join_timeout(HOUR)).await;
    let client = client(lighthouse.url()).await;
    let tasks = [
        spawn_ask(&client, member("replica_a", 12)),
        spawn_ask(&client, member("replica_b", 12)),
        spawn_ask(&client, member(evil, 9)),
    ];
    for task in tasks {
        answer("quorum", task).await.expect("a quorum");
    }
    // One more replica waiting for the next round.
    let waiting = spawn_ask(&client, member("replica_c", 12));
    wait_lighthouse(&lighthouse, "replica_c joined", |s| {
        participant_ids(s) == ["replica_c"]
    })
    .await;

    let (code, head, page) = http(lighthouse.local_addr(), "GET", "/").await;
    assert_eq!(code, 200);
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/html"),
        "{head}"
    );
    assert!(
        page.contains(r#"<span class="value" id="quorum-id">1</span>"#),
        "{page}"
    );
    assert!(page.contains(r#"id="num-participants">3<"#), "{page}");
    assert!(page.contains(r#"id="max-step">12<"#), "{page}");
    for id in ["replica_a", "replica_b", "replica_c"] {
        assert!(
            page.contains(&format!(r#"data-kill="{id}""#)),
            "kill for {id}"
        );
        assert!(
            page.contains(&format!(r#"action="/replica/{id}/kill?token="#)),
            "form for {id}"
        );
        assert!(
            page.contains(&format!("http://{id}.invalid:29512")),
            "address of {id}"
        );
        assert!(
            page.contains(&format!("{id}.invalid:29500")),
            "store of {id}"
        );
    }
    // Three quorum members and one participant: four kill controls.
    assert_eq!(page.matches("data-kill=").count(), 4, "{page}");
    // The reason the next quorum is not ready.
    assert!(
        page.contains("New quorum not ready, only have 1 participants, need min_replicas 3"),
        "{page}"
    );
    // The evil replica id is escaped everywhere, and recovering (step 9 < 12).
    assert!(!page.contains(evil), "unescaped replica id in {page}");
    let escaped = "&lt;script&gt;alert(&quot;x&amp;y&quot;)&lt;/script&gt;";
    assert!(
        page.contains(&format!(r#"data-kill="{escaped}""#)),
        "{page}"
    );
    assert!(
        page.contains(&format!(
            r#"<tr class="member recovering" data-replica="{escaped}">"#
        )),
        "{page}"
    );
    assert_eq!(
        page.matches("<script>").count(),
        1,
        "only the page's own script"
    );
    let path = "/replica/%3Cscript%3Ealert%28%22x%26y%22%29%3C%2Fscript%3E/kill";
    assert!(
        page.contains(&format!(r#"action="{path}?token="#)),
        "{page}"
    );

    // The percent-encoded path reaches the right replica (its address does
    // not resolve: the kill fails, reported, never a panic).
    let token = kill_token(lighthouse.local_addr()).await;
    let path = format!("{path}?token={token}");
    let (code, _, body) = http(lighthouse.local_addr(), "POST", &path).await;
    assert_eq!(code, 502, "{body}");
    let outcome: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(outcome["replica_id"], json!(evil));

    // JSON agrees.
    let status = status_json(lighthouse.local_addr()).await;
    assert_eq!(status["quorum_id"], json!(1));
    assert_eq!(
        status["prev_quorum"]["members"][0]["replica_id"],
        json!(evil)
    );
    assert_eq!(
        status["prev_quorum"]["members"][0]["recovering"],
        json!(true)
    );
    assert_eq!(status["participants"][0]["replica_id"], json!("replica_c"));

    stop_lighthouse(lighthouse).await;
    let error = answer("replica_c", waiting).await.expect_err("stopped");
    assert_eq!(error.code(), Code::Unavailable);
}

// ---------------------------------------------------------------------------
// The binary.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_with_torchft_flags_serves_quorums() {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_ferry-lighthouse"))
        .args([
            "--bind",
            "127.0.0.1:0",
            "--min_replicas",
            "1",
            "--join_timeout_ms",
            "100",
            "--quorum_tick_ms",
            "10",
            "--heartbeat_timeout_ms",
            "5000",
        ])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start ferry-lighthouse");
    let stdout = child.stdout.take().expect("stdout");
    let line = bounded(
        "the address line",
        BufReader::new(stdout).lines().next_line(),
    )
    .await
    .expect("read stdout")
    .expect("a line");
    let url = line
        .strip_prefix("ferry-lighthouse listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();

    let client = client(url.clone()).await;
    heartbeat(&client, "solo").await;
    let quorum = ask(client, member("solo", 1)).await.expect("a quorum");
    assert_eq!((quorum.quorum_id, ids(&quorum)), (1, vec!["solo"]));
    let addr: SocketAddr = url
        .strip_prefix("http://")
        .and_then(|a| a.parse().ok())
        .expect("a socket address");
    let status = status_json(addr).await;
    assert_eq!(status["options"]["join_timeout_ms"], json!(100));
    assert_eq!(status["options"]["min_replicas"], json!(1));

    child.start_kill().expect("stop ferry-lighthouse");
    bounded("ferry-lighthouse exit", child.wait())
        .await
        .expect("wait");
}

// ---------------------------------------------------------------------------
// Headless Chromium: a screenshot, and a click on kill over the DevTools
// protocol.

const CHROMIUM: &str = "/usr/bin/chromium";

fn chromium(user_data_dir: &Path) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(CHROMIUM);
    command
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
        ])
        .arg(format!("--user-data-dir={}", user_data_dir.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true);
    command
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_in_headless_chromium() {
    if !Path::new(CHROMIUM).exists() {
        eprintln!(
            "SKIPPED dashboard_in_headless_chromium: {CHROMIUM} not found (apt-get install chromium)"
        );
        return;
    }
    let mut manager_a = RunningManager::start().await;
    let mut manager_b = RunningManager::start().await;
    let lighthouse = start_lighthouse(lighthouse_options(2).with_join_timeout(HOUR)).await;
    let client = client(lighthouse.url()).await;
    heartbeat(&client, "replica_a").await;
    let a = spawn_ask(&client, managed_member("replica_a", 42, &manager_a));
    let b = spawn_ask(&client, managed_member("replica_b", 40, &manager_b));
    answer("a", a).await.expect("a");
    answer("b", b).await.expect("b");
    let url = format!("{}/", lighthouse.url());

    // 1. Screenshot.
    let profile = tempfile::tempdir().expect("temp dir");
    let png = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("lighthouse-dashboard.png");
    let _ = std::fs::remove_file(&png);
    let output = tokio::time::timeout(
        Duration::from_secs(90),
        chromium(profile.path())
            .arg(format!("--screenshot={}", png.display()))
            .arg("--window-size=1200,800")
            .arg(&url)
            .stderr(Stdio::piped())
            .output(),
    )
    .await
    .expect("chromium --screenshot within 90 s")
    .expect("run chromium");
    let bytes = std::fs::read(&png).unwrap_or_else(|error| {
        panic!(
            "no screenshot at {} ({error}); chromium {}:\n{}",
            png.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        )
    });
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "a PNG");
    let width = u32::from_be_bytes(bytes[16..20].try_into().expect("4 bytes"));
    let height = u32::from_be_bytes(bytes[20..24].try_into().expect("4 bytes"));
    assert_eq!((width, height), (1200, 800));
    assert!(
        bytes.len() > 15_000,
        "a {}-byte screenshot looks blank",
        bytes.len()
    );
    eprintln!(
        "dashboard screenshot: {} ({} bytes)",
        png.display(),
        bytes.len()
    );

    // 2. A click on replica_a's kill button, through the DevTools protocol.
    let profile = tempfile::tempdir().expect("temp dir");
    let mut browser = chromium(profile.path())
        .arg("--remote-debugging-port=0")
        .arg("about:blank")
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chromium");
    let stderr = browser.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let ws_url = bounded("DevTools listening", async {
        loop {
            let line = lines
                .next_line()
                .await
                .expect("read chromium's stderr")
                .expect("chromium exited before listening");
            if let Some(at) = line.find("ws://") {
                if line.contains("DevTools listening on") {
                    return line[at..].trim().to_owned();
                }
            }
        }
    })
    .await;
    // Keep draining stderr so chromium never blocks on it.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

    let page_url = url.clone();
    let clicked =
        tokio::task::spawn_blocking(move || cdp_click_kill(&ws_url, &page_url, "replica_a"));
    let (outcome, kill_text) = bounded("the click", clicked)
        .await
        .expect("the DevTools task")
        .unwrap_or_else(|error| panic!("DevTools: {error}"));
    assert_eq!(outcome["ok"], json!(true), "{outcome}");
    assert_eq!(outcome["replica_id"], json!("replica_a"));
    let message = bounded("Kill at manager a", manager_a.kills.recv())
        .await
        .expect("a Kill");
    assert_eq!(message, "killed from dashboard");
    assert!(kill_text.contains("Killed replica_a"), "{kill_text:?}");
    assert!(
        manager_b.kills.try_recv().is_err(),
        "only replica_a was killed"
    );

    if tokio::time::timeout(Duration::from_secs(10), browser.wait())
        .await
        .is_err()
    {
        browser.start_kill().expect("kill chromium");
        let _ = bounded("chromium exit", browser.wait()).await;
    }
    stop_lighthouse(lighthouse).await;
    manager_a.stop().await;
    manager_b.stop().await;
}

/// A minimal DevTools protocol client over one websocket (flattened
/// sessions): commands wait for their answer, events are kept until asked for.
struct Cdp {
    socket: tungstenite::WebSocket<std::net::TcpStream>,
    next_id: u64,
    events: Vec<Value>,
}

impl Cdp {
    fn connect(ws_url: &str) -> Result<Self, String> {
        let host = ws_url
            .strip_prefix("ws://")
            .and_then(|rest| rest.split('/').next())
            .ok_or_else(|| format!("odd DevTools URL {ws_url}"))?;
        let stream = std::net::TcpStream::connect(host).map_err(|e| e.to_string())?;
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(|e| e.to_string())?;
        stream
            .set_write_timeout(Some(Duration::from_secs(30)))
            .map_err(|e| e.to_string())?;
        let (socket, _) = tungstenite::client(ws_url, stream).map_err(|e| e.to_string())?;
        Ok(Self {
            socket,
            next_id: 0,
            events: Vec::new(),
        })
    }

    fn receive(&mut self) -> Result<Value, String> {
        loop {
            match self.socket.read().map_err(|e| e.to_string())? {
                tungstenite::Message::Text(text) => {
                    return serde_json::from_str(text.as_str()).map_err(|e| e.to_string())
                }
                tungstenite::Message::Close(_) => return Err("DevTools closed".into()),
                _ => {}
            }
        }
    }

    fn call(
        &mut self,
        session: Option<&str>,
        method: &str,
        params: Value,
    ) -> Result<Value, String> {
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({ "id": id, "method": method, "params": params });
        if let Some(session) = session {
            message["sessionId"] = json!(session);
        }
        self.socket
            .send(tungstenite::Message::text(message.to_string()))
            .map_err(|e| e.to_string())?;
        loop {
            let message = self.receive()?;
            if message["id"] == json!(id) {
                if let Some(error) = message.get("error") {
                    return Err(format!("{method}: {error}"));
                }
                return Ok(message["result"].clone());
            }
            if message.get("method").is_some() {
                self.events.push(message);
            }
        }
    }

    fn wait_event(&mut self, session: &str, method: &str) -> Result<Value, String> {
        let matches = |event: &Value| {
            event["method"] == json!(method) && event["sessionId"] == json!(session)
        };
        if let Some(at) = self.events.iter().position(matches) {
            return Ok(self.events.remove(at));
        }
        loop {
            let message = self.receive()?;
            if matches(&message) {
                return Ok(message);
            }
        }
    }

    /// Evaluates `expression` in the page, awaiting a promise result.
    fn evaluate(&mut self, session: &str, expression: &str) -> Result<Value, String> {
        let result = self.call(
            Some(session),
            "Runtime.evaluate",
            json!({ "expression": expression, "awaitPromise": true, "returnByValue": true }),
        )?;
        if let Some(exception) = result.get("exceptionDetails") {
            return Err(format!("{expression}: {exception}"));
        }
        Ok(result["result"]["value"].clone())
    }
}

/// Opens `page_url` in a new tab, clicks `[data-kill="<replica_id>"]` and
/// returns the kill's outcome (the JSON the page got back) and the text the
/// page then shows; closes the browser.
fn cdp_click_kill(
    ws_url: &str,
    page_url: &str,
    replica_id: &str,
) -> Result<(Value, String), String> {
    let mut cdp = Cdp::connect(ws_url)?;
    let target = cdp.call(None, "Target.createTarget", json!({ "url": "about:blank" }))?;
    let target_id = target["targetId"].as_str().ok_or("no targetId")?.to_owned();
    let attached = cdp.call(
        None,
        "Target.attachToTarget",
        json!({ "targetId": target_id, "flatten": true }),
    )?;
    let session = attached["sessionId"]
        .as_str()
        .ok_or("no sessionId")?
        .to_owned();
    cdp.call(Some(&session), "Page.enable", json!({}))?;
    cdp.call(Some(&session), "Page.navigate", json!({ "url": page_url }))?;
    cdp.wait_event(&session, "Page.loadEventFired")?;

    let outcome = cdp.evaluate(
        &session,
        &format!(
            "document.querySelector('[data-kill=\"{replica_id}\"]').click(); window.ferryLastKill"
        ),
    )?;
    let text = cdp.evaluate(
        &session,
        "document.getElementById('kill-result').textContent",
    )?;
    let _ = cdp.call(None, "Browser.close", json!({}));
    Ok((outcome, text.as_str().unwrap_or_default().to_owned()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_ids_are_bounded() {
    let lighthouse = start_lighthouse(lighthouse_options(2).with_join_timeout(HOUR)).await;
    let client = client(lighthouse.url()).await;
    let long = "x".repeat(ferry_ft::lighthouse::MAX_REPLICA_ID_BYTES + 1);
    let mut c = client.clone();
    let error = bounded(
        "heartbeat",
        c.heartbeat(LighthouseHeartbeatRequest {
            replica_id: long.clone(),
        }),
    )
    .await
    .expect_err("refused");
    assert_eq!(error.code(), Code::InvalidArgument, "{error:?}");
    assert!(error
        .message()
        .contains("exceeds the lighthouse's limit of 1024 bytes"));
    let error = answer("long", spawn_ask(&client, member(&long, 1)))
        .await
        .expect_err("refused");
    assert_eq!(error.code(), Code::InvalidArgument, "{error:?}");
    assert!(lighthouse.status().heartbeats.is_empty());
    stop_lighthouse(lighthouse).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_pages_its_lists() {
    let lighthouse = start_lighthouse(lighthouse_options(2).with_join_timeout(HOUR)).await;
    let client = client(lighthouse.url()).await;
    let size = ferry_ft::lighthouse::DASHBOARD_PAGE_SIZE;
    let n = 2 * size + 7;
    for i in 0..n {
        heartbeat(&client, &format!("r{i:04}")).await;
    }
    let addr = lighthouse.local_addr();
    let count = |page: &str| page.matches("<li class=\"heartbeat").count();
    let (_, _, first) = http(addr, "GET", "/").await;
    assert_eq!(count(&first), size);
    assert!(
        first.contains(r#"<span id="pages-count">3</span>"#),
        "{first}"
    );
    assert!(first.contains(r#"href="/?page=1">next"#));
    assert!(first.contains("r0000") && !first.contains(&format!("r{size:04}")));
    let (_, _, second) = http(addr, "GET", "/?page=1").await;
    assert_eq!(count(&second), size);
    assert!(second.contains(&format!("r{size:04}")) && !second.contains("r0000"));
    assert!(second.contains(r#"href="/?page=0">previous"#));
    let (_, _, last) = http(addr, "GET", "/?page=2").await;
    assert_eq!(count(&last), 7);
    assert!(!last.contains(">next<"));
    // Past the end: the last page.
    let (_, _, beyond) = http(addr, "GET", "/?page=99").await;
    assert_eq!(count(&beyond), 7);
    assert!(beyond.contains(r#"<span id="page">3</span>"#));
    stop_lighthouse(lighthouse).await;
}
