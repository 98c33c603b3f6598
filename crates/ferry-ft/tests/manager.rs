//! The manager's rules, ported from torchft's `src/manager.rs` tests:
//! quorum results and recovery assignment, should-commit votes, and the
//! gathering of a group's ranks, driven without servers.

use std::time::{Duration, Instant};

use ferry_ft::lighthouse::{LighthouseOptions, LighthouseState};
use ferry_ft::manager::{compute_quorum_results, ManagerInfo, QuorumGather, ShouldCommitVotes};
use ferry_ft::proto::{ManagerQuorumRequest, ManagerQuorumResponse, Quorum, QuorumMember};
use ferry_ft::FtError;

fn member(i: usize, step: i64) -> QuorumMember {
    QuorumMember {
        replica_id: format!("replica_{i}"),
        address: format!("addr_{i}"),
        store_address: format!("store_addr_{i}"),
        step,
        world_size: 1,
        ..Default::default()
    }
}

fn quorum(steps: &[i64]) -> Quorum {
    Quorum {
        quorum_id: 1,
        participants: steps
            .iter()
            .enumerate()
            .map(|(i, &s)| member(i, s))
            .collect(),
        created: None,
    }
}

fn results(
    replica: usize,
    group_rank: i64,
    quorum: &Quorum,
    init_sync: bool,
) -> ManagerQuorumResponse {
    compute_quorum_results(&format!("replica_{replica}"), group_rank, quorum, init_sync)
        .expect("replica in quorum")
}

fn info(replica_id: &str, world_size: u64) -> ManagerInfo {
    ManagerInfo {
        replica_id: replica_id.to_owned(),
        address: format!("http://{replica_id}:29512"),
        store_address: "store_addr".to_owned(),
        world_size,
    }
}

fn request(group_rank: i64, step: i64) -> ManagerQuorumRequest {
    ManagerQuorumRequest {
        group_rank,
        step,
        checkpoint_metadata: format!("metadata_{group_rank}"),
        init_sync: true,
        ..Default::default()
    }
}

/// torchft `test_should_commit`: two ranks; both true commits, one false
/// makes everyone false.
#[test]
fn should_commit_votes() {
    let mut votes = ShouldCommitVotes::new(2);

    assert_eq!(votes.vote(0, 1, true), Ok(None));
    assert_eq!(votes.step(), Some(1));
    assert_eq!(votes.vote(1, 1, true), Ok(Some(true)));
    assert_eq!(votes.step(), None, "reset after the decision");

    assert_eq!(votes.vote(0, 2, true), Ok(None));
    assert_eq!(votes.vote(1, 2, false), Ok(Some(false)));

    // The false may come first; a rank voting twice counts once and its
    // false sticks.
    assert_eq!(votes.vote(1, 3, false), Ok(None));
    assert_eq!(votes.vote(1, 3, true), Ok(None));
    assert_eq!(votes.voted().collect::<Vec<_>>(), [1]);
    assert_eq!(votes.vote(0, 3, true), Ok(Some(false)));

    // The next step starts clean.
    assert_eq!(votes.vote(1, 4, true), Ok(None));
    assert_eq!(votes.vote(0, 4, true), Ok(Some(true)));
}

/// Votes are checked: rank range and step of the open round.
#[test]
fn should_commit_rejects_bad_votes() {
    let mut votes = ShouldCommitVotes::new(2);
    assert_eq!(
        votes.vote(2, 1, true),
        Err(FtError::InvalidGroupRank {
            group_rank: 2,
            world_size: 2
        })
    );
    assert_eq!(
        votes.vote(-1, 1, true),
        Err(FtError::NegativeGroupRank { group_rank: -1 })
    );
    assert_eq!(votes.vote(0, 5, false), Ok(None));
    assert_eq!(
        votes.vote(1, 6, true),
        Err(FtError::StepMismatch {
            group_rank: 1,
            step: 6,
            expected: 5
        })
    );
    // An abandoned round is dropped with reset.
    votes.reset();
    assert_eq!(votes.vote(1, 6, true), Ok(None));
    assert_eq!(votes.vote(0, 6, true), Ok(Some(true)));

    // One rank: every vote decides at once.
    let mut single = ShouldCommitVotes::new(1);
    assert_eq!(single.vote(0, 1, false), Ok(Some(false)));
    assert_eq!(single.vote(0, 2, true), Ok(Some(true)));
}

