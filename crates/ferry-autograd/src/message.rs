//! What workers send each other during backward and clean-up; the
//! service that handles it is in `service.rs`.

use std::time::Duration;

use ferry_rpc::{Agent, RemoteError, RpcError};
use ferry_tch::Tensor;
use ferry_wire::payload;
use ferry_wire::MessageKind;
use serde::{Deserialize, Serialize};

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
