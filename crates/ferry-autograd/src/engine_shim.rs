//! Safe wrappers over `csrc/engine_shim.cpp`: what the engine needs from
//! libtorch beyond the tch crate (see the crate docs for why a shim).

use std::ffi::{c_char, c_int, c_void, CStr};

use tch::Tensor;

/// `at::Tensor`, as tch's `C_tensor` pointers point to.
#[repr(C)]
struct AtTensor {
    _private: [u8; 0],
}

extern "C" {
    fn ferry_free_error(error: *mut c_char);
    fn ferry_tensor_impl(t: *const AtTensor) -> *const c_void;
    fn ferry_grad(
        roots: *const *const AtTensor,
        grad_outputs: *const *const AtTensor,
        n: c_int,
        inputs: *const *const AtTensor,
        ninputs: c_int,
        keep_graph: c_int,
        outputs: *mut *mut AtTensor,
    ) -> *mut c_char;
    fn ferry_grad_accumulating(
        roots: *const *const AtTensor,
        grad_outputs: *const *const AtTensor,
        n: c_int,
        inputs: *const *const AtTensor,
        ninputs: c_int,
        accs: *const *mut AtTensor,
        outputs: *mut *mut AtTensor,
    ) -> *mut c_char;
    fn ferry_backward_input(
        roots: *const *const AtTensor,
        grad_outputs: *const *const AtTensor,
        n: c_int,
        inputs: *const *const AtTensor,
        ninputs: c_int,
        params: *const *const AtTensor,
        nparams: c_int,
        outputs: *mut *mut AtTensor,
        split: *mut *mut c_void,
    ) -> *mut c_char;
    fn ferry_backward_weight(
        split: *mut c_void,
        params: *const *const AtTensor,
        nparams: c_int,
        accs: *const *mut AtTensor,
        outputs: *mut *mut AtTensor,
    ) -> *mut c_char;
    fn ferry_free_split(split: *mut c_void);
    fn ferry_leaf_pre_hooks(
        leaf: *const AtTensor,
        grad: *const AtTensor,
        out: *mut *mut AtTensor,
        changed: *mut c_int,
    ) -> *mut c_char;
    fn ferry_accumulate_grad(
        leaf: *const AtTensor,
        old: *const AtTensor,
        new_grad: *const AtTensor,
        expected_refs: c_int,
        out: *mut *mut AtTensor,
    ) -> *mut c_char;
    fn ferry_leaf_post_hooks(leaf: *const AtTensor, grad: *const AtTensor) -> *mut c_char;
    fn ferry_leaves(
        roots: *const *const AtTensor,
        n: c_int,
        state: *mut c_void,
        push: extern "C" fn(*mut c_void, *mut AtTensor),
    ) -> *mut c_char;
}

fn ptr(t: &Tensor) -> *const AtTensor {
    t.as_ptr() as *const AtTensor
}