/// torchft `test_get_quorum`: one replica group of one rank, through
/// gather → lighthouse → results.
#[test]
fn get_quorum_single_replica() {
    let opt = LighthouseOptions::new(1).with_join_timeout(Duration::from_millis(100));
    let mut lighthouse = LighthouseState::new();
    let t0 = Instant::now();

    let mut gather = QuorumGather::new(info("rep_id", 1));
    let req = ManagerQuorumRequest {
        commit_failures: 3,
        ..request(0, 123)
    };
    let round = gather.join(&req).expect("valid").expect("complete");
    lighthouse.join(t0, round.request.requester.clone().expect("requester"));
    let quorum = lighthouse.tick(t0, &opt).expect("quorum");

    let resp = compute_quorum_results("rep_id", 0, &quorum, round.init_sync).expect("in quorum");
    assert_eq!(resp.quorum_id, 1);
    assert_eq!(resp.recover_src_manager_address, "");
    assert_eq!(resp.store_address, "store_addr");
    assert_eq!(resp.max_step, 123);
    assert_eq!(resp.max_replica_rank, Some(0));
    assert_eq!(resp.max_world_size, 1);
    assert_eq!(resp.replica_rank, 0);
    assert_eq!(resp.replica_world_size, 1);
    assert!(!resp.heal);
    assert_eq!(resp.commit_failures, 3);
    assert_eq!(resp.replica_ids, ["rep_id"]);
}

/// torchft `test_get_quorum_heal_first_step`: two replica groups at step 0
/// with `init_sync`, min_replicas 2: the second heals from the first.
#[test]
fn get_quorum_heal_first_step() {
    let opt = LighthouseOptions::new(2).with_join_timeout(Duration::from_millis(100));
    let mut lighthouse = LighthouseState::new();
    let t0 = Instant::now();

    let mut inits = Vec::new();
    for name in ["rep_0", "rep_1"] {
        let mut gather = QuorumGather::new(info(name, 1));
        let round = gather
            .join(&request(0, 0))
            .expect("valid")
            .expect("complete");
        lighthouse.join(t0, round.request.requester.clone().expect("requester"));
        inits.push(round.init_sync);
    }
    let quorum = lighthouse.tick(t0, &opt).expect("quorum");

    let a = compute_quorum_results("rep_0", 0, &quorum, inits[0]).expect("a");
    let b = compute_quorum_results("rep_1", 0, &quorum, inits[1]).expect("b");
    assert_eq!((a.quorum_id, a.max_step, a.replica_rank), (1, 0, 0));
    assert_eq!(a.replica_world_size, 2);
    assert!(!a.heal);
    assert_eq!((b.quorum_id, b.max_step, b.replica_rank), (1, 0, 1));
    assert_eq!(b.replica_world_size, 2);
    assert!(b.heal);
    assert_eq!(b.recover_src_manager_address, "http://rep_0:29512");
}

/// torchft `test_checkpoint_metadata`: unknown until the rank asked.
#[test]
fn checkpoint_metadata() {
    let mut gather = QuorumGather::new(info("rep_id", 2));
    assert_eq!(gather.checkpoint_metadata(0), None);
    assert_eq!(gather.join(&request(0, 1)), Ok(None));
    assert_eq!(gather.checkpoint_metadata(0), Some("metadata_0"));
    assert_eq!(gather.checkpoint_metadata(1), None);
    // Kept across rounds, replaced by the rank's next request.
    assert!(gather.join(&request(1, 1)).expect("valid").is_some());
    let next = ManagerQuorumRequest {
        checkpoint_metadata: "newer".into(),
        ..request(0, 2)
    };
    assert_eq!(gather.join(&next), Ok(None));
    assert_eq!(gather.checkpoint_metadata(0), Some("newer"));
    assert_eq!(gather.checkpoint_metadata(1), Some("metadata_1"));
}

