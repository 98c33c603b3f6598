//! A rank's client of its replica group's manager (torchft's Python
//! `ManagerClient`).

use std::fmt;
use std::time::Duration;

use tonic::transport::Channel;
use tonic::{Code, Request, Status};

use super::server::{ERROR_KIND_KEY, LIGHTHOUSE_UNREACHABLE, RETRIES_KEY};
use crate::access::{client_endpoint, tls_failure, ClientTls, EndpointError};
use crate::grpc::error_chain;
use crate::proto::manager_service_client::ManagerServiceClient;
use crate::proto::{
    CheckpointMetadataRequest, KillRequest, ManagerQuorumRequest, ManagerQuorumResponse,
    ShouldCommitRequest,
};

/// How long [`ManagerClient::connect`] may take to connect (torchft's
/// Python `Manager` default `connect_timeout`).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);

/// How long [`ManagerClient::kill`] waits for its answer.
const KILL_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a call to the manager failed.
#[derive(Debug, thiserror::Error)]
pub enum ManagerClientError {
    /// The manager address is not a valid URI, or does not fit the TLS
    /// configuration (`https://` without a CA to trust, or the reverse).
    #[error("invalid manager address {address:?}: {source}")]
    InvalidAddress {
        /// The address given.
        address: String,
        /// Why it was refused.
        source: EndpointError,
    },
    /// The TLS handshake with the manager failed: its certificate is not
    /// signed by the CA this client trusts, does not carry the expected
    /// name, or the manager does not speak TLS.
    #[error("TLS with the manager at {address} failed: {reason}")]
    Tls {
        /// The manager's address.
        address: String,
        /// What rustls reported.
        reason: String,
    },
    /// The manager could not be reached.
    #[error("cannot connect to the manager at {address}: {reason}")]
    Connect {
        /// The manager's address.
        address: String,
        /// What went wrong (timed out, refused, ...).
        reason: String,
    },
    /// A value does not fit the wire's signed 64-bit integers.
    #[error("{what} {value} does not fit in an int64")]
    OutOfRange {
        /// Which argument.
        what: &'static str,
        /// Its value.
        value: u64,
    },
    /// No answer within the call's timeout.
    #[error("{method} to the manager at {address} timed out after {timeout:?}")]
    Timeout {
        /// The call (`quorum`, `should_commit`, ...).
        method: &'static str,
        /// The manager's address.
        address: String,
        /// The timeout it had.
        timeout: Duration,
    },
    /// The manager could not get a quorum from the lighthouse, after every
    /// retry.
    #[error("manager at {address}: lighthouse unreachable after {retries} retries: {message}")]
    LighthouseUnreachable {
        /// The manager's address.
        address: String,
        /// Retries the manager made after its first attempt.
        retries: u32,
        /// The manager's message (the last error included).
        message: String,
    },
    /// `checkpoint_metadata` for a rank that has not registered any (its
    /// metadata comes with its quorum request).
    #[error("manager at {address} has no checkpoint metadata for rank {rank}")]
    RankNotFound {
        /// The manager's address.
        address: String,
        /// The rank asked for.
        rank: u64,
    },
    /// The manager refused the request (a group rank outside the group, a
    /// vote for another step than the open round's, ...).
    #[error("manager at {address} refused {method}: {message}")]
    InvalidArgument {
        /// The call.
        method: &'static str,
        /// The manager's address.
        address: String,
        /// Why.
        message: String,
    },
    /// The manager is not there (shutting down, connection lost).
    #[error("manager at {address} unavailable for {method}: {message}")]
    Unavailable {
        /// The call.
        method: &'static str,
        /// The manager's address.
        address: String,
        /// What the transport or the manager said.
        message: String,
    },
    /// Any other error answer.
    #[error("manager at {address} answered {method} with {code:?}: {message}")]
    Rpc {
        /// The call.
        method: &'static str,
        /// The manager's address.
        address: String,
        /// The gRPC status code.
        code: Code,
        /// Its message.
        message: String,
    },
    /// The answer holds a value the protocol does not allow (a negative
    /// rank or size).
    #[error("manager at {address} answered {method} with an invalid {field}: {value}")]
    InvalidResponse {
        /// The call.
        method: &'static str,
        /// The manager's address.
        address: String,
        /// The field.
        field: &'static str,
        /// Its value.
        value: i64,
    },
}

