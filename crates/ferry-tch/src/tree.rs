//! Flattening any serde value that contains tensors into its tensors plus
//! the rest, and back: PyTorch's pytree `tree_flatten` / `tree_unflatten`
//! for Rust values.
//!
//! [`flatten`] serialises a value with every [`Tensor`](crate::Tensor) inside replaced by
//! its index in a list, and returns the list (shallow handles: no tensor
//! data is copied) and the bytes of the rest. [`unflatten`] rebuilds a value
//! of the same type from the bytes and a list of tensors, which may be other
//! tensors of the same structure (received ones, gradients, detached
//! copies). Pipeline stages use it to hand any value that holds tensors to
//! the next stage and to line gradients up with the tensors they belong to.
//!
//! ```
//! use ferry_tch::{tree, Tensor};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Hidden {
//!     state: Tensor,
//!     mask: Option<Tensor>,
//!     step: u32,
//! }
//!
//! let value = Hidden {
//!     state: Tensor::from(tch::Tensor::ones([2, 3], (tch::Kind::Float, tch::Device::Cpu))),
//!     mask: None,
//!     step: 7,
//! };
//! let flat = tree::flatten(&value)?;
//! assert_eq!(flat.tensors.len(), 1);
//! let doubled: Vec<tch::Tensor> = flat.tensors.iter().map(|t| t * 2).collect();
//! let back: Hidden = tree::unflatten(&flat.bytes, doubled)?;
//! assert_eq!(back.step, 7);
//! assert_eq!(back.state.sum(tch::Kind::Float).double_value(&[]), 12.0);
//! # Ok::<(), ferry_tch::tree::TreeError>(())
//! ```

use std::cell::RefCell;

use serde::de::DeserializeOwned;
use serde::Serialize;

/// A value taken apart by [`flatten`].
#[derive(Debug)]
pub struct Flat {
    /// The value without its tensors (postcard), each tensor replaced by its
    /// index in [`tensors`](Self::tensors).
    pub bytes: Vec<u8>,
    /// The value's tensors, in the order serialisation meets them (shallow
    /// handles on the value's own tensors).
    pub tensors: Vec<tch::Tensor>,
}

/// Why a value could not be flattened or rebuilt.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    /// The value's `Serialize` failed.
    #[error("could not flatten the value: {0}")]
    Flatten(String),
    /// The bytes do not describe a value of the asked type.
    #[error("could not rebuild the value: {0}")]
    Unflatten(String),
    /// The value refers to a tensor the list does not have.
    #[error("the value refers to tensor {index} but only {len} tensors were given")]
    MissingTensor {
        /// The index in the bytes.
        index: u32,
        /// How many tensors were given.
        len: usize,
    },
    /// A tensor of the list was used twice (the bytes are not from [`flatten`]).
    #[error("the value refers to tensor {0} twice")]
    TensorUsedTwice(u32),
    /// Fewer tensors were used than given.
    #[error("{given} tensors were given but the value holds {used}")]
    UnusedTensors {
        /// How many were given.
        given: usize,
        /// How many the value refers to.
        used: usize,
    },
    /// [`flatten`] or [`unflatten`] called from inside a value's own
    /// (de)serialisation.
    #[error("flatten and unflatten do not nest")]
    Nested,
}

/// What the thread is doing with tensors it (de)serialises.
enum Mode {
    Flatten(Vec<tch::Tensor>),
    Unflatten {
        list: Vec<Option<tch::Tensor>>,
        /// The first tensor error, which postcard's own error would hide.
        error: Option<TreeError>,
    },
}

thread_local! {
    static MODE: RefCell<Option<Mode>> = const { RefCell::new(None) };
}

/// Clears the thread's mode when dropped (also on a panic in user code).
struct ModeGuard;

impl Drop for ModeGuard {
    fn drop(&mut self) {
        MODE.with(|m| m.borrow_mut().take());
    }
}

fn enter(mode: Mode) -> Result<ModeGuard, TreeError> {
    MODE.with(|m| {
        let mut m = m.borrow_mut();
        if m.is_some() {
            return Err(TreeError::Nested);
        }
        *m = Some(mode);
        Ok(ModeGuard)
    })
}

/// Takes `value` apart into its tensors and the bytes of the rest.
pub fn flatten<T: Serialize + ?Sized>(value: &T) -> Result<Flat, TreeError> {
    let guard = enter(Mode::Flatten(Vec::new()))?;
    let bytes = postcard::to_stdvec(value).map_err(|e| TreeError::Flatten(e.to_string()));
    let tensors = match MODE.with(|m| m.borrow_mut().take()) {
        Some(Mode::Flatten(tensors)) => tensors,
        _ => Vec::new(),
    };
    drop(guard);
    Ok(Flat {
        bytes: bytes?,
        tensors,
    })
}

/// Rebuilds a value of type `T` from the bytes [`flatten`] made of a value
/// of the same type and a list of as many tensors, which take the places of
/// the original ones in order.
pub fn unflatten<T: DeserializeOwned>(
    bytes: &[u8],
    tensors: Vec<tch::Tensor>,
) -> Result<T, TreeError> {
    let given = tensors.len();
    let guard = enter(Mode::Unflatten {
        list: tensors.into_iter().map(Some).collect(),
        error: None,
    })?;
    let value = postcard::from_bytes::<T>(bytes);
    let (left, error) = match MODE.with(|m| m.borrow_mut().take()) {
        Some(Mode::Unflatten { list, error }) => (list, error),
        _ => (Vec::new(), None),
    };
    drop(guard);
    let value = value.map_err(|e| error.unwrap_or_else(|| TreeError::Unflatten(e.to_string())))?;
    let unused = left.iter().filter(|t| t.is_some()).count();
    if unused > 0 {
        return Err(TreeError::UnusedTensors {
            given,
            used: given - unused,
        });
    }
    Ok(value)
}

