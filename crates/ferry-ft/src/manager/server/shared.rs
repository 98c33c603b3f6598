//! What the gRPC service, the round tasks and the heartbeat share: the
//! state behind one lock, the quorum and lighthouse rounds, the heartbeat.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};
use tracing::{debug, error, info, info_span, warn, Instrument};

use super::options::ManagerOptions;
use super::round::{retry_backoff, AttemptError, LighthouseFailure, RoundOutcome};
use super::status::ManagerStatus;
use crate::access::tls_failure;
use crate::grpc::error_chain;
use crate::manager::{compute_quorum_results, ManagerInfo, QuorumGather, ShouldCommitVotes};
use crate::proto::lighthouse_service_client::LighthouseServiceClient;
use crate::proto::{
    LighthouseHeartbeatRequest, LighthouseQuorumRequest, ManagerQuorumRequest,
    ManagerQuorumResponse, Quorum,
};
use crate::FtError;

/// The manager's mutable state, behind one lock (never held across an
/// await).
pub(super) struct State {
    pub(super) gather: QuorumGather,
    /// The open quorum round; replaced when it starts.
    pub(super) quorum_round: watch::Sender<Option<RoundOutcome>>,
    /// The task asking the lighthouse for the last round started.
    pub(super) round_task: Option<tokio::task::AbortHandle>,
    pub(super) votes: ShouldCommitVotes,
    /// The open should-commit round; replaced when it is decided.
    pub(super) commit_round: watch::Sender<Option<bool>>,
    /// Consecutive failed commits (torchft's Python `Manager` counts them).
    pub(super) commit_failures: i64,
}

/// What the gRPC service, the round tasks and the heartbeat share.
pub(super) struct Shared {
    pub(super) info: ManagerInfo,
    pub(super) opt: ManagerOptions,
    pub(super) lighthouse: Endpoint,
    /// The lighthouse connection, dropped after every failure so the next
    /// request reconnects.
    pub(super) lighthouse_client: Mutex<Option<LighthouseServiceClient<Channel>>>,
    pub(super) state: Mutex<State>,
    pub(super) status: watch::Sender<ManagerStatus>,
    pub(super) shutdown: watch::Receiver<bool>,
}

/// `mutex`'s guard; what it guards stays consistent across a panic
/// elsewhere, so keep going.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The value of `round` once it has one; `None` when the round was dropped
/// undecided.
async fn round_value<T: Clone>(round: &mut watch::Receiver<Option<T>>) -> Option<T> {
    let decided = round.wait_for(Option::is_some).await.map(|v| v.clone());
    decided.ok().flatten()
}

impl Shared {
    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Waits for the round's outcome, or shutdown.
    pub(super) async fn wait_round<T: Clone>(
        &self,
        round: &mut watch::Receiver<Option<T>>,
        what: &str,
    ) -> Result<T, Status> {
        let mut shutdown = self.shutdown.clone();
        tokio::select! {
            value = round_value(round) => value.ok_or_else(|| {
                Status::aborted(format!("{what} round abandoned; ask again"))
            }),
            _ = shutdown.wait_for(|stop| *stop) => {
                Err(Status::unavailable("manager is shutting down"))
            }
        }
    }