/// What a rank asks its manager for the next quorum with: torchft's
/// `ManagerQuorumRequest`, its fields named as torchft's
/// `ManagerClient._quorum` names its arguments, ranks and counts unsigned.
///
/// ```
/// use ferry_ft::manager::QuorumRequest;
///
/// let request = QuorumRequest {
///     checkpoint_metadata: "http://10.0.0.5:29600".into(),
///     ..QuorumRequest::new(0, 42)
/// };
/// assert!(request.init_sync && !request.shrink_only);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuorumRequest {
    /// This rank's rank in its replica group.
    pub group_rank: u64,
    /// The step this rank is at.
    pub step: i64,
    /// What healing peers fetch with
    /// [`ManagerClient::checkpoint_metadata`] (the address of this rank's
    /// checkpoint server, say).
    pub checkpoint_metadata: String,
    /// Whether the quorum may only shrink (no replica group joins).
    pub shrink_only: bool,
    /// Whether a replica group behind, or new, heals before it steps
    /// (torchft's `init_sync`).
    pub init_sync: bool,
    /// This rank's consecutive commit failures so far.
    pub commit_failures: u64,
}

impl QuorumRequest {
    /// Rank `group_rank`'s request at `step` with torchft's defaults: no
    /// checkpoint metadata, not shrink-only, `init_sync`, no commit
    /// failures.
    pub fn new(group_rank: u64, step: i64) -> Self {
        Self {
            group_rank,
            step,
            checkpoint_metadata: String::new(),
            shrink_only: false,
            init_sync: true,
            commit_failures: 0,
        }
    }
}

/// What a rank learns from a quorum: [`ManagerQuorumResponse`] with typed
/// fields (ranks and sizes unsigned, absent values `None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuorumResult {
    /// The quorum's id; it changes whenever the process groups must be
    /// reconfigured.
    pub quorum_id: i64,
    /// This replica group's rank in the quorum (replica groups sorted by
    /// id).
    pub replica_rank: u64,
    /// Replica groups in the quorum, behind ones included.
    pub replica_world_size: u64,
    /// The manager to heal from, when healing.
    pub recover_src_manager_address: Option<String>,
    /// The replica rank to heal from, when healing.
    pub recover_src_replica_rank: Option<u64>,
    /// The replica ranks that heal from this one.
    pub recover_dst_replica_ranks: Vec<u64>,
    /// The store of the primary replica for this group rank.
    pub store_address: String,
    /// The highest step in the quorum.
    pub max_step: i64,
    /// This replica group's rank among those at `max_step`, if it is one.
    pub max_replica_rank: Option<u64>,
    /// Replica groups at `max_step`.
    pub max_world_size: u64,
    /// Whether this replica group must fetch the state before stepping.
    pub heal: bool,
    /// The highest consecutive commit failures reported in the quorum.
    pub commit_failures: u64,
    /// Replica ids of the quorum, in replica-rank order.
    pub replica_ids: Vec<String>,
}

/// A field of a [`ManagerQuorumResponse`] that must not be negative.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NegativeField {
    /// The field's name.
    pub field: &'static str,
    /// Its value.
    pub value: i64,
}

impl fmt::Display for NegativeField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} is negative: {}", self.field, self.value)
    }
}

impl std::error::Error for NegativeField {}

fn unsigned(field: &'static str, value: i64) -> Result<u64, NegativeField> {
    u64::try_from(value).map_err(|_| NegativeField { field, value })
}

impl TryFrom<ManagerQuorumResponse> for QuorumResult {
    type Error = NegativeField;

