//! The store server's bounds (quota, idle connections) and the client's
//! timeouts, against servers on 127.0.0.1.
#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use ferry_store::{QuotaBound, Store, StoreError, StoreLimits, TcpStore, TcpStoreServer};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;

/// Generous bound on every test: a hang fails instead of stalling CI.
const LIMIT: Duration = Duration::from_secs(60);
const TIMEOUT: Duration = Duration::from_secs(30);

async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, f)
        .await
        .expect("the test took too long")
}

fn small() -> StoreLimits {
    StoreLimits {
        max_key_bytes: 16,
        max_value_bytes: 1000,
        max_keys_per_connection: 3,
        max_bytes_per_connection: 2000,
        max_waits_per_connection: 2,
        max_total_keys: 5,
        max_total_bytes: 3000,
        first_request_timeout: Duration::from_secs(30),
    }
}

async fn server(limits: StoreLimits) -> TcpStoreServer {
    TcpStoreServer::bind_with(SocketAddr::from(([127, 0, 0, 1], 0)), limits)
        .await
        .unwrap()
}

async fn client(server: &TcpStoreServer) -> TcpStore {
    TcpStore::connect(server.local_addr(), TIMEOUT)
        .await
        .unwrap()
}

/// Asserts `r` is a quota refusal of `bound` for `key` with `limit`.
#[track_caller]
fn refused<T: std::fmt::Debug>(r: Result<T, StoreError>, bound: QuotaBound, key: &str, limit: u64) {
    match r {
        Err(e @ StoreError::Quota { .. }) => {
            let message = e.to_string();
            let StoreError::Quota {
                bound: b,
                key: k,
                limit: l,
                ..
            } = e
            else {
                unreachable!()
            };
            assert_eq!((b, k.as_str(), l), (bound, key, limit));
            assert!(message.contains(&bound.to_string()), "{message}");
        }
        other => panic!("expected a {bound} refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn key_and_value_sizes_are_bounded() {
    within(async {
        let server = server(small()).await;
        let c = client(&server).await;
        let long = "k".repeat(17);
        refused(c.set(&long, vec![]).await, QuotaBound::KeyBytes, &long, 16);
        refused(
            c.set("v", vec![0; 1001]).await,
            QuotaBound::ValueBytes,
            "v",
            1000,
        );
        refused(
            c.compare_set("v", None, vec![0; 1001]).await,
            QuotaBound::ValueBytes,
            "v",
            1000,
        );
        refused(c.add(&long, 1).await, QuotaBound::KeyBytes, &long, 16);
        // At the bounds: stored.
        c.set(&"k".repeat(16), vec![0; 1000]).await.unwrap();
        assert!(!c.check(&[long]).await.unwrap());
    })
    .await;
}

#[tokio::test]
async fn a_connection_is_bounded_in_keys_bytes_and_waits() {
    within(async {
        let server = server(StoreLimits {
            max_total_keys: 100,
            max_total_bytes: 100_000,
            ..small()
        })
        .await;
        let a = client(&server).await;
        for k in ["a", "b", "c"] {
            a.set(k, vec![1]).await.unwrap();
        }
        refused(a.set("d", vec![]).await, QuotaBound::ConnectionKeys, "d", 3);
        refused(a.add("d", 1).await, QuotaBound::ConnectionKeys, "d", 3);
        // Overwriting its own keys is not a new key; deleting gives back.
        a.set("a", vec![2]).await.unwrap();
        assert!(a.delete("c").await.unwrap());
        a.set("big", vec![0; 1000]).await.unwrap();
        refused(
            a.set("b", vec![0; 1000]).await,
            QuotaBound::ConnectionBytes,
            "b",
            2000,
        );
        // Another connection has its own account.
        let b = client(&server).await;
        b.set("d", vec![0; 1000]).await.unwrap();

        // Two waits may wait; the third is refused, and a wait that ends
        // frees its place.
        let w1 = a.wait(&["x".to_string()], TIMEOUT);
        let w2 = a.get("y");
        let third = async {
            // Registered after the two: the check answers after they are
            // read by the server (requests of one connection are read in
            // order).
            a.check(&["-".to_string()]).await.unwrap();
            let r = a.wait(&["z".to_string()], TIMEOUT).await;
            refused(r, QuotaBound::ConnectionWaits, "z", 2);
            b.set("x", vec![]).await.unwrap();
            b.set("y", vec![]).await.unwrap();
        };
        let (r1, r2, ()) = tokio::join!(w1, w2, third);
        r1.unwrap();
        r2.unwrap();
        a.wait(&["x".to_string()], TIMEOUT).await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn the_store_is_bounded_in_total() {
    within(async {
        let server = server(small()).await;
        let clients = [client(&server).await, client(&server).await];
        clients[0].set("a", vec![0; 990]).await.unwrap();
        clients[0].set("b", vec![0; 990]).await.unwrap();
        clients[1].set("c", vec![0; 990]).await.unwrap();
        refused(
            clients[1].set("d", vec![0; 100]).await,
            QuotaBound::TotalBytes,
            "d",
            3000,
        );
        clients[1].set("d", vec![]).await.unwrap();
        clients[1].add("e", 1).await.unwrap();
        let third = client(&server).await;
        refused(third.set("f", vec![]).await, QuotaBound::TotalKeys, "f", 5);
        // A key taken over from another connection is not a new key.
        third.set("a", vec![]).await.unwrap();
        assert!(third.delete("e").await.unwrap());
        third.set("f", vec![]).await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn a_connection_that_sends_no_request_is_closed() {
    within(async {
        let server = server(StoreLimits {
            first_request_timeout: Duration::from_millis(200),
            ..StoreLimits::default()
        })
        .await;
        let mut idle = tokio::net::TcpStream::connect(server.local_addr())
            .await
            .unwrap();
        // The server closes it: the read ends (no sleep: it waits for that).
        let mut buf = [0u8; 1];
        assert_eq!(idle.read(&mut buf).await.unwrap(), 0);
        // A client whose first request blocks longer than that is kept.
        let c = client(&server).await;
        let waiting = c.wait(&["late".to_string()], TIMEOUT);
        let setter = async {
            let mut idle2 = tokio::net::TcpStream::connect(server.local_addr())
                .await
                .unwrap();
            // Once a second idle connection is closed, the first request
            // of `c` has outlived the timeout.
            assert_eq!(idle2.read(&mut buf).await.unwrap(), 0);
            let other = client(&server).await;
            other.set("late", vec![]).await.unwrap();
        };
        let (r, ()) = tokio::join!(waiting, setter);
        r.unwrap();
    })
    .await;
}

#[tokio::test]
async fn every_client_operation_ends_when_the_server_never_answers() {
    within(async {
        // Accepts and reads, never answers.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let silent = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut sink = Vec::new();
            let _ = stream.read_to_end(&mut sink).await;
        });
        let timeout = Duration::from_millis(200);
        let c = TcpStore::connect(addr, timeout).await.unwrap();
        let k = "rank/3".to_string();
        let results: Vec<(&str, Result<(), StoreError>)> = vec![
            ("set", c.set(&k, vec![1]).await),
            ("get", c.get(&k).await.map(drop)),
            ("wait", c.wait(std::slice::from_ref(&k), timeout).await),
            ("add", c.add(&k, 1).await.map(drop)),
            (
                "compare_set",
                c.compare_set(&k, None, vec![]).await.map(drop),
            ),
            ("delete", c.delete(&k).await.map(drop)),
            ("check", c.check(std::slice::from_ref(&k)).await.map(drop)),
        ];
        for (op, r) in results {
            match r {
                Err(e @ StoreError::NoAnswer { .. }) => {
                    let message = e.to_string();
                    let StoreError::NoAnswer {
                        operation,
                        keys,
                        after,
                    } = e
                    else {
                        unreachable!()
                    };
                    assert_eq!((operation, keys, after), (op, vec![k.clone()], timeout));
                    assert!(message.contains(op) && message.contains(&k), "{message}");
                }
                other => panic!("{op}: expected NoAnswer, got {other:?}"),
            }
        }
        silent.abort();
    })
    .await;
}
