//! What the multi-process autograd tests share: worker start-up, the
//! functions every worker serves, and numeric comparison.
#![allow(dead_code, clippy::unwrap_used)]

use std::time::Duration;

use ferry_autograd::DistAutogradContainer;
use ferry_rpc::{BoxError, Function, Functions, RpcOptions, Schema};
use ferry_rref::RRef;
use ferry_tch::Tensor;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind};

pub(crate) const F64: (Kind, Device) = (Kind::Double, Device::Cpu);

pub(crate) fn name(rank: u32) -> String {
    format!("worker{rank}")
}

/// A Linear + ReLU layer (the paper's Listing 1 `Layer`), kept on its owner.
#[derive(Debug, Clone, Serialize, Deserialize, Schema)]
pub(crate) struct Layer {
    pub(crate) weight: Tensor,
    pub(crate) bias: Tensor,
}

impl Layer {
    /// Deterministic parameters from `seed`.
    pub(crate) fn new(inputs: i64, outputs: i64, seed: i64) -> Layer {
        tch::manual_seed(seed);
        let weight = (tch::Tensor::randn([outputs, inputs], F64) * 0.3).set_requires_grad(true);
        let bias = (tch::Tensor::randn([outputs], F64) * 0.1).set_requires_grad(true);
        Layer {
            weight: weight.into(),
            bias: bias.into(),
        }
    }

    pub(crate) fn forward(&self, x: &tch::Tensor) -> tch::Tensor {
        x.linear(&self.weight, Some(&*self.bias)).relu()
    }
}

pub(crate) const MY_ADD: Function<(Tensor, Tensor), Tensor> = Function::new("my_add");
pub(crate) const MUL: Function<(Tensor, Tensor), Tensor> = Function::new("mul");
pub(crate) const SCALE: Function<(Tensor, f64), Tensor> = Function::new("scale");
pub(crate) const SIN: Function<Tensor, Tensor> = Function::new("sin");
/// A 3x3 leaf requiring grad, from a seed.
pub(crate) const RANDOM_TENSOR: Function<i64, Tensor> = Function::new("random_tensor");
/// `Layer::new(inputs, outputs, seed)`.
pub(crate) const LAYER_NEW: Function<(i64, i64, i64), Layer> = Function::new("layer_new");
/// The layer (owned where it runs) applied to the input's value.
pub(crate) const LAYER_FORWARD: Function<(RRef<Layer>, RRef<Tensor>), Tensor> =
    Function::new("layer_forward");
/// RRefs to the layer's weight and bias, owned where it runs.
pub(crate) const LAYER_PARAMS: Function<RRef<Layer>, Vec<RRef<Tensor>>> =
    Function::new("layer_params");
/// This worker's gradients of the layer in a context (None: no gradient).
pub(crate) const LAYER_GRADS: Function<(RRef<Layer>, u64), LayerGrads> =
    Function::new("layer_grads");

/// The gradients of a layer's weight and bias (None: no gradient).
pub(crate) type LayerGrads = (Option<Tensor>, Option<Tensor>);
/// The gradient of an RRef's value on its owner, in a context.
pub(crate) const RREF_GRAD: Function<(RRef<Tensor>, u64), Option<Tensor>> =
    Function::new("rref_grad");
/// A detached copy of an RRef's value, on its owner.
pub(crate) const RREF_VALUE: Function<RRef<Tensor>, Tensor> = Function::new("rref_value");
/// Uses an RRef owned by a third worker: fetches it (recorded) and multiplies.
pub(crate) const MUL_BY_RREF: Function<(RRef<Tensor>, Tensor), Tensor> =
    Function::new("mul_by_rref");
/// A parameter server: one weight, forward y = x * w.
pub(crate) const PS_FORWARD: Function<Tensor, Tensor> = Function::new("ps_forward");
/// The parameter server's gradient of its weight in a context.
pub(crate) const PS_GRAD: Function<u64, Option<Tensor>> = Function::new("ps_grad");
/// Keeps its output so that `corrupt` can modify it in place later.
pub(crate) const SIGMOID_KEPT: Function<Tensor, Tensor> = Function::new("sigmoid_kept");
/// Forwards `x` along `path` (nested calls in one context), the last hop
/// running `sigmoid_kept`; each hop scales by one on the way back.
pub(crate) const CHAIN: Function<(Tensor, Vec<String>), Tensor> = Function::new("chain");
/// Modifies the output `sigmoid_kept` kept in place.
pub(crate) const CORRUPT: Function<(), ()> = Function::new("corrupt");
/// Another call from inside a function (nested RPC in the same context):
/// `scale` of `x` by `k` on worker `via`.
pub(crate) const NESTED_SCALE: Function<(Tensor, String, f64), Tensor> =
    Function::new("nested_scale");
/// The autograd contexts live on this worker.
pub(crate) const CONTEXT_IDS: Function<(), Vec<u64>> = Function::new("context_ids");
/// An integer tensor (not differentiable).
pub(crate) const INT_TENSOR: Function<(), Tensor> = Function::new("int_tensor");

