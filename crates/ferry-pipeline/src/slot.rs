//! One stage on its worker: the module, its parameters and accumulated
//! gradients, its optimizer, and what each microbatch keeps between its
//! forward and its backward.

use std::collections::HashMap;

use ferry_autograd::optim::LocalOptimizer;

use crate::erased::ErasedStage;

/// What a microbatch keeps from its forward for its backward.
#[derive(Default)]
pub(crate) struct Saved {
    /// The stage's received input tensors made leaves that require grad
    /// (`None` for the ones that cannot carry gradients), in the order they
    /// arrived.
    pub leaves: Vec<Option<tch::Tensor>>,
    /// What backward starts from: the loss on the last stage, else the
    /// output tensors that require grad.
    pub roots: Vec<tch::Tensor>,
    /// For each root, its position among the output's tensors (the order
    /// the next stage's gradients come in).
    pub root_positions: Vec<usize>,
    /// The gradients of the roots, once known (kept from I for W).
    pub seeds: Option<Vec<tch::Tensor>>,
    /// What I captured for W (the gradients flowing into the nodes that
    /// feed the parameters).
    pub weight: Option<ferry_autograd::WeightBackward>,
}

/// A stage living on this worker.
pub(crate) struct StageSlot {
    pub stage: Box<dyn ErasedStage>,
    /// Its parameters that require grad.
    pub params: Vec<tch::Tensor>,
    /// Their accumulated gradients, still to be divided by
    /// `pending_scale` when it is set.
    pub grads: Vec<Option<tch::Tensor>>,
    /// A `scale_grads` division not yet applied to `grads`: the optimizer
    /// folds it into its step, and anything else that reads or adds to the
    /// gradients applies it first ([`StageSlot::settle`]).
    pending_scale: Option<f64>,
    pub optimizer: Option<LocalOptimizer>,
    /// Per microbatch, between forward and backward.
    pub saved: HashMap<usize, Saved>,
    /// Microbatches whose weight gradients are in, this step.
    pub backwards: usize,
}

impl StageSlot {
    pub(crate) fn new(stage: Box<dyn ErasedStage>) -> Self {
        let params: Vec<tch::Tensor> = stage
            .parameters()
            .into_iter()
            .filter(|p| p.requires_grad())
            .collect();
        let grads = (0..params.len()).map(|_| None).collect();
        StageSlot {
            stage,
            params,
            grads,
            pending_scale: None,
            optimizer: None,
            saved: HashMap::new(),
            backwards: 0,
        }
    }

    /// Adds `grads` (one per parameter) to the accumulated gradients.
    pub(crate) fn accumulate(
        &mut self,
        grads: impl IntoIterator<Item = Option<tch::Tensor>>,
    ) -> Result<(), tch::TchError> {
        self.settle()?;
        let _no_grad = tch::no_grad_guard();
        for (acc, g) in self.grads.iter_mut().zip(grads) {
            let Some(g) = g else { continue };
            match acc {
                Some(acc) => {
                    let _ = acc.f_add_(&g)?;
                }
                None => *acc = Some(g),
            }
        }
        Ok(())
    }

    /// Divides the accumulated gradients by `factor` (PyTorch's
    /// `scale_grads`, once after the stage's last backward of a step).
    /// Deferred: the optimizer's step folds it in, which saves a pass over
    /// every gradient; [`StageSlot::settle`] applies it for everything else.
    pub(crate) fn scale(&mut self, factor: f64) {
        self.pending_scale = Some(self.pending_scale.unwrap_or(1.0) * factor);
    }

    /// Applies a deferred [`StageSlot::scale`] to the gradients themselves,
    /// before anything other than the optimizer reads or extends them.
    pub(crate) fn settle(&mut self) -> Result<(), tch::TchError> {
        let Some(factor) = self.pending_scale.take() else {
            return Ok(());
        };
        let _no_grad = tch::no_grad_guard();
        for g in self.grads.iter_mut().flatten() {
            let _ = g.f_div_scalar_(factor)?;
        }
        Ok(())
    }

    /// Drops the accumulated gradients (and any deferred scaling).
    pub(crate) fn zero_grad(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = None);
        self.pending_scale = None;
    }

    /// Steps the optimizer with the accumulated gradients, divided by any
    /// deferred scale on the way.
    pub(crate) fn optimizer_step(&mut self) -> Result<(), ferry_autograd::optim::OptimError> {
        if let Some(optimizer) = &mut self.optimizer {
            match self.pending_scale {
                Some(factor) => optimizer.step_scaled(&self.grads, 1.0 / factor)?,
                None => optimizer.step(&self.grads)?,
            }
        }
        Ok(())
    }
}