    fn try_from(r: ManagerQuorumResponse) -> Result<Self, NegativeField> {
        Ok(Self {
            quorum_id: r.quorum_id,
            replica_rank: unsigned("replica_rank", r.replica_rank)?,
            replica_world_size: unsigned("replica_world_size", r.replica_world_size)?,
            recover_src_manager_address: Some(r.recover_src_manager_address)
                .filter(|address| !address.is_empty()),
            recover_src_replica_rank: r
                .recover_src_replica_rank
                .map(|rank| unsigned("recover_src_replica_rank", rank))
                .transpose()?,
            recover_dst_replica_ranks: r
                .recover_dst_replica_ranks
                .into_iter()
                .map(|rank| unsigned("recover_dst_replica_ranks", rank))
                .collect::<Result<_, _>>()?,
            store_address: r.store_address,
            max_step: r.max_step,
            max_replica_rank: r
                .max_replica_rank
                .map(|rank| unsigned("max_replica_rank", rank))
                .transpose()?,
            max_world_size: unsigned("max_world_size", r.max_world_size)?,
            heal: r.heal,
            commit_failures: unsigned("commit_failures", r.commit_failures)?,
            replica_ids: r.replica_ids,
        })
    }
}

/// A rank's connection to its replica group's manager.
///
/// Cheap to clone; calls may run concurrently. Every call but
/// [`kill`](Self::kill) takes its own timeout, sent as the gRPC deadline
/// (the manager refuses quorum requests without one).
///
/// ```no_run
/// use std::time::Duration;
/// use ferry_ft::manager::{ManagerClient, QuorumRequest};
///
/// # async fn run() -> Result<(), ferry_ft::manager::ManagerClientError> {
/// let client = ManagerClient::connect("http://replica_a:29512").await?;
/// let timeout = Duration::from_secs(60);
/// let quorum = client.quorum(QuorumRequest::new(0, 42), timeout).await?;
/// if quorum.heal {
///     // fetch the state from quorum.recover_src_manager_address ...
/// }
/// let commit = client.should_commit(0, 42, true, timeout).await?;
/// # let _ = commit; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct ManagerClient {
    address: String,
    client: ManagerServiceClient<Channel>,
}

impl ManagerClient {
    /// Connects to the manager at `address` (`http://host:port` or
    /// `host:port`) within [`DEFAULT_CONNECT_TIMEOUT`].
    pub async fn connect(address: impl Into<String>) -> Result<Self, ManagerClientError> {
        Self::connect_with_timeout(address, DEFAULT_CONNECT_TIMEOUT).await
    }

    /// Connects to the manager at `address` within `connect_timeout`.
    pub async fn connect_with_timeout(
        address: impl Into<String>,
        connect_timeout: Duration,
    ) -> Result<Self, ManagerClientError> {
        Self::connect_with(address, connect_timeout, None).await
    }

    /// Connects to the manager at `address` within `connect_timeout`, over
    /// TLS trusting `tls` when given (`https://host:port` or `host:port`),
    /// in plain text otherwise (`http://host:port` or `host:port`).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use ferry_ft::access::ClientTls;
    /// use ferry_ft::manager::ManagerClient;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let tls = ClientTls::from_file("ca.pem".as_ref())?.with_domain("replica-a.internal");
    /// let timeout = Duration::from_secs(10);
    /// let client = ManagerClient::connect_with("https://10.0.0.5:29512", timeout, Some(&tls)).await?;
    /// # let _ = client; Ok(()) }
    /// ```
    pub async fn connect_with(
        address: impl Into<String>,
        connect_timeout: Duration,
        tls: Option<&ClientTls>,
    ) -> Result<Self, ManagerClientError> {
        let address = address.into();
        let (endpoint, address) = client_endpoint(&address, tls).map_err(|source| {
            ManagerClientError::InvalidAddress {
                address: address.clone(),
                source,
            }
        })?;
        let endpoint = endpoint.connect_timeout(connect_timeout).tcp_nodelay(true);
        let channel = match tokio::time::timeout(connect_timeout, endpoint.connect()).await {
            Ok(Ok(channel)) => channel,
            Ok(Err(error)) => {
                return Err(match tls_failure(&error) {
                    Some(reason) => ManagerClientError::Tls { address, reason },
                    None => ManagerClientError::Connect {
                        address,
                        reason: error_chain(&error),
                    },
                })
            }
            Err(_) => {
                return Err(ManagerClientError::Connect {
                    address,
                    reason: format!("timed out after {connect_timeout:?}"),
                })
            }
        };
        Ok(Self {
            address,
            client: ManagerServiceClient::new(channel),
        })
    }

