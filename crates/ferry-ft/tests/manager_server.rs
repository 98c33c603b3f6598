//! The manager server and its client over real sockets (127.0.0.1, port 0),
//! with a real [`Lighthouse`]: quorums for the ranks of a replica group,
//! healing of a group behind (and at the first step with `init_sync`),
//! should-commit votes and the commit failures they send to the lighthouse,
//! checkpoint metadata, requests refused as torchft refuses them, the
//! lighthouse down on the first attempt then up, the lighthouse never up,
//! restarts of a manager and of the lighthouse, shutdown, and `Kill`.
//!
//! Nothing sleeps to wait for state: tests wait on responses, or on
//! [`Manager::wait_for_status`] / [`Lighthouse::wait_for_status`], which are
//! woken by every state change; every wait is bounded by a tokio timeout.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ferry_ft::lighthouse::Lighthouse;
use ferry_ft::manager::{
    Manager, ManagerClient, ManagerClientError, ManagerStatus, QuorumRequest, QuorumResult,
};
use ferry_ft::proto::manager_service_client::ManagerServiceClient;
use ferry_ft::proto::{CheckpointMetadataRequest, ManagerQuorumRequest};
use tokio::task::JoinHandle;
use tonic::{Code, Request};

use common::{
    bounded, connect, http, lighthouse_options, manager_options, start_lighthouse, start_manager,
    stop_lighthouse, stop_manager, store, wait_lighthouse,
};

/// The timeout (gRPC deadline) ranks ask with.
const DEADLINE: Duration = Duration::from_secs(20);

type Answer<T> = JoinHandle<Result<T, ManagerClientError>>;

/// A port nothing listens on (bound, then released).
async fn free_addr() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local addr")
}

/// Rank `group_rank` asks for the quorum on a task of its own.
fn ask(
    client: &ManagerClient,
    group_rank: u64,
    step: i64,
    init_sync: bool,
    commit_failures: u64,
) -> Answer<QuorumResult> {
    ask_with(
        client,
        group_rank,
        step,
        init_sync,
        commit_failures,
        DEADLINE,
    )
}

fn ask_with(
    client: &ManagerClient,
    group_rank: u64,
    step: i64,
    init_sync: bool,
    commit_failures: u64,
    timeout: Duration,
) -> Answer<QuorumResult> {
    let client = client.clone();
    tokio::spawn(async move {
        client
            .quorum(
                QuorumRequest {
                    checkpoint_metadata: format!("metadata_{group_rank}@{step}"),
                    init_sync,
                    commit_failures,
                    ..QuorumRequest::new(group_rank, step)
                },
                timeout,
            )
            .await
    })
}

/// Rank `group_rank` votes on a task of its own.
fn vote(client: &ManagerClient, group_rank: u64, step: i64, should_commit: bool) -> Answer<bool> {
    let client = client.clone();
    tokio::spawn(async move {
        client
            .should_commit(group_rank, step, should_commit, DEADLINE)
            .await
    })
}

async fn answer<T>(what: &str, task: Answer<T>) -> Result<T, ManagerClientError> {
    bounded(what, task).await.expect("the request task")
}

/// Every rank of `client`'s group (`0..world_size`) asks at `step`; their
/// results, by rank.
async fn group_quorum(
    client: &ManagerClient,
    world_size: u64,
    step: i64,
    init_sync: bool,
) -> Vec<QuorumResult> {
    let tasks: Vec<_> = (0..world_size)
        .map(|rank| ask(client, rank, step, init_sync, 0))
        .collect();
    let mut results = Vec::new();
    for (rank, task) in tasks.into_iter().enumerate() {
        results.push(
            answer("quorum", task)
                .await
                .unwrap_or_else(|error| panic!("rank {rank}: {error}")),
        );
    }
    results
}

