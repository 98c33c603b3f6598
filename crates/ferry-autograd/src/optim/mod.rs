//! Functional optimizers for parameters owned by this process.
//!
//! These mirror PyTorch's `torch.distributed.optim` functional optimizers
//! (`_FunctionalSGD`, `_FunctionalAdam`, `_FunctionalAdamW`): gradients are
//! passed in explicitly (they come from a distributed autograd context, never
//! from `.grad`), the optimizer keeps its own per-parameter state, and the
//! update is applied in place to each parameter under [`tch::no_grad`].
//!
//! The update formulas are those of `torch.optim`'s single-tensor
//! (for-loop, `foreach=False`) implementations.
//!
//! A user's own update rule implements [`Optimizer`]; declared as an
//! [`OptimizerClass`] and registered on the workers that own parameters,
//! the [`DistributedOptimizer`] builds and steps it there like the
//! built-in ones ([`OptimizerClass::with`] names it on the driver).

mod adam;
mod custom;
mod scalar;
mod sgd;

pub use custom::{Optimizer, OptimizerClass, OptimizerSpec};

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, TchError, Tensor};

/// Which optimizer to run, with its hyper-parameters.
///
/// Defaults (through [`OptimizerKind::sgd`], [`OptimizerKind::adam`] and
/// [`OptimizerKind::adamw`]) are those of `torch.optim`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ferry_rpc::Schema)]
pub enum OptimizerKind {
    /// Stochastic gradient descent, optionally with (Nesterov) momentum.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum factor (0 disables momentum).
        momentum: f64,
        /// Dampening for momentum (not applied on the first step).
        dampening: f64,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
        /// Use Nesterov momentum (requires `momentum > 0` and `dampening == 0`).
        nesterov: bool,
    },
    /// Adam with L2 weight decay (`g = g + weight_decay * p`).
    Adam {
        /// Learning rate.
        lr: f64,
        /// Decay rate of the first moment estimate.
        beta1: f64,
        /// Decay rate of the second moment estimate.
        beta2: f64,
        /// Term added to the denominator for numerical stability.
        eps: f64,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
        /// Use the AMSGrad variant (maximum of past second moments).
        amsgrad: bool,
    },
    /// AdamW: Adam with decoupled weight decay (`p = p * (1 - lr * weight_decay)`).
    AdamW {
        /// Learning rate.
        lr: f64,
        /// Decay rate of the first moment estimate.
        beta1: f64,
        /// Decay rate of the second moment estimate.
        beta2: f64,
        /// Term added to the denominator for numerical stability.
        eps: f64,
        /// Decoupled weight decay coefficient.
        weight_decay: f64,
        /// Use the AMSGrad variant (maximum of past second moments).
        amsgrad: bool,
    },
}

impl OptimizerKind {
    /// SGD with learning rate `lr` and torch's defaults: no momentum, no
    /// dampening, no weight decay, no Nesterov.
    pub fn sgd(lr: f64) -> Self {
        OptimizerKind::Sgd {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// Adam with learning rate `lr` and torch's defaults: betas (0.9, 0.999),
    /// eps 1e-8, no weight decay, no AMSGrad.
    pub fn adam(lr: f64) -> Self {
        OptimizerKind::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
        }
    }

    /// AdamW with learning rate `lr` and torch's defaults: betas (0.9, 0.999),
    /// eps 1e-8, weight decay 1e-2, no AMSGrad.
    pub fn adamw(lr: f64) -> Self {
        OptimizerKind::AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            amsgrad: false,
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerKind::Sgd { lr, .. }
            | OptimizerKind::Adam { lr, .. }
            | OptimizerKind::AdamW { lr, .. } => *lr,
        }
    }

    /// Sets the learning rate.
    pub fn with_lr(mut self, value: f64) -> Self {
        match &mut self {
            OptimizerKind::Sgd { lr, .. }
            | OptimizerKind::Adam { lr, .. }
            | OptimizerKind::AdamW { lr, .. } => *lr = value,
        }
        self
    }

    /// Sets the weight decay (L2 penalty for SGD and Adam, decoupled for AdamW).
    pub fn weight_decay(mut self, value: f64) -> Self {
        match &mut self {
            OptimizerKind::Sgd { weight_decay, .. }
            | OptimizerKind::Adam { weight_decay, .. }
            | OptimizerKind::AdamW { weight_decay, .. } => *weight_decay = value,
        }
        self
    }

