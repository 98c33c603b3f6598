//! The lighthouse's quorum rules, ported from torchft's `src/lighthouse.rs`
//! tests and driven with explicit instants: `Instant::now()` once, then
//! `t0 + Duration`.

use std::time::{Duration, Instant, SystemTime};

use ferry_ft::lighthouse::{quorum_changed, quorum_compute, LighthouseOptions, LighthouseState};
use ferry_ft::proto::QuorumMember;

fn member(id: &str, step: i64) -> QuorumMember {
    QuorumMember {
        replica_id: id.to_owned(),
        address: format!("addr_{id}"),
        store_address: format!("store_{id}"),
        step,
        world_size: 1,
        ..Default::default()
    }
}

fn shrinking(id: &str, step: i64) -> QuorumMember {
    QuorumMember {
        shrink_only: true,
        ..member(id, step)
    }
}

fn failing(id: &str, commit_failures: i64) -> QuorumMember {
    QuorumMember {
        commit_failures,
        ..member(id, 10)
    }
}

fn opt(min_replicas: u64, join_timeout: Duration) -> LighthouseOptions {
    LighthouseOptions::new(min_replicas)
        .with_join_timeout(join_timeout)
        .with_quorum_tick(Duration::from_millis(10))
        .with_heartbeat_timeout(Duration::from_secs(5))
}

const HOUR: Duration = Duration::from_secs(60 * 60);

fn ids(participants: &[QuorumMember]) -> Vec<&str> {
    participants.iter().map(|p| p.replica_id.as_str()).collect()
}

/// torchft `test_quorum_join_timeout`.
#[test]
fn join_timeout() {
    let opt = opt(1, HOUR);
    let mut state = LighthouseState::new();
    let t0 = Instant::now();

    let (quorum, reason) = quorum_compute(t0, &state, &opt);
    assert!(quorum.is_none(), "{reason}");
    assert!(
        reason.contains(
            "New quorum not ready, only have 0 participants, need min_replicas 1 [0/0 participants healthy]"
        ),
        "{reason}"
    );

    state.join(t0, member("a", 1));
    state.join(t0, member("b", 1));
    // All healthy replicas participating.
    let (quorum, reason) = quorum_compute(t0, &state, &opt);
    assert!(quorum.is_some(), "{reason}");

    // A healthy replica that has not joined: wait for it.
    state.heartbeat(t0, "c");
    let (quorum, reason) = quorum_compute(t0, &state, &opt);
    assert!(quorum.is_none(), "{reason}");
    assert!(reason.contains("join timeout"), "{reason}");
    assert_eq!(
        reason,
        "Valid quorum with 2 participants, waiting for 1 healthy but not participating stragglers \
         due to join timeout [2/2 participants healthy][3 heartbeating][shrink_only=false]"
    );

    // Past the join timeout (heartbeats kept fresh): go without it.
    let t1 = t0 + 10 * HOUR;
    for id in ["a", "b", "c"] {
        state.heartbeat(t1, id);
    }
    let (quorum, reason) = quorum_compute(t1, &state, &opt);
    assert_eq!(ids(&quorum.expect(&reason)), ["a", "b"]);
    assert!(reason.starts_with("Valid quorum found"), "{reason}");

    // Just before the timeout it still waits; at the timeout it does not.
    let (quorum, _) = quorum_compute(t0 + HOUR - Duration::from_nanos(1), &state, &opt);
    assert!(quorum.is_none());
    let (quorum, _) = quorum_compute(t0 + HOUR, &state, &opt);
    assert!(quorum.is_some());
}

