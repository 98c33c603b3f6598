//! How much an `mpt` lane listener says about the lanes it refuses: 200
//! lanes with a wrong key against one accept are logged in a few lines
//! whose `refusals=` count them all, not one line each. (The only test of
//! this binary: see `refusal_log`.)
#![allow(clippy::unwrap_used)]

mod refusal_log;

use std::io;
use std::time::Duration;

use ferry_transport::accept::REFUSAL_WARN_EVERY;
use ferry_transport::auth::{self, Secret, AUTH_TIMEOUT};
use ferry_transport::mpt::{connect_lanes_authenticated, LaneListener};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MESSAGE: &str = "mpt: refused a lane that failed authentication";

fn secret(s: &str) -> Secret {
    Secret::new(format!("secret-of-the-connection-{s}").into_bytes()).unwrap()
}

/// Reads until the listener closed the connection: an end of stream, or a
/// reset.
async fn closed_by_listener(stream: &mut TcpStream) {
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("{e}"),
    }
}

/// 200 lanes that fail authentication (another key), one after the other,
/// each refused before the next connects, then the peer's lane: the accept
/// gets the peer's lane, and the listener warns about the first refusal at
/// once and summarizes the others (here when it is dropped, unless 10 s
/// passed), in at most 3 lines whose counts add up to 200.
#[tokio::test]
async fn two_hundred_lanes_with_a_wrong_key_give_a_few_lines_counting_them_all() {
    const OUTSIDERS: u64 = 200;
    let (log, _default) = refusal_log::capture();
    let listener = LaneListener::bind("127.0.0.1".parse().unwrap())
        .await
        .unwrap();
    let addr = listener.local_addr();
    let key = secret("session").key().clone();
    let wrong = secret("outsider").key().clone();
    let bound = Duration::from_secs(120);
    let accepting = listener.accept_authenticated(7, 1, bound, Some(&key));
    let connecting = async {
        for _ in 0..OUTSIDERS {
            let mut lane = TcpStream::connect(addr).await.unwrap();
            let proved = auth::connect(&mut lane, &wrong, AUTH_TIMEOUT).await;
            assert!(proved.is_err(), "a lane with another key got in");
            // Once the listener closes it, the refusal is counted.
            let _ = lane.shutdown().await;
            closed_by_listener(&mut lane).await;
        }
        connect_lanes_authenticated(addr, 7, 1, bound, Some(key.clone())).await
    };
    let (accepted, connected) = tokio::join!(accepting, connecting);
    assert_eq!(accepted.unwrap().len(), 1);
    assert_eq!(connected.unwrap().len(), 1);
    // The refusals not written yet are summarized as the listener goes.
    drop(listener);

    let text = log.text();
    let lines = log.lines_with(MESSAGE);
    assert!(
        (1..=3).contains(&lines.len()),
        "{} lines for {OUTSIDERS} refusals (one per {REFUSAL_WARN_EVERY:?} at most):\n{text}",
        lines.len()
    );
    assert_eq!(refusal_log::total(&lines), OUTSIDERS, "{text}");
    assert_eq!(refusal_log::refusals(&lines[0]), 1, "{text}");
    assert!(lines[0].contains("peer=127.0.0.1:"), "{text}");
    assert!(lines[0].contains("server=mpt lane listener"), "{text}");
    // Nothing else was logged per lane.
    assert_eq!(log.lines().len(), lines.len(), "{text}");
}
