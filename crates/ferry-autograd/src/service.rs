//! The autograd service: the handler of [`AutogradMessage`]s.

use std::sync::Arc;

use ferry_rpc::{Agent, BoxFuture, Service, WorkerInfo};
use ferry_transport::IncomingMessage;
use ferry_wire::payload::{self, Encoded};

use crate::container::DistAutogradContainer;
use crate::engine;
use crate::message::{AutogradMessage, PropagateReply, SERVICE_NAME};

/// Serves [`AUTOGRAD_SERVICE`](crate::AUTOGRAD_SERVICE).
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