/// Takes an error text from the shim.
fn check(error: *mut c_char) -> Result<(), String> {
    if error.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null result is a NUL-terminated malloc'd string from the
    // shim, freed exactly once here.
    let text = unsafe { CStr::from_ptr(error) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: as above.
    unsafe { ferry_free_error(error) };
    Err(text)
}

/// Wraps a tensor the shim allocated with `new`.
fn own(t: *mut AtTensor) -> Tensor {
    // SAFETY: the shim returns `new at::Tensor(..)`, which tch's `Tensor`
    // owns and frees with `delete` (its `C_tensor` is `at::Tensor`).
    unsafe { Tensor::from_ptr(t as *mut torch_sys::C_tensor) }
}

/// Takes ownership of the tensors the shim wrote to `out`; an undefined
/// one (an unreached input) becomes `None`.
fn owned_outputs(out: Vec<*mut AtTensor>) -> Vec<Option<Tensor>> {
    out.into_iter()
        .map(|p| {
            let t = own(p);
            t.defined().then_some(t)
        })
        .collect()
}

/// The gradient `leaf`'s `AccumulateGrad` node's pre hooks make of
/// `grad`, or `None` when it has none (PyTorch's distributed engine runs
/// them before accumulating).
pub(crate) fn leaf_pre_hooks(leaf: &Tensor, grad: &Tensor) -> Result<Option<Tensor>, String> {
    let mut out = std::ptr::null_mut();
    let mut changed: c_int = 0;
    // SAFETY: live tch tensors for the call; the shim writes `out` only
    // when it sets `changed`.
    check(unsafe { ferry_leaf_pre_hooks(ptr(leaf), ptr(grad), &mut out, &mut changed) })?;
    Ok((changed != 0).then(|| own(out)))
}

/// `leaf`'s gradient once `new_grad` is added to `old`, by libtorch's
/// `AccumulateGrad::accumulateGrad` with grad mode off: with no `old`,
/// `new_grad` itself (no copy) when the caller's `expected_refs` handles
/// are all that hold it and its layout suits the leaf, a copy otherwise;
/// with one, their sum, in place in `old` where libtorch can (sparse and
/// dense in any order).
pub(crate) fn accumulate_grad(
    leaf: &Tensor,
    old: Option<&Tensor>,
    new_grad: &Tensor,
    expected_refs: usize,
) -> Result<Tensor, String> {
    let mut out = std::ptr::null_mut();
    let old = old.map_or(std::ptr::null(), ptr);
    let refs = c_int::try_from(expected_refs).unwrap_or(c_int::MAX);
    // SAFETY: live tch tensors (or null for `old`) for the call; on
    // success the shim writes `out`.
    check(unsafe { ferry_accumulate_grad(ptr(leaf), old, ptr(new_grad), refs, &mut out) })?;
    Ok(own(out))
}

/// Runs `leaf`'s `AccumulateGrad` node's post hooks with `grad` as its
/// input (PyTorch's distributed engine runs them after accumulating).
pub(crate) fn leaf_post_hooks(leaf: &Tensor, grad: &Tensor) -> Result<(), String> {
    // SAFETY: live tch tensors for the call.
    check(unsafe { ferry_leaf_post_hooks(ptr(leaf), ptr(grad)) })
}

/// The identity of a tensor: its TensorImpl, shared by its shallow clones.
pub(crate) fn tensor_id(t: &Tensor) -> usize {
    // SAFETY: `t` is a live tch tensor.
    unsafe { ferry_tensor_impl(ptr(t)) as usize }
}

/// Gradients of `roots`, seeded with `grad_outputs`, with respect to
/// `inputs`: `None` where an input is not reached. `.grad` is not touched.
/// The pointers to hand the shim for `accumulated` (one per input, null
/// where `None`), or an error when the counts differ.
fn acc_pointers(
    accumulated: &mut [Option<Tensor>],
    inputs: usize,
) -> Result<Vec<*mut AtTensor>, String> {
    if accumulated.len() != inputs {
        return Err(format!(
            "{} accumulated gradients for {inputs} tensors",
            accumulated.len()
        ));
    }
    Ok(accumulated
        .iter_mut()
        .map(|a| match a {
            Some(t) => t.as_mut_ptr() as *mut AtTensor,
            None => std::ptr::null_mut(),
        })
        .collect())
}

/// Checks the counts, hands `pass` (a shim entry point) the tensors as the
/// shim takes them: (roots, their gradients, root count, inputs, input
/// count, one output slot per input), and takes the outputs back.
fn backward_pass(
    roots: &[Tensor],
    grad_outputs: &[Tensor],
    inputs: &[Tensor],
    pass: impl FnOnce(
        *const *const AtTensor,
        *const *const AtTensor,
        c_int,
        *const *const AtTensor,
        c_int,
        *mut *mut AtTensor,
    ) -> *mut c_char,
) -> Result<Vec<Option<Tensor>>, String> {
    if roots.len() != grad_outputs.len() {
        return Err(format!(
            "{} roots but {} gradients",
            roots.len(),
            grad_outputs.len()
        ));
    }
    if inputs.is_empty() {
        return Ok(Vec::new());
    }
    let r: Vec<_> = roots.iter().map(ptr).collect();
    let g: Vec<_> = grad_outputs.iter().map(ptr).collect();
    let i: Vec<_> = inputs.iter().map(ptr).collect();
    let mut out: Vec<*mut AtTensor> = vec![std::ptr::null_mut(); inputs.len()];
    check(pass(
        r.as_ptr(),
        g.as_ptr(),
        r.len() as c_int,
        i.as_ptr(),
        i.len() as c_int,
        out.as_mut_ptr(),
    ))?;
    Ok(owned_outputs(out))
}

/// [`grad`] without keeping the graph, adding linear layers' weight
/// gradients into `accumulated` (one entry per input) in place; the result
/// holds the rest of each input's gradient.
pub(crate) fn grad_accumulating(
    roots: &[Tensor],
    grad_outputs: &[Tensor],
    inputs: &[Tensor],
    accumulated: &mut [Option<Tensor>],
) -> Result<Vec<Option<Tensor>>, String> {
    let accs = acc_pointers(accumulated, inputs.len())?;
    backward_pass(roots, grad_outputs, inputs, |r, g, n, i, ni, out| {
        // SAFETY: live tch tensors for the call (the accumulated ones
        // exclusively borrowed); `out` and `accs` have one slot per
        // input.
        unsafe { ferry_grad_accumulating(r, g, n, i, ni, accs.as_ptr(), out) }
    })
}

/// Gradients of `roots` (seeded with `grad_outputs`) with respect to
/// `inputs`, without touching `.grad`.
pub(crate) fn grad(
    roots: &[Tensor],
    grad_outputs: &[Tensor],
    inputs: &[Tensor],
    keep_graph: bool,
) -> Result<Vec<Option<Tensor>>, String> {
    backward_pass(roots, grad_outputs, inputs, |r, g, n, i, ni, out| {
        // SAFETY: live tch tensors for the call; `out` has one slot
        // per input.
        unsafe { ferry_grad(r, g, n, i, ni, c_int::from(keep_graph), out) }
    })
}

/// What the input half of a split backward captured for the weight half
/// (the gradients flowing into the nodes that feed the parameters); owned
/// C++ state, freed when dropped.
pub(crate) struct Captured(*mut c_void);

// SAFETY: the capture is plain data (shared node pointers and tensors),
// used by one thread at a time through `&mut`/ownership, like a tensor.
unsafe impl Send for Captured {}

impl Drop for Captured {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: a capture from ferry_backward_input, freed once (the
            // weight half takes the pointer out before it frees it itself).
            unsafe { ferry_free_split(self.0) };
        }
    }
}