    /// The manager's address.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Asks for the next quorum as rank `request.group_rank` of the
    /// replica group at `request.step`, registering
    /// `request.checkpoint_metadata` (what healing peers fetch with
    /// [`checkpoint_metadata`](Self::checkpoint_metadata)), within
    /// `timeout`. Returns once every rank of the group has asked and the
    /// lighthouse has formed the quorum.
    pub async fn quorum(
        &self,
        request: QuorumRequest,
        timeout: Duration,
    ) -> Result<QuorumResult, ManagerClientError> {
        const METHOD: &str = "quorum";
        let QuorumRequest {
            group_rank,
            step,
            checkpoint_metadata,
            shrink_only,
            init_sync,
            commit_failures,
        } = request;
        let request = ManagerQuorumRequest {
            group_rank: signed("group_rank", group_rank)?,
            step,
            checkpoint_metadata,
            shrink_only,
            init_sync,
            commit_failures: signed("commit_failures", commit_failures)?,
        };
        let mut client = self.client.clone();
        let response = self
            .call(
                METHOD,
                timeout,
                client.quorum(with_timeout(request, timeout)),
            )
            .await?;
        QuorumResult::try_from(response).map_err(|bad| ManagerClientError::InvalidResponse {
            method: METHOD,
            address: self.address.clone(),
            field: bad.field,
            value: bad.value,
        })
    }

    /// The checkpoint metadata rank `rank` registered with its last quorum
    /// request.
    pub async fn checkpoint_metadata(
        &self,
        rank: u64,
        timeout: Duration,
    ) -> Result<String, ManagerClientError> {
        let request = CheckpointMetadataRequest {
            rank: signed("rank", rank)?,
        };
        let mut client = self.client.clone();
        let result = self
            .call(
                "checkpoint_metadata",
                timeout,
                client.checkpoint_metadata(with_timeout(request, timeout)),
            )
            .await;
        match result {
            Ok(response) => Ok(response.checkpoint_metadata),
            Err(ManagerClientError::InvalidArgument { message, .. })
                if message == "rank not found" =>
            {
                Err(ManagerClientError::RankNotFound {
                    address: self.address.clone(),
                    rank,
                })
            }
            Err(error) => Err(error),
        }
    }

    /// Votes `should_commit` for `step` as rank `group_rank`; returns the
    /// group's decision once every rank has voted: true only if none voted
    /// false.
    pub async fn should_commit(
        &self,
        group_rank: u64,
        step: i64,
        should_commit: bool,
        timeout: Duration,
    ) -> Result<bool, ManagerClientError> {
        let request = ShouldCommitRequest {
            should_commit,
            group_rank: signed("group_rank", group_rank)?,
            step,
        };
        let mut client = self.client.clone();
        let response = self
            .call(
                "should_commit",
                timeout,
                client.should_commit(with_timeout(request, timeout)),
            )
            .await?;
        Ok(response.should_commit)
    }

    /// Asks the manager to stop its replica group (torchft's manager exits
    /// its process; the answer may then never come).
    pub async fn kill(&self, msg: impl Into<String>) -> Result<(), ManagerClientError> {
        let request = KillRequest { msg: msg.into() };
        let mut client = self.client.clone();
        self.call(
            "kill",
            KILL_TIMEOUT,
            client.kill(with_timeout(request, KILL_TIMEOUT)),
        )
        .await?;
        Ok(())
    }

