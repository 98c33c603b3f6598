//! The replica-group process group over real sockets (127.0.0.1, port 0):
//! rendezvous through `ferry-store` (tested on its own in
//! `crates/ferry-store/tests/store.rs`), bit-identical allreduce results
//! computed in replica-rank order, a group rebuilt for a new quorum, and
//! failures (a peer dropped mid-allreduce, a stalled peer, a member that
//! never comes, a store nobody listens at) reported as errors, never hangs;
//! a member gone right after its allreduce fails none of its peers.
//!
//! Nothing sleeps to wait for state; every wait is bounded.

use std::future::Future;
use std::time::Duration;

use ferry_ft::collective::{
    reduce_in_rank_order, segment, CollectiveError, ProcessGroup, ProcessGroupOptions, ReduceOp,
};
use ferry_store::TcpStoreServer;

/// Upper bound on any single wait in these tests.
const BOUND: Duration = Duration::from_secs(30);

async fn bounded<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing within {BOUND:?}"))
}

/// A rendezvous store on 127.0.0.1 and its address, as a quorum gives it.
async fn start_store() -> (TcpStoreServer, String) {
    let server = TcpStoreServer::bind(([127, 0, 0, 1], 0).into())
        .await
        .expect("store");
    let address = server.local_addr().to_string();
    (server, address)
}

fn ids(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| n.to_string()).collect()
}

async fn group(name: &str, timeout: Duration) -> ProcessGroup {
    ProcessGroup::bind(
        "127.0.0.1:0",
        ProcessGroupOptions::new(name).with_timeout(timeout),
    )
    .await
    .expect("bind the process group")
}

/// Values of very different magnitudes, so summation order shows in the
/// bits.
fn values(seed: u64, len: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mantissa = (x % 2000) as f32 / 1000.0 - 1.0;
            let scale = [1e-3f32, 1.0, 1e4, 1e8][(x >> 20) as usize % 4];
            mantissa * scale
        })
        .collect()
}