/// The input half of a split backward: gradients of `roots` (seeded) with
/// respect to `inputs`, the graph kept, and the capture the weight half of
/// `params` needs (`None`: the weight half must start again from the roots).
pub(crate) fn backward_input(
    roots: &[Tensor],
    grad_outputs: &[Tensor],
    inputs: &[Tensor],
    params: &[Tensor],
) -> Result<(Vec<Option<Tensor>>, Option<Captured>), String> {
    if roots.len() != grad_outputs.len() {
        return Err(format!(
            "{} roots but {} gradients",
            roots.len(),
            grad_outputs.len()
        ));
    }
    let r: Vec<_> = roots.iter().map(ptr).collect();
    let g: Vec<_> = grad_outputs.iter().map(ptr).collect();
    let i: Vec<_> = inputs.iter().map(ptr).collect();
    let p: Vec<_> = params.iter().map(ptr).collect();
    let mut out: Vec<*mut AtTensor> = vec![std::ptr::null_mut(); inputs.len()];
    let mut split: *mut c_void = std::ptr::null_mut();
    // SAFETY: live tensors for the call; `out` has one slot per input.
    check(unsafe {
        ferry_backward_input(
            r.as_ptr(),
            g.as_ptr(),
            r.len() as c_int,
            i.as_ptr(),
            i.len() as c_int,
            p.as_ptr(),
            p.len() as c_int,
            out.as_mut_ptr(),
            &mut split,
        )
    })?;
    let grads = owned_outputs(out);
    Ok((grads, (!split.is_null()).then_some(Captured(split))))
}

