//! # ferry-autograd
//!
//! Distributed autograd over libtorch, as PyTorch's
//! `torch.distributed.autograd` does it (PyTorch's [distributed autograd
//! design](https://pytorch.org/docs/stable/rpc/distributed_autograd.html),
//! FAST mode), and the [`DistributedOptimizer`].
//!
//! - [`context`] opens a distributed autograd context on this thread. Every
//!   RPC made inside it (`rpc_sync`, `rpc_async`, `remote`, and `to_here`,
//!   including nested calls made by the functions it reaches) records a send
//!   function on the sender and a recv function on the receiver for each
//!   tensor that requires grad, paired by a unique message id.
//! - [`ContextGuard::backward`] runs FAST mode: libtorch's engine here, then
//!   the gradients of received tensors travel back to their senders, whose
//!   engines continue, recursively; it returns when every worker is done.
//!   Gradients accumulate per context ([`get_gradients`]), never in `.grad`,
//!   so concurrent contexts over the same parameters do not mix.
//! - Dropping the guard releases the context on every worker that took part.
//! - [`current_context`] is the context the calling thread is in (the
//!   guard's, or a caller's inside a function an RPC made in one runs).
//! - The [`DistributedOptimizer`] steps built-in optimizers
//!   ([`OptimizerKind`]) or a user's own update rule ([`Optimizer`],
//!   registered on the owners as an [`OptimizerClass`]).
//!
//! ## How it drives libtorch's engine
//!
//! The `tch` crate has no custom autograd functions and no `grad_outputs`.
//! Ferry uses a small C++ shim compiled against the same libtorch
//! (`csrc/engine_shim.cpp`, two functions): `torch::autograd::grad` with
//! explicit incoming gradients (the send function's gradient seeds the sent
//! tensor), and a walk of the graph to the `AccumulateGrad` leaves a pass
//! reaches. Recv functions are plain leaves (the received tensor requires
//! grad): a pass finds them among the leaves and sends their gradients on.
//! The `(t * g).sum()` trick would have done the first, but not the second,
//! which PyTorch's `get_gradients` needs for leaves never sent anywhere.
//!
//! A worker started with the facade's `ferry::init_rpc` has this layer
//! (or call [`install`] on its options before starting the agent):
//!
//! ```no_run
//! use ferry_rpc::{Function, Functions, RpcOptions};
//! use ferry_tch::Tensor;
//!
//! const MY_ADD: Function<(Tensor, Tensor), Tensor> = Function::new("my_add");
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut functions = Functions::new();
//! functions.add(MY_ADD, |(a, b)| Tensor::from(&*a + &*b));
//! let rank: u32 = std::env::var("RANK")?.parse()?;
//! ferry::init_rpc(RpcOptions::from_env(format!("worker{rank}"))?.functions(functions))?;
//!
//! if rank == 0 {
//!     let opts = (tch::Kind::Float, tch::Device::Cpu);
//!     let t1 = tch::Tensor::rand([3, 3], opts).set_requires_grad(true);
//!     let t2 = tch::Tensor::rand([3, 3], opts).set_requires_grad(true);
//!     let ctx = ferry_autograd::context()?;
//!     let args = (Tensor::from(t1.shallow_clone()), Tensor::from(t2.shallow_clone()));
//!     let t3 = MY_ADD.rpc_sync("worker1", args)?;
//!     let loss = (&*t3 * 2.0).sum(tch::Kind::Float);
//!     ctx.backward(&[loss], false)?;
//!     let grads = ctx.gradients();
//!     assert!(grads.get(&t1).is_some() && grads.get(&t2).is_some());
//! }
//! ferry::shutdown()?;
//! # Ok(()) }
//! ```

mod container;
mod context;
mod engine;
mod engine_shim;
mod error;
mod guard;
mod message;
pub mod optim;
mod service;
mod waiting_root;

use std::sync::Arc;

use ferry_rpc::{Agent, RpcOptions};

pub use container::DistAutogradContainer;
pub use context::{ContextInfo, Gradients};
pub use error::AutogradError;
pub use guard::{ContextGuard, CurrentContext};
pub use message::AUTOGRAD_SERVICE;
pub use optim::{DistributedOptimizer, Optimizer, OptimizerClass, OptimizerKind, OptimizerSpec};

use crate::context::Context;

