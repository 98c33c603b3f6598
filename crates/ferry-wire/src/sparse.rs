//! Sparse COO tensors on the wire: the layout that travels in the payload
//! beside the two dense tensors (indices and values) a sparse tensor is
//! made of, and the check a receiver runs before it rebuilds one.
//!
//! As in PyTorch's RPC, a sparse COO tensor of `size` with `sparse_dim`
//! sparse and `dense_dim` dense dimensions and `nnz` specified elements
//! travels as its `indices` (an `int64` tensor of shape
//! `[sparse_dim, nnz]`) and its `values` (shape `[nnz, size[sparse_dim..]]`),
//! each through the tensor table like any strided tensor, plus a
//! [`SparseCoo`] in the payload. [`SparseCoo::check`] holds the layout
//! against the two descriptors that arrived, so a receiver never hands
//! inconsistent parts to libtorch: shapes, element types, devices,
//! dimension counts and the size's element count are checked here, sans
//! libtorch; the index values themselves (in range, sorted when claimed
//! coalesced) are the rebuilding side's to check (`ferry-tch`).
//!
//! ```
//! use ferry_wire::sparse::SparseCoo;
//! use ferry_wire::{DType, Device, Limits, TensorDescriptor};
//!
//! // A 4×3 matrix with two specified rows of 3 values each (sparse_dim 1).
//! let layout = SparseCoo { size: vec![4, 3], sparse_dim: 1, dense_dim: 1, coalesced: true };
//! let indices = TensorDescriptor::contiguous(DType::I64, &[1, 2], Device::Cpu);
//! let values = TensorDescriptor::contiguous(DType::F32, &[2, 3], Device::Cpu);
//! assert_eq!(layout.check(&indices, &values, &Limits::default()), Ok(2));
//! let wrong = TensorDescriptor::contiguous(DType::F32, &[2, 4], Device::Cpu);
//! assert!(layout.check(&indices, &wrong, &Limits::default()).is_err());
//! ```

use serde::{Deserialize, Serialize};

use crate::{DType, Limits, TensorDescriptor, WireError};

/// The layout of a sparse COO tensor, which travels in the payload beside
/// its indices and values tensors (see the [module](self)).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SparseCoo {
    /// The sparse tensor's size, one entry per dimension (sparse ones
    /// first).
    pub size: Vec<i64>,
    /// How many leading dimensions are sparse (rows of the indices).
    pub sparse_dim: u32,
    /// How many trailing dimensions are dense (dimensions of each value
    /// after the first).
    pub dense_dim: u32,
    /// Whether the sender's tensor was coalesced: indices sorted and
    /// unique.
    pub coalesced: bool,
}

