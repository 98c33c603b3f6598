//! Sparse COO tensors: taken apart into their indices and values on the
//! way out, rebuilt with libtorch's `sparse_coo_tensor` on the way in, as
//! PyTorch's RPC does (see `ferry_wire::sparse` for the layout that
//! travels and the checks made on it before libtorch sees anything).

use ferry_wire::sparse::SparseCoo;
use ferry_wire::{Limits, TensorDescriptor};
use tch::Kind;

use crate::TchError;

/// The parts of the sparse COO tensor `tensor`: its indices, its values
/// and its layout. The indices and values are libtorch's own (`_indices()`,
/// `_values()`: no copy, not coalesced first), so the tensor arrives with
/// the same specified elements in the same order.
pub(crate) fn parts(
    tensor: &tch::Tensor,
) -> Result<(tch::Tensor, tch::Tensor, SparseCoo), TchError> {
    let size = crate::outgoing::sizes(tensor)?;
    let sparse_dim = tensor.f_sparse_dim()?;
    let dense_dim = tensor.f_dense_dim()?;
    let layout = SparseCoo {
        size,
        sparse_dim: u32::try_from(sparse_dim)
            .map_err(|_| TchError::Sparse(format!("sparse_dim {sparse_dim}")))?,
        dense_dim: u32::try_from(dense_dim)
            .map_err(|_| TchError::Sparse(format!("dense_dim {dense_dim}")))?,
        coalesced: tensor.f_is_coalesced()?,
    };
    Ok((
        tensor.f_internal_indices()?,
        tensor.f_internal_values()?,
        layout,
    ))
}

/// The sparse COO tensor of `layout` made of the received `indices` and
/// `values` (whose descriptors are given), after checking that they fit:
/// the layout against the descriptors (`SparseCoo::check`), then the index
/// values (each within its dimension's size, and sorted without repeats
/// if the sender claimed the tensor coalesced), which libtorch's
/// constructor takes on trust.
pub(crate) fn rebuild(
    layout: &SparseCoo,
    indices: (tch::Tensor, &TensorDescriptor),
    values: (tch::Tensor, &TensorDescriptor),
) -> Result<tch::Tensor, TchError> {
    let (indices, indices_desc) = indices;
    let (values, values_desc) = values;
    let nnz = layout
        .check(indices_desc, values_desc, &Limits::default())
        .map_err(|e| TchError::Sparse(e.to_string()))?;
    let sparse_dim = layout.sparse_dim as usize;
    let sparse_size = &layout.size[..sparse_dim];
    if nnz > 0 && sparse_dim > 0 {
        let device = indices.device();
        let low = indices.f_min()?.f_int64_value(&[])?;
        if low < 0 {
            return Err(TchError::Sparse(format!("negative index {low}")));
        }
        let bounds = tch::Tensor::from_slice(sparse_size).f_to_device(device)?;
        let high = indices.f_amax([1i64], false)?;
        let within = high.f_lt_tensor(&bounds)?.f_all()?.f_int64_value(&[])? != 0;
        if !within {
            return Err(TchError::Sparse(format!(
                "an index is out of bounds for size {:?} (largest per dimension: {:?})",
                layout.size,
                Vec::<i64>::try_from(&high).unwrap_or_default()
            )));
        }
    }
    if layout.coalesced && nnz > 1 {
        // Coalesced: the indices' row-major positions strictly increase.
        // They fit an i64: each index is within its size, and the check
        // bounded the product of the sizes.
        let mut strides = vec![1i64; sparse_dim];
        for d in (0..sparse_dim.saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * sparse_size[d + 1].max(1);
        }
        let strides = tch::Tensor::from_slice(&strides)
            .f_to_device(indices.device())?
            .f_view([sparse_dim as i64, 1])?;
        let linear =
            indices
                .f_mul(&strides)?
                .f_sum_dim_intlist(Some(&[0i64][..]), false, Kind::Int64)?;
        let n = nnz as i64;
        let increasing = linear
            .f_narrow(0, 1, n - 1)?
            .f_gt_tensor(&linear.f_narrow(0, 0, n - 1)?)?
            .f_all()?
            .f_int64_value(&[])?
            != 0;
        if !increasing {
            return Err(TchError::Sparse(
                "claimed coalesced, but its indices are not sorted and unique".into(),
            ));
        }
    }
    let options = (values.f_kind()?, values.device());
    Ok(tch::Tensor::f_sparse_coo_tensor_indices_size(
        &indices,
        &values,
        layout.size.as_slice(),
        options,
        layout.coalesced,
    )?)
}