/// Every rank of a group votes; their answers, by rank.
async fn group_vote(client: &ManagerClient, step: i64, votes: &[bool]) -> Vec<bool> {
    let tasks: Vec<_> = votes
        .iter()
        .enumerate()
        .map(|(rank, &v)| vote(client, rank as u64, step, v))
        .collect();
    let mut decisions = Vec::new();
    for task in tasks {
        decisions.push(answer("should_commit", task).await.expect("a decision"));
    }
    decisions
}

async fn wait_manager(
    manager: &Manager,
    what: &str,
    done: impl FnMut(&ManagerStatus) -> bool,
) -> ManagerStatus {
    bounded(what, manager.wait_for_status(done)).await
}

// ---------------------------------------------------------------------------
// Quorums.

/// torchft `test_get_quorum`, with two ranks: both ask, the manager asks the
/// lighthouse once, both get the same, consistent answer; the manager
/// heartbeats to the lighthouse meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_group_of_two_ranks_gets_a_quorum() {
    let lighthouse = start_lighthouse(lighthouse_options(1)).await;
    let manager = start_manager("replica_a", &lighthouse.url(), 2).await;
    assert!(manager.address().starts_with("http://127.0.0.1:"));
    let client = connect(&manager).await;

    let rank0 = ask(&client, 0, 7, true, 0);
    let status = wait_manager(&manager, "rank 0 waits", |s| s.waiting_ranks == [0]).await;
    assert_eq!(status.rounds, 0, "no lighthouse request before rank 1 asks");
    let rank1 = ask(&client, 1, 7, true, 0);
    let r0 = answer("rank 0", rank0).await.expect("rank 0's quorum");
    let r1 = answer("rank 1", rank1).await.expect("rank 1's quorum");

    assert_eq!(
        r0,
        QuorumResult {
            quorum_id: 1,
            replica_rank: 0,
            replica_world_size: 1,
            recover_src_manager_address: None,
            recover_src_replica_rank: None,
            recover_dst_replica_ranks: vec![],
            store_address: store("replica_a"),
            max_step: 7,
            max_replica_rank: Some(0),
            max_world_size: 1,
            heal: false,
            commit_failures: 0,
            replica_ids: vec!["replica_a".to_owned()],
        }
    );
    assert_eq!(r1, r0, "both ranks agree");

    // The lighthouse saw the group once, with the manager's address.
    let seen = lighthouse.status();
    let members = &seen.prev_quorum.as_ref().expect("a quorum").members;
    assert_eq!(members.len(), 1);
    assert_eq!(members[0].replica_id, "replica_a");
    assert_eq!(members[0].address, manager.address());
    assert_eq!(members[0].store_address, store("replica_a"));
    assert_eq!((members[0].step, members[0].world_size), (7, 2));

    let status = manager.status();
    assert_eq!(
        (
            status.rounds,
            status.quorums,
            status.quorum_id,
            status.lighthouse_attempts
        ),
        (1, 1, Some(1), 1)
    );
    assert!(status.waiting_ranks.is_empty());

    // Heartbeats reach the lighthouse.
    wait_manager(&manager, "a heartbeat", |s| s.heartbeats > 0).await;
    let seen = lighthouse.status();
    assert!(
        seen.heartbeats.iter().any(|h| h.replica_id == "replica_a"),
        "{:?}",
        seen.heartbeats
    );

    stop_manager(manager).await;
    stop_lighthouse(lighthouse).await;
}