/// torchft `test_quorum_heartbeats`.
#[test]
fn heartbeats_expire() {
    let opt = opt(1, Duration::ZERO);
    let mut state = LighthouseState::new();
    let t0 = Instant::now();

    state.join(t0, member("a", 1));
    let (quorum, reason) = quorum_compute(t0, &state, &opt);
    assert!(quorum.is_some(), "{reason}");
    assert!(
        reason.contains("[1/1 participants healthy][1 heartbeating]"),
        "{reason}"
    );

    // Ten seconds later a's heartbeat (its join) has expired.
    let t1 = t0 + Duration::from_secs(10);
    let (quorum, reason) = quorum_compute(t1, &state, &opt);
    assert!(quorum.is_none(), "{reason}");
    assert!(
        reason.contains("[0/1 participants healthy][0 heartbeating]"),
        "{reason}"
    );

    // One healthy, one expired: the quorum is the healthy one.
    state.join(t1, member("b", 1));
    let (quorum, reason) = quorum_compute(t1, &state, &opt);
    assert_eq!(ids(&quorum.expect(&reason)), ["b"]);

    // The boundary: healthy strictly within the timeout.
    let mut state = LighthouseState::new();
    state.join(t0, member("a", 1));
    assert!(
        quorum_compute(t0 + Duration::from_millis(4_999), &state, &opt)
            .0
            .is_some()
    );
    assert!(quorum_compute(t0 + Duration::from_secs(5), &state, &opt)
        .0
        .is_none());
}

/// torchft `test_quorum_fast_prev_quorum`.
#[test]
fn fast_quorum_from_previous_quorum() {
    let opt = opt(1, HOUR);
    let t0 = Instant::now();

    // Without a previous quorum, a healthy replica that has not joined
    // blocks a 1-of-2 quorum (split brain).
    let mut state = LighthouseState::new();
    assert!(quorum_compute(t0, &state, &opt).0.is_none());
    state.join(t0, member("a", 1));
    state.heartbeat(t0, "b");
    let (quorum, reason) = quorum_compute(t0, &state, &opt);
    assert!(quorum.is_none(), "{reason}");
    assert!(reason.contains("need at least half"), "{reason}");

    // With a previous quorum {a}: a alone is a fast quorum, even though b
    // heartbeats and the join timeout (1 h) has not passed.
    let mut state = LighthouseState::new();
    state.join(t0, member("a", 1));
    let first = state.tick(t0, &opt).expect("first quorum");
    assert_eq!(ids(&first.participants), ["a"]);

    let t1 = t0 + Duration::from_secs(1);
    state.join(t1, member("a", 2));
    state.heartbeat(t1, "b");
    let (quorum, reason) = quorum_compute(t1, &state, &opt);
    assert_eq!(ids(&quorum.expect(&reason)), ["a"]);
    assert!(reason.starts_with("Fast quorum found!"), "{reason}");

    // Expanding the quorum with a fast quorum.
    state.join(t1, member("b", 1));
    let (quorum, reason) = quorum_compute(t1, &state, &opt);
    assert_eq!(ids(&quorum.expect(&reason)), ["a", "b"]);
    assert!(reason.starts_with("Fast quorum found!"), "{reason}");
}

/// torchft `test_quorum_shrink_only`.
#[test]
fn shrink_only() {
    let opt = opt(1, HOUR);
    let mut state = LighthouseState::new();
    let t0 = Instant::now();

    state.join(t0, member("a", 1));
    state.join(t0, member("b", 1));
    let prev = state.tick(t0, &opt).expect("previous quorum");
    assert_eq!(ids(&prev.participants), ["a", "b"]);

    // b is gone (its heartbeat expired); a asks to shrink only; c is new.
    let t1 = t0 + Duration::from_secs(10);
    state.join(t1, shrinking("a", 1));
    state.join(t1, shrinking("c", 1));
    let (quorum, reason) = quorum_compute(t1, &state, &opt);
    assert!(reason.contains("[shrink_only=true]"), "{reason}");
    assert_eq!(ids(&quorum.expect(&reason)), ["a"]);
}

/// torchft `test_quorum_split_brain`.
#[test]
fn split_brain() {
    let opt = opt(1, HOUR);
    let mut state = LighthouseState::new();
    let t0 = Instant::now();

    assert!(quorum_compute(t0, &state, &opt).0.is_none());
    state.join(t0, member("a", 1));
    let (quorum, reason) = quorum_compute(t0, &state, &opt);
    assert!(quorum.is_some(), "{reason}");

    // One replica heartbeats but does not participate.
    state.heartbeat(t0, "b");
    let (quorum, reason) = quorum_compute(t0, &state, &opt);
    assert!(quorum.is_none(), "{reason}");
    assert_eq!(
        reason,
        "New quorum not ready, only have 1 participants, need at least half of 2 healthy workers \
         [1/1 participants healthy][2 heartbeating][shrink_only=false]"
    );

    // Two of three is more than half.
    state.join(t0, member("c", 1));
    let (quorum, reason) = quorum_compute(t0, &state, &opt);
    assert!(reason.contains("join timeout"), "{reason}");
    assert!(quorum.is_none());
}