/// The weight half from a capture: gradients of `params` (the same ones,
/// in the same order, as given to [`backward_input`]).
/// `accumulated`, when given, has one entry per parameter: where it holds a
/// tensor, the part of that parameter's gradient a linear layer's GEMM
/// makes is added to it in place, and the result holds only the rest.
pub(crate) fn backward_weight(
    mut captured: Captured,
    params: &[Tensor],
    accumulated: Option<&mut [Option<Tensor>]>,
) -> Result<Vec<Option<Tensor>>, String> {
    let split = std::mem::replace(&mut captured.0, std::ptr::null_mut());
    let p: Vec<_> = params.iter().map(ptr).collect();
    let accs = match accumulated {
        Some(accs) => Some(acc_pointers(accs, params.len())?),
        None => None,
    };
    let mut out: Vec<*mut AtTensor> = vec![std::ptr::null_mut(); params.len()];
    // SAFETY: `split` is an unfreed capture, which the call frees; live
    // tensors; one output slot per parameter, and `accs` (when given) one
    // entry per parameter, null or a tensor exclusively borrowed for the
    // call.
    check(unsafe {
        ferry_backward_weight(
            split,
            p.as_ptr(),
            p.len() as c_int,
            accs.as_ref().map_or(std::ptr::null(), |a| a.as_ptr()),
            out.as_mut_ptr(),
        )
    })?;
    Ok(owned_outputs(out))
}

/// The leaf tensors (those with an AccumulateGrad node) that a backward
/// pass from `roots` reaches, roots that are leaves included, each once.
pub(crate) fn leaves(roots: &[Tensor]) -> Result<Vec<Tensor>, String> {
    extern "C" fn push(state: *mut c_void, leaf: *mut AtTensor) {
        // SAFETY: `state` is the `Vec<Tensor>` passed below, alive and not
        // otherwise borrowed during the call.
        let out = unsafe { &mut *(state as *mut Vec<Tensor>) };
        out.push(own(leaf));
    }
    let r: Vec<_> = roots.iter().map(ptr).collect();
    let mut out: Vec<Tensor> = Vec::new();
    // SAFETY: live tensors; `push` only appends to `out`.
    check(unsafe {
        ferry_leaves(
            r.as_ptr(),
            r.len() as c_int,
            &mut out as *mut Vec<Tensor> as *mut c_void,
            push,
        )
    })?;
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn grad_with_seeds_matches_the_engine_and_leaves_are_found() {
        let a = Tensor::randn([3, 3], (Kind::Double, Device::Cpu)).set_requires_grad(true);
        let b = Tensor::randn([3, 3], (Kind::Double, Device::Cpu)).set_requires_grad(true);
        let unused = Tensor::randn([3], (Kind::Double, Device::Cpu)).set_requires_grad(true);
        let y = (&a * &b).relu() + &a;
        let seed = Tensor::randn([3, 3], (Kind::Double, Device::Cpu));
        let found = leaves(std::slice::from_ref(&y)).unwrap();
        let ids: Vec<usize> = found.iter().map(tensor_id).collect();
        assert_eq!(found.len(), 2);
        assert!(ids.contains(&tensor_id(&a)) && ids.contains(&tensor_id(&b)));
        assert!(!ids.contains(&tensor_id(&unused)));
        let g = grad(
            std::slice::from_ref(&y),
            std::slice::from_ref(&seed),
            &[a.shallow_clone(), b.shallow_clone(), unused.shallow_clone()],
            true,
        )
        .unwrap();
        // The (t * g).sum() identity: the same gradients via tch's own backward.
        let reference =
            Tensor::run_backward(&[(&y * &seed).sum(Kind::Double)], &[&a, &b], true, false);
        assert!(g[0]
            .as_ref()
            .unwrap()
            .allclose(&reference[0], 1e-12, 1e-12, false));
        assert!(g[1]
            .as_ref()
            .unwrap()
            .allclose(&reference[1], 1e-12, 1e-12, false));
        assert!(g[2].is_none(), "an unreached input has no gradient");
        // .grad was never touched.
        assert!(!a.grad().defined());
        // A leaf root is its own leaf, and its gradient is the seed.
        let g = grad(
            std::slice::from_ref(&a),
            std::slice::from_ref(&seed),
            std::slice::from_ref(&a),
            true,
        )
        .unwrap();
        assert!(g[0].as_ref().unwrap().equal(&seed));
        assert_eq!(leaves(std::slice::from_ref(&a)).unwrap().len(), 1);
    }

    #[test]
    fn engine_errors_are_returned_not_thrown() {
        let a = Tensor::randn([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let y = &a * 2.0;
        let wrong_seed = Tensor::ones([4], (Kind::Float, Device::Cpu));
        let err = grad(std::slice::from_ref(&y), &[wrong_seed], &[a], true).unwrap_err();
        assert!(err.contains("shape") || err.contains("size"), "{err}");
    }
}