/// torchft `test_compute_quorum_results_first_step`.
#[test]
fn first_step_heals_with_init_sync() {
    let q = quorum(&[0, 0]);

    let r = results(0, 0, &q, true);
    assert!(!r.heal);
    assert_eq!(r.replica_rank, 0);
    assert_eq!(r.recover_src_replica_rank, None);
    assert_eq!(r.recover_dst_replica_ranks, [1]);

    let r = results(1, 0, &q, true);
    assert!(r.heal);
    assert_eq!(r.replica_rank, 1);
    assert_eq!(r.recover_src_replica_rank, Some(0));
    assert_eq!(r.recover_src_manager_address, "addr_0");
    assert!(r.recover_dst_replica_ranks.is_empty());

    // Group rank 1 uses the other primary, so the roles swap.
    let r = results(1, 1, &q, true);
    assert!(!r.heal);
    assert_eq!(r.replica_rank, 1);
    assert_eq!(r.recover_src_replica_rank, None);
    assert_eq!(r.recover_dst_replica_ranks, [0]);
    assert_eq!(r.store_address, "store_addr_1");
}

/// torchft `test_compute_quorum_results_recovery`: five replicas at mixed
/// steps.
#[test]
fn recovery_assignment_five_replicas() {
    let q = quorum(&[0, 1, 0, 1, 0]);

    let r = results(0, 0, &q, true);
    assert!(r.heal);
    assert_eq!(r.recover_src_manager_address, "addr_1");
    assert_eq!(r.replica_rank, 0);
    assert_eq!(r.recover_src_replica_rank, Some(1));
    assert!(r.recover_dst_replica_ranks.is_empty());

    let r = results(1, 0, &q, true);
    assert!(!r.heal);
    assert_eq!(r.recover_src_manager_address, "");
    assert_eq!(r.replica_rank, 1);
    assert_eq!(r.recover_src_replica_rank, None);
    assert_eq!(r.recover_dst_replica_ranks, [0, 4]);

    let r = results(3, 0, &q, true);
    assert!(!r.heal);
    assert_eq!(r.replica_rank, 3);
    assert_eq!(r.recover_src_replica_rank, None);
    assert_eq!(r.recover_dst_replica_ranks, [2]);

    // Group rank 1's assignments are offset by one.
    let r = results(1, 1, &q, true);
    assert!(!r.heal);
    assert_eq!(r.replica_rank, 1);
    assert_eq!(r.recover_src_replica_rank, None);
    assert_eq!(r.recover_dst_replica_ranks, [2]);

    // The max replicas and the store.
    let r = results(4, 0, &q, true);
    assert_eq!(
        (r.max_step, r.max_world_size, r.max_replica_rank),
        (1, 2, None)
    );
    assert_eq!(r.store_address, "store_addr_1");
    assert_eq!(r.recover_src_replica_rank, Some(1));
    let r = results(3, 1, &q, true);
    assert_eq!(r.max_replica_rank, Some(1));
    assert_eq!(r.store_address, "store_addr_3");
    assert_eq!(
        r.replica_ids,
        [
            "replica_0",
            "replica_1",
            "replica_2",
            "replica_3",
            "replica_4"
        ]
    );
}

/// torchft `test_compute_quorum_results_skip_init_sync`.
#[test]
fn skip_init_sync() {
    let mut q = quorum(&[0, 0]);
    assert!(!results(0, 0, &q, true).heal);
    assert!(results(1, 0, &q, true).heal);
    // Without init_sync nobody heals at step 0...
    assert!(!results(1, 0, &q, false).heal);
    assert!(results(0, 0, &q, false)
        .recover_dst_replica_ranks
        .is_empty());
    // ...but a replica behind still does.
    q.participants[0].step = 1;
    assert!(results(1, 0, &q, false).heal);
}