    /// Runs one call, bounded by `timeout` (plus a little for the answer to
    /// travel), and types its error.
    async fn call<T>(
        &self,
        method: &'static str,
        timeout: Duration,
        call: impl std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    ) -> Result<T, ManagerClientError> {
        let timed_out = || ManagerClientError::Timeout {
            method,
            address: self.address.clone(),
            timeout,
        };
        match tokio::time::timeout(timeout + Duration::from_secs(1), call).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(self.typed(method, &status).unwrap_or_else(timed_out)),
            Err(_) => Err(timed_out()),
        }
    }

    /// The typed error for `status`; `None` for a deadline that passed.
    fn typed(&self, method: &'static str, status: &Status) -> Option<ManagerClientError> {
        let address = self.address.clone();
        let message = status.message().to_owned();
        let kind = status
            .metadata()
            .get(ERROR_KIND_KEY)
            .and_then(|value| value.to_str().ok());
        if kind == Some(LIGHTHOUSE_UNREACHABLE) {
            let retries = status
                .metadata()
                .get(RETRIES_KEY)
                .and_then(|value| value.to_str().ok())
                .and_then(|value| value.parse().ok())
                .unwrap_or_default();
            return Some(ManagerClientError::LighthouseUnreachable {
                address,
                retries,
                message,
            });
        }
        Some(match status.code() {
            Code::DeadlineExceeded => return None,
            // tonic's own deadline check answers CANCELLED "Timeout expired".
            Code::Cancelled if message == "Timeout expired" => return None,
            Code::InvalidArgument => ManagerClientError::InvalidArgument {
                method,
                address,
                message,
            },
            Code::Unavailable => ManagerClientError::Unavailable {
                method,
                address,
                message,
            },
            code => ManagerClientError::Rpc {
                method,
                address,
                code,
                message,
            },
        })
    }
}

fn signed(what: &'static str, value: u64) -> Result<i64, ManagerClientError> {
    i64::try_from(value).map_err(|_| ManagerClientError::OutOfRange { what, value })
}

fn with_timeout<T>(message: T, timeout: Duration) -> Request<T> {
    let mut request = Request::new(message);
    request.set_timeout(timeout);
    request
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_convert() {
        let response = ManagerQuorumResponse {
            quorum_id: 3,
            recover_src_manager_address: "http://a:1".into(),
            recover_src_replica_rank: Some(0),
            recover_dst_replica_ranks: vec![],
            store_address: "a:2".into(),
            max_step: 10,
            max_replica_rank: None,
            max_world_size: 1,
            replica_rank: 1,
            replica_world_size: 2,
            heal: true,
            commit_failures: 0,
            replica_ids: vec!["a".into(), "b".into()],
        };
        let result = QuorumResult::try_from(response.clone()).expect("valid");
        assert_eq!(
            result.recover_src_manager_address.as_deref(),
            Some("http://a:1")
        );
        assert_eq!(
            (result.replica_rank, result.recover_src_replica_rank),
            (1, Some(0))
        );
        let not_healing = ManagerQuorumResponse {
            recover_src_manager_address: String::new(),
            ..response.clone()
        };
        assert_eq!(
            QuorumResult::try_from(not_healing)
                .expect("valid")
                .recover_src_manager_address,
            None
        );
        let bad = ManagerQuorumResponse {
            recover_dst_replica_ranks: vec![2, -1],
            ..response
        };
        assert_eq!(
            QuorumResult::try_from(bad),
            Err(NegativeField {
                field: "recover_dst_replica_ranks",
                value: -1
            })
        );
    }

    #[test]
    fn ranks_must_fit() {
        assert!(matches!(
            signed("group_rank", u64::MAX),
            Err(ManagerClientError::OutOfRange {
                what: "group_rank",
                ..
            })
        ));
        assert_eq!(signed("rank", 7).ok(), Some(7));
    }
}