/// Two groups of two ranks at different steps: the behind one heals from
/// the up-to-date one, each of its ranks fetching the checkpoint metadata
/// of its group rank from the source's manager, as torchft's Python
/// `Manager` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_behind_heals_from_the_up_to_date_one() {
    let lighthouse = start_lighthouse(lighthouse_options(2)).await;
    let a = start_manager("replica_a", &lighthouse.url(), 2).await;
    let b = start_manager("replica_b", &lighthouse.url(), 2).await;
    let client_a = connect(&a).await;
    let client_b = connect(&b).await;

    let tasks_a: Vec<_> = (0..2)
        .map(|rank| ask(&client_a, rank, 10, false, 0))
        .collect();
    let tasks_b: Vec<_> = (0..2)
        .map(|rank| ask(&client_b, rank, 5, false, 0))
        .collect();
    let mut results_a = Vec::new();
    for task in tasks_a {
        results_a.push(answer("a", task).await.expect("a's quorum"));
    }
    let mut results_b = Vec::new();
    for task in tasks_b {
        results_b.push(answer("b", task).await.expect("b's quorum"));
    }

    for (rank, r) in results_a.iter().enumerate() {
        assert_eq!(r.quorum_id, 1);
        assert_eq!((r.replica_rank, r.replica_world_size), (0, 2), "a/{rank}");
        assert_eq!(
            (r.max_step, r.max_replica_rank, r.max_world_size),
            (10, Some(0), 1)
        );
        assert!(!r.heal, "a/{rank} is up to date");
        assert_eq!(r.recover_src_manager_address, None);
        assert_eq!(r.recover_dst_replica_ranks, [1], "a/{rank} sends to b");
        assert_eq!(r.store_address, store("replica_a"));
        assert_eq!(r.replica_ids, ["replica_a", "replica_b"]);
    }
    for (rank, r) in results_b.iter().enumerate() {
        assert_eq!(r.quorum_id, 1);
        assert_eq!((r.replica_rank, r.replica_world_size), (1, 2), "b/{rank}");
        assert_eq!(
            (r.max_step, r.max_replica_rank, r.max_world_size),
            (10, None, 1)
        );
        assert!(r.heal, "b/{rank} is behind");
        assert_eq!(r.recover_src_manager_address.as_deref(), Some(a.address()));
        assert_eq!(r.recover_src_replica_rank, Some(0));
        assert!(r.recover_dst_replica_ranks.is_empty());
        assert_eq!(r.store_address, store("replica_a"), "the primary's store");

        // Healing: ask the source's manager for this group rank's metadata.
        let source = bounded(
            "connect to the source",
            ManagerClient::connect(r.recover_src_manager_address.clone().expect("a source")),
        )
        .await
        .expect("connect to a");
        let metadata = bounded(
            "checkpoint_metadata",
            source.checkpoint_metadata(rank as u64, DEADLINE),
        )
        .await
        .expect("a's metadata");
        assert_eq!(metadata, format!("metadata_{rank}@10"));
    }

    stop_manager(a).await;
    stop_manager(b).await;
    stop_lighthouse(lighthouse).await;
}

/// torchft `test_get_quorum_heal_first_step`: at step 0 with `init_sync`
/// the second replica heals from the first, so both start from the same
/// weights; without `init_sync` nobody heals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_step_heals_with_init_sync() {
    let lighthouse = start_lighthouse(lighthouse_options(2)).await;
    let rep_0 = start_manager("rep_0", &lighthouse.url(), 1).await;
    let rep_1 = start_manager("rep_1", &lighthouse.url(), 1).await;
    let client_0 = connect(&rep_0).await;
    let client_1 = connect(&rep_1).await;

    let t0 = ask(&client_0, 0, 0, true, 0);
    let t1 = ask(&client_1, 0, 0, true, 0);
    let r0 = answer("rep_0", t0).await.expect("rep_0's quorum");
    let r1 = answer("rep_1", t1).await.expect("rep_1's quorum");
    assert_eq!((r0.quorum_id, r0.max_step), (1, 0));
    assert_eq!((r0.replica_rank, r0.replica_world_size), (0, 2));
    assert!(!r0.heal);
    assert_eq!(r0.recover_dst_replica_ranks, [1]);
    assert_eq!((r1.quorum_id, r1.max_step), (1, 0));
    assert_eq!((r1.replica_rank, r1.replica_world_size), (1, 2));
    assert!(r1.heal);
    assert_eq!(r1.recover_src_replica_rank, Some(0));
    assert_eq!(
        r1.recover_src_manager_address.as_deref(),
        Some(rep_0.address())
    );

    // The same step without init_sync: no forced recovery.
    let t0 = ask(&client_0, 0, 0, false, 0);
    let t1 = ask(&client_1, 0, 0, false, 0);
    let r0 = answer("rep_0", t0).await.expect("rep_0's quorum");
    let r1 = answer("rep_1", t1).await.expect("rep_1's quorum");
    assert_eq!(r0.quorum_id, 1, "same members: same quorum id");
    assert!(!r0.heal && !r1.heal);
    assert!(r0.recover_dst_replica_ranks.is_empty());

    stop_manager(rep_0).await;
    stop_manager(rep_1).await;
    stop_lighthouse(lighthouse).await;
}

