//! Live recovery over real sockets (127.0.0.1, port 0): a healing replica
//! fetches a source's state, checked bit for bit, over several lanes and
//! chunk sizes, into fresh or its own tensors; typed errors for a step
//! mismatch, nothing served, a dead source, a source shut down, and
//! destinations that do not fit.
//!
//! Nothing sleeps to wait for state: tests wait on results or on
//! [`CheckpointServer::wait_for_stats`]; every wait is bounded.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ferry_ft::recovery::{
    fetch_checkpoint, fetch_checkpoint_into, CheckpointServer, CheckpointServerOptions,
    CheckpointState, FetchOptions, RecoveryError,
};
use ferry_transport::RawTensor;
use ferry_wire::DType;

/// Upper bound on any single wait in these tests.
const BOUND: Duration = Duration::from_secs(30);

async fn bounded<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing within {BOUND:?}"))
}

async fn source() -> CheckpointServer {
    CheckpointServer::bind("127.0.0.1:0", CheckpointServerOptions::new("source"))
        .await
        .expect("bind the checkpoint server")
}

fn options() -> FetchOptions {
    FetchOptions::new("healer").with_wait(Duration::from_secs(10))
}

fn patterned(dtype: DType, shape: &[i64], seed: u8) -> RawTensor {
    let n: i64 = shape.iter().product();
    let bytes: Vec<u8> = (0..n as usize * dtype.size())
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect();
    RawTensor::from_bytes(dtype, shape, &bytes).expect("tensor")
}

/// A model and optimizer state of mixed dtypes, sizes that do not divide
/// the chunk size, an empty tensor and a transposed (non-contiguous) view.
fn state(step: i64) -> CheckpointState {
    let grid = patterned(DType::F32, &[37, 53], 1);
    CheckpointState::new(step)
        .with_tensor("model.embed", patterned(DType::F32, &[300, 129], 2))
        .with_tensor("model.proj.t", grid.t().expect("transpose"))
        .with_tensor("model.bias", patterned(DType::BF16, &[1001], 3))
        .with_tensor(
            "model.empty",
            RawTensor::zeros(DType::F32, &[0, 7]).expect("empty"),
        )
        .with_tensor("optim.step_count", patterned(DType::I64, &[1], 4))
        .with_tensor("optim.exp_avg", patterned(DType::F64, &[5000], 5))
        .with_tensor("optim.mask", patterned(DType::U8, &[100_003], 6))
}

#[tokio::test]
async fn a_state_arrives_bit_exact_over_every_lane_and_chunk_size() {
    let server = source().await;
    let sent = state(11);
    server.allow(sent.clone()).expect("allow");
    for (lanes, chunk_bytes) in [(1, 4096), (3, 4096), (4, 64 << 10), (2, 8 << 20)] {
        let options = options().with_lanes(lanes).with_chunk_bytes(chunk_bytes);
        let got = bounded("fetch", fetch_checkpoint(&server.address(), 11, &options))
            .await
            .unwrap_or_else(|e| panic!("{lanes} lanes, {chunk_bytes}-byte chunks: {e}"));
        assert_eq!(got.step, 11);
        assert_eq!(got, sent, "{lanes} lanes, {chunk_bytes}-byte chunks");
        for (_, tensor) in &got.tensors {
            assert!(tensor.is_contiguous());
        }
    }
    let stats = server.stats();
    assert_eq!(stats.manifests, 4);
    assert_eq!(stats.streams_completed, 1 + 3 + 4 + 2);
    assert_eq!(stats.in_flight, 0);
    assert_eq!(stats.bytes_sent, 4 * sent.total_bytes());
}

#[tokio::test]
async fn a_state_without_bytes_arrives_too() {
    let server = source().await;
    for sent in [
        CheckpointState::new(9),
        CheckpointState::new(9)
            .with_tensor("empty", RawTensor::zeros(DType::F32, &[0]).expect("empty")),
    ] {
        server.allow(sent.clone()).expect("allow");
        let got = bounded(
            "fetch",
            fetch_checkpoint(&server.address(), 9, &options().with_lanes(4)),
        )
        .await
        .expect("fetch");
        assert_eq!(got, sent);
    }
}

#[tokio::test]
async fn fetching_into_the_replicas_own_tensors_writes_in_place() {
    let server = source().await;
    let sent = state(5);
    server.allow(sent.clone()).expect("allow");
    // The healing replica's own (stale) state: same names, dtypes, shapes.
    let mut mine = CheckpointState::new(2);
    for (name, tensor) in &sent.tensors {
        mine = mine.with_tensor(
            name.clone(),
            RawTensor::zeros(tensor.dtype(), tensor.shape()).expect("zeros"),
        );
    }
    let places: Vec<*const u8> = mine
        .tensors
        .iter()
        .map(|(_, t)| t.storage().as_bytes().as_ptr())
        .collect();
    let options = options().with_lanes(3).with_chunk_bytes(4096);
    let got = bounded(
        "fetch into",
        fetch_checkpoint_into(&server.address(), 5, mine, &options),
    )
    .await
    .expect("fetch into");
    assert_eq!(got, sent);
    assert_eq!(got.step, 5);
    for ((name, tensor), place) in got.tensors.iter().zip(places) {
        if tensor.numel() > 0 {
            assert_eq!(tensor.storage().as_bytes().as_ptr(), place, "{name} moved");
        }
    }
}

