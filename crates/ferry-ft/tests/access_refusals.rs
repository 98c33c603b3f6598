//! How much a lighthouse says about the clients its allow-list refuses: a
//! flood of connections from outside the allowed networks is logged in a
//! few lines whose `refusals=` count them all, not one line each. (The
//! only test of this binary: the subscriber capturing the lines is this
//! test thread's default, and tracing caches whether a log statement is
//! enabled when another thread's test hits it first.)
#![allow(clippy::unwrap_used)]

use std::io::{self, Write};
use std::sync::{Arc, Mutex};

use ferry_ft::access::{Access, AllowList};
use ferry_ft::lighthouse::{Lighthouse, LighthouseOptions};
use ferry_transport::accept::REFUSAL_WARN_EVERY;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

const MESSAGE: &str = "refused a client outside the allowed networks";

/// A buffer the test's log lines are written to.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl Write for Log {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The `refusals=N` field of a log line.
fn refusals(line: &str) -> u64 {
    let at = line.find("refusals=").unwrap() + "refusals=".len();
    let digits: String = line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().unwrap()
}

/// Reads until the server closed the connection: an end of stream, or a
/// reset.
async fn closed_by_server(stream: &mut TcpStream) {
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest).await {
        Ok(_) => assert!(rest.is_empty(), "the lighthouse answered"),
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("{e}"),
    }
}

/// 2,000 connections from 127.0.0.1 to a lighthouse that allows only
/// 10.0.0.0/8, one after the other, each closed unread: the lighthouse
/// warns about the first at once and summarizes the others (here when it
/// shuts down, unless 10 s passed), in at most 3 lines whose counts add up
/// to 2,000. The lighthouse runs on this test's one thread, where the
/// capturing subscriber is the default.
#[tokio::test]
async fn a_flood_of_clients_outside_the_allow_list_is_logged_in_a_few_lines() {
    const CLIENTS: u64 = 2_000;
    let log = Log::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);

    let elsewhere: AllowList = "10.0.0.0/8".parse().unwrap();
    let lighthouse = Lighthouse::bind(
        "127.0.0.1:0",
        LighthouseOptions::new(1).with_access(Access::default().with_allow(elsewhere)),
    )
    .await
    .unwrap();
    let addr = lighthouse.local_addr();
    for _ in 0..CLIENTS {
        let mut client = TcpStream::connect(addr).await.unwrap();
        closed_by_server(&mut client).await;
    }
    // The refusals not written yet are summarized as the listener goes.
    lighthouse.shutdown().await.unwrap();

    let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains(MESSAGE)).collect();
    assert!(
        (1..=3).contains(&lines.len()),
        "{} lines for {CLIENTS} refusals (one per {REFUSAL_WARN_EVERY:?} at most):\n{text}",
        lines.len()
    );
    assert_eq!(
        lines.iter().map(|l| refusals(l)).sum::<u64>(),
        CLIENTS,
        "{text}"
    );
    assert_eq!(refusals(lines[0]), 1, "{text}");
    assert!(lines[0].contains("peer=127.0.0.1:"), "{text}");
    assert!(lines[0].contains("lighthouse"), "{text}");
    // Nothing else was logged per connection.
    assert_eq!(text.lines().count(), lines.len(), "{text}");
}
