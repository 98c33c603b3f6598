//! How much an authenticated store says about the clients it refuses: a
//! flood of them is logged in a few lines that count them all, not one
//! line each. (The only test of this binary: the subscriber capturing the
//! lines is this test thread's default, and tracing caches whether a log
//! statement is enabled when another thread's test hits it first.)
#![allow(clippy::unwrap_used)]

use std::io::{self, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_store::{StoreLimits, TcpStoreServer};
use ferry_transport::accept::REFUSAL_WARN_EVERY;
use ferry_transport::auth::{self, Secret};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// c10d's first query: `VALIDATE` (query type 0) and its magic, 5 bytes,
/// fewer than a handshake header.
const VALIDATE: [u8; 5] = [0x00, 0xCE, 0xF7, 0x85, 0x3C];

fn secret(s: &str) -> Secret {
    Secret::new(format!("secret-of-the-group-{s}").into_bytes()).unwrap()
}

async fn server() -> TcpStoreServer {
    TcpStoreServer::bind_authenticated(
        "127.0.0.1:0".parse().unwrap(),
        StoreLimits::default(),
        Some(secret("a")),
    )
    .await
    .unwrap()
}

/// Reads until the server closed the connection: an end of stream, or a
/// reset (the server closes without reading what the client sent).
async fn closed_by_server(stream: &mut TcpStream) {
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("{e}"),
    }
}

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

/// 2,000 clients refused one after the other (c10d's `VALIDATE`, and some
/// with another secret): the store warns about the first at once and
/// summarizes the others (here when it closes, unless 10 s passed), in a
/// few lines whose counts add up to every refusal. The server runs on this
/// test's one thread, where the capturing subscriber is the default.
#[tokio::test]
async fn a_flood_of_refused_clients_is_logged_in_a_few_lines_counting_them_all() {
    const CLIENTS: u64 = 2_000;
    const WRONG_SECRET: u64 = 20;
    let log = Log::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);

    let server = server().await;
    let addr = server.local_addr();
    let wrong = secret("b");
    for i in 0..CLIENTS {
        let mut client = TcpStream::connect(addr).await.unwrap();
        if i < WRONG_SECRET {
            // The server's proof does not check out: the client hangs up.
            let e = auth::connect(&mut client, wrong.key(), Duration::from_secs(60)).await;
            assert!(e.is_err(), "another secret got in");
        } else {
            client.write_all(&VALIDATE).await.unwrap();
            closed_by_server(&mut client).await;
        }
    }
    // Closing waits for every connection; the refusals not written yet
    // are summarized as the server goes.
    server.close().await;

    let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("refused a store client that failed authentication"))
        .collect();
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
    assert!(lines[0].contains("peer=127.0.0.1:"), "{text}");
    assert_eq!(refusals(lines[0]), 1, "{text}");
    let last = lines.last().unwrap();
    assert!(last.contains("not an authentication handshake"), "{text}");
    // Nothing else was logged per connection.
    assert_eq!(text.lines().count(), lines.len(), "{text}");
}