    /// Sets the SGD momentum factor. No effect on Adam/AdamW (see [`Self::betas`]).
    pub fn momentum(mut self, value: f64) -> Self {
        if let OptimizerKind::Sgd { momentum, .. } = &mut self {
            *momentum = value;
        }
        self
    }

    /// Sets the SGD dampening. No effect on Adam/AdamW.
    pub fn dampening(mut self, value: f64) -> Self {
        if let OptimizerKind::Sgd { dampening, .. } = &mut self {
            *dampening = value;
        }
        self
    }

    /// Enables or disables SGD Nesterov momentum. No effect on Adam/AdamW.
    pub fn nesterov(mut self, value: bool) -> Self {
        if let OptimizerKind::Sgd { nesterov, .. } = &mut self {
            *nesterov = value;
        }
        self
    }

    /// Sets Adam/AdamW's `(beta1, beta2)`. No effect on SGD.
    pub fn betas(mut self, b1: f64, b2: f64) -> Self {
        match &mut self {
            OptimizerKind::Adam { beta1, beta2, .. }
            | OptimizerKind::AdamW { beta1, beta2, .. } => {
                *beta1 = b1;
                *beta2 = b2;
            }
            OptimizerKind::Sgd { .. } => {}
        }
        self
    }

    /// Sets Adam/AdamW's epsilon. No effect on SGD.
    pub fn eps(mut self, value: f64) -> Self {
        match &mut self {
            OptimizerKind::Adam { eps, .. } | OptimizerKind::AdamW { eps, .. } => *eps = value,
            OptimizerKind::Sgd { .. } => {}
        }
        self
    }

    /// Enables or disables Adam/AdamW's AMSGrad variant. No effect on SGD.
    pub fn amsgrad(mut self, value: bool) -> Self {
        match &mut self {
            OptimizerKind::Adam { amsgrad, .. } | OptimizerKind::AdamW { amsgrad, .. } => {
                *amsgrad = value
            }
            OptimizerKind::Sgd { .. } => {}
        }
        self
    }

    /// Checks the hyper-parameters the way `torch.optim`'s constructors do.
    ///
    /// SGD: `lr >= 0`, `momentum >= 0`, `weight_decay >= 0`, and Nesterov
    /// needs `momentum > 0` and `dampening == 0`. Adam/AdamW: `lr >= 0`,
    /// `eps >= 0`, `0 <= beta1 < 1`, `0 <= beta2 < 1`, `weight_decay >= 0`.
    /// NaN fails every check, as in torch.
    pub fn validate(&self) -> Result<(), OptimError> {
        match *self {
            OptimizerKind::Sgd {
                lr,
                momentum,
                dampening,
                weight_decay,
                nesterov,
            } => {
                non_negative("lr", lr)?;
                non_negative("momentum", momentum)?;
                non_negative("weight_decay", weight_decay)?;
                // Written so that NaN momentum/dampening are rejected too.
                if nesterov && !(momentum > 0.0 && dampening == 0.0) {
                    return Err(OptimError::NesterovRequiresMomentum {
                        momentum,
                        dampening,
                    });
                }
                Ok(())
            }
            OptimizerKind::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            }
            | OptimizerKind::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => {
                non_negative("lr", lr)?;
                non_negative("eps", eps)?;
                unit_interval("beta1", beta1)?;
                unit_interval("beta2", beta2)?;
                non_negative("weight_decay", weight_decay)
            }
        }
    }
}

fn non_negative(name: &'static str, value: f64) -> Result<(), OptimError> {
    if value >= 0.0 {
        Ok(())
    } else {
        Err(OptimError::InvalidHyperParameter {
            name,
            value,
            expected: "a value >= 0",
        })
    }
}

fn unit_interval(name: &'static str, value: f64) -> Result<(), OptimError> {
    if (0.0..1.0).contains(&value) {
        Ok(())
    } else {
        Err(OptimError::InvalidHyperParameter {
            name,
            value,
            expected: "a value in [0, 1)",
        })
    }
}

