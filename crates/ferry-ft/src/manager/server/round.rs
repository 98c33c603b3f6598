//! A quorum round's outcome and a lighthouse request's failures, with
//! torchft's retry back-off and the metadata that tags them for
//! [`ManagerClient`](crate::manager::ManagerClient).

use std::sync::Arc;
use std::time::Duration;

use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Status};

use crate::proto::Quorum;

/// The shortest pause between two lighthouse quorum attempts (torchft:
/// 100 ms).
pub(super) const MIN_RETRY_BACKOFF: Duration = Duration::from_millis(100);

/// Metadata key of a manager's error answers saying what failed, for
/// [`ManagerClient`](super::ManagerClient) to type the error.
pub(crate) const ERROR_KIND_KEY: &str = "ferry-ft-error";
/// [`ERROR_KIND_KEY`]'s value when the lighthouse could not be reached.
pub(crate) const LIGHTHOUSE_UNREACHABLE: &str = "lighthouse-unreachable";
/// Metadata key carrying how many retries were made.
pub(crate) const RETRIES_KEY: &str = "ferry-ft-retries";

/// The outcome of one quorum round, for every rank of it.
#[derive(Clone)]
pub(super) enum RoundOutcome {
    Quorum {
        quorum: Arc<Quorum>,
        init_sync: bool,
    },
    Failed(Arc<LighthouseFailure>),
}

/// The lighthouse could not be asked, after every retry.
#[derive(Debug)]
pub(super) struct LighthouseFailure {
    pub(super) lighthouse: String,
    pub(super) retries: u32,
    pub(super) error: String,
}

impl LighthouseFailure {
    pub(super) fn to_status(&self) -> Status {
        let mut metadata = MetadataMap::new();
        metadata.insert(
            ERROR_KIND_KEY,
            MetadataValue::from_static(LIGHTHOUSE_UNREACHABLE),
        );
        metadata.insert(RETRIES_KEY, MetadataValue::from(self.retries));
        Status::with_metadata(
            Code::Unavailable,
            format!(
                "lighthouse quorum failed after {} retries (lighthouse {}): {}",
                self.retries, self.lighthouse, self.error
            ),
            metadata,
        )
    }
}

/// Why one lighthouse request failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum AttemptError {
    #[error("cannot connect to the lighthouse within {0:?}")]
    ConnectTimeout(Duration),
    #[error("cannot connect to the lighthouse: {0}")]
    Connect(String),
    #[error("TLS with the lighthouse failed: {0}")]
    Tls(String),
    #[error("no answer from the lighthouse within {0:?}")]
    Timeout(Duration),
    #[error("lighthouse answered {}: {}", .0.code(), .0.message())]
    Rpc(Box<Status>),
    #[error("lighthouse answered without a quorum")]
    MissingQuorum,
}

impl AttemptError {
    /// A deadline passed (torchft retries those after 100 ms).
    fn is_timeout(&self) -> bool {
        match self {
            Self::Timeout(_) => true,
            Self::Rpc(status) => {
                status.code() == Code::DeadlineExceeded
                    || (status.code() == Code::Cancelled && status.message() == "Timeout expired")
            }
            _ => false,
        }
    }
}

/// The pause after a failed lighthouse request (torchft's): 100 ms after a
/// timeout, else the deadline spread over the attempts, at least 100 ms.
pub(super) fn retry_backoff(error: &AttemptError, timeout: Duration, retries: u32) -> Duration {
    if error.is_timeout() {
        return MIN_RETRY_BACKOFF;
    }
    (timeout / retries.saturating_add(1)).max(MIN_RETRY_BACKOFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_torchfts() {
        let timeout = Duration::from_secs(10);
        let refused = AttemptError::Connect("refused".into());
        assert_eq!(retry_backoff(&refused, timeout, 0), Duration::from_secs(10));
        assert_eq!(retry_backoff(&refused, timeout, 4), Duration::from_secs(2));
        assert_eq!(
            retry_backoff(&refused, Duration::from_millis(300), 9),
            MIN_RETRY_BACKOFF
        );
        assert_eq!(
            retry_backoff(&AttemptError::Timeout(timeout), timeout, 1),
            MIN_RETRY_BACKOFF
        );
        let expired = AttemptError::Rpc(Box::new(Status::cancelled("Timeout expired")));
        assert_eq!(retry_backoff(&expired, timeout, 1), MIN_RETRY_BACKOFF);
    }

    #[test]
    fn lighthouse_failures_are_tagged() {
        let status = LighthouseFailure {
            lighthouse: "http://lh:1".into(),
            retries: 3,
            error: "refused".into(),
        }
        .to_status();
        assert_eq!(status.code(), Code::Unavailable);
        assert!(
            status.message().contains("after 3 retries") && status.message().contains("refused"),
            "{}",
            status.message()
        );
        assert_eq!(
            status
                .metadata()
                .get(ERROR_KIND_KEY)
                .and_then(|v| v.to_str().ok()),
            Some(LIGHTHOUSE_UNREACHABLE)
        );
        assert_eq!(
            status
                .metadata()
                .get(RETRIES_KEY)
                .and_then(|v| v.to_str().ok()),
            Some("3")
        );
    }
}