/// The functions every test worker serves.
pub(crate) fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(MY_ADD, |(a, b)| Tensor::from(&*a + &*b));
    f.add(MUL, |(a, b)| Tensor::from(&*a * &*b));
    f.add(SCALE, |(a, k)| Tensor::from(&*a * k));
    f.add(SIN, |a| Tensor::from(a.sin()));
    f.add(RANDOM_TENSOR, |seed| {
        tch::manual_seed(seed);
        Tensor::from(tch::Tensor::rand([3, 3], F64).set_requires_grad(true))
    });
    f.add(LAYER_NEW, |(i, o, seed)| Layer::new(i, o, seed));
    f.add(LAYER_FORWARD, |(layer, x)| -> Result<Tensor, BoxError> {
        let layer = layer.local_value()?;
        let x = x.to_here()?;
        Ok(Tensor::from(layer.forward(&x)))
    });
    f.add(LAYER_PARAMS, |layer| -> Result<_, BoxError> {
        let layer = layer.local_value()?;
        let w = RRef::new(layer.weight.clone())?;
        let b = RRef::new(layer.bias.clone())?;
        Ok(vec![w, b])
    });
    f.add(LAYER_GRADS, |(layer, ctx)| -> Result<_, BoxError> {
        let layer = layer.local_value()?;
        let g = ferry_autograd::get_gradients(ctx)?;
        let get = |t: &Tensor| g.get(t).map(|g| Tensor::from(g.shallow_clone()));
        Ok((get(&layer.weight), get(&layer.bias)))
    });
    f.add(RREF_GRAD, |(r, ctx)| -> Result<_, BoxError> {
        let v = r.local_value()?;
        let g = ferry_autograd::get_gradients(ctx)?;
        Ok(g.get(&v).map(|g| Tensor::from(g.shallow_clone())))
    });
    f.add(RREF_VALUE, |r| -> Result<_, BoxError> {
        let v = r.local_value()?;
        Ok(Tensor::from(v.detach().copy()))
    });
    f.add(MUL_BY_RREF, |(r, x)| -> Result<_, BoxError> {
        let w = r.to_here()?;
        Ok(Tensor::from(&*w * &*x))
    });
    f.add(PS_FORWARD, |x| Tensor::from(&*x * &ps_weight()));
    f.add(PS_GRAD, |ctx| -> Result<_, BoxError> {
        let g = ferry_autograd::get_gradients(ctx)?;
        let w = ps_weight();
        Ok(g.get(&w).map(|g| Tensor::from(g.shallow_clone())))
    });
    f.add(SIGMOID_KEPT, |x| {
        let y = x.sigmoid();
        *KEPT.lock().unwrap() = Some(Tensor::from(y.shallow_clone()));
        Tensor::from(y)
    });
    f.add(CHAIN, |(x, path)| -> Result<_, BoxError> {
        let y = match path.as_slice() {
            [] => return Err("an empty path".into()),
            [last] => SIGMOID_KEPT.rpc_sync(last.as_str(), x),
            [next, rest @ ..] => CHAIN.rpc_sync(next.as_str(), (x, rest.to_vec())),
        }?;
        Ok(Tensor::from(&*y * 1.0))
    });
    f.add(CORRUPT, |()| {
        if let Some(t) = KEPT.lock().unwrap().take() {
            let mut t = t.into_inner();
            let _ = tch::no_grad(|| t.f_add_scalar_(1.0));
        }
    });
    f.add(NESTED_SCALE, |(x, via, k)| {
        SCALE.rpc_sync(via.as_str(), (x, k))
    });
    f.add(CONTEXT_IDS, |()| ferry_autograd::context_ids());
    f.add(INT_TENSOR, |()| {
        Tensor::from(tch::Tensor::arange(3, (Kind::Int64, Device::Cpu)))
    });
    f
}

static KEPT: std::sync::Mutex<Option<Tensor>> = std::sync::Mutex::new(None);

static PS_WEIGHT: std::sync::OnceLock<Tensor> = std::sync::OnceLock::new();

/// The parameter server's weight (one per process).
pub(crate) fn ps_weight() -> tch::Tensor {
    PS_WEIGHT
        .get_or_init(|| {
            let g = tch::Tensor::arange(4, F64) * 0.25 + 0.5;
            Tensor::from(g.set_requires_grad(true))
        })
        .shallow_clone()
}

/// Starts this rank's worker with distributed autograd installed.
pub(crate) fn init(rank: u32) -> std::sync::Arc<DistAutogradContainer> {
    let mut options = RpcOptions::from_env(name(rank))
        .unwrap()
        .functions(functions());
    let container = ferry_autograd::install(&mut options);
    init_rpc(options).unwrap();
    container
}

/// Every worker waits until no context is left on it (clean-up reached
/// everywhere), then all shut down together.
pub(crate) fn finish(container: &DistAutogradContainer) {
    assert!(
        container.wait_until_empty(Duration::from_secs(30)),
        "contexts left on this worker: {:?}",
        container.context_ids()
    );
    ferry_rpc::shutdown().unwrap();
}

/// `a` equals `b` to 1e-6 relative.
#[track_caller]
pub(crate) fn assert_close(a: &tch::Tensor, b: &tch::Tensor, what: &str) {
    assert_eq!(a.size(), b.size(), "{what}: shapes");
    let diff = (a - b).abs().max().double_value(&[]);
    let scale = b.abs().max().double_value(&[]).max(1.0);
    assert!(
        diff <= 1e-6 * scale,
        "{what}: differs by {diff} (scale {scale})\n{a}\n{b}"
    );
}

/// A fresh leaf that requires grad (values copied from `t`).
pub(crate) fn leaf(t: &tch::Tensor) -> tch::Tensor {
    t.detach().copy().set_requires_grad(true)
}

/// Local reference gradients of `loss` with respect to `inputs`.
pub(crate) fn local_grads(loss: &tch::Tensor, inputs: &[&tch::Tensor]) -> Vec<tch::Tensor> {
    tch::Tensor::run_backward(&[loss], inputs, false, false)
}

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
