//! What a `torch.distributed.rpc` user reaches for, written against the
//! `ferry` facade alone, across worker processes on 127.0.0.1: the order
//! of `backward`'s root checks (PyTorch's `test_backward_invalid_args`),
//! the current autograd context (`dist_autograd._current_context()`), and
//! a user-defined optimizer class in the `DistributedOptimizer`, trained
//! against libtorch's own SGD run locally.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use ferry::autograd::{self, AutogradError, DistributedOptimizer, Optimizer, OptimizerClass};
use ferry::tensor::Tensor;
use ferry::{BoxError, Function, Functions, RRef, RemoteExt, RpcOptions, Schema};
use ferry_testkit::world_ok;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind};

const F32: (Kind, Device) = (Kind::Float, Device::Cpu);

fn name(rank: u32) -> String {
    format!("worker{rank}")
}

/// A parameter of `shape` from `seed`, kept where it is made (a leaf that
/// requires grad).
const PARAM: Function<(Vec<i64>, i64), Tensor> = Function::new("param");
/// `x @ w^T`, with the weight `w` owned where it runs.
const LINEAR: Function<(RRef<Tensor>, Tensor), Tensor> = Function::new("linear");
/// The id of the autograd context the call runs in, if any.
const CURRENT_ID: Function<(), Option<u64>> = Function::new("current_id");
/// The gradient of an RRef's value (owned where it runs) in the context
/// the call runs in, read through `current_context()`.
const GRAD_HERE: Function<RRef<Tensor>, Option<Tensor>> = Function::new("grad_here");

/// SGD with momentum as a user writes it (dampening 0, no weight decay,
/// no Nesterov): `buf = momentum * buf + g` (`buf = g` at first),
/// `p -= lr * buf`.
struct MomentumSgd {
    lr: f64,
    momentum: f64,
    buffers: Vec<Option<tch::Tensor>>,
}

impl Optimizer for MomentumSgd {
    fn step(
        &mut self,
        params: &mut [tch::Tensor],
        grads: &[Option<tch::Tensor>],
    ) -> Result<(), BoxError> {
        for ((p, g), buf) in params.iter_mut().zip(grads).zip(&mut self.buffers) {
            let Some(g) = g else { continue };
            let b = match buf.take() {
                Some(b) => b * self.momentum + g,
                None => g.copy(),
            };
            let _ = p.f_sub_(&(&b * self.lr))?;
            *buf = Some(b);
        }
        Ok(())
    }
}

/// The constructor's arguments, sent by the driver to every owner.
#[derive(Debug, Clone, Serialize, Deserialize, Schema)]
struct MomentumArgs {
    lr: f64,
    momentum: f64,
}

const MOMENTUM_SGD: OptimizerClass<MomentumArgs> = OptimizerClass::new("momentum_sgd");
/// Registered nowhere.
const UNREGISTERED: OptimizerClass<MomentumArgs> = OptimizerClass::new("unregistered");
/// A rule that replaces its parameters instead of updating them in place.
const REPLACING: OptimizerClass<f64> = OptimizerClass::new("replacing");

/// The wrong way: `params[i]` replaced by a new tensor.
struct Replacing(f64);

impl Optimizer for Replacing {
    fn step(
        &mut self,
        params: &mut [tch::Tensor],
        grads: &[Option<tch::Tensor>],
    ) -> Result<(), BoxError> {
        for (p, g) in params.iter_mut().zip(grads) {
            if let Some(g) = g {
                *p = &*p - g * self.0;
            }
        }
        Ok(())
    }
}

/// What every worker serves.
fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(PARAM, |(shape, seed)| {
        tch::manual_seed(seed);
        Tensor::from((tch::Tensor::randn(shape, F32) * 0.5).set_requires_grad(true))
    });
    f.add(LINEAR, |(w, x)| -> Result<Tensor, BoxError> {
        let w = w.local_value()?;
        Ok(Tensor::from(x.linear::<&tch::Tensor>(&w, None)))
    });
    f.add(CURRENT_ID, |()| match autograd::current_context() {
        Ok(ctx) => Ok(Some(ctx.id())),
        Err(AutogradError::NoCurrentContext) => Ok(None),
        Err(e) => Err(e),
    });
    f.add(GRAD_HERE, |w| -> Result<_, BoxError> {
        let w = w.local_value()?;
        let grads = autograd::current_context()?.gradients()?;
        Ok(grads.get(&w).map(|g| Tensor::from(g.shallow_clone())))
    });
    MOMENTUM_SGD.register(&mut f, |args: MomentumArgs, params: &[tch::Tensor]| {
        if !(args.lr >= 0.0 && args.momentum >= 0.0) {
            return Err(format!("invalid {args:?}: lr and momentum must be >= 0"));
        }
        Ok(MomentumSgd {
            lr: args.lr,
            momentum: args.momentum,
            buffers: params.iter().map(|_| None).collect(),
        })
    });
    REPLACING.register(&mut f, |lr: f64, _: &[tch::Tensor]| {
        Ok::<_, BoxError>(Replacing(lr))
    });
    f
}

