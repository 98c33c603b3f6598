//! One distributed autograd context on one worker: the send and recv
//! functions the forward pass recorded here, and the gradients that
//! backward passes accumulated here.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;
use tch::Tensor;

use crate::engine_shim::tensor_id;
use crate::waiting_root::WaitingRoot;

/// A recv function: a received tensor (a leaf here) whose gradient goes
/// back to the worker that sent it.
pub(crate) struct RecvFunction {
    /// Pairs it with the sender's send function.
    pub(crate) message_id: u64,
    /// The sender's rank.
    pub(crate) sender: u32,
    /// The received tensor (keeps the leaf alive while recorded).
    pub(crate) _tensor: Tensor,
}

#[derive(Default)]
pub(crate) struct ContextState {
    /// Send functions: message id → the tensor that left.
    pub(crate) sends: HashMap<u64, Tensor>,
    /// Recv functions by the received tensor's identity.
    pub(crate) recvs: HashMap<usize, RecvFunction>,
    /// Accumulated gradients by the leaf's identity: (leaf, gradient).
    pub(crate) grads: HashMap<usize, (Tensor, Tensor)>,
    /// Workers this context exchanged messages with (clean-up goes there).
    pub(crate) known_workers: BTreeSet<u32>,
    /// Set by a backward without `retain_graph`.
    pub(crate) graph_released: bool,
    /// The thread blocked in `backward` in this context on this worker,
    /// which runs the passes arriving meanwhile (see `waiting_root`).
    pub(crate) waiting_root: Option<Arc<WaitingRoot>>,
}

/// A distributed autograd context on this worker.
pub(crate) struct Context {
    pub(crate) id: u64,
    pub(crate) state: Mutex<ContextState>,
}

impl Context {
    pub(crate) fn new(id: u64) -> Self {
        Context {
            id,
            state: Mutex::new(ContextState::default()),
        }
    }

    pub(crate) fn record_send(&self, message_id: u64, tensor: &Tensor) {
        self.state
            .lock()
            .sends
            .insert(message_id, tensor.shallow_clone());
    }

    pub(crate) fn record_recv(&self, message_id: u64, sender: u32, leaf: &Tensor) {
        let mut s = self.state.lock();
        s.known_workers.insert(sender);
        s.recvs.insert(
            tensor_id(leaf),
            RecvFunction {
                message_id,
                sender,
                _tensor: leaf.shallow_clone(),
            },
        );
    }

    pub(crate) fn know(&self, worker: u32) {
        self.state.lock().known_workers.insert(worker);
    }

    /// Adds `grad` to the gradient kept for `leaf`.
    pub(crate) fn accumulate(state: &mut ContextState, leaf: &Tensor, grad: Tensor) {
        match state.grads.entry(tensor_id(leaf)) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                let sum = &e.get().1 + &grad;
                e.get_mut().1 = sum;
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert((leaf.shallow_clone(), grad));
            }
        }
    }
}

/// The gradients a context accumulated on one worker
/// ([`get_gradients`](crate::get_gradients)): each leaf tensor with its
/// gradient, looked up by tensor identity like PyTorch's `Dict[Tensor, Tensor]`.
pub struct Gradients {
    pub(crate) entries: Vec<(Tensor, Tensor)>,
}

impl Gradients {
    /// The gradient of `tensor` (the same tensor or a shallow clone of it).
    pub fn get(&self, tensor: &Tensor) -> Option<&Tensor> {
        let id = tensor_id(tensor);
        self.entries
            .iter()
            .find(|(t, _)| tensor_id(t) == id)
            .map(|(_, g)| g)
    }

    /// Every (tensor, gradient) pair.
    pub fn iter(&self) -> impl Iterator<Item = (&Tensor, &Tensor)> {
        self.entries.iter().map(|(t, g)| (t, g))
    }

    /// Number of tensors with a gradient.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no tensor has a gradient.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl std::fmt::Debug for Gradients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.entries.iter().map(|(t, _)| t.size()))
            .finish()
    }
}
