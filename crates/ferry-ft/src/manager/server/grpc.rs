//! `torchft.ManagerService` over the shared state.

use std::sync::Arc;

use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::{info, info_span, warn, Instrument};

use super::shared::Shared;
use crate::grpc::request_timeout;
use crate::proto::manager_service_server::ManagerService;
use crate::proto::{
    CheckpointMetadataRequest, CheckpointMetadataResponse, KillRequest, KillResponse,
    ManagerQuorumRequest, ManagerQuorumResponse, ShouldCommitRequest, ShouldCommitResponse,
};

/// `torchft.ManagerService` over the shared state.
pub(super) struct GrpcService {
    pub(super) shared: Arc<Shared>,
}

#[tonic::async_trait]
impl ManagerService for GrpcService {
    async fn quorum(
        &self,
        request: Request<ManagerQuorumRequest>,
    ) -> Result<Response<ManagerQuorumResponse>, Status> {
        let timeout = request_timeout(request.metadata()).map_err(Status::invalid_argument)?;
        let req = request.into_inner();
        let span = info_span!(
            "quorum",
            replica_id = %self.shared.info.replica_id,
            group_rank = req.group_rank,
        );
        self.shared
            .quorum(req, timeout)
            .instrument(span)
            .await
            .map(Response::new)
    }

    async fn checkpoint_metadata(
        &self,
        request: Request<CheckpointMetadataRequest>,
    ) -> Result<Response<CheckpointMetadataResponse>, Status> {
        let rank = request.into_inner().rank;
        let state = self.shared.state();
        let checkpoint_metadata = state
            .gather
            .checkpoint_metadata(rank)
            .ok_or_else(|| Status::invalid_argument("rank not found"))?
            .to_owned();
        Ok(Response::new(CheckpointMetadataResponse {
            checkpoint_metadata,
        }))
    }

    async fn should_commit(
        &self,
        request: Request<ShouldCommitRequest>,
    ) -> Result<Response<ShouldCommitResponse>, Status> {
        let req = request.into_inner();
        let span = info_span!(
            "should_commit",
            replica_id = %self.shared.info.replica_id,
            group_rank = req.group_rank,
            step = req.step,
        );
        async {
            info!(
                "should_commit request from {} should_commit={}",
                req.group_rank, req.should_commit
            );
            let mut round = {
                let mut state = self.shared.state();
                let round = state.commit_round.subscribe();
                let decision = state
                    .votes
                    .vote(req.group_rank, req.step, req.should_commit)
                    .map_err(|error| Status::invalid_argument(error.to_string()))?;
                if let Some(decision) = decision {
                    state.commit_failures = if decision {
                        0
                    } else {
                        state.commit_failures.saturating_add(1)
                    };
                    let sender = std::mem::replace(&mut state.commit_round, watch::channel(None).0);
                    sender.send_replace(Some(decision));
                }
                let voted: Vec<i64> = state.votes.voted().collect();
                let commit_failures = state.commit_failures;
                self.shared.status.send_modify(|status| {
                    status.voted_ranks = voted;
                    status.commit_decisions += u64::from(decision.is_some());
                    status.commit_failures = commit_failures;
                });
                round
            };
            let should_commit = self.shared.wait_round(&mut round, "should_commit").await?;
            Ok(Response::new(ShouldCommitResponse { should_commit }))
        }
        .instrument(span)
        .await
    }

    async fn kill(&self, request: Request<KillRequest>) -> Result<Response<KillResponse>, Status> {
        let msg = request.into_inner().msg;
        warn!(
            replica_id = %self.shared.info.replica_id,
            "got kill request: {}",
            ferry_wire::PeerText::new(&msg)
        );
        self.shared.status.send_modify(|status| status.kills += 1);
        (self.shared.opt.on_kill)(msg);
        Ok(Response::new(KillResponse {}))
    }
}
