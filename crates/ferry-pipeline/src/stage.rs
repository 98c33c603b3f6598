//! What a user writes: a [`Stage`], the typed handles [`StageFn`] and
//! [`LossFn`] declared once in code the driver and the workers share, and
//! the [`Stages`] registry that builds stages on their owning worker.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;

use ferry_rpc::BoxError;
use ferry_tch::tree::{self, Flat};
use ferry_tch::Tensor;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::erased::{ErasedLoss, ErasedStage, StageBuilder, TypedLoss};

/// One stage of a pipeline: a libtorch module (or any struct with a
/// forward) that lives on its owning worker.
///
/// `Input` is what the previous stage's `forward` returned (for stage 0,
/// one microbatch of the batch, a [`Tensor`]); `Output` goes to the next
/// stage, or to the loss on the last one. Both may be any serde value that
/// holds tensors (a tensor, a tuple, a struct with several tensors and
/// plain fields): the tensors travel over Ferry's channels, and the
/// floating-point ones carry gradients back. Shapes may change from
/// microbatch to microbatch.
///
/// ```
/// use ferry_pipeline::Stage;
/// use ferry_tch::Tensor;
///
/// struct Block {
///     linear: tch::nn::Linear,
///     _vars: tch::nn::VarStore,
/// }
///
/// impl Stage for Block {
///     type Input = Tensor;
///     type Output = Tensor;
///     fn forward(&mut self, x: Tensor) -> Result<Tensor, ferry_rpc::BoxError> {
///         use tch::nn::Module;
///         Ok(Tensor::from(self.linear.forward(&x).relu()))
///     }
///     fn parameters(&self) -> Vec<tch::Tensor> {
///         vec![self.linear.ws.shallow_clone(), self.linear.bs.as_ref().unwrap().shallow_clone()]
///     }
/// }
/// ```
pub trait Stage: Send + 'static {
    /// What the stage takes.
    type Input: DeserializeOwned + Send + 'static;
    /// What the stage returns.
    type Output: Serialize + DeserializeOwned + Send + 'static;
    /// Runs the stage on one microbatch, recording the autograd graph.
    fn forward(&mut self, input: Self::Input) -> Result<Self::Output, BoxError>;
    /// The parameters the optimizer steps (leaf tensors that require grad).
    fn parameters(&self) -> Vec<tch::Tensor>;
}

/// A stage constructor taking `A`, registered under a name on the workers
/// that own such stages ([`Stages::add`]) and named by the driver
/// ([`PipelineBuilder::stage`](crate::PipelineBuilder::stage)). Declare it
/// once in code both share:
///
/// ```
/// # use ferry_pipeline::{Stage, StageFn};
/// # struct Block;
/// # impl Stage for Block {
/// #     type Input = ferry_tch::Tensor; type Output = ferry_tch::Tensor;
/// #     fn forward(&mut self, x: ferry_tch::Tensor) -> Result<ferry_tch::Tensor, ferry_rpc::BoxError> { Ok(x) }
/// #     fn parameters(&self) -> Vec<tch::Tensor> { Vec::new() }
/// # }
/// pub const BLOCK: StageFn<(i64, i64), Block> = StageFn::new("block");
/// assert_eq!(BLOCK.name(), "block");
/// ```
pub struct StageFn<A, S> {
    name: &'static str,
    _types: PhantomData<fn(A) -> S>,
}

impl<A, S> StageFn<A, S> {
    /// Declares the constructor registered under `name`.
    pub const fn new(name: &'static str) -> Self {
        Self {
            name,
            _types: PhantomData,
        }
    }

    /// The name it is registered under.
    pub const fn name(&self) -> &'static str {
        self.name
    }
}

impl<A, S> Clone for StageFn<A, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<A, S> Copy for StageFn<A, S> {}

/// A loss function from the last stage's output `O` and the targets of a
/// microbatch to a scalar loss tensor, registered on the last stage's
/// worker ([`Stages::add_loss`]) and named by the driver
/// ([`PipelineBuilder::loss`](crate::PipelineBuilder::loss)).
pub struct LossFn<O> {
    name: &'static str,
    _types: PhantomData<fn(O)>,
}

impl<O> LossFn<O> {
    /// Declares the loss registered under `name`.
    pub const fn new(name: &'static str) -> Self {
        Self {
            name,
            _types: PhantomData,
        }
    }