/// What every member must end with: element-wise, the inputs summed in
/// rank order, then divided.
fn expected(inputs: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
    let len = inputs[0].len();
    let mut out = vec![0.0; len];
    for k in 0..inputs.len() {
        let range = segment(len, inputs.len(), k);
        let parts: Vec<&[f32]> = inputs.iter().map(|v| &v[range.clone()]).collect();
        reduce_in_rank_order(&parts, op, &mut out[range]);
    }
    out
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

async fn configure_all(
    groups: &mut [&mut ProcessGroup],
    store: &str,
    quorum_id: i64,
    members: &[String],
) {
    let futures = groups
        .iter_mut()
        .enumerate()
        .map(|(rank, pg)| pg.configure_with(store, quorum_id, members, rank as u64));
    for result in bounded("configure", futures::future::join_all(futures)).await {
        result.expect("configure");
    }
}

async fn allreduce_all(
    groups: &mut [&mut ProcessGroup],
    inputs: &[Vec<f32>],
    op: ReduceOp,
) -> Vec<Result<Vec<f32>, CollectiveError>> {
    let futures = groups.iter_mut().zip(inputs).map(|(pg, input)| async move {
        let mut data = input.clone();
        pg.allreduce(&mut data, op).await.map(|()| data)
    });
    bounded("allreduce", futures::future::join_all(futures)).await
}

#[tokio::test]
async fn three_members_end_with_bit_identical_means_in_rank_order() {
    let (_store, address) = start_store().await;
    let members = ids(&["replica_a", "replica_b", "replica_c"]);
    let (mut a, mut b, mut c) = (
        group("replica_a", BOUND).await,
        group("replica_b", BOUND).await,
        group("replica_c", BOUND).await,
    );
    let mut groups = [&mut a, &mut b, &mut c];
    configure_all(&mut groups, &address, 1, &members).await;
    for pg in &groups {
        assert_eq!(pg.quorum_id(), Some(1));
        assert_eq!(pg.world_size(), Some(3));
    }
    // Several rounds, lengths that do not divide by 3 (and one shorter
    // than the group; the last one streams each segment in several
    // chunks, more than a sender may run ahead), both ops.
    for (round, len) in [1001usize, 2, 0, 65_537, 2_500_001].into_iter().enumerate() {
        for op in [ReduceOp::Mean, ReduceOp::Sum] {
            let inputs: Vec<Vec<f32>> =
                (0..3).map(|r| values(round as u64 * 10 + r, len)).collect();
            let want = bits(&expected(&inputs, op));
            for (rank, result) in allreduce_all(&mut groups, &inputs, op)
                .await
                .into_iter()
                .enumerate()
            {
                let got = result.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                assert_eq!(bits(&got), want, "rank {rank}, len {len}, {op:?}");
            }
        }
    }
    // The same quorum again keeps the group (and its connections).
    configure_all(&mut groups, &address, 1, &members).await;
    let inputs: Vec<Vec<f32>> = (0..3).map(|r| values(99 + r, 10)).collect();
    let want = bits(&expected(&inputs, ReduceOp::Mean));
    for result in allreduce_all(&mut groups, &inputs, ReduceOp::Mean).await {
        assert_eq!(bits(&result.expect("allreduce")), want);
    }
}

#[tokio::test]
async fn a_new_quorum_rebuilds_the_group() {
    let (_store, address) = start_store().await;
    let (mut a, mut b, mut c) = (
        group("replica_a", BOUND).await,
        group("replica_b", BOUND).await,
        group("replica_c", BOUND).await,
    );
    let all = ids(&["replica_a", "replica_b", "replica_c"]);
    configure_all(&mut [&mut a, &mut b, &mut c], &address, 1, &all).await;

    // replica_b leaves: quorum 2 is replica_a and replica_c, ranks 0 and 1.
    drop(b);
    let two = ids(&["replica_a", "replica_c"]);
    let mut groups = [&mut a, &mut c];
    configure_all(&mut groups, &address, 2, &two).await;
    assert_eq!(groups[1].rank(), Some(1));
    let inputs = vec![values(1, 33), values(2, 33)];
    let want = bits(&expected(&inputs, ReduceOp::Mean));
    for result in allreduce_all(&mut groups, &inputs, ReduceOp::Mean).await {
        assert_eq!(bits(&result.expect("allreduce")), want);
    }

    // A newcomer joins: quorum 3 of three again, the newcomer in the middle.
    let mut d = group("replica_b2", BOUND).await;
    let three = ids(&["replica_a", "replica_b2", "replica_c"]);
    let mut groups = [&mut a, &mut d, &mut c];
    configure_all(&mut groups, &address, 3, &three).await;
    let inputs: Vec<Vec<f32>> = (0..3).map(|r| values(7 + r, 100)).collect();
    let want = bits(&expected(&inputs, ReduceOp::Mean));
    for result in allreduce_all(&mut groups, &inputs, ReduceOp::Mean).await {
        assert_eq!(bits(&result.expect("allreduce")), want);
    }
}

#[tokio::test]
async fn a_peer_dying_mid_allreduce_is_an_error_not_a_hang() {
    let (_store, address) = start_store().await;
    let (mut a, mut b, c) = (
        group("replica_a", BOUND).await,
        group("replica_b", BOUND).await,
        group("replica_c", BOUND).await,
    );
    let members = ids(&["replica_a", "replica_b", "replica_c"]);
    let mut c = c;
    configure_all(&mut [&mut a, &mut b, &mut c], &address, 1, &members).await;

    // replica_a and replica_b start the allreduce; replica_c dies instead
    // of joining it (its sockets close, as a killed process's do).
    let running = tokio::spawn(async move {
        let mut groups = [&mut a, &mut b];
        let inputs = vec![values(1, 1 << 16), values(2, 1 << 16)];
        let results = allreduce_all(&mut groups, &inputs, ReduceOp::Mean).await;
        (a, b, results)
    });
    tokio::task::yield_now().await;
    drop(c);
    let (mut a, mut b, results) = bounded("allreduce", running).await.expect("task");
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Err(CollectiveError::PeerLost { .. }) => {}
            other => panic!("rank {rank}: expected PeerLost, got {other:?}"),
        }
    }
    // The group stays broken for this quorum...
    let mut data = vec![1.0; 4];
    assert!(matches!(
        a.allreduce_mean(&mut data).await,
        Err(CollectiveError::Broken { quorum_id: 1, .. })
    ));
    assert!(matches!(
        a.configure_with(&address, 1, &members, 0).await,
        Err(CollectiveError::Broken { .. })
    ));
    // ... and works again with the next one.
    let two = ids(&["replica_a", "replica_b"]);
    configure_all(&mut [&mut a, &mut b], &address, 2, &two).await;
    let inputs = vec![values(3, 50), values(4, 50)];
    let want = bits(&expected(&inputs, ReduceOp::Mean));
    for result in allreduce_all(&mut [&mut a, &mut b], &inputs, ReduceOp::Mean).await {
        assert_eq!(bits(&result.expect("allreduce")), want);
    }
}