// ---------------------------------------------------------------------------
// Should-commit.

/// torchft `test_should_commit` and the commit-failure propagation: all
/// true commits; one false makes everyone false; the next quorum request
/// carries the failure (even though the ranks report none) and the
/// lighthouse raises the quorum id; a success resets the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn should_commit_votes_and_commit_failures() {
    let lighthouse = start_lighthouse(lighthouse_options(1)).await;
    let manager = start_manager("replica_a", &lighthouse.url(), 2).await;
    let client = connect(&manager).await;

    let q = group_quorum(&client, 2, 1, false).await;
    assert_eq!((q[0].quorum_id, q[0].commit_failures), (1, 0));
    assert_eq!(group_vote(&client, 1, &[true, true]).await, [true, true]);
    assert_eq!(manager.status().commit_failures, 0);

    let q = group_quorum(&client, 2, 2, false).await;
    assert_eq!(
        (q[0].quorum_id, q[0].commit_failures),
        (1, 0),
        "no failure: same quorum"
    );
    assert_eq!(group_vote(&client, 2, &[true, false]).await, [false, false]);
    let status = manager.status();
    assert_eq!((status.commit_failures, status.commit_decisions), (1, 2));

    // Step 2 was not committed: the ranks retry it, reporting no failure
    // themselves; the manager sends its count.
    let q = group_quorum(&client, 2, 2, false).await;
    assert_eq!(
        q[0].commit_failures, 1,
        "carried to the lighthouse and back"
    );
    assert_eq!(q[1], q[0]);
    assert_eq!(q[0].quorum_id, 2, "commit failures raise the quorum id");
    let seen = lighthouse.status();
    assert_eq!(
        seen.prev_quorum.as_ref().expect("a quorum").members[0].commit_failures,
        1
    );

    // A false vote first, then a second failure in a row.
    let rank1 = vote(&client, 1, 2, false);
    wait_manager(&manager, "rank 1 voted", |s| s.voted_ranks == [1]).await;
    let rank0 = vote(&client, 0, 2, true);
    assert!(!answer("rank 0", rank0).await.expect("decision"));
    assert!(!answer("rank 1", rank1).await.expect("decision"));
    assert_eq!(manager.status().commit_failures, 2, "consecutive failures");
    let q = group_quorum(&client, 2, 2, false).await;
    assert_eq!((q[0].quorum_id, q[0].commit_failures), (3, 2));

    // Success resets the count; the quorum id stays.
    assert_eq!(group_vote(&client, 2, &[true, true]).await, [true, true]);
    assert_eq!(manager.status().commit_failures, 0);
    let q = group_quorum(&client, 2, 3, false).await;
    assert_eq!((q[0].quorum_id, q[0].commit_failures), (3, 0));

    // A vote for another step than the open round's is refused.
    let rank0 = vote(&client, 0, 3, true);
    wait_manager(&manager, "rank 0 voted", |s| s.voted_ranks == [0]).await;
    let refused = bounded(
        "a vote for step 4",
        client.should_commit(1, 4, true, DEADLINE),
    )
    .await
    .expect_err("step mismatch");
    assert!(
        matches!(&refused, ManagerClientError::InvalidArgument { method: "should_commit", message, .. } if message.contains("step 4")),
        "{refused}"
    );
    let rank1 = vote(&client, 1, 3, true);
    assert!(answer("rank 0", rank0).await.expect("decision"));
    assert!(answer("rank 1", rank1).await.expect("decision"));

    stop_manager(manager).await;
    stop_lighthouse(lighthouse).await;
}

