//! What live recovery moves: named tensors plus the step.

use ferry_transport::RawTensor;

/// A replica's model and optimizer state at a step: named tensors (model
/// parameters, optimizer buffers, anything a `state_dict` holds), in a
/// fixed order, and the step they belong to.
///
/// Cloning shares the tensors' storage.
///
/// ```
/// use ferry_ft::recovery::CheckpointState;
/// use ferry_transport::RawTensor;
///
/// # fn main() -> Result<(), ferry_transport::TransportError> {
/// let state = CheckpointState::new(42)
///     .with_tensor("model.weight", RawTensor::from_slice(&[1.0f32, 2.0], &[2])?)
///     .with_tensor("optim.momentum", RawTensor::from_slice(&[0.0f32, 0.5], &[2])?);
/// assert_eq!(state.step, 42);
/// assert_eq!(state.total_bytes(), 16);
/// assert!(state.get("model.weight").is_some());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CheckpointState {
    /// The step the state belongs to (torchft's `current_step`: committed
    /// steps so far).
    pub step: i64,
    /// The tensors, by name, in order.
    pub tensors: Vec<(String, RawTensor)>,
}

impl CheckpointState {
    /// An empty state at `step`.
    pub fn new(step: i64) -> Self {
        Self {
            step,
            tensors: Vec::new(),
        }
    }

    /// Appends a tensor.
    pub fn with_tensor(mut self, name: impl Into<String>, tensor: RawTensor) -> Self {
        self.tensors.push((name.into(), tensor));
        self
    }

    /// The tensor called `name`, if any.
    pub fn get(&self, name: &str) -> Option<&RawTensor> {
        self.tensors
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, tensor)| tensor)
    }

    /// Bytes of all tensors' elements.
    pub fn total_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|(_, t)| t.numel() * t.dtype().size() as u64)
            .sum()
    }
}
