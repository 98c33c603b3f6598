//! User-defined optimizers for the [`DistributedOptimizer`]: an update rule
//! ([`Optimizer`]) registered by name on the workers that own parameters
//! ([`OptimizerClass::register`]) and chosen by the driver with serde
//! arguments ([`OptimizerClass::with`]). No code travels: as with remote
//! functions, every owner runs its own registered constructor.
//!
//! [`DistributedOptimizer`]: super::DistributedOptimizer

use std::collections::BTreeMap;
use std::marker::PhantomData;

use ferry_rpc::{Agent, BoxError, Function, Functions, RpcFuture, Schema};
use ferry_rref::RRef;
use ferry_tch::Tensor;
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{OptimError, OptimizerKind};
use crate::engine_shim::tensor_id;
use crate::{container_of, AutogradError};

/// What every optimizer class's constructor is registered under: this,
/// then the class name (so that a class never shadows a function).
const CLASS_PREFIX: &str = "ferry_autograd::optimizer_class::";

/// A user-defined update rule over one owner's parameters (PyTorch: any
/// `torch.optim.Optimizer` class given to `DistributedOptimizer`).
///
/// An instance lives on each worker that owns parameters of a
/// [`DistributedOptimizer`](super::DistributedOptimizer), built there by
/// the constructor registered for its [`OptimizerClass`], and is stepped
/// there with the gradients a distributed autograd context accumulated on
/// that worker. Steps on one worker run one at a time (under the worker's
/// optimizer lock) and under [`tch::no_grad`].
///
/// ```
/// use ferry_autograd::optim::Optimizer;
/// use ferry_rpc::BoxError;
/// use tch::Tensor;
///
/// /// SGD with momentum: `buf = momentum * buf + g; p -= lr * buf`.
/// struct MomentumSgd {
///     lr: f64,
///     momentum: f64,
///     buffers: Vec<Option<Tensor>>,
/// }
///
/// impl Optimizer for MomentumSgd {
///     fn step(&mut self, params: &mut [Tensor], grads: &[Option<Tensor>]) -> Result<(), BoxError> {
///         for ((p, g), buf) in params.iter_mut().zip(grads).zip(&mut self.buffers) {
///             let Some(g) = g else { continue };
///             let b = match buf.take() {
///                 Some(b) => b * self.momentum + g,
///                 None => g.copy(),
///             };
///             let _ = p.f_sub_(&(&b * self.lr))?;
///             *buf = Some(b);
///         }
///         Ok(())
///     }
/// }
///
/// let p = Tensor::from_slice(&[1.0f64]);
/// let mut opt = MomentumSgd { lr: 0.5, momentum: 0.9, buffers: vec![None] };
/// let mut params = [p.shallow_clone()];
/// opt.step(&mut params, &[Some(Tensor::from_slice(&[2.0f64]))])?;
/// assert_eq!(p.double_value(&[0]), 0.0); // updated in place
/// # Ok::<(), BoxError>(())
/// ```
pub trait Optimizer: Send + 'static {
    /// Applies one update: `grads[i]` is the gradient of `params[i]` in the
    /// context being stepped, `None` where that parameter got none (leave
    /// it, and its state, as they are).
    ///
    /// `params` are handles on the owner's tensors (the values the
    /// parameter RRefs hold): update them **in place** (`f_sub_`,
    /// `f_copy_`, ...). Replacing a handle (`params[i] = new`) would leave
    /// the owner's tensor unchanged, so the step fails with
    /// [`OptimError::ParameterReplaced`] instead. An `Err` reaches the
    /// driver as [`AutogradError::Optimizer`] naming this worker, with the
    /// error's text.
    fn step(
        &mut self,
        params: &mut [tch::Tensor],
        grads: &[Option<tch::Tensor>],
    ) -> Result<(), BoxError>;
}

