//! The autograd service: what workers send each other during backward and
//! clean-up, and the handler that serves it.

use std::sync::Arc;
use std::time::Duration;

use ferry_rpc::{Agent, BoxFuture, RemoteError, RpcError, Service, WorkerInfo};
use ferry_tch::Tensor;
use ferry_transport::IncomingMessage;
use ferry_wire::payload::{self, Encoded};
use ferry_wire::MessageKind;
use serde::{Deserialize, Serialize};

use crate::container::DistAutogradContainer;
use crate::engine;

/// The service kind of distributed autograd messages.
pub const AUTOGRAD_SERVICE: MessageKind = ferry_wire::kinds::AUTOGRAD;

/// The service's name (errors, logs, and the interceptor's check).
pub(crate) const SERVICE_NAME: &str = "autograd";

/// Tries of a clean-up message before giving up.
const RELEASE_TRIES: u32 = 6;
/// Timeout of one try of a clean-up message.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// A message of the autograd service.
#[derive(Serialize, Deserialize)]
pub(crate) enum AutogradMessage {
    /// The gradient of a tensor this worker sent (PyTorch's
    /// `PropagateGradientsReq`): run the send function's part of backward
    /// here and further on. Replied to once all of it finished.
    Propagate {
        context_id: u64,
        message_id: u64,
        grad: Tensor,
    },
    /// These contexts ended: release them here and pass it on.
    ReleaseContexts { context_ids: Vec<u64> },
}

/// The reply to [`AutogradMessage::Propagate`], once the part it started
/// (here and further on) has finished.
#[derive(Serialize, Deserialize)]
pub(crate) enum PropagateReply {
    /// Every part finished.
    Done,
    /// A part failed: where the error started and the workers that
    /// relayed it, this one last.
    Failed(RemoteError),
}

/// Sends a clean-up message, retrying on dead-peer and timeout errors with
/// back-off; never blocks the caller.
pub(crate) fn send_with_retries(agent: &Agent, to: u32, message: AutogradMessage) {
    let Ok(encoded) = payload::encode(&message) else {
        return;
    };
    let first = agent.call_service(to, AUTOGRAD_SERVICE, encoded, RELEASE_TIMEOUT);
    let weak = agent.downgrade();
    agent.spawn(async move {
        let mut attempt = first;
        let mut backoff = Duration::from_millis(20);
        for tries in 1..=RELEASE_TRIES {
            match attempt.await {
                Ok(_) => return,
                Err(RpcError::PeerUnreachable { .. } | RpcError::Timeout { .. })
                    if tries < RELEASE_TRIES =>
                {
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                    let Some(agent) = weak.upgrade() else { return };
                    let Ok(encoded) = payload::encode(&message) else {
                        return;
                    };
                    attempt = agent.call_service(to, AUTOGRAD_SERVICE, encoded, RELEASE_TIMEOUT);
                }
                Err(e) => {
                    tracing::warn!(to, error = %e, "distributed autograd clean-up message failed");
                    return;
                }
            }
        }
    });
}

/// Serves [`AUTOGRAD_SERVICE`].
pub(crate) struct AutogradService(pub(crate) Arc<DistAutogradContainer>);

impl Service for AutogradService {
    fn name(&self) -> &str {
        SERVICE_NAME
    }

    fn started(&self, agent: &Agent) {
        self.0.started(agent);
    }

    fn after_join(&self) -> BoxFuture<()> {
        // Releases still waiting for a message to ride on leave now; the
        // second termination round waits for them.
        self.0.flush_releases();
        Box::pin(async {})
    }

    fn handle(
        &self,
        from: WorkerInfo,
        message: IncomingMessage,
    ) -> BoxFuture<Result<Encoded, String>> {
        let container = self.0.clone();
        Box::pin(async move {
            let msg: AutogradMessage = payload::decode(&message.payload, message.tensors)
                .map_err(|e| format!("malformed autograd message: {e}"))?;
            match msg {
                AutogradMessage::Propagate {
                    context_id,
                    message_id,
                    grad,
                } => {
                    let outcome = engine::on_propagate(
                        container.clone(),
                        context_id,
                        message_id,
                        grad.into_inner(),
                    )
                    .await;
                    let reply = match outcome {
                        Ok(()) => PropagateReply::Done,
                        Err(e) => PropagateReply::Failed(e.into_remote(&container.worker_name())),
                    };
                    payload::encode(&reply).map_err(|e| e.to_string())
                }
                AutogradMessage::ReleaseContexts { context_ids } => {
                    for id in context_ids {
                        container.release(id, Some(from.id));
                    }
                    payload::encode(&()).map_err(|e| e.to_string())
                }
            }
        })
    }
}