/// Errors from building or stepping a [`LocalOptimizer`] or a
/// user-defined [`Optimizer`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OptimError {
    /// A hyper-parameter is out of its valid range.
    #[error("invalid {name}: {value} (expected {expected})")]
    InvalidHyperParameter {
        /// Name of the hyper-parameter, e.g. `"lr"` or `"beta1"`.
        name: &'static str,
        /// The rejected value.
        value: f64,
        /// The valid range, in words.
        expected: &'static str,
    },
    /// Nesterov momentum was requested without momentum or with dampening.
    #[error(
        "nesterov momentum requires momentum > 0 and zero dampening \
         (got momentum {momentum}, dampening {dampening})"
    )]
    NesterovRequiresMomentum {
        /// The configured momentum.
        momentum: f64,
        /// The configured dampening.
        dampening: f64,
    },
    /// A parameter tensor handed to [`LocalOptimizer::new`] is undefined.
    #[error("parameter {index} is an undefined tensor")]
    UndefinedParameter {
        /// Index of the parameter.
        index: usize,
    },
    /// A parameter's dtype is not a real floating-point type (half,
    /// bfloat16, float32 or float64).
    #[error("parameter {index} has dtype {dtype:?}; optimizers need a real floating-point dtype")]
    UnsupportedDtype {
        /// Index of the parameter.
        index: usize,
        /// The parameter's dtype.
        dtype: Kind,
    },
    /// Adam and AdamW do not support sparse gradients (neither does torch).
    #[error(
        "gradient for parameter {index} is sparse; Adam and AdamW do not support sparse gradients"
    )]
    SparseGradient {
        /// Index of the parameter.
        index: usize,
    },
    /// `step` got a different number of gradients than there are parameters.
    #[error("expected {expected} gradients (one per parameter), got {actual}")]
    GradCountMismatch {
        /// Number of parameters.
        expected: usize,
        /// Number of gradients passed.
        actual: usize,
    },
    /// A gradient's shape differs from its parameter's.
    #[error(
        "gradient for parameter {index} has shape {grad:?}, but the parameter has shape {param:?}"
    )]
    ShapeMismatch {
        /// Index of the parameter.
        index: usize,
        /// Shape of the parameter.
        param: Vec<i64>,
        /// Shape of the gradient.
        grad: Vec<i64>,
    },
    /// A gradient's dtype differs from its parameter's.
    #[error(
        "gradient for parameter {index} has dtype {grad:?}, but the parameter has dtype {param:?}"
    )]
    DtypeMismatch {
        /// Index of the parameter.
        index: usize,
        /// Dtype of the parameter.
        param: Kind,
        /// Dtype of the gradient.
        grad: Kind,
    },
    /// A gradient lives on a different device than its parameter.
    #[error(
        "gradient for parameter {index} is on device {grad:?}, but the parameter is on {param:?}"
    )]
    DeviceMismatch {
        /// Index of the parameter.
        index: usize,
        /// Device of the parameter.
        param: Device,
        /// Device of the gradient.
        grad: Device,
    },
    /// A user-defined optimizer's step failed.
    #[error("optimizer class {class:?} failed: {message}")]
    Custom {
        /// The class ([`OptimizerClass::name`]).
        class: &'static str,
        /// The step's error text (with its sources).
        message: String,
    },
    /// A user-defined optimizer's step replaced a parameter's handle
    /// instead of updating the tensor in place: the owner's parameter
    /// would not see the update.
    #[error(
        "optimizer class {class:?} replaced parameter {index} instead of updating it in place \
         (use in-place operations such as f_sub_ or f_copy_ on params[i])"
    )]
    ParameterReplaced {
        /// The class ([`OptimizerClass::name`]).
        class: &'static str,
        /// Index of the parameter.
        index: usize,
    },
    /// libtorch reported an error while inspecting or updating a parameter.
    #[error("libtorch error on parameter {index}: {source}")]
    Torch {
        /// Index of the parameter.
        index: usize,
        /// The underlying error.
        #[source]
        source: TchError,
    },
}

/// The algorithm's hyper-parameters together with its per-parameter state.
#[derive(Debug)]
enum Algorithm {
    Sgd(sgd::SgdParams, Vec<sgd::SgdState>),
    Adam(adam::AdamParams, Vec<adam::AdamState>),
}

