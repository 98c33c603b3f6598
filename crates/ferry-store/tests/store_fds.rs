//! The store server out of file descriptors: accepting backs off with a
//! bounded number of warnings, and serves again once descriptors free up.
//!
//! Rank 0 hosts the store with a low `RLIMIT_NOFILE`; rank 1 opens far
//! more connections than rank 0 can accept, holds them until rank 0 has
//! seen a number of failed accepts, then lets them go and is served.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

use ferry_store::{Store, StoreLimits, TcpStore, TcpStoreServer};
use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

/// Failed accepts rank 0 waits for: without back-off, each would be a
/// warning line of its own.
const FAILURES: u64 = 8;
/// Connections rank 1 opens: many more than rank 0's descriptors.
const FLOOD: usize = 64;
/// Descriptors rank 0 may open beyond those it has when it starts.
const HEADROOM: u64 = 6;
const LIMIT: Duration = Duration::from_secs(60);

fn addr() -> SocketAddr {
    let port: u16 = std::env::var("MASTER_PORT").unwrap().parse().unwrap();
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn host() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .init();
    runtime().block_on(async {
        let server = TcpStoreServer::bind_with(addr(), StoreLimits::default())
            .await
            .unwrap();
        let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
        let hard = getrlimit(Resource::Nofile).maximum;
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(open + HEADROOM),
                maximum: hard,
            },
        )
        .unwrap();
        let mut failures = server.accept_failures();
        tokio::time::timeout(LIMIT, failures.wait_for(|n| *n >= FAILURES))
            .await
            .expect("accepts fail once descriptors run out")
            .unwrap();
        println!("FAILURES={}", *failures.borrow());
        let memory = server.memory();
        memory.set("release", vec![]).await.unwrap();
        memory
            .wait(&["recovered".to_string()], LIMIT)
            .await
            .expect("rank 1 is served again");
        // Writes the answer to that `set` before closing.
        tokio::time::timeout(LIMIT, server.close()).await.unwrap();
    });
}

fn flood() {
    runtime().block_on(async {
        let client = TcpStore::connect(addr(), LIMIT).await.unwrap();
        client.check(&["-".to_string()]).await.unwrap();
        let mut held = Vec::new();
        for _ in 0..FLOOD {
            held.push(tokio::net::TcpStream::connect(addr()).await.unwrap());
        }
        client
            .wait(&["release".to_string()], LIMIT)
            .await
            .expect("rank 0 releases");
        drop(held);
        let fresh = TcpStore::connect(addr(), LIMIT).await.unwrap();
        fresh.set("probe", b"yes".to_vec()).await.unwrap();
        assert_eq!(fresh.get("probe").await.unwrap(), b"yes");
        fresh.set("recovered", vec![]).await.unwrap();
        println!("SERVED=1");
    });
}

#[test]
fn out_of_descriptors_the_store_backs_off_and_recovers() {
    let Some(outputs) = ferry_testkit::world(
        "out_of_descriptors_the_store_backs_off_and_recovers",
        2,
        |rank| {
            if rank == 0 {
                host()
            } else {
                flood()
            }
        },
    ) else {
        return;
    };
    for (rank, o) in outputs.iter().enumerate() {
        assert!(
            o.success,
            "rank {rank} failed\n--- rank 0 stdout ---\n{}\n--- rank 0 stderr ---\n{}\n--- rank 1 stderr ---\n{}",
            outputs[0].stdout,
            outputs[0].stderr,
            outputs[1].stderr
        );
    }
    let failures: u64 = outputs[0].values("FAILURES")[0].parse().unwrap();
    assert!(failures >= FAILURES);
    assert_eq!(outputs[1].values("SERVED"), ["1"]);
    let warnings = outputs[0]
        .stderr
        .lines()
        .filter(|l| l.contains("accept failed"))
        .count();
    // One warning per streak and then one per 10 s: far fewer lines than
    // failures (without back-off, every failure was a line).
    assert!(
        (1..=3).contains(&warnings),
        "{warnings} warning lines for {failures} failed accepts:\n{}",
        outputs[0].stderr
    );
}
