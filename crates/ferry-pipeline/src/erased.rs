//! Typed stages and losses behind object-safe traits, so that one runtime
//! runs every stage type: values cross as [`Flat`] (bytes plus tensors).
//! A typed [`Stage`](crate::Stage) takes the trait through `stage.rs`'s
//! `TypedStage`.

use std::sync::Arc;

use ferry_rpc::BoxError;
use ferry_tch::tree::{self, Flat};
use ferry_tch::Tensor;
use serde::de::DeserializeOwned;

/// Builds a stage from its flattened constructor arguments.
pub(crate) type StageBuilder =
    Arc<dyn Fn(&[u8], Vec<tch::Tensor>) -> Result<Box<dyn ErasedStage>, BoxError> + Send + Sync>;

/// A stage with its types erased.
pub(crate) trait ErasedStage: Send {
    /// Rebuilds the input from `bytes` and `tensors`, runs `forward` and
    /// flattens the output.
    fn forward(&mut self, bytes: &[u8], tensors: Vec<tch::Tensor>) -> Result<Flat, BoxError>;
    /// The stage's parameters.
    fn parameters(&self) -> Vec<tch::Tensor>;
}

/// A loss with its output type erased.
pub(crate) trait ErasedLoss: Send + Sync {
    /// The loss of the flattened last-stage output against `target`.
    fn loss(
        &self,
        bytes: &[u8],
        tensors: Vec<tch::Tensor>,
        target: Tensor,
    ) -> Result<tch::Tensor, BoxError>;
}

/// The [`ErasedLoss`] of a typed loss function.
pub(crate) struct TypedLoss<O, F> {
    f: F,
    _output: std::marker::PhantomData<fn(O)>,
}

impl<O, F> TypedLoss<O, F> {
    pub(crate) fn new(f: F) -> Self {
        Self {
            f,
            _output: std::marker::PhantomData,
        }
    }
}

impl<O, F> ErasedLoss for TypedLoss<O, F>
where
    O: DeserializeOwned + Send + 'static,
    F: Fn(O, Tensor) -> Result<tch::Tensor, BoxError> + Send + Sync,
{
    fn loss(
        &self,
        bytes: &[u8],
        tensors: Vec<tch::Tensor>,
        target: Tensor,
    ) -> Result<tch::Tensor, BoxError> {
        let output: O = tree::unflatten(bytes, tensors)?;
        (self.f)(output, target)
    }
}