/// torchft `test_quorum_changed`.
#[test]
fn quorum_changed_compares_replica_ids() {
    let a = vec![member("1", 1)];
    let b = vec![QuorumMember {
        address: "changed".into(),
        store_address: "changed".into(),
        step: 1000,
        ..member("1", 1)
    }];
    // Same replica id: unchanged whatever else differs.
    assert!(!quorum_changed(&a, &b));

    let c = vec![member("2", 1)];
    assert!(quorum_changed(&a, &c));

    // A member more or less is a change.
    let ab = vec![member("1", 1), member("2", 1)];
    assert!(quorum_changed(&a, &ab));
    assert!(quorum_changed(&ab, &a));
    assert!(!quorum_changed(&[], &[]));
}

/// torchft `test_lighthouse_join_during_shrink`, driven without a server:
/// every request joins and then ticks, as the server does.
#[test]
fn join_during_shrink() {
    let opt = opt(2, Duration::from_secs(1));
    let mut state = LighthouseState::new();
    let t0 = Instant::now();
    let ms = Duration::from_millis;

    // 1. First quorum.
    state.join(t0, member("replica0", 1));
    assert!(state.tick(t0, &opt).is_none(), "min_replicas 2");
    state.join(t0 + ms(1), member("replica1", 1));
    let first = state.tick(t0 + ms(1), &opt).expect("first quorum");
    assert_eq!(ids(&first.participants), ["replica0", "replica1"]);
    assert_eq!(first.participants[1].step, 1);
    assert_eq!(first.quorum_id, 1);

    // 2. A joiner arrives while replica0 asks to shrink only: not admitted.
    let t1 = t0 + ms(100);
    state.join(t1, member("joiner", 1));
    assert!(state.tick(t1, &opt).is_none());
    state.join(t1 + ms(1), shrinking("replica0", 2));
    let (none, reason) = (state.tick(t1 + ms(1), &opt), state.last_reason());
    assert!(none.is_none(), "{reason:?}");
    state.join(t1 + ms(2), member("replica1", 2));
    let second = state.tick(t1 + ms(2), &opt).expect("second quorum");
    assert_eq!(ids(&second.participants), ["replica0", "replica1"]);
    assert_eq!(second.participants[1].step, 2);
    assert_eq!(second.quorum_id, 1, "same membership, same quorum id");
    assert!(state.participants().is_empty());

    // The joiner was left out: it joins again for the next round.
    state.join(t1 + ms(3), member("joiner", 1));
    assert!(state.tick(t1 + ms(3), &opt).is_none());

    // 3. Without shrink_only the joiner is in.
    let t2 = t0 + ms(200);
    state.join(t2, member("replica0", 3));
    assert!(state.tick(t2, &opt).is_none());
    state.join(t2 + ms(1), member("replica1", 3));
    let third = state.tick(t2 + ms(1), &opt).expect("third quorum");
    assert_eq!(ids(&third.participants), ["joiner", "replica0", "replica1"]);
    assert_eq!(third.participants[2].step, 3);
    assert_eq!(third.quorum_id, 2);
}

/// torchft `test_lighthouse_commit_failures`.
#[test]
fn commit_failures_raise_quorum_id() {
    let opt = opt(2, Duration::from_secs(1));
    let mut state = LighthouseState::new();
    let t0 = Instant::now();

    // The first two quorums are stable.
    for round in 0..2u32 {
        let t = t0 + Duration::from_millis(100) * round;
        state.join(t, failing("replica0", 0));
        assert!(state.tick(t, &opt).is_none(), "replica1 has not joined");
        state.join(t, failing("replica1", 0));
        let quorum = state.tick(t, &opt).expect("quorum");
        assert_eq!(quorum.quorum_id, 1);
        assert_eq!(quorum.participants.len(), 2);
        assert!(quorum.participants.iter().all(|p| p.commit_failures == 0));
    }

    // Commit failures raise the quorum id though membership is the same.
    let t = t0 + Duration::from_millis(300);
    state.join(t, failing("replica0", 0));
    assert!(state.tick(t, &opt).is_none());
    state.join(t, failing("replica1", 2));
    let quorum = state.tick(t, &opt).expect("quorum");
    assert_eq!(quorum.quorum_id, 2);
    assert_eq!(quorum.participants[0].commit_failures, 0);
    assert_eq!(quorum.participants[1].commit_failures, 2);
    assert_eq!(state.quorum_id(), 2);
}

