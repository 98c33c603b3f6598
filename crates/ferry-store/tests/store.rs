//! The rendezvous store: a TCP server on 127.0.0.1 and several clients.
#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_store::{
    FormatError, MemoryStore, PrefixStore, Store, StoreError, TcpStore, TcpStoreServer,
    MAX_MESSAGE_BYTES,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;

/// Generous bound on every test: a hang fails instead of stalling CI.
const LIMIT: Duration = Duration::from_secs(60);
const TIMEOUT: Duration = Duration::from_secs(30);

async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, f)
        .await
        .expect("the test took too long")
}

async fn server() -> TcpStoreServer {
    TcpStoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("bind the store server")
}

async fn client(addr: SocketAddr) -> TcpStore {
    TcpStore::connect(addr, TIMEOUT)
        .await
        .expect("connect to the store")
}

fn keys(ks: &[&str]) -> Vec<String> {
    ks.iter().map(|k| k.to_string()).collect()
}

/// A request the server has answered on `store`'s connection after
/// everything sent there before it: makes sure an earlier blocking request
/// is registered on the server.
async fn round_trip(store: &dyn Store) {
    store.check(&keys(&["-"])).await.expect("round trip");
}

#[tokio::test]
async fn set_and_get_across_clients() {
    within(async {
        let server = server().await;
        let a = client(server.local_addr()).await;
        let b = client(server.local_addr()).await;
        a.set("k", b"v1".to_vec()).await.unwrap();
        assert_eq!(b.get("k").await.unwrap(), b"v1");
        b.set("k", b"v2".to_vec()).await.unwrap();
        assert_eq!(a.get("k").await.unwrap(), b"v2");
        a.set("empty", Vec::new()).await.unwrap();
        assert_eq!(b.get("empty").await.unwrap(), b"");
        let big = vec![7u8; 1 << 20];
        a.set("big", big.clone()).await.unwrap();
        assert_eq!(b.get("big").await.unwrap(), big);
    })
    .await;
}

#[tokio::test]
async fn get_waits_for_a_key_set_later_by_another_client() {
    within(async {
        let server = server().await;
        let a = Arc::new(client(server.local_addr()).await);
        let b = client(server.local_addr()).await;
        let (sent, sent_rx) = oneshot::channel();
        let getter = {
            let a = a.clone();
            tokio::spawn(async move {
                let mut get = a.get("late");
                // First poll: the request is on its way and cannot be
                // answered yet.
                assert!(futures::poll!(&mut get).is_pending());
                sent.send(()).unwrap();
                get.await
            })
        };
        sent_rx.await.unwrap();
        round_trip(&*a).await;
        assert!(!b.check(&keys(&["late"])).await.unwrap());
        b.set("late", b"here".to_vec()).await.unwrap();
        assert_eq!(getter.await.unwrap().unwrap(), b"here");
    })
    .await;
}

