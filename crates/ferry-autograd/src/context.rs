//! One distributed autograd context on one worker: the send and recv
//! functions the forward pass recorded here, and the gradients that
//! backward passes accumulated here.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;
use tch::Tensor;

use crate::engine_shim::{accumulate_grad, tensor_id};
use crate::waiting_root::WaitingRoot;

/// A recv function: a received tensor (a leaf here) whose gradient goes
/// back to the worker that sent it.
pub(crate) struct RecvFunction {
    /// Pairs it with the sender's send function.
    pub(crate) message_id: u64,
    /// The sender's rank.
    pub(crate) sender: u32,
    /// The received tensor (keeps the leaf alive while recorded).
    pub(crate) tensor: Tensor,
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
                tensor: leaf.shallow_clone(),
            },
        );
    }

    pub(crate) fn know(&self, worker: u32) {
        self.state.lock().known_workers.insert(worker);
    }

    /// Adds `grad` to the gradient kept for `leaf`, by libtorch's rules
    /// for `.grad` (`AccumulateGrad::accumulateGrad`), as PyTorch's
    /// distributed autograd context does: the first gradient is kept as it
    /// is, without a copy, when the caller's handle is the only reference
    /// to it and its layout suits the leaf (a copy otherwise, so that no
    /// one else's tensor becomes the context's gradient); later ones are
    /// added, in place where libtorch can. Either may be sparse: a sparse
    /// sum stays sparse, a dense and a sparse one sum to a dense one.
    pub(crate) fn accumulate(
        state: &mut ContextState,
        leaf: &Tensor,
        grad: &Tensor,
    ) -> Result<(), String> {
        let key = tensor_id(leaf);
        let old = state.grads.get(&key).map(|(_, g)| g);
        let sum = accumulate_grad(leaf, old, grad, 1)
            .map_err(|e| format!("cannot accumulate a gradient: {e}"))?;
        match state.grads.entry(key) {
            std::collections::hash_map::Entry::Occupied(mut e) => e.get_mut().1 = sum,
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert((leaf.shallow_clone(), sum));
            }
        }
        Ok(())
    }
}

/// What a distributed autograd context recorded on one worker
/// ([`context_info`](crate::context_info)), as PyTorch's
/// `DistAutogradContext` exposes it: its send functions, recv functions
/// and the workers it exchanged messages with.
///
/// Ferry records a send function per tensor that left requiring grad (the
/// tensor itself: its gradient seeds the sender's graph there) and a recv
/// function per tensor that arrived in the context (the received tensor, a
/// leaf whose gradient goes back to the sender); PyTorch records one
/// `SendRpcBackward` / `RecvRpcBackward` node per message instead.
pub struct ContextInfo {
    /// The send functions, by increasing message id: (message id, the
    /// tensor that left).
    pub sends: Vec<(u64, Tensor)>,
    /// The recv functions, by increasing message id: (message id, the
    /// sender's rank, the received leaf).
    pub recvs: Vec<(u64, u32, Tensor)>,
    /// The ranks of the workers this context exchanged messages with.
    pub known_workers: BTreeSet<u32>,
}

impl Context {
    /// A snapshot of what this context recorded here.
    pub(crate) fn info(&self) -> ContextInfo {
        let s = self.state.lock();
        let mut sends: Vec<(u64, Tensor)> = s
            .sends
            .iter()
            .map(|(id, t)| (*id, t.shallow_clone()))
            .collect();
        sends.sort_by_key(|(id, _)| *id);
        let mut recvs: Vec<(u64, u32, Tensor)> = s
            .recvs
            .values()
            .map(|r| (r.message_id, r.sender, r.tensor.shallow_clone()))
            .collect();
        recvs.sort_by_key(|(id, _, _)| *id);
        ContextInfo {
            sends,
            recvs,
            known_workers: s.known_workers.clone(),
        }
    }
}

impl std::fmt::Debug for ContextInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextInfo")
            .field(
                "sends",
                &self.sends.iter().map(|(id, _)| id).collect::<Vec<_>>(),
            )
            .field(
                "recvs",
                &self
                    .recvs
                    .iter()
                    .map(|(id, w, _)| (id, w))
                    .collect::<Vec<_>>(),
            )
            .field("known_workers", &self.known_workers)
            .finish()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Sparse and dense gradients of one leaf sum in any order: sparse
    /// ones to a sparse one, a mix to a dense one.
    #[test]
    fn sparse_and_dense_gradients_accumulate_in_any_order() {
        let leaf = Tensor::zeros([3, 2], (tch::Kind::Double, tch::Device::Cpu));
        let dense = Tensor::ones([3, 2], (tch::Kind::Double, tch::Device::Cpu));
        let sparse = || {
            let i = Tensor::from_slice(&[2i64, 0, 2]).reshape([1, 3]);
            let v = Tensor::from_slice(&[1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0]).reshape([3, 2]);
            Tensor::sparse_coo_tensor_indices_size(
                &i,
                &v,
                [3, 2],
                (tch::Kind::Double, tch::Device::Cpu),
                false,
            )
        };
        let want = |k: f64, d: f64| &sparse().to_dense(None, false) * k + &dense * d;
        for (grads, k, d, stays_sparse) in [
            (vec![sparse(), sparse()], 2.0, 0.0, true),
            (vec![sparse(), dense.copy()], 1.0, 1.0, false),
            (vec![dense.copy(), sparse(), sparse()], 2.0, 1.0, false),
        ] {
            let mut state = ContextState::default();
            for g in grads {
                Context::accumulate(&mut state, &leaf, &g).unwrap();
            }
            let got = &state.grads[&tensor_id(&leaf)].1;
            assert_eq!(got.is_sparse(), stays_sparse);
            assert!(got
                .to_dense(None, false)
                .allclose(&want(k, d), 1e-12, 1e-12, false));
        }
        // A gradient of another shape is an error, not a panic.
        let mut state = ContextState::default();
        Context::accumulate(&mut state, &leaf, &dense.copy()).unwrap();
        let wrong = Tensor::ones([4], (tch::Kind::Double, tch::Device::Cpu));
        assert!(Context::accumulate(&mut state, &leaf, &wrong).is_err());
    }

    #[test]
    fn info_lists_sends_recvs_and_workers_by_message_id() {
        let ctx = Context::new(7);
        let t = |v: f32| Tensor::from_slice(&[v]).set_requires_grad(true);
        ctx.record_send(5, &t(1.0));
        ctx.record_send(2, &t(2.0));
        ctx.record_recv(9, 3, &t(3.0));
        ctx.record_recv(4, 1, &t(4.0));
        ctx.know(6);
        let info = ctx.info();
        let sends: Vec<(u64, f64)> = info
            .sends
            .iter()
            .map(|(id, t)| (*id, t.double_value(&[0])))
            .collect();
        assert_eq!(sends, [(2, 2.0), (5, 1.0)]);
        let recvs: Vec<(u64, u32, f64)> = info
            .recvs
            .iter()
            .map(|(id, w, t)| (*id, *w, t.double_value(&[0])))
            .collect();
        assert_eq!(recvs, [(4, 1, 4.0), (9, 3, 3.0)]);
        // Senders of recvs are known, and so is a worker called.
        assert_eq!(
            info.known_workers.into_iter().collect::<Vec<_>>(),
            [1, 3, 6]
        );
    }
}