/// Installs distributed autograd on a worker's options: the autograd
/// service, the interceptor that carries contexts on calls, the tensor
/// recorder, libtorch tensors ([`ferry_tch::install`]), Remote References
/// ([`ferry_rref::install`], unless already there) and the optimizer's
/// remote functions.
pub fn install(options: &mut RpcOptions) -> Arc<DistAutogradContainer> {
    let container = Arc::new(DistAutogradContainer::new());
    ferry_tch::install(options);
    if !options.hooks.has_layer::<ferry_rref::RRefContext>() {
        ferry_rref::install(options);
    }
    options
        .hooks
        .service(
            AUTOGRAD_SERVICE,
            Arc::new(service::AutogradService(container.clone())),
        )
        .interceptor(Arc::new(container::ContextInterceptor(container.clone())))
        .layer(container.clone())
        .layer(Arc::new(ferry_tch::grad::RecorderLayer(container.clone())));
    optim::register(&mut options.functions);
    container
}

/// The container of `agent`.
pub fn container_of(agent: &Agent) -> Result<Arc<DistAutogradContainer>, AutogradError> {
    agent
        .layer::<DistAutogradContainer>()
        .ok_or(AutogradError::NotInstalled)
}

fn container() -> Result<Arc<DistAutogradContainer>, AutogradError> {
    container_of(&ferry_rpc::agent()?)
}

/// Opens a distributed autograd context on this thread (the process's
/// agent). Contexts do not nest: a second one on the same thread is an error.
pub fn context() -> Result<ContextGuard, AutogradError> {
    ContextGuard::new(container()?)
}

/// The distributed autograd context this thread is inside (PyTorch's
/// `dist_autograd._current_context()`): the one a [`ContextGuard`] opened
/// on this thread, or, in a function that an RPC made inside a context
/// runs (on any worker), the caller's. Outside any context it is
/// [`AutogradError::NoCurrentContext`]; inside one already released here,
/// [`AutogradError::UnknownContext`].
///
/// ```no_run
/// # fn main() -> Result<(), ferry_autograd::AutogradError> {
/// assert!(matches!(
///     ferry_autograd::current_context(),
///     Err(ferry_autograd::AutogradError::NoCurrentContext)
/// ));
/// let ctx = ferry_autograd::context()?;
/// assert_eq!(ferry_autograd::current_context()?.id(), ctx.id());
/// # Ok(()) }
/// ```
pub fn current_context() -> Result<CurrentContext, AutogradError> {
    let (id, container) = container::current().ok_or(AutogradError::NoCurrentContext)?;
    // A context a call brought comes into being here on its first use.
    if container.current_context().is_none() {
        return Err(AutogradError::UnknownContext {
            context_id: id,
            worker: container.worker_name(),
        });
    }
    Ok(CurrentContext::new(id, container))
}

/// Runs the distributed backward pass of context `context_id` from `roots`
/// (see [`ContextGuard::backward`]).
pub fn backward(
    context_id: u64,
    roots: &[tch::Tensor],
    retain_graph: bool,
) -> Result<(), AutogradError> {
    engine::backward(&*container()?, context_id, roots, retain_graph)
}

/// Local gradients of `roots`, seeded with `grad_outputs` (one per root, of
/// its shape), with respect to `inputs`: libtorch's
/// `torch.autograd.grad(roots, inputs, grad_outputs, retain_graph=keep_graph)`,
/// with `None` where an input is not reached. Nothing is accumulated into
/// `.grad`. This is the per-stage backward a pipeline stage runs on the
/// gradient it received (`ferry-pipeline`): no autograd context is involved.
///
/// ```
/// use tch::{Device, Kind, Tensor};
///
/// let x = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
/// let y = &x * &x;
/// let seed = Tensor::from_slice(&[1.0f32, 10.0]);
/// let grads = ferry_autograd::grad(&[y], &[seed], &[x.shallow_clone()], false)?;
/// let dx = grads[0].as_ref().expect("x is reached");
/// assert_eq!(Vec::<f32>::try_from(dx)?, [2.0, 40.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn grad(
    roots: &[tch::Tensor],
    grad_outputs: &[tch::Tensor],
    inputs: &[tch::Tensor],
    keep_graph: bool,
) -> Result<Vec<Option<tch::Tensor>>, AutogradError> {
    engine_shim::grad(roots, grad_outputs, inputs, keep_graph).map_err(engine_error)
}