/// torchft `test_compute_quorum_results_commit_failures`.
#[test]
fn commit_failures_propagated() {
    let mut q = quorum(&[0, 0]);
    q.participants[1].commit_failures = 2;
    assert_eq!(results(0, 0, &q, true).commit_failures, 2);
    assert_eq!(results(1, 0, &q, true).commit_failures, 2);
}

/// Participants arrive in any order: results sort them by replica id.
#[test]
fn results_sort_participants() {
    let mut q = quorum(&[3, 5, 5]);
    q.participants.reverse();
    let r = results(0, 0, &q, true);
    assert_eq!(r.replica_rank, 0);
    assert_eq!(r.replica_ids, ["replica_0", "replica_1", "replica_2"]);
    assert!(r.heal);
    assert_eq!(r.recover_src_replica_rank, Some(1));
    assert_eq!(r.store_address, "store_addr_1");
}

/// Results refuse a replica that is not in the quorum and negative ranks.
#[test]
fn results_errors() {
    let q = quorum(&[1, 1]);
    assert_eq!(
        compute_quorum_results("stranger", 0, &q, true),
        Err(FtError::NotInQuorum {
            replica_id: "stranger".into()
        })
    );
    assert_eq!(
        compute_quorum_results("replica_0", -1, &q, true),
        Err(FtError::NegativeGroupRank { group_rank: -1 })
    );
    assert!(compute_quorum_results("replica_0", 0, &quorum(&[]), true).is_err());
    // A large group rank wraps around the sources without overflow.
    let r = compute_quorum_results("replica_0", i64::MAX, &quorum(&[0, 1, 1]), true)
        .expect("in quorum");
    assert!(r.heal);
}

/// The gather waits for every rank and folds their requests.
#[test]
fn gather_folds_ranks() {
    let mut gather = QuorumGather::new(info("group_a", 3));
    let r0 = ManagerQuorumRequest {
        commit_failures: 1,
        init_sync: false,
        ..request(0, 7)
    };
    let r2 = ManagerQuorumRequest {
        shrink_only: true,
        init_sync: false,
        ..request(2, 8)
    };
    let r1 = ManagerQuorumRequest {
        init_sync: false,
        ..request(1, 8)
    };
    assert_eq!(gather.join(&r0), Ok(None));
    assert_eq!(gather.join(&r2), Ok(None));
    // Asking twice counts once.
    assert_eq!(gather.join(&r2), Ok(None));
    assert_eq!(gather.waiting().collect::<Vec<_>>(), [0, 2]);
    let round = gather.join(&r1).expect("valid").expect("complete");
    assert_eq!(round.group_ranks, [0, 1, 2]);
    assert!(!round.init_sync);
    let member = round.request.requester.expect("requester");
    assert_eq!(member.replica_id, "group_a");
    assert_eq!(member.address, "http://group_a:29512");
    assert_eq!(member.store_address, "store_addr");
    assert_eq!(member.world_size, 3);
    assert_eq!(member.step, 8);
    assert_eq!(member.commit_failures, 1);
    assert!(member.shrink_only);
    assert_eq!(member.data, "");
    assert_eq!(gather.waiting().count(), 0, "the next round starts empty");

    // init_sync holds if any rank asks for it.
    let mut gather = QuorumGather::new(info("group_b", 2));
    assert_eq!(gather.join(&request(1, 0)), Ok(None));
    let r0 = ManagerQuorumRequest {
        init_sync: false,
        ..request(0, 0)
    };
    assert!(
        gather
            .join(&r0)
            .expect("valid")
            .expect("complete")
            .init_sync
    );
}