// ---------------------------------------------------------------------------
// Checkpoint metadata and refused requests.

/// torchft `test_checkpoint_metadata`: a rank's metadata comes with its
/// quorum request; a rank that sent none is not found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_metadata_round_trip_and_unknown_rank() {
    let lighthouse = start_lighthouse(lighthouse_options(1)).await;
    let manager = start_manager("replica_a", &lighthouse.url(), 2).await;
    let client = connect(&manager).await;

    let error = bounded("metadata", client.checkpoint_metadata(0, DEADLINE))
        .await
        .expect_err("nothing registered yet");
    assert!(
        matches!(error, ManagerClientError::RankNotFound { rank: 0, .. }),
        "{error}"
    );

    group_quorum(&client, 2, 4, false).await;
    for rank in 0..2 {
        let metadata = bounded("metadata", client.checkpoint_metadata(rank, DEADLINE))
            .await
            .expect("registered metadata");
        assert_eq!(metadata, format!("metadata_{rank}@4"));
    }
    let error = bounded("metadata", client.checkpoint_metadata(5, DEADLINE))
        .await
        .expect_err("rank 5 is not in the group");
    assert!(
        matches!(error, ManagerClientError::RankNotFound { rank: 5, .. }),
        "{error}"
    );

    // On the wire: torchft's INVALID_ARGUMENT "rank not found".
    let mut raw = ManagerServiceClient::connect(manager.address().to_owned())
        .await
        .expect("connect");
    let status = bounded(
        "raw metadata",
        raw.checkpoint_metadata(CheckpointMetadataRequest { rank: 9 }),
    )
    .await
    .expect_err("unknown rank");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(status.message(), "rank not found");

    stop_manager(manager).await;
    stop_lighthouse(lighthouse).await;
}

/// Quorum requests without a deadline are refused with INVALID_ARGUMENT
/// "missing timeout", as torchft does; so are malformed deadlines and ranks
/// outside the group. None of them joins a round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_deadline_or_outside_the_group_are_invalid() {
    let lighthouse = start_lighthouse(lighthouse_options(1)).await;
    let manager = start_manager("replica_a", &lighthouse.url(), 2).await;
    let mut raw = ManagerServiceClient::connect(manager.address().to_owned())
        .await
        .expect("connect");
    let request = ManagerQuorumRequest {
        group_rank: 0,
        step: 1,
        ..Default::default()
    };

    let status = bounded("no deadline", raw.quorum(Request::new(request.clone())))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(status.message(), "missing timeout");

    let mut malformed = Request::new(request.clone());
    malformed
        .metadata_mut()
        .insert("grpc-timeout", "soon".parse().expect("ascii"));
    let status = bounded("bad deadline", raw.quorum(malformed))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    let client = connect(&manager).await;
    let error = bounded(
        "rank 2 of 2",
        client.quorum(
            QuorumRequest {
                init_sync: false,
                ..QuorumRequest::new(2, 1)
            },
            DEADLINE,
        ),
    )
    .await
    .expect_err("outside the group");
    assert!(
        matches!(&error, ManagerClientError::InvalidArgument { method: "quorum", message, .. } if message.contains("world size 2")),
        "{error}"
    );

    let status = manager.status();
    assert!(status.waiting_ranks.is_empty() && status.rounds == 0);
    stop_manager(manager).await;
    stop_lighthouse(lighthouse).await;
}

// ---------------------------------------------------------------------------
// The lighthouse unreachable.