fn init(rank: u32) {
    ferry::init_rpc(
        RpcOptions::from_env(name(rank))
            .unwrap()
            .functions(functions()),
    )
    .unwrap();
}

/// Every worker waits until clean-up has released every context here,
/// then all shut down together.
fn finish() {
    let container = autograd::container_of(&ferry::rpc::agent().unwrap()).unwrap();
    assert!(
        container.wait_until_empty(Duration::from_secs(30)),
        "contexts left on this worker: {:?}",
        container.context_ids()
    );
    ferry::shutdown().unwrap();
}

fn t(x: &tch::Tensor) -> Tensor {
    Tensor::from(x.shallow_clone())
}

/// `a` equals `b` elementwise to `atol + rtol * |b|`.
#[track_caller]
fn assert_close(a: &tch::Tensor, b: &tch::Tensor, rtol: f64, atol: f64, what: &str) {
    assert_eq!(a.size(), b.size(), "{what}: shapes");
    let excess = ((a - b).abs() - (b.abs() * rtol + atol))
        .max()
        .double_value(&[]);
    assert!(
        excess <= 0.0,
        "{what}: beyond tolerance by {excess}\n{a}\n{b}"
    );
}

/// PyTorch's `test_backward_invalid_args`: a root is checked for
/// `requires_grad`, then for being a scalar, then for a gradient function,
/// and the error names the first thing wrong.
#[test]
fn backward_checks_roots_in_pytorchs_order() {
    world_ok("backward_checks_roots_in_pytorchs_order", 2, |rank| {
        init(rank);
        if rank == 0 {
            let w: RRef<Tensor> = PARAM.remote(name(1), (vec![2, 3], 3)).unwrap();
            let w0 = w.to_here().unwrap().detach().copy();
            let x = tch::Tensor::randn([4, 3], F32).set_requires_grad(true);
            let ctx = autograd::context().unwrap();
            let y: Tensor = LINEAR.rpc_sync(name(1), (w.clone(), t(&x))).unwrap();
            let backward = |roots: &[tch::Tensor]| ctx.backward(roots, false).unwrap_err();

            let err = backward(&[]);
            assert!(matches!(err, AutogradError::NoRoots), "{err}");
            assert!(
                err.to_string()
                    .contains("no tensors provided for gradient computation"),
                "{err}"
            );
            // A 3x3 leaf without requires_grad.
            let err = backward(&[tch::Tensor::rand([3, 3], F32)]);
            assert!(
                matches!(err, AutogradError::RootDoesNotRequireGrad { index: 0 }),
                "{err}"
            );
            assert!(err.to_string().contains("requires_grad not set"), "{err}");
            // A non-scalar that requires grad (computed through worker1).
            let err = backward(&[y.shallow_clone()]);
            match &err {
                AutogradError::RootNotScalar { index: 0, shape } => assert_eq!(shape, &[4, 2]),
                other => panic!("want RootNotScalar, got {other:?}"),
            }
            assert!(
                err.to_string()
                    .contains("is not a scalar, all roots need to be scalar"),
                "{err}"
            );
            // A 3x3 leaf with requires_grad: not a scalar comes before leaf.
            let err = backward(&[tch::Tensor::rand([3, 3], F32).set_requires_grad(true)]);
            match &err {
                AutogradError::RootNotScalar { index: 0, shape } => assert_eq!(shape, &[3, 3]),
                other => panic!("want RootNotScalar, got {other:?}"),
            }
            // Scalar leaves with requires_grad (one element, and zero-dim).
            for leaf in [
                tch::Tensor::rand([1], F32).set_requires_grad(true),
                tch::Tensor::from(1.0f32).set_requires_grad(true),
            ] {
                let err = backward(&[leaf]);
                assert!(
                    matches!(err, AutogradError::RootWithoutGradFn { index: 0 }),
                    "{err}"
                );
                assert!(
                    err.to_string()
                        .contains("does not have a valid gradient function"),
                    "{err}"
                );
            }
            // The error names the first bad root, after good ones.
            let err = backward(&[y.sum(Kind::Float), tch::Tensor::rand([3, 3], F32)]);
            assert!(
                matches!(err, AutogradError::RootDoesNotRequireGrad { index: 1 }),
                "{err}"
            );
            // None of these touched the graph: the right backward works.
            ctx.backward(&[y.sum(Kind::Float)], false).unwrap();
            let grads = ctx.gradients();
            let want = w0
                .sum_dim_intlist([0].as_slice(), true, Kind::Float)
                .expand([4, 3], false);
            assert_close(grads.get(&x).unwrap(), &want, 1e-6, 1e-6, "x's gradient");
        }
        finish();
    });
}

