//! Where distributed autograd plugs into tensor (de)serialisation.
//!
//! A tensor that requires grad and is serialised while a [`GradRecorder`]
//! is current on the thread gets a send function recorded for it, and the
//! [`GradMeta`] returned travels with it. The receiver hands the fresh
//! tensor and that metadata to its own recorder, which makes the tensor a
//! leaf that requires grad and records the matching recv function. Without
//! a recorder, tensors travel as plain data (received tensors do not
//! require grad), as in PyTorch outside a distributed autograd context.

use std::cell::RefCell;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// What travels with a tensor recorded by distributed autograd.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GradMeta {
    /// The autograd context the send belongs to.
    pub context_id: u64,
    /// The id pairing the send function with its recv function.
    pub message_id: u64,
    /// The rank of the worker that sent the tensor (where its gradient goes).
    pub sender: u32,
}

/// The distributed autograd layer's side of tensor (de)serialisation.
pub trait GradRecorder: Send + Sync + 'static {
    /// `tensor` (which requires grad) is being serialised on this thread:
    /// record a send function for it and return what travels, or `None` to
    /// send it as plain data.
    fn record_send(&self, tensor: &tch::Tensor) -> Option<GradMeta>;
    /// A tensor that travelled with `meta` arrived; `tensor` is the fresh
    /// destination. Returns the tensor the payload hands out (a leaf that
    /// requires grad, with a recv function recorded for it).
    fn record_recv(&self, tensor: tch::Tensor, meta: GradMeta) -> Result<tch::Tensor, String>;
}

/// The layer object that finds a worker's recorder for received tensors
/// (installed with `Hooks::layer`; found through the agent decoding the
/// message).
pub struct RecorderLayer(pub Arc<dyn GradRecorder>);

thread_local! {
    static CURRENT: RefCell<Option<Arc<dyn GradRecorder>>> = const { RefCell::new(None) };
}

/// Undoes [`enter`] when dropped.
#[must_use = "the recorder is current until the guard drops"]
pub struct RecorderGuard {
    previous: Option<Arc<dyn GradRecorder>>,
    // Thread-bound: must drop on the thread that entered.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for RecorderGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

/// Makes `recorder` the thread's current one until the guard drops.
pub fn enter(recorder: Arc<dyn GradRecorder>) -> RecorderGuard {
    let previous = CURRENT.with(|c| c.borrow_mut().replace(recorder));
    RecorderGuard {
        previous,
        _not_send: std::marker::PhantomData,
    }
}

/// The thread's current recorder.
pub fn current() -> Option<Arc<dyn GradRecorder>> {
    CURRENT.with(|c| c.borrow().clone())
}

/// The recorder for a received tensor: the thread's, else the one of the
/// agent decoding the message.
pub(crate) fn for_receive() -> Option<Arc<dyn GradRecorder>> {
    current().or_else(|| {
        ferry_rpc::Agent::current()
            .and_then(|a| a.layer::<RecorderLayer>())
            .map(|l| l.0.clone())
    })
}
