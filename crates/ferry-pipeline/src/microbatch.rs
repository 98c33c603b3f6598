//! Splitting a batch into microbatches, and merging the last stage's
//! outputs back, as PyTorch's `split_args_kwargs_into_chunks` and
//! `merge_chunks` do: every tensor is cut with `tensor_split` semantics
//! (10 rows into 4 microbatches: 3, 3, 2, 2), along its own dimension, and
//! what is marked so is replicated.
//!
//! What stage 0 takes says how it splits, in its type, so the compiler
//! checks it like the stages' types:
//!
//! - a [`Tensor`] splits along dimension 0 (PyTorch's `TensorChunkSpec(0)`);
//! - [`SplitAlong<D>`] splits its tensor along dimension `D`
//!   (`TensorChunkSpec(D)`);
//! - [`Replicate<T>`] gives every microbatch the whole value (`_Replicate`);
//! - numbers, `bool`, `String` and `()` pass through to every microbatch, as
//!   PyTorch passes non-tensor values;
//! - `Option`, `Vec` and tuples of these split element by element.
//!
//! A tuple of them splits too (what [`Pipeline::step`](crate::Pipeline::step)
//! takes), and so does a struct of them with `#[derive(Split)]` (each
//! field split as its type says), or one that implements [`Split`] by hand.
//!
//! ```
//! use ferry_pipeline::{Replicate, Split, SplitAlong};
//! use ferry_tch::Tensor;
//!
//! #[derive(serde::Serialize, serde::Deserialize, Split)]
//! struct Batch {
//!     tokens: Tensor,
//!     mask: SplitAlong<1>,
//!     table: Replicate<Tensor>,
//!     causal: bool,
//! }
//!
//! let f = (tch::Kind::Float, tch::Device::Cpu);
//! let batch = Batch {
//!     tokens: Tensor::from(tch::Tensor::zeros([10, 4], f)),
//!     mask: SplitAlong(Tensor::from(tch::Tensor::zeros([2, 10], f))),
//!     table: Replicate(Tensor::from(tch::Tensor::zeros([3], f))),
//!     causal: true,
//! };
//! let parts = batch.split(4)?;
//! assert_eq!(parts[0].tokens.size(), [3, 4]);
//! assert_eq!(parts[3].mask.size(), [2, 2]);
//! assert!(parts.iter().all(|p| p.causal && p.table.size() == [3]));
//! # Ok::<(), ferry_pipeline::SplitError>(())
//! ```
//!
//! ```
//! use ferry_pipeline::{Replicate, Split, SplitAlong};
//! use ferry_tch::Tensor;
//!
//! // Tokens split by row, a mask by column, a table every microbatch uses
//! // whole, and a flag passed through.
//! type Input = (Tensor, SplitAlong<1>, Replicate<Tensor>, bool);
//! let f = (tch::Kind::Float, tch::Device::Cpu);
//! let batch: Input = (
//!     Tensor::from(tch::Tensor::zeros([10, 4], f)),
//!     SplitAlong(Tensor::from(tch::Tensor::zeros([2, 10], f))),
//!     Replicate(Tensor::from(tch::Tensor::zeros([3], f))),
//!     true,
//! );
//! let parts = batch.split(4)?;
//! let rows: Vec<i64> = parts.iter().map(|p| p.0.size()[0]).collect();
//! assert_eq!(rows, [3, 3, 2, 2]);
//! assert_eq!(parts[3].1 .0.size(), [2, 2]);
//! assert_eq!(parts[3].2 .0.size(), [3]);
//! # Ok::<(), ferry_pipeline::SplitError>(())
//! ```

use ferry_tch::Tensor;
use serde::{Deserialize, Serialize};

/// Why a batch could not be split.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    /// A tensor is shorter along its split dimension than the microbatch
    /// count (PyTorch refuses it too: a microbatch would be empty).
    #[error("a tensor of shape {shape:?} has {size} along dimension {dim}, fewer than the {microbatches} microbatches")]
    TooShort {
        /// The tensor's shape.
        shape: Vec<i64>,
        /// Its split dimension.
        dim: i64,
        /// Its size there.
        size: i64,
        /// The microbatch count.
        microbatches: usize,
    },
    /// A tensor has no such dimension to split along.
    #[error("a tensor of shape {shape:?} has no dimension {dim} to split along")]
    NoDimension {
        /// The tensor's shape.
        shape: Vec<i64>,
        /// The dimension asked for.
        dim: i64,
    },
    /// Asked for no microbatch at all.
    #[error("cannot split into 0 microbatches")]
    Zero,
}