/// `current_context()` outside any context, on the thread of a context,
/// in a remote function called inside one (the caller's), on another
/// thread (none), and once the context is released.
#[test]
fn current_context_inside_and_outside_a_context() {
    world_ok("current_context_inside_and_outside_a_context", 2, |rank| {
        init(rank);
        if rank == 0 {
            assert!(matches!(
                autograd::current_context(),
                Err(AutogradError::NoCurrentContext)
            ));
            assert_eq!(CURRENT_ID.rpc_sync(name(1), ()).unwrap(), None);
            let w: RRef<Tensor> = PARAM.remote(name(1), (vec![2, 3], 5)).unwrap();
            let w0 = w.to_here().unwrap().detach().copy();
            let x = tch::Tensor::randn([4, 3], F32);
            let kept = {
                let ctx = autograd::context().unwrap();
                let current = autograd::current_context().unwrap();
                assert_eq!(current.id(), ctx.id());
                // A call made inside runs in the caller's context.
                assert_eq!(CURRENT_ID.rpc_sync(name(1), ()).unwrap(), Some(ctx.id()));
                // Contexts are per thread.
                std::thread::scope(|s| {
                    s.spawn(|| {
                        assert!(matches!(
                            autograd::current_context(),
                            Err(AutogradError::NoCurrentContext)
                        ));
                    })
                    .join()
                    .unwrap();
                });
                let y: Tensor = LINEAR.rpc_sync(name(1), (w.clone(), t(&x))).unwrap();
                let loss = y.pow_tensor_scalar(2).sum(Kind::Float);
                current.backward(&[loss], false).unwrap();
                // worker1 reads its gradient through its current context.
                let got = GRAD_HERE.rpc_sync(name(1), w.clone()).unwrap().unwrap();
                let lw = w0.copy().set_requires_grad(true);
                let local = x
                    .linear::<&tch::Tensor>(&lw, None)
                    .pow_tensor_scalar(2)
                    .sum(Kind::Float);
                let want = tch::Tensor::run_backward(&[local], &[&lw], false, false);
                assert_close(&got, &want[0], 1e-5, 1e-5, "worker1's gradient");
                assert!(current.gradients().unwrap().get(&x).is_none());
                current
            };
            assert!(matches!(
                autograd::current_context(),
                Err(AutogradError::NoCurrentContext)
            ));
            // The handle does not keep the context: it is released.
            assert!(matches!(
                kept.gradients(),
                Err(AutogradError::UnknownContext { .. })
            ));
            assert_eq!(CURRENT_ID.rpc_sync(name(1), ()).unwrap(), None);
        }
        finish();
    });
}