/// [`grad`] for a caller that accumulates the gradients (of parameters,
/// typically, over microbatches), without keeping the graph:
/// `accumulated[i]` is `inputs[i]`'s accumulated gradient, or `None`.
/// Where an input is a linear layer's weight (`F.linear`, or `mm` with the
/// weight transposed) with an accumulated gradient, the layer's own matrix
/// product adds its gradient into it in place (`acc += grad^T x`, one GEMM
/// with no gradient-sized temporary and no separate addition), and the
/// result holds only the rest of that input's gradient (`None` when there
/// is none). Add the result to `accumulated` as after [`grad`]: the sums
/// are the same, up to the order of floating-point additions.
///
/// ```
/// use tch::{Kind, Tensor};
///
/// let opts = (Kind::Float, tch::Device::Cpu);
/// let w = Tensor::ones([2, 3], opts).set_requires_grad(true);
/// let b = Tensor::zeros([2], opts).set_requires_grad(true);
/// let y = Tensor::ones([4, 3], opts).linear(&w, Some(&b)).sum(Kind::Float);
/// let mut acc = [Some(Tensor::zeros([2, 3], opts)), None];
/// let rest = ferry_autograd::grad_accumulating(&[y], &[Tensor::from(1.0f32)], &[w, b], &mut acc)?;
/// assert!(rest[0].is_none()); // the weight's went into acc
/// assert_eq!(acc[0].as_ref().unwrap().sum(Kind::Float).double_value(&[]), 24.0);
/// assert_eq!(rest[1].as_ref().unwrap().sum(Kind::Float).double_value(&[]), 8.0); // the bias's
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn grad_accumulating(
    roots: &[tch::Tensor],
    grad_outputs: &[tch::Tensor],
    inputs: &[tch::Tensor],
    accumulated: &mut [Option<tch::Tensor>],
) -> Result<Vec<Option<tch::Tensor>>, AutogradError> {
    engine_shim::grad_accumulating(roots, grad_outputs, inputs, accumulated).map_err(engine_error)
}

/// The input half of a backward split in two, as zero-bubble pipeline
/// schedules run it (their I action): the gradients of `roots`, seeded with
/// `grad_outputs`, with respect to `inputs`, keeping the graph for the
/// weight half. It also captures the gradients flowing into the nodes that
/// feed `params` directly, so that [`WeightBackward::run`] computes the
/// parameters' gradients without going back through the input path, as
/// PyTorch's `stage_backward_input` / `stage_backward_weight` do. Where a
/// parameter is fed by a node the input pass does not run, the weight half
/// goes back from the roots instead (the same result, more work).
///
/// ```
/// use tch::Tensor;
///
/// let w = Tensor::from_slice(&[2.0f32]).set_requires_grad(true);
/// let x = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
/// let y = (&x * &w).relu() * &w;
/// let seed = Tensor::from_slice(&[1.0f32]);
/// let (dx, weight) = ferry_autograd::backward_input(&[y.shallow_clone()], &[seed.shallow_clone()], &[x.shallow_clone()], &[w.shallow_clone()])?;
/// // y = x w^2: dy/dx = w^2 = 4, dy/dw = 2 x w = 12.
/// assert_eq!(dx[0].as_ref().unwrap().double_value(&[0]), 4.0);
/// let dw = weight.run(&[y], &[seed], &[w])?;
/// assert_eq!(dw[0].as_ref().unwrap().double_value(&[0]), 12.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn backward_input(
    roots: &[tch::Tensor],
    grad_outputs: &[tch::Tensor],
    inputs: &[tch::Tensor],
    params: &[tch::Tensor],
) -> Result<(Vec<Option<tch::Tensor>>, WeightBackward), AutogradError> {
    let (grads, captured) =
        engine_shim::backward_input(roots, grad_outputs, inputs, params).map_err(engine_error)?;
    Ok((grads, WeightBackward(captured)))
}

/// The weight half of a split backward, from [`backward_input`].
pub struct WeightBackward(Option<engine_shim::Captured>);

impl WeightBackward {
    /// The gradients of `params` (the ones given to [`backward_input`], in
    /// the same order); releases the graph. `roots` and `grad_outputs` (the
    /// same as the input half's) are used only where the input half could
    /// not capture what this needs.
    pub fn run(
        self,
        roots: &[tch::Tensor],
        grad_outputs: &[tch::Tensor],
        params: &[tch::Tensor],
    ) -> Result<Vec<Option<tch::Tensor>>, AutogradError> {
        match self.0 {
            Some(captured) => {
                engine_shim::backward_weight(captured, params, None).map_err(engine_error)
            }
            None => grad(roots, grad_outputs, params, false),
        }
    }