/// A user-defined optimizer class, declared by name with the type of its
/// constructor's arguments `A`, in code every worker shares (as a
/// [`Function`] is): register its constructor on the workers that own
/// parameters with [`register`](Self::register), and name it on the driver
/// with [`with`](Self::with).
///
/// `A` travels to each owner with serde and is checked there by its
/// [`Schema`] like a typed function's arguments. The class's constructor is
/// a remote function whose name is the class's under a prefix of its own,
/// so a class and a function may share a name.
///
/// ```no_run
/// use ferry_autograd::optim::{Optimizer, OptimizerClass};
/// use ferry_autograd::DistributedOptimizer;
/// use ferry_rpc::{BoxError, Functions, RpcOptions, Schema};
/// use ferry_rref::RRef;
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Clone, Serialize, Deserialize, Schema)]
/// struct SignSgdArgs {
///     lr: f64,
/// }
///
/// /// signSGD: `p -= lr * sign(g)`.
/// struct SignSgd(f64);
///
/// impl Optimizer for SignSgd {
///     fn step(&mut self, params: &mut [tch::Tensor], grads: &[Option<tch::Tensor>]) -> Result<(), BoxError> {
///         for (p, g) in params.iter_mut().zip(grads) {
///             if let Some(g) = g {
///                 let _ = p.f_sub_(&(g.sign() * self.0))?;
///             }
///         }
///         Ok(())
///     }
/// }
///
/// const SIGN_SGD: OptimizerClass<SignSgdArgs> = OptimizerClass::new("sign_sgd");
///
/// # fn main() -> Result<(), BoxError> {
/// // On every worker:
/// let mut functions = Functions::new();
/// SIGN_SGD.register(&mut functions, |args: SignSgdArgs, _params: &[tch::Tensor]| {
///     Ok::<_, BoxError>(SignSgd(args.lr))
/// });
/// ferry::init_rpc(RpcOptions::from_env("worker0")?.functions(functions))?;
/// // On the driver:
/// let params: Vec<RRef<ferry_tch::Tensor>> = Vec::new(); // RRefs of parameters
/// let opt = DistributedOptimizer::new(SIGN_SGD.with(SignSgdArgs { lr: 0.01 }), params)?;
/// let ctx = ferry_autograd::context()?;
/// // ... forward, ctx.backward(&[loss], false)? ...
/// opt.step(ctx.id())?;
/// # Ok(()) }
/// ```
pub struct OptimizerClass<A> {
    name: &'static str,
    _args: PhantomData<fn(A)>,
}

impl<A> OptimizerClass<A> {
    /// Declares the optimizer class registered under `name`.
    pub const fn new(name: &'static str) -> Self {
        OptimizerClass {
            name,
            _args: PhantomData,
        }
    }

    /// The class's name.
    pub const fn name(&self) -> &'static str {
        self.name
    }
}

/// The arguments of a class's constructor call on an owner: the
/// distributed optimizer's id, the class's arguments, the owner's
/// parameters.
type NewArgs<A> = (u64, A, Vec<RRef<Tensor>>);

impl<A> OptimizerClass<A>
where
    A: Serialize + DeserializeOwned + Schema + Clone + Send + Sync + 'static,
{
    /// Registers `constructor` as this class on a worker (in the
    /// functions it serves): a [`DistributedOptimizer`](super::DistributedOptimizer)
    /// built with [`with`](Self::with) calls it on each owner of
    /// parameters with the driver's arguments and that owner's parameters
    /// (handles on the tensors, in the driver's order), and keeps the
    /// optimizer it returns there. An `Err` fails the driver's
    /// `DistributedOptimizer::new` with [`AutogradError::Optimizer`] naming
    /// the owner. The constructor runs under [`tch::no_grad`].
    pub fn register<O, E, F>(&self, functions: &mut Functions, constructor: F)
    where
        O: Optimizer,
        E: Into<BoxError>,
        F: Fn(A, &[tch::Tensor]) -> Result<O, E> + Send + Sync + 'static,
    {
        let class = self.name;
        functions.add(
            self.function(),
            move |(id, args, params): NewArgs<A>| -> Result<(), BoxError> {
                let agent = Agent::current().ok_or("no agent runs this call")?;
                let container = container_of(&agent)?;
                let mut tensors = Vec::with_capacity(params.len());
                for p in &params {
                    tensors.push(p.local_value()?.0.shallow_clone());
                }
                let rule = tch::no_grad(|| constructor(args, &tensors)).map_err(Into::into)?;
                tracing::debug!(class, id, params = tensors.len(), "optimizer class built");
                container.optimizers.insert(
                    id,
                    CustomOptimizer {
                        class,
                        params: tensors,
                        rule: Box::new(rule),
                    },
                );
                Ok(())
            },
        );
    }

    /// The choice of this class with constructor arguments `args`, for
    /// [`DistributedOptimizer::new`](super::DistributedOptimizer::new).
    pub fn with(&self, args: A) -> OptimizerSpec {
        let function = self.function();
        OptimizerSpec(Spec::Class {
            name: self.name,
            create: Box::new(move |agent, owner, id, params| {
                function
                    .agent(agent)
                    .rpc_async(owner, (id, args.clone(), params))
            }),
        })
    }

    /// The remote function the constructor is registered as.
    fn function(&self) -> Function<NewArgs<A>, ()> {
        Function::new(function_name(self.name))
    }
}