#[tokio::test]
async fn destinations_that_do_not_fit_are_refused() {
    let server = source().await;
    server
        .allow(CheckpointState::new(1).with_tensor("w", patterned(DType::F32, &[4, 4], 0)))
        .expect("allow");
    let address = server.address();
    let cases = [
        (
            CheckpointState::new(0).with_tensor("w", RawTensor::zeros(DType::F32, &[16]).unwrap()),
            "where the checkpoint has",
        ),
        (
            CheckpointState::new(0)
                .with_tensor("v", RawTensor::zeros(DType::F32, &[4, 4]).unwrap()),
            "where the checkpoint has",
        ),
        (CheckpointState::new(0), "0 destination tensors"),
        (
            CheckpointState::new(0).with_tensor(
                "w",
                RawTensor::zeros(DType::F32, &[4, 4]).unwrap().t().unwrap(),
            ),
            "not contiguous",
        ),
    ];
    for (into, needle) in cases {
        match bounded(
            "fetch into",
            fetch_checkpoint_into(&address, 1, into, &options()),
        )
        .await
        {
            Err(RecoveryError::Destination { reason }) => {
                assert!(reason.contains(needle), "{needle:?} not in {reason:?}")
            }
            other => panic!("expected a destination error ({needle}), got {other:?}"),
        }
    }
    // A destination whose storage someone else holds cannot be written.
    let shared = RawTensor::zeros(DType::F32, &[4, 4]).unwrap();
    let into = CheckpointState::new(0).with_tensor("w", shared.clone());
    match bounded(
        "fetch into",
        fetch_checkpoint_into(&address, 1, into, &options()),
    )
    .await
    {
        Err(RecoveryError::Destination { reason }) => {
            assert!(reason.contains("shares"), "{reason}")
        }
        other => panic!("expected a destination error, got {other:?}"),
    }
    assert_eq!(Arc::strong_count(shared.storage()), 1);
}

#[tokio::test]
async fn a_step_mismatch_is_a_typed_refusal() {
    let server = source().await;
    server.allow(state(7)).expect("allow");
    let error = bounded("fetch", fetch_checkpoint(&server.address(), 8, &options()))
        .await
        .expect_err("step 8 is not served");
    match error {
        RecoveryError::StepMismatch {
            address,
            requested,
            serving,
        } => {
            assert_eq!((requested, serving), (8, 7));
            assert_eq!(address, server.address());
        }
        other => panic!("expected StepMismatch, got {other:?}"),
    }
    assert_eq!(server.stats().refusals, 1);
}

#[tokio::test]
async fn nothing_served_within_the_wait_is_a_typed_refusal() {
    let server = source().await;
    let options = options().with_wait(Duration::from_millis(50));
    match bounded("fetch", fetch_checkpoint(&server.address(), 3, &options)).await {
        Err(RecoveryError::NotServing { requested, .. }) => assert_eq!(requested, 3),
        other => panic!("expected NotServing, got {other:?}"),
    }
}

#[tokio::test]
async fn a_request_waits_for_the_source_to_allow_its_checkpoint() {
    let server = source().await;
    let address = server.address();
    let fetch = tokio::spawn(async move { fetch_checkpoint(&address, 4, &options()).await });
    bounded("request waiting", server.wait_for_stats(|s| s.waiting == 1)).await;
    server.allow(state(4)).expect("allow");
    let got = bounded("fetch", fetch).await.expect("task").expect("fetch");
    assert_eq!(got, state(4));
    assert_eq!(server.stats().waiting, 0);
}

#[tokio::test]
async fn disallowing_stops_serving_and_releases_the_tensors() {
    let server = source().await;
    let weights = patterned(DType::F32, &[1000], 9);
    server
        .allow(CheckpointState::new(2).with_tensor("w", weights.clone()))
        .expect("allow");
    assert_eq!(server.serving_step(), Some(2));
    bounded("fetch", fetch_checkpoint(&server.address(), 2, &options()))
        .await
        .expect("fetch");
    bounded("disallow", server.disallow()).await;
    assert_eq!(server.serving_step(), None);
    assert_eq!(Arc::strong_count(weights.storage()), 1);
    let options = options().with_wait(Duration::from_millis(20));
    assert!(matches!(
        bounded("fetch", fetch_checkpoint(&server.address(), 2, &options)).await,
        Err(RecoveryError::NotServing { .. })
    ));
}

#[tokio::test]
async fn a_dead_source_is_unreachable() {
    let server = source().await;
    let address = server.address();
    server.shutdown().await;
    match bounded("fetch", fetch_checkpoint(&address, 1, &options())).await {
        Err(RecoveryError::SourceUnreachable { address: a, .. }) => assert_eq!(a, address),
        other => panic!("expected SourceUnreachable, got {other:?}"),
    }
    match bounded(
        "fetch",
        fetch_checkpoint("no-such-host.invalid:1", 1, &options()),
    )
    .await
    {
        Err(RecoveryError::InvalidAddress { .. }) => {}
        other => panic!("expected InvalidAddress, got {other:?}"),
    }
}

#[tokio::test]
async fn a_source_shut_down_while_a_request_waits_is_lost() {
    let server = source().await;
    let address = server.address();
    let fetch = tokio::spawn(async move { fetch_checkpoint(&address, 4, &options()).await });
    bounded("request waiting", server.wait_for_stats(|s| s.waiting == 1)).await;
    server.shutdown().await;
    match bounded("fetch", fetch).await.expect("task") {
        Err(RecoveryError::SourceLost { .. }) => {}
        other => panic!("expected SourceLost, got {other:?}"),
    }
}

#[tokio::test]
async fn invalid_options_are_refused() {
    let options = options().with_chunk_bytes(1000);
    assert!(matches!(
        fetch_checkpoint("127.0.0.1:1", 1, &options).await,
        Err(RecoveryError::InvalidOptions { .. })
    ));
    let options = FetchOptions::new("healer").with_lanes(0);
    assert!(matches!(
        fetch_checkpoint("127.0.0.1:1", 1, &options).await,
        Err(RecoveryError::InvalidOptions { .. })
    ));
}
