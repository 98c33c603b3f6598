//! Connecting to a store server, retrying until it listens.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::time::Instant;
use tracing::debug;

use crate::StoreError;

/// First and largest pause between attempts to connect.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(500);
/// Least time one connection attempt gets, even at the deadline.
const MIN_ATTEMPT: Duration = Duration::from_millis(100);

pub(crate) async fn connect_with_retry(
    addr: SocketAddr,
    timeout: Duration,
) -> Result<TcpStream, StoreError> {
    let start = Instant::now();
    let deadline = start.checked_add(timeout);
    let mut backoff = FIRST_BACKOFF;
    loop {
        let remaining = deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        let error = match tokio::time::timeout(remaining.max(MIN_ATTEMPT), TcpStream::connect(addr))
            .await
        {
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(e)) if retryable(&e) => e,
            Ok(Err(e)) => {
                return Err(StoreError::Io {
                    addr: addr.to_string(),
                    source: e,
                })
            }
            Err(_) => io::Error::new(io::ErrorKind::TimedOut, "connection attempt timed out"),
        };
        let now = Instant::now();
        let left = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(now));
        if left.is_zero() {
            return Err(StoreError::Io {
                addr: addr.to_string(),
                source: io::Error::new(
                    error.kind(),
                    format!("no store server reachable within {timeout:?}: {error}"),
                ),
            });
        }
        debug!(%addr, error = %error, "store server not reachable yet; retrying");
        tokio::time::sleep(backoff.min(left)).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Whether a failed connection attempt is worth repeating: nobody
/// listening yet, or the network not ready yet.
fn retryable(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused
            | ConnectionReset
            | ConnectionAborted
            | NotConnected
            | TimedOut
            | Interrupted
            | WouldBlock
            | AddrNotAvailable
            | HostUnreachable
            | NetworkUnreachable
    )
}