/// The gather refuses ranks outside the group, and reset drops a round.
#[test]
fn gather_rejects_and_resets() {
    let mut gather = QuorumGather::new(info("group", 2));
    assert_eq!(
        gather.join(&request(2, 0)),
        Err(FtError::InvalidGroupRank {
            group_rank: 2,
            world_size: 2
        })
    );
    assert_eq!(
        gather.join(&request(-3, 0)),
        Err(FtError::NegativeGroupRank { group_rank: -3 })
    );
    assert_eq!(gather.checkpoint_metadata(2), None);
    assert_eq!(gather.join(&request(0, 0)), Ok(None));
    gather.reset();
    assert_eq!(
        gather.join(&request(1, 0)),
        Ok(None),
        "rank 0 must ask again"
    );
    assert!(gather.join(&request(0, 0)).expect("valid").is_some());
    assert_eq!(gather.info().world_size, 2);
}

/// Three replica groups of two ranks each, end to end without I/O: a
/// group rejoins behind and heals, spread over the up-to-date sources by
/// group rank; commit failures reach every rank and raise the quorum id.
#[test]
fn three_groups_end_to_end() {
    let opt = LighthouseOptions::new(2).with_join_timeout(Duration::from_secs(1));
    let mut lighthouse = LighthouseState::new();
    let t0 = Instant::now();
    let names = ["g0", "g1", "g2"];
    let mut gathers: Vec<QuorumGather> = names
        .iter()
        .map(|n| QuorumGather::new(info(n, 2)))
        .collect();

    // Every manager heartbeats from the start.
    for name in names {
        lighthouse.heartbeat(t0, name);
    }

    // Round 1: g0 and g1 at step 10, g2 restarted at step 0.
    let steps = [10, 10, 0];
    let mut quorum = None;
    for (g, gather) in gathers.iter_mut().enumerate() {
        for rank in 0..2 {
            let req = ManagerQuorumRequest {
                init_sync: false,
                ..request(rank, steps[g])
            };
            if let Some(round) = gather.join(&req).expect("valid") {
                lighthouse.join(t0, round.request.requester.expect("requester"));
                quorum = lighthouse.tick(t0, &opt).or(quorum);
            }
        }
    }
    let quorum = quorum.expect("all three joined");
    assert_eq!(quorum.quorum_id, 1);
    assert_eq!(quorum.participants.len(), 3);

    let g2r0 = compute_quorum_results("g2", 0, &quorum, false).expect("in");
    let g2r1 = compute_quorum_results("g2", 1, &quorum, false).expect("in");
    assert!(g2r0.heal && g2r1.heal);
    // Group rank 0 recovers from g0, group rank 1 from g1.
    assert_eq!(g2r0.recover_src_manager_address, "http://g0:29512");
    assert_eq!(g2r1.recover_src_manager_address, "http://g1:29512");
    assert_eq!(
        compute_quorum_results("g0", 0, &quorum, false)
            .expect("in")
            .recover_dst_replica_ranks,
        [2]
    );
    assert_eq!(
        compute_quorum_results("g1", 1, &quorum, false)
            .expect("in")
            .recover_dst_replica_ranks,
        [2]
    );

    // Round 2: everyone at step 11; g1 failed to commit once.
    let t1 = t0 + Duration::from_millis(100);
    let mut quorum = None;
    for (g, gather) in gathers.iter_mut().enumerate() {
        for rank in 0..2 {
            let req = ManagerQuorumRequest {
                commit_failures: i64::from(g == 1),
                ..request(rank, 11)
            };
            if let Some(round) = gather.join(&req).expect("valid") {
                lighthouse.join(t1, round.request.requester.expect("requester"));
                quorum = lighthouse.tick(t1, &opt).or(quorum);
            }
        }
    }
    let quorum = quorum.expect("fast quorum");
    assert_eq!(quorum.quorum_id, 2, "commit failures raise the quorum id");
    for name in names {
        let r = compute_quorum_results(name, 0, &quorum, true).expect("in");
        assert!(!r.heal);
        assert_eq!(r.commit_failures, 1);
        assert_eq!(r.max_step, 11);
    }
}