#[tokio::test]
async fn get_times_out_after_the_client_timeout() {
    within(async {
        let server = server().await;
        let c = TcpStore::connect(server.local_addr(), Duration::from_millis(100))
            .await
            .unwrap();
        match c.get("never").await {
            Err(StoreError::Timeout { keys, after }) => {
                assert_eq!(keys, ["never"]);
                assert_eq!(after, Duration::from_millis(100));
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    })
    .await;
}

#[tokio::test]
async fn wait_timeout_names_the_missing_keys() {
    within(async {
        let server = server().await;
        let c = client(server.local_addr()).await;
        c.set("present", vec![1]).await.unwrap();
        let err = c
            .wait(
                &keys(&["present", "missing/1", "missing/2"]),
                Duration::from_millis(100),
            )
            .await
            .unwrap_err();
        let message = err.to_string();
        match err {
            StoreError::Timeout { keys, after } => {
                assert_eq!(keys, ["missing/1", "missing/2"]);
                assert_eq!(after, Duration::from_millis(100));
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(message.contains("missing/1") && message.contains("missing/2"));
        assert!(!message.contains("\"present\""));
        // Nothing missing: no wait.
        c.wait(&keys(&["present"]), Duration::ZERO).await.unwrap();
        c.wait(&[], Duration::ZERO).await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn wait_returns_once_every_key_is_set() {
    within(async {
        let server = server().await;
        let a = Arc::new(client(server.local_addr()).await);
        let b = client(server.local_addr()).await;
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.wait(&keys(&["x", "y", "z"]), TIMEOUT).await })
        };
        b.set("z", vec![]).await.unwrap();
        b.add("x", 1).await.unwrap();
        b.compare_set("y", None, vec![1]).await.unwrap();
        waiter.await.unwrap().unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_from_eight_clients_sums_exactly() {
    within(async {
        let server = server().await;
        let addr = server.local_addr();
        let mut tasks = Vec::new();
        for _ in 0..8 {
            tasks.push(tokio::spawn(async move {
                let c = client(addr).await;
                let mut seen = Vec::with_capacity(100);
                for _ in 0..100 {
                    seen.push(c.add("counter", 1).await.unwrap());
                }
                seen
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        all.sort_unstable();
        // Every increment saw its own value: none was lost or doubled.
        assert_eq!(all, (1..=800).collect::<Vec<i64>>());
        let c = client(addr).await;
        assert_eq!(c.get("counter").await.unwrap(), b"800");
        assert_eq!(c.add("counter", -1000).await.unwrap(), -200);
        assert_eq!(c.add("counter", 0).await.unwrap(), -200);
        c.set("text", b"41".to_vec()).await.unwrap();
        assert_eq!(c.add("text", 1).await.unwrap(), 42);
    })
    .await;
}

#[tokio::test]
async fn add_on_a_non_number_is_not_a_counter() {
    within(async {
        let server = server().await;
        let c = client(server.local_addr()).await;
        c.set("name", b"worker0".to_vec()).await.unwrap();
        match c.add("name", 1).await {
            Err(StoreError::NotACounter { key }) => assert_eq!(key, "name"),
            other => panic!("expected NotACounter, got {other:?}"),
        }
        // The value is untouched and the connection still serves.
        assert_eq!(c.get("name").await.unwrap(), b"worker0");
        c.set("max", i64::MAX.to_string().into_bytes())
            .await
            .unwrap();
        assert!(matches!(
            c.add("max", 1).await,
            Err(StoreError::Overflow { .. })
        ));
    })
    .await;
}

#[tokio::test]
async fn compare_set_semantics() {
    within(async {
        let server = server().await;
        let a = client(server.local_addr()).await;
        let b = client(server.local_addr()).await;
        // Absent and expected absent: stored.
        assert_eq!(a.compare_set("k", None, b"a".to_vec()).await.unwrap(), b"a");
        // Present but expected absent: the current value, unchanged.
        assert_eq!(b.compare_set("k", None, b"b".to_vec()).await.unwrap(), b"a");
        // Mismatch: the current value, unchanged.
        assert_eq!(
            b.compare_set("k", Some(b"x".to_vec()), b"b".to_vec())
                .await
                .unwrap(),
            b"a"
        );
        // Match: swapped.
        assert_eq!(
            b.compare_set("k", Some(b"a".to_vec()), b"b".to_vec())
                .await
                .unwrap(),
            b"b"
        );
        assert_eq!(a.get("k").await.unwrap(), b"b");
        // Absent but expected present (c10d): `expected` back, nothing stored.
        assert_eq!(
            a.compare_set("absent", Some(b"e".to_vec()), b"d".to_vec())
                .await
                .unwrap(),
            b"e"
        );
        assert!(!a.check(&keys(&["absent"])).await.unwrap());
    })
    .await;
}

#[tokio::test]
async fn compare_set_claims_exactly_once() {
    within(async {
        let server = server().await;
        let addr = server.local_addr();
        let mut tasks = Vec::new();
        for i in 0..8u8 {
            tasks.push(tokio::spawn(async move {
                let c = client(addr).await;
                c.compare_set("rank/0", None, vec![i]).await.unwrap() == [i]
            }));
        }
        let mut winners = 0;
        for t in tasks {
            winners += usize::from(t.await.unwrap());
        }
        assert_eq!(winners, 1);
    })
    .await;
}

#[tokio::test]
async fn prefix_stores_are_isolated() {
    within(async {
        let server = server().await;
        let raw: Arc<dyn Store> = Arc::new(client(server.local_addr()).await);
        let job1 = PrefixStore::new("job1", raw.clone());
        let job2 = PrefixStore::new("job2", raw.clone());
        job1.set("k", b"one".to_vec()).await.unwrap();
        job2.set("k", b"two".to_vec()).await.unwrap();
        assert_eq!(job1.get("k").await.unwrap(), b"one");
        assert_eq!(job2.get("k").await.unwrap(), b"two");
        assert_eq!(raw.get("job1/k").await.unwrap(), b"one");
        assert!(!raw.check(&keys(&["k"])).await.unwrap());

        job1.set("only1", vec![]).await.unwrap();
        assert!(job1.check(&keys(&["only1"])).await.unwrap());
        assert!(!job2.check(&keys(&["only1"])).await.unwrap());
        assert!(!job2.delete("only1").await.unwrap());
        assert_eq!(job1.add("n", 2).await.unwrap(), 2);
        assert_eq!(job2.add("n", 5).await.unwrap(), 5);

        // Prefixes nest; errors name the keys as the caller gave them.
        let nested = PrefixStore::new("inner", Arc::new(job1.clone()));
        nested.set("x", vec![9]).await.unwrap();
        assert_eq!(raw.get("job1/inner/x").await.unwrap(), [9]);
        match nested
            .wait(&keys(&["x", "y"]), Duration::from_millis(50))
            .await
        {
            Err(StoreError::Timeout { keys, .. }) => assert_eq!(keys, ["y"]),
            other => panic!("expected a timeout, got {other:?}"),
        }
        match job2.add("k", 1).await {
            Err(StoreError::NotACounter { key }) => assert_eq!(key, "k"),
            other => panic!("expected NotACounter, got {other:?}"),
        }
    })
    .await;
}

#[tokio::test]
async fn a_client_may_connect_before_the_server_binds() {
    within(async {
        // Reserve a free port, then let it go.
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let early = tokio::spawn(TcpStore::connect(addr, TIMEOUT));
        let server = TcpStoreServer::bind(addr).await.unwrap();
        assert_eq!(server.local_addr(), addr);
        let early = early.await.unwrap().unwrap();
        let late = client(addr).await;
        early.set("hello", b"world".to_vec()).await.unwrap();
        assert_eq!(late.get("hello").await.unwrap(), b"world");
    })
    .await;
}

#[tokio::test]
async fn connecting_gives_up_after_the_timeout() {
    within(async {
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        match TcpStore::connect(addr, Duration::from_millis(200)).await {
            Err(StoreError::Io { addr: a, .. }) => assert_eq!(a, addr.to_string()),
            other => panic!("expected an I/O error, got {other:?}"),
        }
    })
    .await;
}

/// Sends `bytes` on a raw connection and expects the server to close it.
async fn send_raw_and_expect_close(addr: SocketAddr, bytes: &[u8]) {
    let mut raw = tokio::net::TcpStream::connect(addr)
        .await
        .expect("raw connect");
    raw.write_all(bytes).await.expect("raw write");
    let mut buf = [0u8; 64];
    // EOF (or a reset): the server dropped the connection without
    // answering.
    match raw.read(&mut buf).await {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("the server answered garbage with {n} bytes"),
    }
}

#[tokio::test]
async fn garbage_and_oversized_input_do_not_stop_the_server() {
    within(async {
        let server = server().await;
        let addr = server.local_addr();
        let before = client(addr).await;
        before.set("k", b"v".to_vec()).await.unwrap();

        // A well-sized frame of garbage.
        send_raw_and_expect_close(addr, &[5, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff]).await;
        // Trailing bytes after a valid message (id 0, check of no keys)
        // are garbage too.
        send_raw_and_expect_close(addr, &[4, 0, 0, 0, 0, 6, 0, 0xff]).await;
        // A length prefix over the limit: closed before any allocation.
        send_raw_and_expect_close(addr, &u32::MAX.to_le_bytes()).await;
        let over = u32::try_from(MAX_MESSAGE_BYTES + 1).unwrap();
        send_raw_and_expect_close(addr, &over.to_le_bytes()).await;
        // Not even a whole length prefix, then gone.
        drop(tokio::net::TcpStream::connect(addr).await.unwrap());

        // Clients old and new are served on.
        assert_eq!(before.get("k").await.unwrap(), b"v");
        let after = client(addr).await;
        after.set("k2", b"v2".to_vec()).await.unwrap();
        assert_eq!(before.get("k2").await.unwrap(), b"v2");
    })
    .await;
}

#[tokio::test]
async fn an_oversized_value_is_refused_by_the_client() {
    within(async {
        let server = server().await;
        let c = client(server.local_addr()).await;
        let err = c
            .set("huge", vec![0; MAX_MESSAGE_BYTES + 1])
            .await
            .unwrap_err();
        assert!(
            matches!(
                &err,
                StoreError::Format {
                    source: FormatError::TooLarge { limit, .. },
                    ..
                } if *limit == MAX_MESSAGE_BYTES
            ),
            "{err:?}"
        );
        // Nothing was sent: the connection is fine.
        c.set("small", vec![1]).await.unwrap();
        assert_eq!(c.get("small").await.unwrap(), [1]);
    })
    .await;
}

#[tokio::test]
async fn delete_and_check() {
    within(async {
        let server = server().await;
        let a = client(server.local_addr()).await;
        let b = client(server.local_addr()).await;
        assert!(a.check(&[]).await.unwrap());
        assert!(!a.check(&keys(&["x"])).await.unwrap());
        a.set("x", vec![]).await.unwrap();
        a.set("y", vec![]).await.unwrap();
        assert!(b.check(&keys(&["x", "y"])).await.unwrap());
        assert!(!b.check(&keys(&["x", "y", "z"])).await.unwrap());
        assert!(b.delete("x").await.unwrap());
        assert!(!b.delete("x").await.unwrap());
        assert!(!a.check(&keys(&["x", "y"])).await.unwrap());
        assert!(a.check(&keys(&["y"])).await.unwrap());
        // A deleted key can be set again and waited for again.
        a.set("x", b"again".to_vec()).await.unwrap();
        assert_eq!(b.get("x").await.unwrap(), b"again");
    })
    .await;
}

#[tokio::test]
async fn a_blocking_wait_does_not_block_a_set_on_the_same_client() {
    within(async {
        let server = server().await;
        let c = Arc::new(client(server.local_addr()).await);
        let waiter = {
            let c = c.clone();
            tokio::spawn(async move { c.wait(&keys(&["go"]), TIMEOUT).await })
        };
        let getter = {
            let c = c.clone();
            tokio::spawn(async move { c.get("go").await })
        };
        // Same connection, while the wait and the get are outstanding.
        c.set("other", vec![1]).await.unwrap();
        assert_eq!(c.add("n", 1).await.unwrap(), 1);
        c.set("go", b"now".to_vec()).await.unwrap();
        waiter.await.unwrap().unwrap();
        assert_eq!(getter.await.unwrap().unwrap(), b"now");
    })
    .await;
}

#[tokio::test]
async fn dropping_the_server_fails_a_pending_get() {
    within(async {
        let server = server().await;
        // Its own timeout is far beyond the test's limit: only the lost
        // connection can end the get in time.
        let c = Arc::new(
            TcpStore::connect(server.local_addr(), Duration::from_secs(3600))
                .await
                .unwrap(),
        );
        let getter = {
            let c = c.clone();
            tokio::spawn(async move { c.get("never").await })
        };
        let waiter = {
            let c = c.clone();
            tokio::spawn(async move { c.wait(&keys(&["never"]), Duration::from_secs(3600)).await })
        };
        round_trip(&*c).await;
        drop(server);
        for result in [getter.await.unwrap().map(drop), waiter.await.unwrap()] {
            match result {
                Err(StoreError::Closed | StoreError::Io { .. }) => {}
                other => panic!("expected the connection to be lost, got {other:?}"),
            }
        }
        // Later requests fail at once.
        assert!(matches!(
            c.set("k", vec![]).await,
            Err(StoreError::Closed | StoreError::Io { .. })
        ));
    })
    .await;
}

#[tokio::test]
async fn shutdown_stops_the_server() {
    within(async {
        let server = server().await;
        let addr = server.local_addr();
        let c = client(addr).await;
        c.set("k", vec![]).await.unwrap();
        server.shutdown();
        let get = c.get("k2");
        assert!(matches!(
            get.await,
            Err(StoreError::Closed | StoreError::Io { .. })
        ));
    })
    .await;
}

#[tokio::test]
async fn memory_store_is_a_store() {
    within(async {
        let s: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_millis(100)));
        let getter = {
            let s = s.clone();
            tokio::spawn(async move { s.get("late").await })
        };
        s.set("late", b"v".to_vec()).await.unwrap();
        assert_eq!(getter.await.unwrap().unwrap(), b"v");
        assert!(matches!(
            s.get("never").await,
            Err(StoreError::Timeout { keys, .. }) if keys == ["never"]
        ));
        assert_eq!(s.add("c", 3).await.unwrap(), 3);
        assert_eq!(
            s.compare_set("c", Some(b"3".to_vec()), b"4".to_vec())
                .await
                .unwrap(),
            b"4"
        );
        assert!(s.delete("c").await.unwrap());
        assert!(!s.check(&keys(&["c"])).await.unwrap());
        let p = PrefixStore::new("p", s.clone());
        p.set("k", vec![]).await.unwrap();
        assert!(s.check(&keys(&["p/k"])).await.unwrap());
    })
    .await;
}