/// A value cut into microbatches: what a batch (or a field, or an element
/// of it) does when [`Pipeline::step`](crate::Pipeline::step) splits it.
/// [`Part`](Self::Part) is what one microbatch holds, the type stage 0
/// takes. Implemented for [`Tensor`] (along dimension 0, also from a
/// `tch::Tensor`), [`SplitAlong`], [`Replicate`], plain values (passed
/// through), `Option`, `Vec` and tuples; derive it (`#[derive(Split)]`)
/// or implement it for your own struct field by field.
///
/// ```
/// use ferry_pipeline::{Replicate, Split, SplitError};
/// use ferry_tch::Tensor;
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Batch {
///     tokens: Tensor,
///     table: Replicate<Tensor>,
/// }
///
/// impl Split for Batch {
///     type Part = Batch;
///     fn split(&self, microbatches: usize) -> Result<Vec<Batch>, SplitError> {
///         let tokens = self.tokens.split(microbatches)?;
///         let table = self.table.split(microbatches)?;
///         Ok(tokens.into_iter().zip(table).map(|(tokens, table)| Batch { tokens, table }).collect())
///     }
/// }
/// ```
pub trait Split {
    /// One microbatch's part.
    type Part;
    /// The `microbatches` parts of `self`, in order.
    fn split(&self, microbatches: usize) -> Result<Vec<Self::Part>, SplitError>;
}

/// Splits `tensor` along `dim` into `microbatches` parts with
/// `tensor_split` semantics (the first `size % microbatches` parts one
/// longer); a negative `dim` counts from the end.
pub fn split_tensor(
    tensor: &tch::Tensor,
    dim: i64,
    microbatches: usize,
) -> Result<Vec<Tensor>, SplitError> {
    if microbatches == 0 {
        return Err(SplitError::Zero);
    }
    let shape = tensor.size();
    let rank = shape.len() as i64;
    let d = if dim < 0 { dim + rank } else { dim };
    if d < 0 || d >= rank {
        return Err(SplitError::NoDimension { shape, dim });
    }
    let size = shape[d as usize];
    if size < microbatches as i64 {
        return Err(SplitError::TooShort {
            shape,
            dim,
            size,
            microbatches,
        });
    }
    Ok(tensor
        .tensor_split(microbatches as i64, d)
        .into_iter()
        .map(Tensor::from)
        .collect())
}

impl Split for Tensor {
    type Part = Tensor;
    fn split(&self, microbatches: usize) -> Result<Vec<Tensor>, SplitError> {
        split_tensor(self, 0, microbatches)
    }
}

impl Split for tch::Tensor {
    type Part = Tensor;
    fn split(&self, microbatches: usize) -> Result<Vec<Tensor>, SplitError> {
        split_tensor(self, 0, microbatches)
    }
}

/// A tensor split along dimension `D` (PyTorch's `TensorChunkSpec(D)`);
/// negative `D` counts from the end.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SplitAlong<const D: i64>(pub Tensor);

impl<const D: i64> Split for SplitAlong<D> {
    type Part = SplitAlong<D>;
    fn split(&self, microbatches: usize) -> Result<Vec<Self>, SplitError> {
        Ok(split_tensor(&self.0, D, microbatches)?
            .into_iter()
            .map(SplitAlong)
            .collect())
    }
}

impl<const D: i64> std::ops::Deref for SplitAlong<D> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        &self.0
    }
}

/// A value every microbatch gets whole (PyTorch's `_Replicate`): a tensor
/// (shared, not copied: [`Tensor`]'s clone is shallow), or anything else
/// that clones.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Replicate<T>(pub T);

impl<T: Clone> Split for Replicate<T> {
    type Part = Replicate<T>;
    fn split(&self, microbatches: usize) -> Result<Vec<Self>, SplitError> {
        if microbatches == 0 {
            return Err(SplitError::Zero);
        }
        Ok(vec![self.clone(); microbatches])
    }
}