/// torchft `test_get_quorum_when_lighthouse_down`, with a real lighthouse
/// that is not up yet: the manager's first attempt fails (seen in its
/// status, no sleeping), the lighthouse then starts on that port, and the
/// retry forms the quorum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lighthouse_down_on_the_first_attempt_then_up() {
    let addr = free_addr().await;
    let (options, _) = manager_options("replica_a", &format!("http://{addr}"), 2);
    let manager = Manager::bind("127.0.0.1:0", options.with_quorum_retries(10))
        .await
        .expect("bind the manager");
    let client = connect(&manager).await;

    let rank0 = ask(&client, 0, 3, false, 0);
    let rank1 = ask(&client, 1, 3, false, 0);
    let status = wait_manager(&manager, "a failed attempt", |s| s.lighthouse_failures > 0).await;
    assert!(
        status
            .last_lighthouse_error
            .as_deref()
            .is_some_and(|e| e.contains("connect")),
        "{status:?}"
    );

    let lighthouse = Lighthouse::bind(addr, lighthouse_options(1))
        .await
        .expect("start the lighthouse on the port the manager tries");
    let r0 = answer("rank 0", rank0)
        .await
        .expect("a quorum after the retry");
    let r1 = answer("rank 1", rank1)
        .await
        .expect("a quorum after the retry");
    assert_eq!((r0.quorum_id, r0.max_step), (1, 3));
    assert_eq!(r1, r0);
    let status = manager.status();
    assert!(status.lighthouse_attempts >= 2, "{status:?}");
    assert_eq!((status.quorums, status.failed_rounds), (1, 0));

    stop_manager(manager).await;
    stop_lighthouse(lighthouse).await;
}

/// The lighthouse never comes up: after the last retry every waiting rank
/// gets the same clear error, well before its deadline (torchft leaves the
/// ranks hanging until their deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lighthouse_never_up_fails_every_rank() {
    let addr = free_addr().await;
    let (options, _) = manager_options("replica_a", &format!("http://{addr}"), 2);
    let manager = Manager::bind("127.0.0.1:0", options.with_quorum_retries(1))
        .await
        .expect("bind the manager");
    let client = connect(&manager).await;

    // One retry after max(100 ms, 4 s / 2) = 2 s: the error comes at about
    // 2 s, the deadline is 4 s.
    let deadline = Duration::from_secs(4);
    let started = Instant::now();
    let rank0 = ask_with(&client, 0, 1, false, 0, deadline);
    let rank1 = ask_with(&client, 1, 1, false, 0, deadline);
    for (rank, task) in [rank0, rank1].into_iter().enumerate() {
        let error = answer("rank", task).await.expect_err("no lighthouse");
        match &error {
            ManagerClientError::LighthouseUnreachable {
                retries, message, ..
            } => {
                assert_eq!(*retries, 1);
                assert!(
                    message.contains("after 1 retries") && message.contains(&addr.to_string()),
                    "{message}"
                );
            }
            other => panic!("rank {rank}: {other}"),
        }
    }
    assert!(
        started.elapsed() < deadline,
        "answered after {:?}",
        started.elapsed()
    );
    let status = manager.status();
    assert_eq!(
        (
            status.lighthouse_attempts,
            status.lighthouse_failures,
            status.failed_rounds,
            status.quorums
        ),
        (2, 2, 1, 0)
    );
    stop_manager(manager).await;
}

