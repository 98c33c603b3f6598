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

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use ferry_rpc::{Agent, RawFuture, RemoteError};
use ferry_wire::payload;
use tch::Tensor;

use crate::container::DistAutogradContainer;
use crate::context::Context;
use crate::engine_shim::{grad, leaf_post_hooks, leaf_pre_hooks, leaves, tensor_id};
use crate::error::error_proper;
use crate::message::{AutogradMessage, PropagateReply, AUTOGRAD_SERVICE};
use crate::waiting_root::{Job, WaitingRoot};
use crate::AutogradError;

/// A gradient to send back: (sender's rank, message id, gradient).
type Outgoing = (u32, u64, Tensor);

/// Runs one local pass; returns the gradients that go to other workers.
///
/// A gradient that reaches a leaf of this worker goes where PyTorch's
/// distributed engine puts it: the leaf's `AccumulateGrad` node's pre
/// hooks, then the context (`Context::accumulate`, holding every
/// gradient of the pass until all are accumulated, so that one gradient
/// two leaves share is copied for each, never kept for one), then the
/// node's post hooks. Hooks run outside the context's lock: they may call
/// back into it.
fn run_pass(ctx: &Context, roots: &[Tensor], seeds: &[Tensor]) -> Result<Vec<Outgoing>, String> {
    let leaves = leaves(roots)?;
    let grads = grad(roots, seeds, &leaves, true)?;
    let recvs: Vec<Option<(u32, u64)>> = {
        let state = ctx.state.lock();
        leaves
            .iter()
            .map(|leaf| {
                state
                    .recvs
                    .get(&tensor_id(leaf))
                    .map(|r| (r.sender, r.message_id))
            })
            .collect()
    };
    let mut out = Vec::new();
    // (leaf, the gradient its pre hooks gave, if they changed it, and the
    // pass's own gradient).
    let mut local: Vec<(&Tensor, Option<Tensor>, &Tensor)> = Vec::new();
    for ((leaf, g), recv) in leaves.iter().zip(&grads).zip(recvs) {
        let Some(g) = g else { continue };
        match recv {
            Some((sender, message_id)) => out.push((sender, message_id, g.shallow_clone())),
            None => local.push((leaf, leaf_pre_hooks(leaf, g)?, g)),
        }
    }
    {
        let mut state = ctx.state.lock();
        for (leaf, hooked, g) in &local {
            match hooked {
                Some(h) if !h.defined() => {}
                Some(h) => Context::accumulate(&mut state, leaf, h)?,
                None => Context::accumulate(&mut state, leaf, g)?,
            }
        }
    }
    for (leaf, hooked, g) in &local {
        leaf_post_hooks(leaf, hooked.as_ref().unwrap_or(g))?;
    }
    Ok(out)
}

/// The replies of gradients sent by [`send`], one per gradient: the
/// worker it went to and its reply (or why it could not be sent).
type Replies = Vec<(u32, Result<RawFuture, AutogradError>)>;

/// Sends each gradient to the worker that sent its tensor.
fn send(agent: &Agent, context_id: u64, outgoing: Vec<Outgoing>) -> Replies {
    let timeout = agent.rpc_timeout();
    outgoing
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
        .collect()
}