impl<T> std::ops::Deref for Replicate<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Plain values pass through to every microbatch, as PyTorch passes
/// non-tensor arguments.
macro_rules! pass_through {
    ($($t:ty),*) => {$(
        impl Split for $t {
            type Part = $t;
            fn split(&self, microbatches: usize) -> Result<Vec<Self>, SplitError> {
                if microbatches == 0 {
                    return Err(SplitError::Zero);
                }
                Ok(vec![self.clone(); microbatches])
            }
        }
    )*};
}
pass_through!(
    bool,
    i8,
    i16,
    i32,
    i64,
    u8,
    u16,
    u32,
    u64,
    usize,
    isize,
    f32,
    f64,
    char,
    String,
    ()
);

impl<T: Split> Split for Option<T> {
    type Part = Option<T::Part>;
    fn split(&self, microbatches: usize) -> Result<Vec<Self::Part>, SplitError> {
        match self {
            Some(value) => Ok(value.split(microbatches)?.into_iter().map(Some).collect()),
            None if microbatches == 0 => Err(SplitError::Zero),
            None => Ok((0..microbatches).map(|_| None).collect()),
        }
    }
}

impl<T: Split> Split for Vec<T> {
    type Part = Vec<T::Part>;
    /// Every element split, then regrouped: microbatch `i` holds the `i`th
    /// part of every element.
    fn split(&self, microbatches: usize) -> Result<Vec<Self::Part>, SplitError> {
        if microbatches == 0 {
            return Err(SplitError::Zero);
        }
        let mut out: Vec<Vec<T::Part>> = (0..microbatches)
            .map(|_| Vec::with_capacity(self.len()))
            .collect();
        for element in self {
            for (part, piece) in out.iter_mut().zip(element.split(microbatches)?) {
                part.push(piece);
            }
        }
        Ok(out)
    }
}

macro_rules! tuples {
    ($(($($t:ident $v:ident),+)),*) => {$(
        impl<$($t: Split),+> Split for ($($t,)+) {
            type Part = ($($t::Part,)+);
            fn split(&self, microbatches: usize) -> Result<Vec<Self::Part>, SplitError> {
                let ($($v,)+) = self;
                $(let mut $v = $v.split(microbatches)?.into_iter();)+
                Ok((0..microbatches)
                    .filter_map(|_| Some(($($v.next()?,)+)))
                    .collect())
            }
        }
    )*};
}
tuples!(
    (A a),
    (A a, B b),
    (A a, B b, C c),
    (A a, B b, C c, D d),
    (A a, B b, C c, D d, E e),
    (A a, B b, C c, D d, E e, F f)
);

/// Merges the last stage's outputs of every microbatch into one value, as
/// PyTorch's `merge_chunks` with `TensorChunkSpec(dim)`: the tensor at each
/// position is concatenated along `dim` across the microbatches; what is not
/// a tensor comes from the first microbatch.
pub(crate) fn merge(
    outputs: &[ferry_tch::tree::Flat],
    dim: i64,
) -> Result<ferry_tch::tree::Flat, String> {
    let first = outputs.first().ok_or("no microbatch output to merge")?;
    let count = first.tensors.len();
    let mut tensors = Vec::with_capacity(count);
    for position in 0..count {
        let mut parts = Vec::with_capacity(outputs.len());
        for (mb, output) in outputs.iter().enumerate() {
            let t = output.tensors.get(position).ok_or_else(|| {
                format!(
                    "microbatch {mb}'s output holds {} tensors, microbatch 0's {count}",
                    output.tensors.len()
                )
            })?;
            if t.dim() == 0 {
                return Err(format!(
                    "tensor {position} of the output is a 0-dimensional tensor: nothing to concatenate along"
                ));
            }
            parts.push(t.shallow_clone());
        }
        let merged = tch::Tensor::f_cat(&parts, dim).map_err(|e| {
            format!(
                "cannot concatenate tensor {position} of the outputs along dimension {dim}: {e}"
            )
        })?;
        tensors.push(merged);
    }
    Ok(ferry_tch::tree::Flat {
        bytes: first.bytes.clone(),
        tensors,
    })
}