/// A quorum that does not form within the rank's timeout (the lighthouse
/// waits for a second group) is a timeout for the rank, named as such; the
/// next round, once the second group is there, forms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_not_formed_in_time_is_a_timeout() {
    let lighthouse = start_lighthouse(lighthouse_options(2)).await;
    let (options, _) = manager_options("replica_a", &lighthouse.url(), 1);
    // Retries outlast the deadline: the rank's own timeout answers first.
    let manager = Manager::bind("127.0.0.1:0", options.with_quorum_retries(100))
        .await
        .expect("bind the manager");
    let client = connect(&manager).await;
    let timeout = Duration::from_millis(300);
    let error = answer("rank 0", ask_with(&client, 0, 1, false, 0, timeout))
        .await
        .expect_err("no quorum with one group of two");
    assert!(
        matches!(
            &error,
            ManagerClientError::Timeout { method: "quorum", timeout: t, .. } if *t == timeout
        ),
        "{error}"
    );

    // The rank asks again once a second group is there: the new round
    // replaces the one still retrying, and the quorum forms. (The timed-out
    // request left replica_a joined at step 1 in the lighthouse, as torchft's
    // does: b asks only once a's new request, at step 2, has joined, else
    // the quorum may form with that stale join and a's new request wait for
    // the next one.)
    let b = start_manager("replica_b", &lighthouse.url(), 1).await;
    let client_b = connect(&b).await;
    let ra = ask(&client, 0, 2, false, 0);
    wait_lighthouse(&lighthouse, "a's new request joined", |s| {
        s.participants
            .iter()
            .any(|p| p.replica_id == "replica_a" && p.step == 2)
    })
    .await;
    let rb = ask(&client_b, 0, 2, false, 0);
    let ra = answer("a", ra).await.expect("a's quorum");
    assert_eq!(
        answer("b", rb).await.expect("b's quorum").quorum_id,
        ra.quorum_id
    );
    assert_eq!(ra.replica_ids, ["replica_a", "replica_b"]);
    let status = manager.status();
    assert_eq!((status.rounds, status.quorums), (2, 1));

    stop_manager(b).await;
    stop_manager(manager).await;
    stop_lighthouse(lighthouse).await;
}

// ---------------------------------------------------------------------------
// Restarts and shutdown.

/// A replica group's manager restarts on the same port (as a new process
/// would, under a new replica id): the next quorum forms, with a new id,
/// and the restarted group, back at step 0, heals from the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_restart_on_the_same_port() {
    let lighthouse = start_lighthouse(lighthouse_options(2)).await;
    let a = start_manager("replica_a:1", &lighthouse.url(), 1).await;
    let b = start_manager("replica_b:1", &lighthouse.url(), 1).await;
    let client_a = connect(&a).await;
    let client_b = connect(&b).await;

    let ta = ask(&client_a, 0, 3, false, 0);
    let tb = ask(&client_b, 0, 3, false, 0);
    let ra = answer("a", ta).await.expect("a's quorum");
    answer("b", tb).await.expect("b's quorum");
    assert_eq!(ra.quorum_id, 1);

    let b_addr = b.local_addr();
    let b_address = b.address().to_owned();
    stop_manager(b).await;
    let (options, _) = manager_options("replica_b:2", &lighthouse.url(), 1);
    let b = Manager::bind(b_addr, options)
        .await
        .expect("bind the same port again");
    assert_eq!(b.address(), b_address);
    let client_b = connect(&b).await;

    let ta = ask(&client_a, 0, 4, false, 0);
    let tb = ask(&client_b, 0, 0, false, 0);
    let ra = answer("a", ta).await.expect("a's quorum after b's restart");
    let rb = answer("b", tb).await.expect("b's quorum after its restart");
    assert_eq!(ra.quorum_id, 2, "new membership: new quorum id");
    assert_eq!(rb.quorum_id, 2);
    assert_eq!(ra.replica_ids, ["replica_a:1", "replica_b:2"]);
    assert!(!ra.heal && ra.recover_dst_replica_ranks == [1]);
    assert!(rb.heal);
    assert_eq!(rb.recover_src_manager_address.as_deref(), Some(a.address()));

    stop_manager(a).await;
    stop_manager(b).await;
    stop_lighthouse(lighthouse).await;
}