/// A member that goes away as soon as its allreduce returns (a process
/// exiting after its last step) leaves its peers nothing more to copy from
/// it: their allreduce succeeds too. Segments of several chunks, the
/// members on two threads; a few rounds, each with fresh groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_gone_right_after_its_allreduce_fails_no_one() {
    let (_store, address) = start_store().await;
    let members = ids(&["replica_a", "replica_b"]);
    let len = 1_000_003;
    for quorum in 1..=5i64 {
        let (mut a, mut b) = (
            group("replica_a", BOUND).await,
            group("replica_b", BOUND).await,
        );
        configure_all(&mut [&mut a, &mut b], &address, quorum, &members).await;
        let inputs = [values(quorum as u64, len), values(100 + quorum as u64, len)];
        let want = bits(&expected(&inputs, ReduceOp::Sum));
        let run = |mut pg: ProcessGroup, mut data: Vec<f32>| {
            tokio::spawn(async move {
                let result = pg.allreduce(&mut data, ReduceOp::Sum).await;
                // Its connections close at once, as an exiting process's do.
                drop(pg);
                result.map(|()| data)
            })
        };
        let (ra, rb) = (run(a, inputs[0].clone()), run(b, inputs[1].clone()));
        let results = [bounded("a", ra).await, bounded("b", rb).await];
        for (rank, result) in results.into_iter().enumerate() {
            let got = result
                .expect("the task")
                .unwrap_or_else(|e| panic!("quorum {quorum}, rank {rank}: {e}"));
            assert_eq!(bits(&got), want, "quorum {quorum}, rank {rank}");
        }
    }
}

#[tokio::test]
async fn a_stalled_peer_times_out() {
    let (_store, address) = start_store().await;
    let timeout = Duration::from_millis(300);
    let (mut a, mut b) = (
        group("replica_a", timeout).await,
        group("replica_b", timeout).await,
    );
    let members = ids(&["replica_a", "replica_b"]);
    configure_all(&mut [&mut a, &mut b], &address, 1, &members).await;
    // replica_b is alive but never joins the allreduce.
    let mut data = values(1, 100);
    match bounded("allreduce", a.allreduce_mean(&mut data)).await {
        Err(CollectiveError::Timeout { what, .. }) => assert_eq!(what, "allreduce"),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(a.is_broken());
}

#[tokio::test]
async fn a_member_that_never_arrives_fails_the_rendezvous() {
    let (store, address) = start_store().await;
    let timeout = Duration::from_millis(300);
    let mut a = group("replica_a", timeout).await;
    let mut b = group("replica_b", timeout).await;
    let members = ids(&["replica_a", "replica_b"]);
    // Rank 1 waits for rank 0's address; rank 0 waits for rank 1's hello.
    match bounded("configure", b.configure_with(&address, 5, &members, 1)).await {
        Err(CollectiveError::Timeout { .. } | CollectiveError::StoreTimeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    match bounded("configure", a.configure_with(&address, 6, &members, 0)).await {
        Err(CollectiveError::Timeout { what, .. }) => assert_eq!(what, "process group rendezvous"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert_eq!(a.quorum_id(), None);
    let mut data = vec![0.0; 3];
    assert!(matches!(
        a.allreduce_mean(&mut data).await,
        Err(CollectiveError::NotConfigured)
    ));
    // A store nobody listens at.
    drop(store);
    let dead = {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap().to_string()
    };
    assert!(matches!(
        bounded("configure", a.configure_with(&dead, 7, &members, 0)).await,
        Err(CollectiveError::Store { .. })
    ));
}

#[tokio::test]
async fn a_quorum_that_does_not_name_this_replica_at_its_rank_is_refused() {
    let mut a = group("replica_a", BOUND).await;
    let members = ids(&["replica_a", "replica_b"]);
    assert!(matches!(
        a.configure_with("127.0.0.1:1", 1, &members, 1).await,
        Err(CollectiveError::InvalidQuorum { .. })
    ));
    assert!(matches!(
        a.configure_with("127.0.0.1:1", 1, &members, 2).await,
        Err(CollectiveError::InvalidQuorum { .. })
    ));
}

#[tokio::test]
async fn a_store_address_that_is_not_host_and_port_is_refused() {
    let mut a = group("replica_a", BOUND).await;
    let members = ids(&["replica_a", "replica_b"]);
    match bounded("configure", a.configure_with("no port", 1, &members, 0)).await {
        Err(CollectiveError::StoreAddress { address, .. }) => assert_eq!(address, "no port"),
        other => panic!("expected StoreAddress, got {other:?}"),
    }
    assert_eq!(a.quorum_id(), None);
}

#[tokio::test]
async fn a_group_of_one_reduces_to_itself() {
    let mut a = group("replica_a", BOUND).await;
    a.configure_with("", 1, &ids(&["replica_a"]), 0)
        .await
        .expect("configure alone");
    let mut data = values(5, 17);
    let before = bits(&data);
    a.allreduce_mean(&mut data).await.expect("allreduce");
    assert_eq!(bits(&data), before);
}
