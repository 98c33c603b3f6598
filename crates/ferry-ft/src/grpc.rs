//! gRPC helpers shared by the lighthouse and the manager: the deadline check
//! torchft's servers apply to quorum requests, error chains for messages,
//! and the end of a server's graceful shutdown (client endpoints from
//! torchft-style addresses are `access::client_endpoint`).

use std::fmt;
use std::time::Duration;

use tokio::task::{JoinError, JoinHandle};
use tonic::metadata::MetadataMap;
use tracing::warn;

/// How long a server's `shutdown` waits for open connections to finish.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The end of a graceful shutdown: waits up to [`SHUTDOWN_GRACE`] for
/// `serve`, a server task already told to stop, then aborts it (an abort
/// counts as a clean stop). The task's outcome: the server's result, or
/// how the task failed. `server` names it in the log.
pub(crate) async fn finish_serving(
    mut serve: JoinHandle<Result<(), tonic::transport::Error>>,
    server: &dyn fmt::Display,
) -> Result<Result<(), tonic::transport::Error>, JoinError> {
    if let Ok(result) = tokio::time::timeout(SHUTDOWN_GRACE, &mut serve).await {
        return result;
    }
    warn!(%server, "connections still open after {SHUTDOWN_GRACE:?}; closing the server");
    serve.abort();
    match serve.await {
        Err(join) if join.is_cancelled() => Ok(Ok(())),
        other => other,
    }
}

/// The request's gRPC deadline; torchft refuses quorum requests without
/// one, since they may wait a long time. The error is the message of the
/// `INVALID_ARGUMENT` answer (`"missing timeout"`, as torchft words it).
pub(crate) fn request_timeout(metadata: &MetadataMap) -> Result<Duration, String> {
    let value = metadata
        .get("grpc-timeout")
        .ok_or_else(|| "missing timeout".to_owned())?;
    let text = value
        .to_str()
        .map_err(|_| "invalid timeout: not ASCII".to_owned())?;
    parse_grpc_timeout(text).ok_or_else(|| format!("invalid timeout {text}"))
}

/// Parses a `grpc-timeout` value: 1 to 8 digits and a unit (`H`, `M`, `S`,
/// `m`, `u`, `n`), as the gRPC HTTP/2 protocol spells it.
pub(crate) fn parse_grpc_timeout(text: &str) -> Option<Duration> {
    let unit = *text.as_bytes().last()?;
    let digits = text.get(..text.len() - 1)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let value: u64 = digits.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(value * 60 * 60),
        b'M' => Duration::from_secs(value * 60),
        b'S' => Duration::from_secs(value),
        b'm' => Duration::from_millis(value),
        b'u' => Duration::from_micros(value),
        b'n' => Duration::from_nanos(value),
        _ => return None,
    })
}

/// An error and its sources, joined with ": " (a source whose text is
/// already there is skipped).
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts() {
        assert_eq!(parse_grpc_timeout("10S"), Some(Duration::from_secs(10)));
        assert_eq!(parse_grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_grpc_timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(
            parse_grpc_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        for bad in ["", "S", "10", "10s", "123456789S", "-1S", "1.5S", "1 S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn error_chains_skip_repeats() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(error_chain(&io), "refused");
    }
}