/// A functional optimizer over a fixed list of local parameters.
///
/// Gradients are passed to [`LocalOptimizer::step`] explicitly, aligned with
/// the parameters. The parameters are updated in place, so any
/// [`Tensor::shallow_clone`] of them (e.g. held by a module) sees the update.
#[derive(Debug)]
pub struct LocalOptimizer {
    kind: OptimizerKind,
    params: Vec<Tensor>,
    algorithm: Algorithm,
}

impl LocalOptimizer {
    /// Builds an optimizer for `params` after validating `kind`'s
    /// hyper-parameters (see [`OptimizerKind::validate`]) and checking that
    /// every parameter is a defined tensor of a real floating-point dtype.
    ///
    /// State (momentum buffers, moments) is allocated lazily, on the first
    /// step in which a parameter gets a gradient, as in torch.
    pub fn new(kind: OptimizerKind, params: Vec<Tensor>) -> Result<Self, OptimError> {
        kind.validate()?;
        for (index, param) in params.iter().enumerate() {
            if !param.defined() {
                return Err(OptimError::UndefinedParameter { index });
            }
            let dtype = param
                .f_kind()
                .map_err(|source| OptimError::Torch { index, source })?;
            if !matches!(
                dtype,
                Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double
            ) {
                return Err(OptimError::UnsupportedDtype { index, dtype });
            }
        }
        let n = params.len();
        let algorithm = match kind {
            OptimizerKind::Sgd {
                lr,
                momentum,
                dampening,
                weight_decay,
                nesterov,
            } => Algorithm::Sgd(
                sgd::SgdParams {
                    lr,
                    momentum,
                    dampening,
                    weight_decay,
                    nesterov,
                },
                (0..n).map(|_| sgd::SgdState::default()).collect(),
            ),
            OptimizerKind::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                amsgrad,
            }
            | OptimizerKind::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                amsgrad,
            } => Algorithm::Adam(
                adam::AdamParams {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    amsgrad,
                    decoupled_weight_decay: matches!(kind, OptimizerKind::AdamW { .. }),
                },
                (0..n).map(|_| adam::AdamState::default()).collect(),
            ),
        };
        Ok(LocalOptimizer {
            kind,
            params,
            algorithm,
        })
    }

    /// The optimizer's kind and hyper-parameters.
    pub fn kind(&self) -> &OptimizerKind {
        &self.kind
    }

    /// The parameters, in the order given to [`LocalOptimizer::new`].
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// Gives the parameters back, dropping the optimizer state.
    pub fn into_params(self) -> Vec<Tensor> {
        self.params
    }

    /// Applies one optimization step with `grads[i]` as the gradient of
    /// parameter `i`.
    ///
    /// `None` (or an undefined tensor) means parameter `i` got no gradient
    /// this step: it and its state (including Adam's step count) are left
    /// untouched. The gradients themselves are never modified. All gradients
    /// are checked (count, shape, dtype, sparsity, device) before any
    /// parameter is updated, so a mismatch leaves every parameter unchanged.
    /// If libtorch itself fails during the update (e.g. out of memory), the
    /// step stops at that parameter and returns [`OptimError::Torch`]: earlier
    /// parameters have been updated, and that parameter's state may have been.
    pub fn step(&mut self, grads: &[Option<Tensor>]) -> Result<(), OptimError> {
        self.check_grads(grads)?;
        tch::no_grad(|| self.apply(grads, 1.0))
    }

    /// [`step`](Self::step) as if every gradient had been multiplied by
    /// `grad_scale` first, which saves that pass over the gradients (a
    /// pipeline's `scale_grads`, for instance, can hand its division by the
    /// microbatch count to the optimizer this way). The gradients are not
    /// modified. Plain SGD (no momentum, no weight decay) folds the scale
    /// into its step size, with the same result as scaling first up to
    /// rounding (bit for bit when `grad_scale` is a power of two); the
    /// other algorithms scale a temporary copy of each gradient.
    ///
    /// ```
    /// use ferry_autograd::optim::LocalOptimizer;
    /// use ferry_autograd::OptimizerKind;
    /// use tch::Tensor;
    ///
    /// let p = Tensor::from_slice(&[1.0f32]);
    /// let mut opt = LocalOptimizer::new(OptimizerKind::sgd(0.5), vec![p.shallow_clone()])?;
    /// // The sum of 4 microbatches' gradients, stepped as their mean.
    /// opt.step_scaled(&[Some(Tensor::from_slice(&[8.0f32]))], 0.25)?;
    /// assert_eq!(p.double_value(&[0]), 0.0); // 1 - 0.5 * (8 / 4)
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn step_scaled(
        &mut self,
        grads: &[Option<Tensor>],
        grad_scale: f64,
    ) -> Result<(), OptimError> {
        if !grad_scale.is_finite() {
            return Err(OptimError::InvalidHyperParameter {
                name: "grad_scale",
                value: grad_scale,
                expected: "a finite number",
            });
        }
        self.check_grads(grads)?;
        tch::no_grad(|| self.apply(grads, grad_scale))
    }

    fn check_grads(&self, grads: &[Option<Tensor>]) -> Result<(), OptimError> {
        if grads.len() != self.params.len() {
            return Err(OptimError::GradCountMismatch {
                expected: self.params.len(),
                actual: grads.len(),
            });
        }
        for (index, (param, grad)) in self.params.iter().zip(grads).enumerate() {
            let Some(grad) = present(grad) else { continue };
            let (param_shape, grad_shape) = (param.size(), grad.size());
            if param_shape != grad_shape {
                return Err(OptimError::ShapeMismatch {
                    index,
                    param: param_shape,
                    grad: grad_shape,
                });
            }
            let torch_err = |source| OptimError::Torch { index, source };
            let (param_kind, grad_kind) = (
                param.f_kind().map_err(torch_err)?,
                grad.f_kind().map_err(torch_err)?,
            );
            if param_kind != grad_kind {
                return Err(OptimError::DtypeMismatch {
                    index,
                    param: param_kind,
                    grad: grad_kind,
                });
            }
            if grad.is_sparse() && matches!(self.algorithm, Algorithm::Adam(..)) {
                return Err(OptimError::SparseGradient { index });
            }
            let (param_device, grad_device) = (param.device(), grad.device());
            if param_device != grad_device {
                return Err(OptimError::DeviceMismatch {
                    index,
                    param: param_device,
                    grad: grad_device,
                });
            }
        }
        Ok(())
    }

    fn apply(&mut self, grads: &[Option<Tensor>], grad_scale: f64) -> Result<(), OptimError> {
        let params = self.params.iter_mut().zip(grads).enumerate();
        // The gradient as the algorithm should see it: scaled into a
        // temporary unless the scale is 1.
        let scaled = |grad: &Tensor| -> Result<Tensor, tch::TchError> {
            if grad_scale == 1.0 {
                Ok(grad.shallow_clone())
            } else {
                scalar::mul(grad, grad_scale)
            }
        };
        match &mut self.algorithm {
            Algorithm::Sgd(hp, states) => {
                for ((index, (param, grad)), state) in params.zip(states.iter_mut()) {
                    if let Some(grad) = present(grad) {
                        let torch = |source| OptimError::Torch { index, source };
                        if hp.momentum == 0.0 && hp.weight_decay == 0.0 {
                            // param.add_(grad * scale, alpha=-lr), in one pass.
                            sgd::plain_step(hp, param, grad, grad_scale).map_err(torch)?;
                        } else {
                            let grad = scaled(grad).map_err(torch)?;
                            sgd::step(hp, param, &grad, state).map_err(torch)?;
                        }
                    }
                }
            }
            Algorithm::Adam(hp, states) => {
                for ((index, (param, grad)), state) in params.zip(states.iter_mut()) {
                    if let Some(grad) = present(grad) {
                        let torch = |source| OptimError::Torch { index, source };
                        let grad = scaled(grad).map_err(torch)?;
                        adam::step(hp, param, &grad, state).map_err(torch)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// A gradient that is present and defined.
fn present(grad: &Option<Tensor>) -> Option<&Tensor> {
    grad.as_ref().filter(|g| g.defined())
}

mod distributed;
pub use distributed::DistributedOptimizer;
pub(crate) use distributed::{register, LocalOptimizers};
