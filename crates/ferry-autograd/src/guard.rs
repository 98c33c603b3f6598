//! The user's handle on a distributed autograd context.

use std::sync::Arc;

use tch::Tensor;

use crate::container::{DistAutogradContainer, Entered};
use crate::context::{Context, Gradients};
use crate::{engine, AutogradError};

/// A distributed autograd context, current on the thread that created it
/// until dropped (PyTorch's `with dist_autograd.context() as context_id`).
///
/// RPCs made on this thread while it lives record send and recv functions
/// for the tensors that require grad, on every worker they reach. Dropping
/// it releases the context on every worker that took part.
#[must_use = "the context ends when the guard drops"]
pub struct ContextGuard {
    ctx: Arc<Context>,
    container: Arc<DistAutogradContainer>,
    // Declared last: leaves the thread's context after the fields above.
    _entered: Entered,
}

impl ContextGuard {
    pub(crate) fn new(container: Arc<DistAutogradContainer>) -> Result<Self, AutogradError> {
        if let Some(existing) = crate::container::current_id() {
            return Err(AutogradError::NestedContext { existing });
        }
        let ctx = container.new_context();
        let entered = container.enter(ctx.id, None);
        Ok(ContextGuard {
            ctx,
            container,
            _entered: entered,
        })
    }

    /// The context id, unique across the cluster (`worker_id << 48 | counter`).
    pub fn id(&self) -> u64 {
        self.ctx.id
    }

    /// Runs the distributed backward pass from `roots` (scalars on this
    /// worker) and returns once every participating worker has finished.
    /// Gradients accumulate in the context, never in `.grad`.
    pub fn backward(&self, roots: &[Tensor], retain_graph: bool) -> Result<(), AutogradError> {
        engine::backward(&self.container, self.ctx.id, roots, retain_graph)
    }

    /// The gradients accumulated on this worker in this context.
    pub fn gradients(&self) -> Gradients {
        crate::gradients_of(&self.ctx)
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        self.container.release(self.ctx.id, None);
    }
}

impl std::fmt::Debug for ContextGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextGuard")
            .field("id", &self.ctx.id)
            .finish()
    }
}

/// The distributed autograd context the calling thread is inside, from
/// [`current_context`](crate::current_context) (PyTorch's
/// `dist_autograd._current_context()`): a user's [`ContextGuard`] on its
/// thread, or, inside a function that an RPC made in a context runs, the
/// caller's context.
///
/// It does not own the context: dropping it releases nothing, and once the
/// context is released (its guard dropped on the worker that created it)
/// [`gradients`](Self::gradients) and [`backward`](Self::backward) fail
/// with [`AutogradError::UnknownContext`].
#[derive(Clone)]
pub struct CurrentContext {
    id: u64,
    container: Arc<DistAutogradContainer>,
}

impl CurrentContext {
    pub(crate) fn new(id: u64, container: Arc<DistAutogradContainer>) -> Self {
        CurrentContext { id, container }
    }

    /// The context id (the same as the [`ContextGuard::id`] of the worker
    /// that created it).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The gradients accumulated on this worker in this context
    /// ([`get_gradients`](crate::get_gradients) of [`id`](Self::id)).
    pub fn gradients(&self) -> Result<Gradients, AutogradError> {
        Ok(crate::gradients_of(&*self.container.get(self.id)?))
    }

    /// Runs the distributed backward pass from `roots` in this context
    /// (see [`ContextGuard::backward`]).
    pub fn backward(&self, roots: &[Tensor], retain_graph: bool) -> Result<(), AutogradError> {
        engine::backward(&self.container, self.id, roots, retain_graph)
    }
}

impl std::fmt::Debug for CurrentContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CurrentContext")
            .field("id", &self.id)
            .finish()
    }
}