/// How a tensor serialises right now: inside [`flatten`], pushed to its list
/// (`Some(index)`); otherwise `None` (onto the wire).
pub(crate) fn push_flattened(tensor: &tch::Tensor) -> Option<u32> {
    MODE.with(|m| match m.borrow_mut().as_mut() {
        Some(Mode::Flatten(list)) => {
            list.push(tensor.shallow_clone());
            Some((list.len() - 1) as u32)
        }
        _ => None,
    })
}

/// Whether tensors deserialise from an [`unflatten`] list right now.
pub(crate) fn unflattening() -> bool {
    MODE.with(|m| matches!(m.borrow().as_ref(), Some(Mode::Unflatten { .. })))
}

/// Takes tensor `index` of the [`unflatten`] list.
pub(crate) fn take_unflattened(index: u32) -> Result<tch::Tensor, TreeError> {
    MODE.with(|m| match m.borrow_mut().as_mut() {
        Some(Mode::Unflatten { list, error }) => {
            let len = list.len();
            let taken = match list.get_mut(index as usize) {
                None => Err(TreeError::MissingTensor { index, len }),
                Some(slot) => slot.take().ok_or(TreeError::TensorUsedTwice(index)),
            };
            taken.map_err(|e| {
                let text = e.to_string();
                error.get_or_insert(e);
                TreeError::Unflatten(text)
            })
        }
        _ => Err(TreeError::Unflatten("not unflattening".into())),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::Tensor;
    use std::collections::BTreeMap;
    use tch::{Device, Kind};

    fn t(values: &[f32]) -> Tensor {
        Tensor::from(tch::Tensor::from_slice(values))
    }

    #[derive(serde::Serialize, serde::Deserialize, Debug)]
    enum Message {
        Empty,
        One(Tensor),
        Pair {
            a: Tensor,
            b: Vec<Tensor>,
            label: String,
        },
    }

    #[test]
    fn nested_values_round_trip_with_their_tensors_in_order() {
        let value = (
            Message::Pair {
                a: t(&[1.0]),
                b: vec![t(&[2.0, 3.0]), t(&[4.0])],
                label: "x".into(),
            },
            Message::Empty,
            BTreeMap::from([(1u8, Message::One(t(&[5.0])))]),
        );
        let flat = flatten(&value).unwrap();
        let sums: Vec<f64> = flat
            .tensors
            .iter()
            .map(|t| t.sum(Kind::Float).double_value(&[]))
            .collect();
        assert_eq!(sums, [1.0, 5.0, 4.0, 5.0]);
        let back: (Message, Message, BTreeMap<u8, Message>) =
            unflatten(&flat.bytes, flat.tensors).unwrap();
        match back.0 {
            Message::Pair { a, b, label } => {
                assert_eq!(a.double_value(&[0]), 1.0);
                assert_eq!(b[1].double_value(&[0]), 4.0);
                assert_eq!(label, "x");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(back.1, Message::Empty));
        assert!(matches!(back.2[&1], Message::One(_)));
    }

    #[test]
    fn flattening_shares_storage_and_copies_nothing() {
        let value = vec![t(&[1.0, 2.0])];
        let flat = flatten(&value).unwrap();
        assert_eq!(flat.tensors[0].data_ptr(), value[0].data_ptr());
    }

    #[test]
    fn wrong_tensor_counts_are_typed_errors() {
        let value = (t(&[1.0]), t(&[2.0]));
        let flat = flatten(&value).unwrap();
        let one = vec![tch::Tensor::zeros([1], (Kind::Float, Device::Cpu))];
        let err = unflatten::<(Tensor, Tensor)>(&flat.bytes, one).unwrap_err();
        assert!(err.to_string().contains("tensor 1 but only 1"), "{err}");
        let three = (0..3)
            .map(|_| tch::Tensor::zeros([1], (Kind::Float, Device::Cpu)))
            .collect();
        let err = unflatten::<(Tensor, Tensor)>(&flat.bytes, three).unwrap_err();
        assert!(
            matches!(err, TreeError::UnusedTensors { given: 3, used: 2 }),
            "{err}"
        );
    }

    #[test]
    fn garbage_bytes_are_an_error_not_a_panic() {
        for bytes in [&[][..], &[0xff; 9][..], &[1, 200, 3][..]] {
            assert!(unflatten::<(Tensor, String)>(bytes, Vec::new()).is_err());
        }
        // The thread is usable afterwards.
        let flat = flatten(&t(&[1.0])).unwrap();
        assert_eq!(flat.tensors.len(), 1);
    }

    #[test]
    fn a_tensor_used_twice_is_refused() {
        // Inside `flatten` a tensor is only its index: the bytes are [0, 1].
        let flat = flatten(&(t(&[1.0]), t(&[2.0]))).unwrap();
        let mut bytes = flat.bytes.clone();
        let second = bytes.iter().rposition(|&b| b == 1).unwrap();
        bytes[second] = 0;
        let err = unflatten::<(Tensor, Tensor)>(&bytes, flat.tensors).unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
    }
}
