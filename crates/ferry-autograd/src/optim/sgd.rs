//! SGD update, following `torch.optim.sgd._single_tensor_sgd`.

use super::scalar::{add_scaled, add_scaled_, mul_};
use tch::{TchError, Tensor};

/// SGD hyper-parameters (already validated).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SgdParams {
    pub(crate) lr: f64,
    pub(crate) momentum: f64,
    pub(crate) dampening: f64,
    pub(crate) weight_decay: f64,
    pub(crate) nesterov: bool,
}

/// Per-parameter SGD state.
#[derive(Debug, Default)]
pub(crate) struct SgdState {
    /// Created on the first step with a gradient, when `momentum != 0`.
    momentum_buffer: Option<Tensor>,
}

/// Applies one SGD step to `param` in place. `grad` is never modified.
pub(crate) fn step(
    hp: &SgdParams,
    param: &mut Tensor,
    grad: &Tensor,
    state: &mut SgdState,
) -> Result<(), TchError> {
    // grad = grad.add(param, alpha=weight_decay)
    let mut d_p = if hp.weight_decay != 0.0 {
        add_scaled(grad, param, hp.weight_decay)?
    } else {
        grad.shallow_clone()
    };

    if hp.momentum != 0.0 {
        let buf = match state.momentum_buffer.as_mut() {
            Some(buf) => {
                // buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                mul_(buf, hp.momentum)?;
                add_scaled_(buf, &d_p, 1.0 - hp.dampening)?;
                buf.shallow_clone()
            }
            None => {
                // First step: buf = grad.detach().clone(), without dampening.
                // (tch has no plain fallible clone; this also works for
                // sparse gradients.)
                let mut buf = d_p.f_zeros_like()?;
                buf.f_copy_(&d_p)?;
                state.momentum_buffer = Some(buf.shallow_clone());
                buf
            }
        };
        d_p = if hp.nesterov {
            // grad = grad.add(buf, alpha=momentum)
            add_scaled(&d_p, &buf, hp.momentum)?
        } else {
            buf
        };
    }

    // param.add_(grad, alpha=-lr)
    add_scaled_(param, &d_p, -hp.lr)
}

/// SGD without momentum or weight decay on `grad * grad_scale`:
/// `param.add_(grad, alpha=-lr * grad_scale)`. `grad` is never modified.
pub(crate) fn plain_step(
    hp: &SgdParams,
    param: &mut Tensor,
    grad: &Tensor,
    grad_scale: f64,
) -> Result<(), TchError> {
    add_scaled_(param, grad, -hp.lr * grad_scale)
}
