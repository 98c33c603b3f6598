//! What the multi-process autograd tests share: worker start-up, the
//! functions every worker serves, and numeric comparison.
#![allow(dead_code, clippy::unwrap_used)]

use std::time::Duration;

use ferry_autograd::DistAutogradContainer;
use ferry_rpc::{Functions, RpcOptions};
use ferry_rref::RRef;
use ferry_tch::Tensor;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind};

pub(crate) const F64: (Kind, Device) = (Kind::Double, Device::Cpu);

pub(crate) fn name(rank: u32) -> String {
    format!("worker{rank}")
}

/// A Linear + ReLU layer (the paper's Listing 1 `Layer`), kept on its owner.
#[derive(Debug, Clone, Serialize, Deserialize)]
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

/// The functions every test worker serves.
pub(crate) fn functions() -> Functions {
    let mut f = Functions::new();
    f.register("my_add", |(a, b): (Tensor, Tensor)| Tensor::from(&*a + &*b));
    f.register("mul", |(a, b): (Tensor, Tensor)| Tensor::from(&*a * &*b));
    f.register("scale", |(a, k): (Tensor, f64)| Tensor::from(&*a * k));
    f.register("sin", |a: Tensor| Tensor::from(a.sin()));
    f.register("random_tensor", |seed: i64| {
        tch::manual_seed(seed);
        Tensor::from(tch::Tensor::rand([3, 3], F64).set_requires_grad(true))
    });
    f.register("layer_new", |(i, o, seed): (i64, i64, i64)| {
        Layer::new(i, o, seed)
    });
    f.register_fallible(
        "layer_forward",
        |(layer, x): (RRef<Layer>, RRef<Tensor>)| {
            let layer = layer.local_value().map_err(|e| e.to_string())?;
            let x = x.to_here().map_err(|e| e.to_string())?;
            Ok::<_, String>(Tensor::from(layer.forward(&x)))
        },
    );
    f.register_fallible("layer_params", |layer: RRef<Layer>| {
        let layer = layer.local_value().map_err(|e| e.to_string())?;
        let w = RRef::new(layer.weight.clone()).map_err(|e| e.to_string())?;
        let b = RRef::new(layer.bias.clone()).map_err(|e| e.to_string())?;
        Ok::<_, String>(vec![w, b])
    });
    // This worker's gradients of the layer in a context (None: no gradient).
    f.register_fallible("layer_grads", |(layer, ctx): (RRef<Layer>, u64)| {
        let layer = layer.local_value().map_err(|e| e.to_string())?;
        let g = ferry_autograd::get_gradients(ctx).map_err(|e| e.to_string())?;
        let get = |t: &Tensor| g.get(t).map(|g| Tensor::from(g.shallow_clone()));
        Ok::<_, String>((get(&layer.weight), get(&layer.bias)))
    });
    // The gradient of an RRef's value on its owner, in a context.
    f.register_fallible("rref_grad", |(r, ctx): (RRef<Tensor>, u64)| {
        let v = r.local_value().map_err(|e| e.to_string())?;
        let g = ferry_autograd::get_gradients(ctx).map_err(|e| e.to_string())?;
        Ok::<_, String>(g.get(&v).map(|g| Tensor::from(g.shallow_clone())))
    });
    f.register_fallible("rref_value", |r: RRef<Tensor>| {
        let v = r.local_value().map_err(|e| e.to_string())?;
        Ok::<_, String>(Tensor::from(v.detach().copy()))
    });
    // Uses an RRef owned by a third worker: fetches it (recorded) and multiplies.
    f.register_fallible("mul_by_rref", |(r, x): (RRef<Tensor>, Tensor)| {
        let w = r.to_here().map_err(|e| e.to_string())?;
        Ok::<_, String>(Tensor::from(&*w * &*x))
    });
    // A parameter server: one weight, forward y = x * w, per-context gradient.
    f.register("ps_forward", |x: Tensor| Tensor::from(&*x * &ps_weight()));
    f.register_fallible("ps_grad", |ctx: u64| {
        let g = ferry_autograd::get_gradients(ctx).map_err(|e| e.to_string())?;
        let w = ps_weight();
        Ok::<_, String>(g.get(&w).map(|g| Tensor::from(g.shallow_clone())))
    });
    // Keeps its output so that `corrupt` can modify it in place later.
    f.register("sigmoid_kept", |x: Tensor| {
        let y = x.sigmoid();
        *KEPT.lock().unwrap() = Some(Tensor::from(y.shallow_clone()));
        Tensor::from(y)
    });
    // Forwards `x` along `path` (nested calls in one context), the last
    // hop running `sigmoid_kept`; each hop scales by one on the way back.
    f.register_fallible("chain", |(x, path): (Tensor, Vec<String>)| {
        let y: Tensor = match path.as_slice() {
            [] => return Err("an empty path".to_string()),
            [last] => ferry_rpc::rpc_sync(last.as_str(), "sigmoid_kept", x),
            [next, rest @ ..] => ferry_rpc::rpc_sync(next.as_str(), "chain", (x, rest.to_vec())),
        }
        .map_err(|e| e.to_string())?;
        Ok(Tensor::from(&*y * 1.0))
    });
    f.register("corrupt", |(): ()| {
        if let Some(t) = KEPT.lock().unwrap().take() {
            let mut t = t.into_inner();
            let _ = tch::no_grad(|| t.f_add_scalar_(1.0));
        }
    });
    // Another call from inside a function (nested RPC in the same context).
    f.register_fallible("nested_scale", |(x, via, k): (Tensor, String, f64)| {
        ferry_rpc::rpc_sync::<Tensor, _>(via.as_str(), "scale", (x, k)).map_err(|e| e.to_string())
    });
    f.register_fallible("context_ids", |(): ()| {
        ferry_autograd::context_ids().map_err(|e| e.to_string())
    });
    f.register("int_tensor", |(): ()| {
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
    ferry_rpc::init_rpc(options).unwrap();
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