impl SparseCoo {
    /// Checks this layout against the descriptors of the indices and the
    /// values that arrived with it, and returns the number of specified
    /// elements (`nnz`).
    ///
    /// `size` has `sparse_dim + dense_dim` entries, at most
    /// `limits.max_dims`, none negative, and its element count fits an
    /// `i64`; the indices are `int64` of shape `[sparse_dim, nnz]`; the
    /// values have shape `[nnz, size[sparse_dim..]]`; both live on the
    /// same device. Anything else is [`WireError::TooLarge`] (too many
    /// dimensions) or [`WireError::InvalidDescriptor`] naming what is off.
    pub fn check(
        &self,
        indices: &TensorDescriptor,
        values: &TensorDescriptor,
        limits: &Limits,
    ) -> Result<u64, WireError> {
        let bad = |m: String| WireError::InvalidDescriptor(format!("sparse COO tensor: {m}"));
        let ndim = self.size.len();
        if ndim > limits.max_dims {
            return Err(WireError::TooLarge {
                what: "sparse tensor dimension count",
                len: ndim as u64,
                max: limits.max_dims as u64,
            });
        }
        let sparse_dim = self.sparse_dim as usize;
        if sparse_dim as u64 + u64::from(self.dense_dim) != ndim as u64 {
            return Err(bad(format!(
                "sparse_dim {} plus dense_dim {} is not its {ndim} dimensions",
                self.sparse_dim, self.dense_dim
            )));
        }
        if let Some(d) = self.size.iter().find(|&&d| d < 0) {
            return Err(bad(format!("negative size {d} in {:?}", self.size)));
        }
        // libtorch counts elements in an i64; count the dimensions of size
        // zero as one, so that no dimension overflows either.
        if self
            .size
            .iter()
            .try_fold(1i64, |acc, &d| acc.checked_mul(d.max(1)))
            .is_none()
        {
            return Err(bad(format!(
                "the element count of size {:?} overflows",
                self.size
            )));
        }
        if indices.dtype != DType::I64 {
            return Err(bad(format!("indices are {}, not int64", indices.dtype)));
        }
        let [rows, nnz] = indices.shape[..] else {
            return Err(bad(format!(
                "indices have shape {:?}, not [sparse_dim, nnz]",
                &indices.shape[..]
            )));
        };
        if rows != i64::from(self.sparse_dim) {
            return Err(bad(format!(
                "indices have {rows} rows for {} sparse dimensions",
                self.sparse_dim
            )));
        }
        let expected = std::iter::once(nnz).chain(self.size[sparse_dim..].iter().copied());
        if !values.shape.iter().copied().eq(expected) {
            return Err(bad(format!(
                "values have shape {:?}, not [{nnz}] followed by the dense size {:?}",
                &values.shape[..],
                &self.size[sparse_dim..]
            )));
        }
        if indices.device != values.device {
            return Err(bad(format!(
                "indices on {} and values on {}",
                indices.device, values.device
            )));
        }
        // `nnz` is a validated descriptor's size: not negative.
        Ok(nnz as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    fn desc(dtype: DType, shape: &[i64]) -> TensorDescriptor {
        TensorDescriptor::contiguous(dtype, shape, Device::Cpu)
    }

    fn layout(size: &[i64], sparse_dim: u32) -> SparseCoo {
        SparseCoo {
            size: size.to_vec(),
            sparse_dim,
            dense_dim: size.len() as u32 - sparse_dim,
            coalesced: false,
        }
    }

    #[test]
    fn consistent_layouts_pass_with_their_nnz() {
        let limits = Limits::default();
        let l = layout(&[5, 6, 2], 2);
        let got = l.check(
            &desc(DType::I64, &[2, 7]),
            &desc(DType::F64, &[7, 2]),
            &limits,
        );
        assert_eq!(got, Ok(7));
        // Zero specified elements.
        let got = l.check(
            &desc(DType::I64, &[2, 0]),
            &desc(DType::F64, &[0, 2]),
            &limits,
        );
        assert_eq!(got, Ok(0));
        // No sparse dimension (a dense tensor in sparse clothing).
        let l = layout(&[3], 0);
        let got = l.check(
            &desc(DType::I64, &[0, 1]),
            &desc(DType::F32, &[1, 3]),
            &limits,
        );
        assert_eq!(got, Ok(1));
    }

    #[test]
    fn inconsistent_layouts_are_named() {
        let limits = Limits::default();
        let l = layout(&[5, 6], 2);
        let cases = [
            (
                l.clone(),
                desc(DType::I32, &[2, 3]),
                desc(DType::F32, &[3]),
                "int32",
            ),
            (
                l.clone(),
                desc(DType::I64, &[6]),
                desc(DType::F32, &[6]),
                "[sparse_dim, nnz]",
            ),
            (
                l.clone(),
                desc(DType::I64, &[1, 3]),
                desc(DType::F32, &[3]),
                "1 rows",
            ),
            (
                l.clone(),
                desc(DType::I64, &[2, 3]),
                desc(DType::F32, &[4]),
                "values have shape",
            ),
            (
                l.clone(),
                desc(DType::I64, &[2, 3]),
                desc(DType::F32, &[3, 1]),
                "values have shape",
            ),
            (
                SparseCoo {
                    dense_dim: 1,
                    ..l.clone()
                },
                desc(DType::I64, &[2, 3]),
                desc(DType::F32, &[3]),
                "dense_dim 1",
            ),
            (
                SparseCoo {
                    size: vec![-1, 6],
                    ..l.clone()
                },
                desc(DType::I64, &[2, 3]),
                desc(DType::F32, &[3]),
                "negative size",
            ),
            (
                SparseCoo {
                    size: vec![i64::MAX, 2],
                    ..l.clone()
                },
                desc(DType::I64, &[2, 3]),
                desc(DType::F32, &[3]),
                "overflows",
            ),
        ];
        for (l, i, v, needle) in cases {
            let err = l.check(&i, &v, &limits).unwrap_err();
            assert!(matches!(err, WireError::InvalidDescriptor(_)), "{err}");
            assert!(err.to_string().contains(needle), "{err} lacks {needle}");
        }
        let mut v = desc(DType::F32, &[3]);
        v.device = Device::Cuda(0);
        let err = l
            .check(&desc(DType::I64, &[2, 3]), &v, &limits)
            .unwrap_err();
        assert!(err.to_string().contains("cuda:0"), "{err}");
    }

    #[test]
    fn too_many_dimensions_are_refused_before_anything_else() {
        let limits = Limits::default();
        let l = layout(&vec![1; limits.max_dims + 1], 1);
        let err = l
            .check(&desc(DType::I64, &[1, 1]), &desc(DType::F32, &[1]), &limits)
            .unwrap_err();
        assert!(matches!(err, WireError::TooLarge { .. }), "{err}");
        // A dimension count that does not fit the sum of the two u32s.
        let l = SparseCoo {
            size: vec![1; 2],
            sparse_dim: u32::MAX,
            dense_dim: u32::MAX,
            coalesced: true,
        };
        let err = l
            .check(&desc(DType::I64, &[1, 1]), &desc(DType::F32, &[1]), &limits)
            .unwrap_err();
        assert!(err.to_string().contains("dense_dim"), "{err}");
    }
}