    /// Rank `req.group_rank` asks for the next quorum.
    pub(super) async fn quorum(
        self: &Arc<Self>,
        req: ManagerQuorumRequest,
        timeout: Duration,
    ) -> Result<ManagerQuorumResponse, Status> {
        let group_rank = req.group_rank;
        info!(
            step = req.step,
            timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            "Start quorum for group_rank {group_rank}"
        );
        let mut round = {
            let mut state = self.state();
            let gathered = state
                .gather
                .join(&req)
                .map_err(|error| Status::invalid_argument(error.to_string()))?;
            let round = state.quorum_round.subscribe();
            let started = gathered.is_some();
            if let Some(gathered) = gathered {
                let sender = std::mem::replace(&mut state.quorum_round, watch::channel(None).0);
                if let Some(step) = state.votes.step() {
                    // Every rank moved on to the next quorum: the open vote
                    // can no longer complete. Its waiters are told so.
                    warn!(step, "dropping the unfinished should_commit round");
                    state.votes.reset();
                    state.commit_round = watch::channel(None).0;
                }
                let mut request = gathered.request;
                if let Some(member) = request.requester.as_mut() {
                    member.data.clone_from(&self.opt.data);
                    member.commit_failures = member.commit_failures.max(state.commit_failures);
                }
                let span = info_span!(
                    "quorum_round",
                    replica_id = %self.info.replica_id,
                    step = request.requester.as_ref().map_or(0, |m| m.step),
                );
                let shared = Arc::clone(self);
                let task = tokio::spawn(
                    async move {
                        shared
                            .run_round(request, gathered.init_sync, timeout, sender)
                            .await;
                    }
                    .instrument(span),
                );
                // Every rank has left the previous round (each asks again
                // only once its last request ended): if it is still asking
                // the lighthouse (retrying past the ranks' deadlines), it
                // can serve nobody.
                if let Some(previous) = state.round_task.replace(task.abort_handle()) {
                    previous.abort();
                }
            }
            let waiting: Vec<i64> = state.gather.waiting().collect();
            let voted: Vec<i64> = state.votes.voted().collect();
            self.status.send_modify(|status| {
                status.waiting_ranks = waiting;
                status.voted_ranks = voted;
                status.rounds += u64::from(started);
            });
            round
        };

        match self.wait_round(&mut round, "quorum").await? {
            RoundOutcome::Quorum { quorum, init_sync } => {
                let reply =
                    compute_quorum_results(&self.info.replica_id, group_rank, &quorum, init_sync)
                        .map_err(|error| match error {
                        FtError::NotInQuorum { .. } => Status::not_found(error.to_string()),
                        other => Status::invalid_argument(other.to_string()),
                    })?;
                info!(
                    quorum_id = reply.quorum_id,
                    heal = reply.heal,
                    "Finished quorum for group_rank {group_rank}"
                );
                Ok(reply)
            }
            RoundOutcome::Failed(failure) => Err(failure.to_status()),
        }
    }

    /// Asks the lighthouse for the round's quorum and hands the outcome to
    /// the round's ranks. On shutdown the round is dropped undecided (the
    /// ranks see the shutdown themselves).
    async fn run_round(
        &self,
        request: LighthouseQuorumRequest,
        init_sync: bool,
        timeout: Duration,
        round: watch::Sender<Option<RoundOutcome>>,
    ) {
        info!("All workers joined - starting quorum");
        let mut shutdown = self.shutdown.clone();
        let outcome = tokio::select! {
            result = self.lighthouse_quorum(&request, timeout) => result,
            _ = shutdown.wait_for(|stop| *stop) => return,
        };
        let outcome = match outcome {
            Ok(quorum) => {
                let quorum_id = quorum.quorum_id;
                self.status.send_modify(|status| {
                    status.quorums += 1;
                    status.quorum_id = Some(quorum_id);
                });
                RoundOutcome::Quorum {
                    quorum: Arc::new(quorum),
                    init_sync,
                }
            }
            Err(failure) => {
                error!(
                    retries = failure.retries,
                    "lighthouse quorum failed after {} retries: {}", failure.retries, failure.error
                );
                self.status.send_modify(|status| status.failed_rounds += 1);
                RoundOutcome::Failed(Arc::new(failure))
            }
        };
        round.send_replace(Some(outcome));
    }