/// Completes when every worker that was sent a gradient has finished its
/// part (and the parts those cause). The first error wins, after all
/// replies are in.
async fn wait(agent: Agent, replies: Replies) -> Result<(), AutogradError> {
    let mut first_error = None;
    for (to, reply) in replies {
        let done = match reply {
            Ok(r) => {
                let worker = || {
                    agent
                        .get_worker_info(to)
                        .map(|w| w.name)
                        .unwrap_or_else(|_| format!("rank {to}"))
                };
                match r.await {
                    Ok(reply) => {
                        match payload::decode::<PropagateReply>(&reply.payload, Vec::new()) {
                            Ok(PropagateReply::Done) => Ok(()),
                            Ok(PropagateReply::Failed(e)) => Err(AutogradError::Remote(e)),
                            Err(e) => Err(AutogradError::Remote(RemoteError::new(
                                worker(),
                                format!("malformed reply to a gradient: {e}"),
                            ))),
                        }
                    }
                    Err(e) => Err(AutogradError::from_remote(&worker(), e)),
                }
            }
            Err(e) => Err(e),
        };
        if let Err(e) = done {
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
    // Bad arguments are refused before anything, the graph included, is touched.
    if roots.is_empty() {
        return Err(AutogradError::NoRoots);
    }
    let agent = container.agent()?;
    let ctx = container.get(context_id)?;
    if ctx.state.lock().graph_released {
        return Err(AutogradError::GraphReleased(context_id));
    }
    check_roots(roots)?;
    let seeds: Vec<Tensor> = roots.iter().map(Tensor::ones_like).collect();
    let outgoing = run_pass(&ctx, roots, &seeds).map_err(|message| AutogradError::Engine {
        worker: container.worker_name(),
        message: error_proper(&message),
    })?;
    let replies = send(&agent, context_id, outgoing);
    // Wait here, running on this thread the passes that the gradients
    // coming back to this worker start (see `waiting_root`).
    let root = WaitingRoot::for_current_thread();
    let registered = {
        let mut state = ctx.state.lock();
        let free = state.waiting_root.is_none();
        if free {
            state.waiting_root = Some(root.clone());
        }
        free
    };
    let done = root.block_on(wait(agent, replies));
    if registered {
        ctx.state.lock().waiting_root = None;
    }
    // Jobs are queued under the context's lock, so none comes after this.
    root.run_queued();
    done?;
    if !retain_graph {
        // Released on the root: another backward in this context fails
        // here before anything is sent. The other workers' parts of the
        // graph go when the context is released (no message of its own on
        // the critical path, nor in the next forward pass).
        release_graph(&ctx);
    }
    Ok(())
}

/// Checks every root in PyTorch's order (`DistEngine`'s
/// `validateRootsAndRetrieveEdges`): defined, requires grad, scalar, has a
/// gradient function. The error names the first thing wrong with the first
/// bad root.
pub(crate) fn check_roots(roots: &[Tensor]) -> Result<(), AutogradError> {
    for (index, root) in roots.iter().enumerate() {
        if !root.defined() {
            return Err(AutogradError::UndefinedRoot { index });
        }
        if !root.requires_grad() {
            return Err(AutogradError::RootDoesNotRequireGrad { index });
        }
        if root.numel() != 1 {
            return Err(AutogradError::RootNotScalar {
                index,
                shape: root.size(),
            });
        }
        if root.is_leaf() {
            return Err(AutogradError::RootWithoutGradFn { index });
        }
    }
    Ok(())
}

/// A `Propagate` arrived: the gradient of the tensor sent as `message_id`.
/// Completes when the pass it starts here, and the passes that one causes
/// elsewhere, are done.
///
/// The pass runs libtorch: on the thread waiting in `backward` in this
/// context here if there is one, on the blocking pool otherwise (see
/// `waiting_root`). It sends what it yields for other workers itself;
/// their parts are awaited here, holding no thread.
pub(crate) async fn on_propagate(
    container: Arc<DistAutogradContainer>,
    context_id: u64,
    message_id: u64,
    grad: Tensor,
) -> Result<(), AutogradError> {
    let (done, outcome) = tokio::sync::oneshot::channel();
    let worker = container.worker_name();
    let job: Job = {
        let container = container.clone();
        Box::new(move || {
            // A panic is this message's error, not the waiting root
            // thread's (nor a lost reply).
            let sent = catch_unwind(AssertUnwindSafe(|| {
                run_propagated(&container, context_id, message_id, grad)
            }))
            .unwrap_or_else(|panic| {
                Err(AutogradError::Engine {
                    worker: container.worker_name(),
                    message: format!("the backward pass {}", ferry_rpc::panic_message(&*panic)),
                })
            });
            let _ = done.send(sent);
        })
    };
    if let Some(job) = run_on_waiting_root(&container, context_id, job) {
        tokio::task::spawn_blocking(job);
    }
    let (agent, replies) = outcome.await.map_err(|_| AutogradError::Engine {
        worker,
        message: "the backward pass was dropped before it ran".into(),
    })??;
    wait(agent, replies).await
}

/// Runs `job`, a pass for context `context_id`, on the thread waiting in
/// `backward` in that context here, if there is one; otherwise gives it
/// back, for the caller to run elsewhere.
fn run_on_waiting_root(
    container: &DistAutogradContainer,
    context_id: u64,
    job: Job,
) -> Option<Job> {
    let Ok(ctx) = container.get(context_id) else {
        return Some(job);
    };
    let state = ctx.state.lock();
    match &state.waiting_root {
        Some(root) => {
            root.push(job);
            None
        }
        None => Some(job),
    }
}

/// The pass of a `Propagate`, run on this thread: the local pass from the
/// send function's tensor, and the gradients it yields for other workers
/// sent, without waiting for them.
fn run_propagated(
    container: &DistAutogradContainer,
    context_id: u64,
    message_id: u64,
    grad: Tensor,
) -> Result<(Agent, Replies), AutogradError> {
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
        message: error_proper(&message),
    })?;
    let replies = send(&agent, context_id, outgoing);
    Ok((agent, replies))
}

/// Frees the recorded graph of `ctx` (the tensors the send and recv
/// functions held); its gradients stay.
pub(crate) fn release_graph(ctx: &Context) {
    let mut state = ctx.state.lock();
    state.graph_released = true;
    state.sends.clear();
    state.recvs.clear();
}
