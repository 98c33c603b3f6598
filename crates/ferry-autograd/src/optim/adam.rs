//! Adam and AdamW updates, following `torch.optim.adam._single_tensor_adam`
//! (AdamW is Adam with `decoupled_weight_decay=True`).

use super::scalar::{add_, add_scaled, div_, in_place, mul, mul_, number_on_device};
use tch::{TchError, Tensor};

/// Adam/AdamW hyper-parameters (already validated).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamParams {
    pub(crate) lr: f64,
    pub(crate) beta1: f64,
    pub(crate) beta2: f64,
    pub(crate) eps: f64,
    pub(crate) weight_decay: f64,
    pub(crate) amsgrad: bool,
    /// AdamW (`p *= 1 - lr * wd`) rather than Adam's L2 term (`g += wd * p`).
    pub(crate) decoupled_weight_decay: bool,
}

/// Per-parameter Adam state.
#[derive(Debug, Default)]
pub(crate) struct AdamState {
    /// Number of steps taken with a gradient for this parameter.
    step: f64,
    /// Created on the first step with a gradient.
    moments: Option<Moments>,
}

#[derive(Debug)]
struct Moments {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// Only with AMSGrad.
    max_exp_avg_sq: Option<Tensor>,
    /// `1 - beta1` as a 0-dim tensor on the parameter's device (the weight
    /// of `lerp_`, which tch only takes panic-free as a tensor).
    one_minus_beta1: Tensor,
}

impl Moments {
    fn zeros_like(param: &Tensor, hp: &AdamParams) -> Result<Self, TchError> {
        Ok(Moments {
            exp_avg: param.f_zeros_like()?,
            exp_avg_sq: param.f_zeros_like()?,
            max_exp_avg_sq: if hp.amsgrad {
                Some(param.f_zeros_like()?)
            } else {
                None
            },
            one_minus_beta1: number_on_device(1.0 - hp.beta1, param)?,
        })
    }
}

/// Applies one Adam (or AdamW) step to `param` in place. `grad` is never
/// modified. (The `scalar` module explains how torch's `alpha=`/`value=`
/// arguments are expressed.)
pub(crate) fn step(
    hp: &AdamParams,
    param: &mut Tensor,
    grad: &Tensor,
    state: &mut AdamState,
) -> Result<(), TchError> {
    // Allocate before touching anything, so a failure leaves the parameter as is.
    let moments = match state.moments.as_mut() {
        Some(moments) => moments,
        None => state.moments.insert(Moments::zeros_like(param, hp)?),
    };
    state.step += 1.0;

    let grad = if hp.weight_decay == 0.0 {
        grad.shallow_clone()
    } else if hp.decoupled_weight_decay {
        // param.mul_(1 - lr * weight_decay)
        mul_(param, 1.0 - hp.lr * hp.weight_decay)?;
        grad.shallow_clone()
    } else {
        // grad = grad.add(param, alpha=weight_decay)
        add_scaled(grad, param, hp.weight_decay)?
    };

    // exp_avg.lerp_(grad, 1 - beta1)
    in_place(
        moments
            .exp_avg
            .f_lerp_tensor_(&grad, &moments.one_minus_beta1),
    )?;
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    mul_(&mut moments.exp_avg_sq, hp.beta2)?;
    in_place(
        moments
            .exp_avg_sq
            .f_addcmul_(&mul(&grad, 1.0 - hp.beta2)?, &grad),
    )?;

    let bias_correction1 = 1.0 - hp.beta1.powf(state.step);
    let bias_correction2 = 1.0 - hp.beta2.powf(state.step);
    let step_size = hp.lr / bias_correction1;
    let bias_correction2_sqrt = bias_correction2.sqrt();

    let second_moment = match moments.max_exp_avg_sq.as_mut() {
        Some(max_exp_avg_sq) => {
            // torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            *max_exp_avg_sq = max_exp_avg_sq.f_maximum(&moments.exp_avg_sq)?;
            &*max_exp_avg_sq
        }
        None => &moments.exp_avg_sq,
    };
    // denom = (second_moment.sqrt() / bias_correction2_sqrt).add_(eps)
    let mut denom = second_moment.f_sqrt()?;
    div_(&mut denom, bias_correction2_sqrt)?;
    add_(&mut denom, hp.eps)?;

    // param.addcdiv_(exp_avg, denom, value=-step_size)
    in_place(param.f_addcdiv_(&mul(&moments.exp_avg, -step_size)?, &denom))
}
