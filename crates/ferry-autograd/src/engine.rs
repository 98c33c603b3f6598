//! FAST-mode backward over libtorch's engine.
//!
//! A pass on a worker runs libtorch's engine from some roots (the user's
//! losses, or a send function's tensor seeded with the gradient that came
//! back for it) to every leaf it reaches. A leaf that is a recv function's
//! tensor has its gradient sent to the worker that sent the tensor, which
//! runs its own pass from the matching send function, and so on; every
//! other leaf's gradient accumulates in the context. A pass replies only
//! after every pass it caused has finished, so the root's `backward`
//! returns once every participating worker is done.
//!
//! Each incoming gradient is its own pass. Backward is linear in its seed,
//! so passes that share part of a graph sum to exactly what one pass over
//! all seeds would give; graphs are kept (`retain_graph`) until the whole
//! backward is over. Unless the caller retains it, the root's part is then
//! released at once and the other workers' parts with the context.

use ferry_rpc::Agent;
use ferry_wire::payload;
use tch::Tensor;

use crate::container::DistAutogradContainer;
use crate::context::Context;
use crate::engine_shim::{grad, leaves, tensor_id};
use crate::message::{AutogradMessage, AUTOGRAD_SERVICE};
use crate::AutogradError;

/// A gradient to send back: (sender's rank, message id, gradient).
type Outgoing = (u32, u64, Tensor);

/// Runs one local pass; returns the gradients that go to other workers.
fn run_pass(ctx: &Context, roots: &[Tensor], seeds: &[Tensor]) -> Result<Vec<Outgoing>, String> {
    let leaves = leaves(roots)?;
    let grads = grad(roots, seeds, &leaves, true)?;
    let mut out = Vec::new();
    let mut state = ctx.state.lock();
    for (leaf, g) in leaves.iter().zip(grads) {
        let Some(g) = g else { continue };
        match state.recvs.get(&tensor_id(leaf)) {
            Some(recv) => out.push((recv.sender, recv.message_id, g)),
            None => Context::accumulate(&mut state, leaf, g),
        }
    }
    Ok(out)
}

/// Sends each gradient to its worker and waits until all of their parts
/// (and the parts those cause) are done. The first error wins, after all
/// replies are in.
fn propagate(agent: &Agent, context_id: u64, outgoing: Vec<Outgoing>) -> Result<(), AutogradError> {
    let timeout = agent.rpc_timeout();
    let calls: Vec<_> = outgoing
        .into_iter()
        .map(|(to, message_id, grad)| {
            let message = AutogradMessage::Propagate {
                context_id,
                message_id,
                grad: grad.into(),
            };
            let call = payload::encode(&message)
                .map_err(|e| AutogradError::Engine {
                    worker: agent.worker_info().name.clone(),
                    message: format!("cannot encode a gradient: {e}"),
                })
                .map(|m| agent.call_service(to, AUTOGRAD_SERVICE, m, timeout));
            (to, call)
        })
        .collect();
    let mut first_error = None;
    for (to, call) in calls {
        if let Err(e) = call.and_then(|c| {
            c.wait().map(drop).map_err(|e| {
                let worker = agent
                    .get_worker_info(to)
                    .map(|w| w.name)
                    .unwrap_or_else(|_| format!("rank {to}"));
                AutogradError::from_remote(&worker, e)
            })
        }) {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// The root's `backward`: a pass from `roots` (seeded with ones), then
/// the passes it causes elsewhere; returns when all are done.
pub(crate) fn backward(
    container: &DistAutogradContainer,
    context_id: u64,
    roots: &[Tensor],
    retain_graph: bool,
) -> Result<(), AutogradError> {
    let agent = container.agent()?;
    let ctx = container.get(context_id)?;
    if ctx.state.lock().graph_released {
        return Err(AutogradError::GraphReleased(context_id));
    }
    for (index, root) in roots.iter().enumerate() {
        let bad = |reason: &str| AutogradError::BadRoot {
            index,
            reason: reason.to_string(),
        };
        if !root.defined() {
            return Err(bad("undefined tensor"));
        }
        if !root.requires_grad() {
            return Err(bad("does not require grad (no autograd history)"));
        }
        if root.numel() != 1 {
            return Err(bad(&format!(
                "roots must be scalars (one element), this one has shape {:?}",
                root.size()
            )));
        }
    }
    let seeds: Vec<Tensor> = roots.iter().map(Tensor::ones_like).collect();
    let outgoing = run_pass(&ctx, roots, &seeds).map_err(|message| AutogradError::Engine {
        worker: container.worker_name(),
        message,
    })?;
    propagate(&agent, context_id, outgoing)?;
    if !retain_graph {
        // Released on the root: another backward in this context fails
        // here before anything is sent. The other workers' parts of the
        // graph go when the context is released (no message of its own on
        // the critical path, nor in the next forward pass).
        release_graph(&ctx);
    }
    Ok(())
}

/// A `Propagate` arrived: the gradient of the tensor sent as `message_id`.
pub(crate) fn on_propagate(
    container: &DistAutogradContainer,
    context_id: u64,
    message_id: u64,
    grad: Tensor,
) -> Result<(), AutogradError> {
    let agent = container.agent()?;
    let ctx = container.get(context_id)?;
    let sent = {
        let state = ctx.state.lock();
        if state.graph_released {
            return Err(AutogradError::GraphReleased(context_id));
        }
        state.sends.get(&message_id).map(Tensor::shallow_clone)
    };
    let Some(sent) = sent else {
        return Err(AutogradError::Engine {
            worker: container.worker_name(),
            message: format!("no send function for message {message_id} in context {context_id}"),
        });
    };
    let outgoing = run_pass(&ctx, &[sent], &[grad]).map_err(|message| AutogradError::Engine {
        worker: container.worker_name(),
        message,
    })?;
    propagate(&agent, context_id, outgoing)
}

/// Frees the recorded graph of `ctx` (the tensors the send and recv
/// functions held); its gradients stay.
pub(crate) fn release_graph(ctx: &Context) {
    let mut state = ctx.state.lock();
    state.graph_released = true;
    state.sends.clear();
    state.recvs.clear();
}