    /// The lighthouse quorum request with torchft's retries: after a
    /// failure, pause ([`retry_backoff`]), reconnect and try again, up to
    /// `quorum_retries` times.
    async fn lighthouse_quorum(
        &self,
        request: &LighthouseQuorumRequest,
        timeout: Duration,
    ) -> Result<Quorum, LighthouseFailure> {
        let retries = self.opt.quorum_retries;
        let mut retry = 0;
        loop {
            self.status
                .send_modify(|status| status.lighthouse_attempts += 1);
            let error = match self.lighthouse_quorum_once(request, timeout).await {
                Ok(quorum) => {
                    info!(
                        quorum_id = quorum.quorum_id,
                        participants = quorum.participants.len(),
                        "got lighthouse quorum"
                    );
                    return Ok(quorum);
                }
                Err(error) => error,
            };
            self.forget_lighthouse_client();
            let message = error.to_string();
            warn!(
                attempt = retry + 1,
                of = retries.saturating_add(1),
                "lighthouse quorum failed: {message}"
            );
            self.status.send_modify(|status| {
                status.lighthouse_failures += 1;
                status.last_lighthouse_error = Some(message.clone());
            });
            if retry >= retries {
                return Err(LighthouseFailure {
                    lighthouse: self.opt.lighthouse_addr.clone(),
                    retries,
                    error: message,
                });
            }
            tokio::time::sleep(retry_backoff(&error, timeout, retries)).await;
            retry += 1;
        }
    }

    async fn lighthouse_quorum_once(
        &self,
        request: &LighthouseQuorumRequest,
        timeout: Duration,
    ) -> Result<Quorum, AttemptError> {
        let mut client = self.lighthouse_client().await?;
        let mut call = Request::new(request.clone());
        call.set_timeout(timeout);
        let response = tokio::time::timeout(timeout, client.quorum(call))
            .await
            .map_err(|_| AttemptError::Timeout(timeout))?
            .map_err(|status| AttemptError::Rpc(Box::new(status)))?;
        response
            .into_inner()
            .quorum
            .ok_or(AttemptError::MissingQuorum)
    }

    async fn heartbeat_once(&self) -> Result<(), AttemptError> {
        let mut client = self.lighthouse_client().await?;
        let limit = self.opt.connect_timeout;
        let mut call = Request::new(LighthouseHeartbeatRequest {
            replica_id: self.info.replica_id.clone(),
        });
        call.set_timeout(limit);
        tokio::time::timeout(limit, client.heartbeat(call))
            .await
            .map_err(|_| AttemptError::Timeout(limit))?
            .map_err(|status| AttemptError::Rpc(Box::new(status)))?;
        Ok(())
    }

    /// The cached lighthouse client, or a new connection.
    async fn lighthouse_client(&self) -> Result<LighthouseServiceClient<Channel>, AttemptError> {
        if let Some(client) = lock(&self.lighthouse_client).clone() {
            return Ok(client);
        }
        let limit = self.opt.connect_timeout;
        debug!(lighthouse = %self.opt.lighthouse_addr, "connecting to the lighthouse");
        let channel = tokio::time::timeout(limit, self.lighthouse.connect())
            .await
            .map_err(|_| AttemptError::ConnectTimeout(limit))?
            .map_err(|error| match tls_failure(&error) {
                Some(reason) => AttemptError::Tls(reason),
                None => AttemptError::Connect(error_chain(&error)),
            })?;
        let client = LighthouseServiceClient::new(channel);
        *lock(&self.lighthouse_client) = Some(client.clone());
        Ok(client)
    }

    fn forget_lighthouse_client(&self) {
        lock(&self.lighthouse_client).take();
    }
}

/// Heartbeats to the lighthouse every `heartbeat_interval` until shutdown.
pub(super) async fn run_heartbeats(shared: Arc<Shared>, mut shutdown: watch::Receiver<bool>) {
    let period = shared.opt.heartbeat_interval.max(Duration::from_millis(1));
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
        let result = tokio::select! {
            result = shared.heartbeat_once() => result,
            _ = shutdown.wait_for(|stop| *stop) => return,
        };
        match result {
            Ok(()) => {
                if failing {
                    info!("heartbeats reach the lighthouse again");
                    failing = false;
                }
                shared.status.send_modify(|status| status.heartbeats += 1);
            }
            Err(error) => {
                shared.forget_lighthouse_client();
                if failing {
                    debug!("Failed to send heartbeat to lighthouse: {error}");
                } else {
                    warn!(
                        lighthouse = %shared.opt.lighthouse_addr,
                        "Failed to send heartbeat to lighthouse: {error}"
                    );
                    failing = true;
                }
                shared
                    .status
                    .send_modify(|status| status.heartbeat_failures += 1);
            }
        }
    }
}