/// A fast quorum in round 2 waits for every previous member: with one of
/// two joined, tick is not ready until the other joins or its heartbeat
/// expires.
#[test]
fn tick_waits_for_previous_members_then_drops_dead_ones() {
    let opt = opt(1, Duration::from_secs(1));
    let mut state = LighthouseState::new();
    let t0 = Instant::now();
    state.join(t0, member("a", 1));
    state.join(t0, member("b", 1));
    assert_eq!(state.tick(t0, &opt).expect("quorum").quorum_id, 1);

    let t1 = t0 + Duration::from_millis(100);
    state.join(t1, member("a", 2));
    // b still heartbeats but has not joined: 1 of 2 is not more than half.
    assert!(state.tick(t1, &opt).is_none());
    assert!(state
        .last_reason()
        .expect("reason")
        .contains("need at least half of 2 healthy workers"));

    // b's heartbeat expires 5 s after its join; a keeps heartbeating.
    let t2 = t0 + Duration::from_secs(5);
    state.heartbeat(t2, "a");
    let quorum = state.tick(t2, &opt).expect("b is dead: a alone");
    assert_eq!(ids(&quorum.participants), ["a"]);
    assert_eq!(quorum.quorum_id, 2, "membership changed");
}

/// The `created` stamp and the status accessors.
#[test]
fn tick_created_and_status() {
    let opt = opt(1, Duration::ZERO);
    let mut state = LighthouseState::new();
    let t0 = Instant::now();
    assert_eq!(state.quorum_id(), 0);
    assert!(state.prev_quorum().is_none());
    assert!(state.last_reason().is_none());

    state.join(t0, member("a", 7));
    assert!(state.status(t0, &opt).starts_with("Valid quorum found"));
    assert_eq!(state.participants().len(), 1);
    assert_eq!(state.heartbeats().get("a"), Some(&t0));

    let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let quorum = state.tick_created(t0, wall, &opt).expect("quorum");
    let created = quorum.created.expect("stamped");
    assert_eq!(created.seconds, 1_700_000_000);
    assert_eq!(state.prev_quorum(), Some(&quorum));
    assert_eq!(
        state.last_reason(),
        Some("Valid quorum found [1/1 participants healthy][1 heartbeating][shrink_only=false]")
    );
    // Nobody joined since: not ready again.
    assert!(state.tick(t0, &opt).is_none());
}

/// Dead heartbeat ids are forgotten once their heartbeat timeout has
/// passed (at a tick), live ones stay, and no decision changes: an expired
/// heartbeat was already unhealthy.
#[test]
fn expired_heartbeats_are_forgotten_at_a_tick() {
    let opt = opt(2, HOUR);
    let mut state = LighthouseState::new();
    let t0 = Instant::now();
    for i in 0..40 {
        state.heartbeat(t0, format!("dead_{i}"));
    }
    state.heartbeat(t0 + Duration::from_secs(4), "live");
    // Just before the timeout: all kept.
    assert!(state.tick(t0 + Duration::from_millis(4999), &opt).is_none());
    assert_eq!(state.heartbeats().len(), 41);
    let before = state.status(t0 + Duration::from_secs(5), &opt);
    assert!(state.tick(t0 + Duration::from_secs(5), &opt).is_none());
    assert_eq!(
        state.heartbeats().keys().collect::<Vec<_>>(),
        ["live"],
        "only the live heartbeat is left"
    );
    assert_eq!(state.status(t0 + Duration::from_secs(5), &opt), before);
    // A replica that comes back is heard again.
    state.heartbeat(t0 + Duration::from_secs(6), "dead_3");
    assert_eq!(state.heartbeats().len(), 2);
    assert!(state.tick(t0 + Duration::from_secs(60), &opt).is_none());
    assert!(state.heartbeats().is_empty());
}