    /// [`run`](Self::run) for a caller that accumulates the gradients
    /// (`accumulated[i]` for `params[i]`, `None` where nothing is
    /// accumulated yet): the part of a parameter's gradient that a linear
    /// layer's matrix product makes (`F.linear`'s weight) is added to its
    /// accumulated gradient in place by that product itself, with no
    /// gradient-sized temporary and no separate addition, and the result
    /// holds only the rest of each gradient (`None` where nothing is left),
    /// for the caller to add as before. Other layers, hooks and parameters
    /// without an accumulated gradient go through [`run`](Self::run)'s path;
    /// without a capture, the pass from the roots is [`grad_accumulating`].
    ///
    /// ```
    /// use tch::{Kind, Tensor};
    ///
    /// let w = Tensor::ones([2, 3], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    /// let x = Tensor::ones([4, 3], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    /// let y = x.linear::<&Tensor>(&w, None).sum(Kind::Float);
    /// let seed = Tensor::from(1.0f32);
    /// let (_, weight) = ferry_autograd::backward_input(&[y.shallow_clone()], &[seed.shallow_clone()], &[x], &[w.shallow_clone()])?;
    /// let mut acc = [Some(Tensor::zeros([2, 3], (Kind::Float, tch::Device::Cpu)))];
    /// let rest = weight.run_accumulating(&[y], &[seed], &[w], &mut acc)?;
    /// assert!(rest[0].is_none()); // all of it went into acc
    /// assert_eq!(acc[0].as_ref().unwrap().sum(Kind::Float).double_value(&[]), 24.0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn run_accumulating(
        self,
        roots: &[tch::Tensor],
        grad_outputs: &[tch::Tensor],
        params: &[tch::Tensor],
        accumulated: &mut [Option<tch::Tensor>],
    ) -> Result<Vec<Option<tch::Tensor>>, AutogradError> {
        match self.0 {
            Some(captured) => engine_shim::backward_weight(captured, params, Some(accumulated))
                .map_err(engine_error),
            None => grad_accumulating(roots, grad_outputs, params, accumulated),
        }
    }

    /// Whether the weight half runs from the capture (only the parameters'
    /// own gradient functions), not again from the roots.
    pub fn is_captured(&self) -> bool {
        self.0.is_some()
    }
}

impl std::fmt::Debug for WeightBackward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightBackward")
            .field("captured", &self.is_captured())
            .finish()
    }
}

fn engine_error(message: String) -> AutogradError {
    AutogradError::Engine {
        worker: ferry_rpc::Agent::current()
            .map(|a| a.worker_info().name.clone())
            .unwrap_or_else(|| "(no worker)".to_owned()),
        message: error::error_proper(&message),
    }
}

/// The gradients context `context_id` accumulated on this worker.
pub fn get_gradients(context_id: u64) -> Result<Gradients, AutogradError> {
    Ok(gradients_of(&*container()?.get(context_id)?))
}

pub(crate) fn gradients_of(ctx: &Context) -> Gradients {
    let state = ctx.state.lock();
    Gradients {
        entries: state
            .grads
            .values()
            .map(|(t, g)| (t.shallow_clone(), g.shallow_clone()))
            .collect(),
    }
}

/// What context `context_id` recorded on this worker: its send and recv
/// functions and the workers it exchanged messages with (PyTorch's
/// `DistAutogradContext._send_functions()`, `_recv_functions()` and
/// `_known_worker_ids()`); [`AutogradError::UnknownContext`] if it does
/// not live here.
pub fn context_info(context_id: u64) -> Result<ContextInfo, AutogradError> {
    Ok(container()?.get(context_id)?.info())
}

/// The largest context id this worker can hand out (PyTorch's
/// `dist_autograd._get_max_id()`): ids are the worker's rank in the top 16
/// bits and a counter in the low 48.
pub fn max_context_id() -> Result<u64, AutogradError> {
    Ok(container()?.max_id())
}

/// Ids of the distributed autograd contexts alive on this process's worker.
pub fn context_ids() -> Result<Vec<u64>, AutogradError> {
    Ok(container()?.context_ids())
}