/// A user-defined optimizer class (SGD with momentum, written above) on
/// three owners, one of them the driver, trained for some steps through
/// RPCs, equals libtorch's own SGD with momentum run locally on the same
/// model; unknown classes, constructor errors and rules that do not update
/// in place name the owner.
#[test]
fn user_defined_optimizer_trains_like_libtorch_sgd() {
    const STEPS: usize = 8;
    let (lr, momentum) = (0.05, 0.9);
    world_ok(
        "user_defined_optimizer_trains_like_libtorch_sgd",
        3,
        |rank| {
            init(rank);
            if rank == 0 {
                // w1 on worker1, w2 on worker2, the bias b on the driver.
                let w1: RRef<Tensor> = PARAM.remote(name(1), (vec![4, 3], 11)).unwrap();
                let w2: RRef<Tensor> = PARAM.remote(name(2), (vec![2, 4], 12)).unwrap();
                let b = tch::Tensor::zeros([2], F32).set_requires_grad(true);
                let b_ref = RRef::new(t(&b)).unwrap();
                let start = [
                    w1.to_here().unwrap().detach().copy(),
                    w2.to_here().unwrap().detach().copy(),
                    b.detach().copy(),
                ];
                tch::manual_seed(13);
                let x = tch::Tensor::randn([5, 3], F32);
                let target = tch::Tensor::randn([5, 2], F32);
                let params = vec![w1.clone(), w2.clone(), b_ref.clone()];

                let opt = DistributedOptimizer::new(
                    MOMENTUM_SGD.with(MomentumArgs { lr, momentum }),
                    params.clone(),
                )
                .unwrap();
                let mut owners = opt.owners();
                owners.sort();
                assert_eq!(owners, [name(0), name(1), name(2)]);
                for _ in 0..STEPS {
                    let ctx = autograd::context().unwrap();
                    let h: Tensor = LINEAR.rpc_sync(name(1), (w1.clone(), t(&x))).unwrap();
                    let h = Tensor::from(h.relu());
                    let out: Tensor = LINEAR.rpc_sync(name(2), (w2.clone(), h)).unwrap();
                    let loss = (&*out + &b - &target)
                        .pow_tensor_scalar(2)
                        .mean(Kind::Float);
                    ctx.backward(&[loss], false).unwrap();
                    opt.step(ctx.id()).unwrap();
                }
                let trained = [
                    w1.to_here().unwrap().detach().copy(),
                    w2.to_here().unwrap().detach().copy(),
                    b.detach().copy(),
                ];

                // The same model locally, stepped by libtorch's SGD.
                let local: Vec<tch::Tensor> = start
                    .iter()
                    .map(|p| p.copy().set_requires_grad(true))
                    .collect();
                let mut sgd = tch::COptimizer::sgd(lr, momentum, 0.0, 0.0, false).unwrap();
                for p in &local {
                    sgd.add_parameters(p, 0).unwrap();
                }
                for _ in 0..STEPS {
                    sgd.zero_grad().unwrap();
                    let h = x.linear::<&tch::Tensor>(&local[0], None).relu();
                    let out = h.linear(&local[1], Some(&local[2]));
                    (out - &target)
                        .pow_tensor_scalar(2)
                        .mean(Kind::Float)
                        .backward();
                    sgd.step().unwrap();
                }
                for (i, ((got, want), before)) in trained.iter().zip(&local).zip(&start).enumerate()
                {
                    assert_close(got, want, 1e-5, 4e-5, &format!("parameter {i}"));
                    assert!(
                        (got - before).abs().max().double_value(&[]) > 1e-3,
                        "parameter {i} did not move"
                    );
                }
                drop(opt);

                // A class the owners do not have.
                let err = DistributedOptimizer::new(
                    UNREGISTERED.with(MomentumArgs { lr, momentum }),
                    vec![w1.clone()],
                )
                .unwrap_err();
                match &err {
                    AutogradError::UnknownOptimizerClass { worker, class } => {
                        assert_eq!(
                            (worker.as_str(), class.as_str()),
                            ("worker1", "unregistered")
                        );
                    }
                    other => panic!("want UnknownOptimizerClass, got {other:?}"),
                }
                // The constructor refuses its arguments on the owner.
                let err = DistributedOptimizer::new(
                    MOMENTUM_SGD.with(MomentumArgs { lr: -1.0, momentum }),
                    vec![w2.clone()],
                )
                .unwrap_err();
                assert!(
                    matches!(&err, AutogradError::Optimizer { worker, .. } if worker == "worker2"),
                    "{err:?}"
                );
                assert!(
                    err.to_string().contains("lr and momentum must be >= 0"),
                    "{err}"
                );
                // A rule that replaces a parameter instead of updating it.
                let before = w1.to_here().unwrap().detach().copy();
                let opt = DistributedOptimizer::new(REPLACING.with(lr), vec![w1.clone()]).unwrap();
                let ctx = autograd::context().unwrap();
                let y: Tensor = LINEAR.rpc_sync(name(1), (w1.clone(), t(&x))).unwrap();
                ctx.backward(&[y.sum(Kind::Float)], false).unwrap();
                let err = opt.step(ctx.id()).unwrap_err();
                assert!(
                    matches!(&err, AutogradError::Optimizer { worker, .. } if worker == "worker1"),
                    "{err:?}"
                );
                assert!(err.to_string().contains("replaced parameter 0"), "{err}");
                assert!(w1.to_here().unwrap().equal(&before), "w1 changed");
            }
            finish();
        },
    );
}