impl<A> Clone for OptimizerClass<A> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<A> Copy for OptimizerClass<A> {}

impl<A> std::fmt::Debug for OptimizerClass<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OptimizerClass")
            .field("name", &self.name)
            .field("args", &std::any::type_name::<A>())
            .finish()
    }
}

/// The name of class `class`'s constructor function. Each class name is
/// made once and kept for the life of the process (a few bytes per class).
fn function_name(class: &'static str) -> &'static str {
    static NAMES: Mutex<BTreeMap<&'static str, &'static str>> = Mutex::new(BTreeMap::new());
    NAMES
        .lock()
        .entry(class)
        .or_insert_with(|| Box::leak(format!("{CLASS_PREFIX}{class}").into_boxed_str()))
}

/// The class name in a constructor function's name, if it is one.
pub(crate) fn class_of(function: &str) -> Option<&str> {
    function.strip_prefix(CLASS_PREFIX)
}

/// Builds one owner's optimizer: (agent, owner rank, optimizer id, the
/// owner's parameters) → the constructor call.
type Create = dyn Fn(&Agent, u32, u64, Vec<RRef<Tensor>>) -> RpcFuture<()> + Send + Sync;

/// Which optimizer a [`DistributedOptimizer`](super::DistributedOptimizer)
/// builds on the owners: a built-in one (from an [`OptimizerKind`], which
/// converts into this), or a user-defined [`OptimizerClass`] with its
/// arguments ([`OptimizerClass::with`]).
pub struct OptimizerSpec(pub(crate) Spec);

pub(crate) enum Spec {
    Builtin(OptimizerKind),
    Class {
        name: &'static str,
        create: Box<Create>,
    },
}

impl OptimizerSpec {
    /// The built-in optimizer's kind, or `None` for a user-defined class.
    pub fn kind(&self) -> Option<&OptimizerKind> {
        match &self.0 {
            Spec::Builtin(kind) => Some(kind),
            Spec::Class { .. } => None,
        }
    }

    /// The user-defined class's name, or `None` for a built-in optimizer.
    pub fn class(&self) -> Option<&'static str> {
        match &self.0 {
            Spec::Builtin(_) => None,
            Spec::Class { name, .. } => Some(name),
        }
    }

    /// Refuses a built-in optimizer's bad hyper-parameters on the driver,
    /// before any owner is called (a class's arguments are its
    /// constructor's to check, on each owner).
    pub(crate) fn validate(&self, me: &str) -> Result<(), AutogradError> {
        match &self.0 {
            Spec::Builtin(kind) => kind.validate().map_err(|e| AutogradError::Optimizer {
                worker: me.to_string(),
                message: e.to_string(),
            }),
            Spec::Class { .. } => Ok(()),
        }
    }
}

impl From<OptimizerKind> for OptimizerSpec {
    fn from(kind: OptimizerKind) -> Self {
        OptimizerSpec(Spec::Builtin(kind))
    }
}

impl std::fmt::Debug for OptimizerSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Spec::Builtin(kind) => f.debug_tuple("OptimizerSpec").field(kind).finish(),
            Spec::Class { name, .. } => f
                .debug_struct("OptimizerSpec")
                .field("class", name)
                .finish(),
        }
    }
}

/// A user-defined optimizer on an owner: its rule and the parameters it
/// updates.
pub(crate) struct CustomOptimizer {
    class: &'static str,
    params: Vec<tch::Tensor>,
    rule: Box<dyn Optimizer>,
}

impl CustomOptimizer {
    pub(crate) fn params(&self) -> &[tch::Tensor] {
        &self.params
    }

    /// One step of the rule, on handles of the parameters; a handle the
    /// rule replaced (instead of updating it in place) is an error.
    pub(crate) fn step(&mut self, grads: &[Option<tch::Tensor>]) -> Result<(), OptimError> {
        if grads.len() != self.params.len() {
            return Err(OptimError::GradCountMismatch {
                expected: self.params.len(),
                actual: grads.len(),
            });
        }
        let mut handles: Vec<tch::Tensor> =
            self.params.iter().map(tch::Tensor::shallow_clone).collect();
        let rule = &mut self.rule;
        tch::no_grad(|| rule.step(&mut handles, grads)).map_err(|e| OptimError::Custom {
            class: self.class,
            message: ferry_rpc::error_text(&*e),
        })?;
        for (index, (handle, param)) in handles.iter().zip(&self.params).enumerate() {
            if tensor_id(handle) != tensor_id(param) {
                return Err(OptimError::ParameterReplaced {
                    class: self.class,
                    index,
                });
            }
        }
        Ok(())
    }
}
