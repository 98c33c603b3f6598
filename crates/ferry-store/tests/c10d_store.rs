//! Ferry's c10d client ([`C10dStore`]) against Ferry's server
//! ([`TcpStoreServer`], which serves c10d clients beside its own), on
//! 127.0.0.1, without Python: concurrency, waits, timeouts, c10d's
//! compare-set, refusals and a server that goes away.
#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_store::{C10dStore, Store, StoreError, StoreLimits, TcpStore, TcpStoreServer};

const BOUND: Duration = Duration::from_secs(60);
const TIMEOUT: Duration = Duration::from_secs(20);

async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("finished within the bound")
}

async fn server() -> TcpStoreServer {
    TcpStoreServer::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

async fn client(addr: SocketAddr) -> Arc<C10dStore> {
    Arc::new(C10dStore::connect(addr, TIMEOUT).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_wait_does_not_block_a_set_on_the_same_client() {
    let server = server().await;
    let store = client(server.local_addr()).await;
    within(async {
        let waiter = {
            let store = store.clone();
            tokio::spawn(async move { store.wait(&["k".into()], TIMEOUT).await })
        };
        let getter = {
            let store = store.clone();
            tokio::spawn(async move { store.get("k").await })
        };
        // The waits hold connections of their own; this set opens (or
        // takes) another.
        store.set("k", b"v".to_vec()).await.unwrap();
        waiter.await.unwrap().unwrap();
        assert_eq!(getter.await.unwrap().unwrap(), b"v");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_times_out_names_the_missing_keys_and_the_client_goes_on() {
    let server = server().await;
    let store = client(server.local_addr()).await;
    within(async {
        store.set("here", Vec::new()).await.unwrap();
        let keys = vec!["here".to_string(), "missing".to_string()];
        match store.wait(&keys, Duration::from_millis(50)).await {
            Err(StoreError::Timeout { keys, after }) => {
                assert_eq!(keys, vec!["missing".to_string()]);
                assert_eq!(after, Duration::from_millis(50));
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        // The canceled wait left nothing behind on the connection.
        store.set("missing", b"now".to_vec()).await.unwrap();
        store.wait(&keys, TIMEOUT).await.unwrap();
        assert_eq!(store.get("missing").await.unwrap(), b"now");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_compare_set_delete_and_key_counts_follow_c10d() {
    let server = server().await;
    let addr = server.local_addr();
    let store = client(addr).await;
    within(async {
        assert_eq!(store.add("n", 5).await.unwrap(), 5);
        assert_eq!(store.add("n", -8).await.unwrap(), -3);
        assert_eq!(store.get("n").await.unwrap(), b"-3");
        // An empty expected value matches an absent key and an empty one.
        assert_eq!(
            store.compare_set("c", None, b"a".to_vec()).await.unwrap(),
            b"a"
        );
        assert_eq!(
            store
                .compare_set("c", Some(b"x".to_vec()), b"b".to_vec())
                .await
                .unwrap(),
            b"a"
        );
        assert_eq!(
            store
                .compare_set("absent", Some(b"x".to_vec()), b"b".to_vec())
                .await
                .unwrap(),
            b"x"
        );
        assert!(!store.check(&["absent".into()]).await.unwrap());
        store.set("e", Vec::new()).await.unwrap();
        assert_eq!(
            store.compare_set("e", None, b"f".to_vec()).await.unwrap(),
            b"f"
        );
        assert!(store.delete("e").await.unwrap());
        assert!(!store.delete("e").await.unwrap());
        assert_eq!(store.num_keys().await.unwrap(), 2);
        // The keys carry c10d's `/` prefix for Ferry's own clients.
        let ferry = TcpStore::connect(addr, TIMEOUT).await.unwrap();
        assert_eq!(ferry.get("/c").await.unwrap(), b"a");
        ferry.set("/from_ferry", b"1".to_vec()).await.unwrap();
        assert_eq!(store.get("from_ferry").await.unwrap(), b"1");
    })
    .await;
}

/// c10d has no error replies: a refused write closes its connection, the
/// client reports it, and its other connections (and clients) go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_closes_only_its_connection() {
    let limits = StoreLimits {
        max_value_bytes: 8,
        ..StoreLimits::default()
    };
    let server = TcpStoreServer::bind_with("127.0.0.1:0".parse().unwrap(), limits)
        .await
        .unwrap();
    let store = client(server.local_addr()).await;
    within(async {
        let e = store.set("big", vec![0; 9]).await.unwrap_err();
        assert!(
            matches!(e, StoreError::Closed | StoreError::Io { .. }),
            "{e}"
        );
        store.set("text", b"abc".to_vec()).await.unwrap();
        let e = store.add("text", 1).await.unwrap_err();
        assert!(
            matches!(e, StoreError::Closed | StoreError::Io { .. }),
            "{e}"
        );
        assert!(!store.check(&["big".into()]).await.unwrap());
        assert_eq!(store.get("text").await.unwrap(), b"abc");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_server_fails_a_pending_wait() {
    let server = server().await;
    let store = client(server.local_addr()).await;
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.wait(&["never".into()], BOUND).await })
    };
    // Once a check from another connection is answered, the server runs;
    // the wait is on the wire or about to be.
    assert!(!within(store.check(&["never".into()])).await.unwrap());
    drop(server);
    let result = within(waiter).await.unwrap();
    assert!(
        matches!(
            result,
            Err(StoreError::Closed | StoreError::Io { .. } | StoreError::NoAnswer { .. })
        ),
        "{result:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_retries_until_the_server_binds_then_gives_up_in_time() {
    // Nobody listens: a short timeout ends in an error naming the address.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let e = within(C10dStore::connect(addr, Duration::from_millis(200)))
        .await
        .unwrap_err();
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
}
