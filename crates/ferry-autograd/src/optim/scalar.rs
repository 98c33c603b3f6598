//! Panic-free arithmetic between tensors and plain numbers.
//!
//! tch 0.26's fallible ops that take a `Scalar` (`f_mul_scalar`,
//! `f_add_scalar_`, `f_lerp_`, ...) panic instead of returning `Err` when
//! libtorch reports an error: the temporary `Scalar` is dropped before the
//! op's error is read, and `Scalar::drop` unwraps that pending error. So
//! numbers are passed as 0-dim CPU tensors of the operand's dtype instead.
//! libtorch handles those like the wrapped Python numbers `torch.optim`
//! passes (CPU scalars, same kernels), so float32/float64 results are the
//! same bit for bit.
//!
//! tch also exposes no `alpha`/`value` arguments. `a.add(b, alpha=x)` is
//! computed as `a.addcmul(b, x)` (see [`add_scaled`]); `addcmul`/`addcdiv`
//! with `value=x` as `addcmul(b * x, c)` / `addcdiv(b * x, c)`, which is the
//! order libtorch's kernels evaluate `a + x * b * c` / `a + x * b / c` in.

use tch::{Device, TchError, Tensor};

/// In-place tch ops return a handle to the tensor they modified; only the
/// side effect is needed.
pub(crate) fn in_place(result: Result<Tensor, TchError>) -> Result<(), TchError> {
    result.map(drop)
}

/// `value` as a 0-dim CPU tensor with `like`'s dtype.
pub(crate) fn number(value: f64, like: &Tensor) -> Result<Tensor, TchError> {
    Tensor::f_from_slice(&[value])?
        .f_squeeze()?
        .f_to_kind(like.f_kind()?)
}

/// `value` as a 0-dim tensor with `like`'s dtype, on `like`'s device.
pub(crate) fn number_on_device(value: f64, like: &Tensor) -> Result<Tensor, TchError> {
    let n = number(value, like)?;
    match like.device() {
        Device::Cpu => Ok(n),
        device => n.f_to_device(device),
    }
}

/// `t * value`.
pub(crate) fn mul(t: &Tensor, value: f64) -> Result<Tensor, TchError> {
    t.f_mul(&number(value, t)?)
}

/// `t *= value`.
pub(crate) fn mul_(t: &mut Tensor, value: f64) -> Result<(), TchError> {
    let n = number(value, t)?;
    in_place(t.f_mul_(&n))
}

/// `t /= value`.
pub(crate) fn div_(t: &mut Tensor, value: f64) -> Result<(), TchError> {
    let n = number(value, t)?;
    in_place(t.f_div_(&n))
}

/// `t += value`.
pub(crate) fn add_(t: &mut Tensor, value: f64) -> Result<(), TchError> {
    let n = number(value, t)?;
    in_place(t.f_add_(&n))
}

/// `a + alpha * b`, rounded like torch's `a.add(b, alpha=alpha)`: dense
/// operands go through `addcmul` (libtorch's CPU kernels fuse that
/// multiply-add like `add`'s); sparse `b` falls back to `a + (b * alpha)`.
pub(crate) fn add_scaled(a: &Tensor, b: &Tensor, alpha: f64) -> Result<Tensor, TchError> {
    if b.is_sparse() {
        a.f_add(&mul(b, alpha)?)
    } else {
        a.f_addcmul(b, &number(alpha, b)?)
    }
}

/// `a += alpha * b`, rounded like torch's `a.add_(b, alpha=alpha)` (see
/// [`add_scaled`]).
pub(crate) fn add_scaled_(a: &mut Tensor, b: &Tensor, alpha: f64) -> Result<(), TchError> {
    if b.is_sparse() {
        let scaled = mul(b, alpha)?;
        in_place(a.f_add_(&scaled))
    } else {
        let n = number(alpha, b)?;
        in_place(a.f_addcmul_(b, &n))
    }
}