/// The lighthouse stops while the manager waits in it and restarts on the
/// same port: the manager's attempt fails, its retry reaches the new
/// lighthouse and the quorum forms; after a second restart between rounds
/// the next quorum forms too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lighthouse_restart_mid_run() {
    // min_replicas 2: the one group waits in the first lighthouse.
    let first = start_lighthouse(lighthouse_options(2)).await;
    let addr = first.local_addr();
    let (options, _) = manager_options("replica_a", &first.url(), 1);
    let manager = Manager::bind("127.0.0.1:0", options.with_quorum_retries(20))
        .await
        .expect("bind the manager");
    let client = connect(&manager).await;

    let rank0 = ask(&client, 0, 8, false, 0);
    wait_lighthouse(&first, "the manager joined", |s| {
        s.participants.iter().any(|p| p.replica_id == "replica_a")
    })
    .await;
    stop_lighthouse(first).await;
    wait_manager(&manager, "the attempt failed", |s| {
        s.lighthouse_failures > 0
    })
    .await;

    let second = Lighthouse::bind(addr, lighthouse_options(1))
        .await
        .expect("restart the lighthouse on the same port");
    let r = answer("rank 0", rank0)
        .await
        .expect("a quorum from the second lighthouse");
    assert_eq!((r.quorum_id, r.max_step), (1, 8));

    // Between rounds.
    stop_lighthouse(second).await;
    let third = Lighthouse::bind(addr, lighthouse_options(1))
        .await
        .expect("restart the lighthouse again");
    let r = answer("rank 0", ask(&client, 0, 9, false, 0))
        .await
        .expect("a quorum from the third lighthouse");
    assert_eq!((r.quorum_id, r.max_step), (1, 9));
    assert_eq!(manager.status().failed_rounds, 0);

    stop_manager(manager).await;
    stop_lighthouse(third).await;
}

/// Shutting the manager down answers its waiting ranks (UNAVAILABLE)
/// instead of leaving them hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_waiting_ranks() {
    let lighthouse = start_lighthouse(lighthouse_options(1)).await;
    let manager = start_manager("replica_a", &lighthouse.url(), 2).await;
    let client = connect(&manager).await;
    let rank0 = ask(&client, 0, 1, false, 0);
    let voter = vote(&client, 1, 1, true);
    wait_manager(&manager, "rank 0 waits, rank 1 voted", |s| {
        s.waiting_ranks == [0] && s.voted_ranks == [1]
    })
    .await;
    stop_manager(manager).await;
    for (what, error) in [
        (
            "quorum",
            answer("rank 0", rank0).await.expect_err("stopped"),
        ),
        (
            "should_commit",
            answer("rank 1", voter).await.expect_err("stopped"),
        ),
    ] {
        assert!(
            matches!(error, ManagerClientError::Unavailable { .. }),
            "{what}: {error}"
        );
    }
    stop_lighthouse(lighthouse).await;
}

// ---------------------------------------------------------------------------
// Kill.

/// `Kill` reaches the hook (torchft exits the process there), from a rank's
/// client and from the lighthouse dashboard's kill button.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_reaches_the_hook() {
    let lighthouse = start_lighthouse(lighthouse_options(1)).await;
    let (options, mut killed) = manager_options("replica_a", &lighthouse.url(), 1);
    let manager = Manager::bind("127.0.0.1:0", options)
        .await
        .expect("bind the manager");
    let client = connect(&manager).await;

    bounded("kill", client.kill("stop, please"))
        .await
        .expect("kill answered");
    assert_eq!(
        bounded("the hook", killed.recv()).await.as_deref(),
        Some("stop, please")
    );

    // From the dashboard: the lighthouse knows the manager from the quorum.
    group_quorum(&client, 1, 1, false).await;
    // The dashboard's kill carries the token of its page.
    let (_, _, page) = http(lighthouse.local_addr(), "GET", "/").await;
    let token = page
        .split_once(r#"<meta name="ferry-kill-token" content=""#)
        .and_then(|(_, rest)| rest.split('"').next())
        .expect("a kill token in the page");
    let path = format!("/replica/replica_a/kill?token={token}");
    let (code, _, body) = http(lighthouse.local_addr(), "POST", &path).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        bounded("the hook", killed.recv()).await.as_deref(),
        Some("killed from dashboard")
    );
    assert_eq!(manager.status().kills, 2);

    stop_manager(manager).await;
    stop_lighthouse(lighthouse).await;
}