    /// The name it is registered under.
    pub const fn name(&self) -> &'static str {
        self.name
    }
}

impl<O> Clone for LossFn<O> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<O> Copy for LossFn<O> {}

/// The [`ErasedStage`] of a typed [`Stage`].
pub(crate) struct TypedStage<S>(pub(crate) S);

impl<S: Stage> ErasedStage for TypedStage<S> {
    fn forward(&mut self, bytes: &[u8], tensors: Vec<tch::Tensor>) -> Result<Flat, BoxError> {
        let input: S::Input = tree::unflatten(bytes, tensors)?;
        let output = self.0.forward(input)?;
        Ok(tree::flatten(&output)?)
    }

    fn parameters(&self) -> Vec<tch::Tensor> {
        self.0.parameters()
    }
}

/// The stage constructors and loss functions a worker can run, given to
/// [`install`](crate::install) before the worker starts. Every worker that
/// may own a stage registers its constructor; nothing but the arguments
/// travels.
///
/// ```
/// use ferry_pipeline::{LossFn, Stage, StageFn, Stages};
/// use ferry_tch::Tensor;
///
/// # struct Block(tch::nn::Linear, tch::nn::VarStore);
/// # impl Stage for Block {
/// #     type Input = Tensor; type Output = Tensor;
/// #     fn forward(&mut self, x: Tensor) -> Result<Tensor, ferry_rpc::BoxError> { Ok(x) }
/// #     fn parameters(&self) -> Vec<tch::Tensor> { Vec::new() }
/// # }
/// pub const BLOCK: StageFn<i64, Block> = StageFn::new("block");
/// pub const MSE: LossFn<Tensor> = LossFn::new("mse");
///
/// let mut stages = Stages::new();
/// stages.add(BLOCK, |width| {
///     let vars = tch::nn::VarStore::new(tch::Device::Cpu);
///     let linear = tch::nn::linear(vars.root(), width, width, Default::default());
///     Ok::<_, ferry_rpc::BoxError>(Block(linear, vars))
/// });
/// stages.add_loss(MSE, |output: Tensor, target: Tensor| {
///     Ok::<_, ferry_rpc::BoxError>(output.mse_loss(&target, tch::Reduction::Mean))
/// });
/// assert!(stages.has_stage("block") && stages.has_loss("mse"));
/// ```
#[derive(Clone, Default)]
pub struct Stages {
    pub(crate) builders: HashMap<String, StageBuilder>,
    pub(crate) losses: HashMap<String, Arc<dyn ErasedLoss>>,
}

impl Stages {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers the constructor `ctor` for stages declared by `stage`.
    pub fn add<A, S, E, F>(&mut self, stage: StageFn<A, S>, ctor: F) -> &mut Self
    where
        A: DeserializeOwned + 'static,
        S: Stage,
        E: Into<BoxError>,
        F: Fn(A) -> Result<S, E> + Send + Sync + 'static,
    {
        let build = move |bytes: &[u8],
                          tensors: Vec<tch::Tensor>|
              -> Result<Box<dyn ErasedStage>, BoxError> {
            let args: A = ferry_tch::tree::unflatten(bytes, tensors)?;
            let stage = ctor(args).map_err(Into::into)?;
            Ok(Box::new(TypedStage(stage)))
        };
        self.builders.insert(stage.name.to_owned(), Arc::new(build));
        self
    }

    /// Registers the loss `loss` computes for the loss declared by `handle`.
    pub fn add_loss<O, E, F>(&mut self, handle: LossFn<O>, loss: F) -> &mut Self
    where
        O: DeserializeOwned + Send + 'static,
        E: Into<BoxError>,
        F: Fn(O, Tensor) -> Result<tch::Tensor, E> + Send + Sync + 'static,
    {
        let loss = TypedLoss::new(move |o: O, t: Tensor| loss(o, t).map_err(Into::into));
        self.losses.insert(handle.name.to_owned(), Arc::new(loss));
        self
    }

    /// Whether a stage constructor is registered as `name`.
    pub fn has_stage(&self, name: &str) -> bool {
        self.builders.contains_key(name)
    }

    /// Whether a loss is registered as `name`.
    pub fn has_loss(&self, name: &str) -> bool {
        self.losses.contains_key(name)
    }
}
