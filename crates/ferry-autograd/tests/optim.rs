//! Tests for the functional optimizers, checked against libtorch's own C++
//! optimizers (`torch::optim::{SGD, Adam, AdamW}` through `tch::COptimizer`).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use ferry_autograd::optim::{LocalOptimizer, OptimError, OptimizerKind};
use tch::{COptimizer, Device, Kind, Tensor};

const SHAPES: &[&[i64]] = &[&[3, 4], &[5], &[2, 3, 2]];
const STEPS: usize = 20;

/// libtorch's C++ optimizer with the same hyper-parameters.
fn reference_optimizer(kind: &OptimizerKind) -> COptimizer {
    match *kind {
        OptimizerKind::Sgd {
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        } => COptimizer::sgd(lr, momentum, dampening, weight_decay, nesterov),
        OptimizerKind::Adam {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            amsgrad,
        } => COptimizer::adam(lr, beta1, beta2, weight_decay, eps, amsgrad),
        OptimizerKind::AdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            amsgrad,
        } => COptimizer::adamw(lr, beta1, beta2, weight_decay, eps, amsgrad),
    }
    .expect("reference optimizer")
}

/// Deterministic initial parameters and `STEPS` rounds of gradients. The
/// gradient scale varies from step to step so that AMSGrad's maximum matters.
fn problem(dtype: Kind) -> (Vec<Tensor>, Vec<Vec<Tensor>>) {
    tch::manual_seed(42);
    let opts = (dtype, Device::Cpu);
    let init = SHAPES.iter().map(|s| Tensor::randn(*s, opts)).collect();
    let grads = (0..STEPS)
        .map(|step| {
            let scale = 0.1 + (step % 5) as f64;
            SHAPES
                .iter()
                .map(|s| Tensor::randn(*s, opts) * scale)
                .collect()
        })
        .collect();
    (init, grads)
}

fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let diff = (a - b).abs().max().double_value(&[]);
    let scale = b.abs().max().double_value(&[]).max(1.0);
    diff / scale
}

/// Runs ours and libtorch's optimizer side by side, asserting after every
/// step that all parameters agree to 1e-6 relative. Returns the worst error.
fn compare_with_libtorch(kind: OptimizerKind, dtype: Kind) -> f64 {
    let (init, grads) = problem(dtype);

    let mut ours = LocalOptimizer::new(kind.clone(), init.iter().map(Tensor::copy).collect())
        .expect("valid hyper-parameters");

    let reference: Vec<Tensor> = init
        .iter()
        .map(|t| t.copy().set_requires_grad(true))
        .collect();
    let mut copt = reference_optimizer(&kind);
    for p in &reference {
        copt.add_parameters(p, 0).unwrap();
    }

    let mut worst = 0.0f64;
    for (step, step_grads) in grads.iter().enumerate() {
        let before: Vec<Tensor> = step_grads.iter().map(Tensor::copy).collect();
        ours.step(
            &step_grads
                .iter()
                .map(|g| Some(g.shallow_clone()))
                .collect::<Vec<_>>(),
        )
        .unwrap();
        for (g, b) in step_grads.iter().zip(&before) {
            assert!(g.equal(b), "{kind:?}: step modified a gradient");
        }

        // Reference: .grad = g exactly, via backward of sum(p * g).
        copt.zero_grad().unwrap();
        let loss = reference
            .iter()
            .zip(step_grads)
            .map(|(p, g)| (p * g).sum(dtype))
            .reduce(|a, b| a + b)
            .unwrap();
        loss.backward();
        for (p, g) in reference.iter().zip(step_grads) {
            assert!(p.grad().equal(g));
        }
        copt.step().unwrap();

        for (i, (a, b)) in ours.params().iter().zip(&reference).enumerate() {
            let err = rel_err(a, b);
            assert!(
                err <= 1e-6,
                "{kind:?} {dtype:?}: parameter {i} differs by {err:e} (relative) after step {}",
                step + 1
            );
            worst = worst.max(err);
        }
    }
    // The parameters must actually have moved.
    for (a, b) in ours.params().iter().zip(&init) {
        assert!(rel_err(a, b) > 1e-4, "{kind:?}: parameters did not move");
    }
    worst
}

fn check_all(kinds: &[OptimizerKind]) {
    for kind in kinds {
        for dtype in [Kind::Float, Kind::Double] {
            let worst = compare_with_libtorch(kind.clone(), dtype);
            println!("{kind:?} {dtype:?}: worst relative error {worst:e}");
        }
    }
}

#[test]
fn sgd_matches_libtorch() {
    check_all(&[
        OptimizerKind::sgd(0.1),
        OptimizerKind::sgd(0.1).weight_decay(1e-2),
        OptimizerKind::sgd(0.05).momentum(0.9),
        OptimizerKind::sgd(0.05)
            .momentum(0.9)
            .dampening(0.1)
            .weight_decay(1e-2),
        OptimizerKind::sgd(0.05).momentum(0.9).nesterov(true),
        OptimizerKind::sgd(0.05)
            .momentum(0.5)
            .nesterov(true)
            .weight_decay(1e-3),
    ]);
}

#[test]
fn adam_matches_libtorch() {
    check_all(&[
        OptimizerKind::adam(1e-2),
        OptimizerKind::adam(1e-2).weight_decay(0.1),
        OptimizerKind::adam(1e-2).amsgrad(true),
        OptimizerKind::adam(5e-2)
            .betas(0.8, 0.99)
            .eps(1e-6)
            .weight_decay(1e-2)
            .amsgrad(true),
    ]);
}

#[test]
fn adamw_matches_libtorch() {
    check_all(&[
        OptimizerKind::adamw(1e-2),
        OptimizerKind::adamw(1e-2).weight_decay(0.0),
        OptimizerKind::adamw(1e-2).weight_decay(0.1).amsgrad(true),
        OptimizerKind::adamw(5e-2).betas(0.8, 0.99).eps(1e-6),
    ]);
}

/// Sanity check that the comparisons exercise the options they claim to.
#[test]
fn options_change_the_result() {
    let run = |kind: OptimizerKind| {
        let (init, grads) = problem(Kind::Double);
        let mut opt = LocalOptimizer::new(kind, init).unwrap();
        for g in &grads {
            opt.step(
                &g.iter()
                    .map(|g| Some(g.shallow_clone()))
                    .collect::<Vec<_>>(),
            )
            .unwrap();
        }
        opt.into_params()
    };
    let differs = |a: OptimizerKind, b: OptimizerKind| {
        let (pa, pb) = (run(a.clone()), run(b.clone()));
        assert!(
            pa.iter().zip(&pb).any(|(x, y)| rel_err(x, y) > 1e-6),
            "{a:?} and {b:?} gave the same parameters"
        );
    };
    differs(
        OptimizerKind::adam(1e-2),
        OptimizerKind::adam(1e-2).amsgrad(true),
    );
    differs(
        OptimizerKind::adam(1e-2).weight_decay(0.1),
        OptimizerKind::adamw(1e-2).weight_decay(0.1),
    );
    differs(
        OptimizerKind::sgd(0.05).momentum(0.9),
        OptimizerKind::sgd(0.05).momentum(0.9).nesterov(true),
    );
    differs(
        OptimizerKind::sgd(0.05).momentum(0.9),
        OptimizerKind::sgd(0.05).momentum(0.9).dampening(0.5),
    );
}

/// A parameter whose gradient is `None` (or undefined) is left untouched, and
/// so is its state: it ends up exactly where an optimizer that only saw its
/// present gradients would put it.
#[test]
fn missing_gradients_leave_parameter_and_state_untouched() {
    for kind in [
        OptimizerKind::sgd(0.05).momentum(0.9).weight_decay(1e-2),
        OptimizerKind::adam(1e-2).weight_decay(1e-2).amsgrad(true),
        OptimizerKind::adamw(1e-2),
    ] {
        let (init, grads) = problem(Kind::Float);
        let mut both =
            LocalOptimizer::new(kind.clone(), init.iter().map(Tensor::copy).collect()).unwrap();
        let mut only_present = LocalOptimizer::new(kind.clone(), vec![init[1].copy()]).unwrap();

        for (step, g) in grads.iter().enumerate() {
            let before = both.params()[1].copy();
            let second = match step % 3 {
                0 => Some(g[1].shallow_clone()),
                1 => None,
                _ => Some(Tensor::new()), // undefined counts as absent
            };
            let present = step % 3 == 0;
            both.step(&[
                Some(g[0].shallow_clone()),
                second,
                Some(g[2].shallow_clone()),
            ])
            .unwrap();
            if present {
                only_present.step(&[Some(g[1].shallow_clone())]).unwrap();
            } else {
                assert!(
                    both.params()[1].equal(&before),
                    "{kind:?}: parameter without gradient changed"
                );
            }
        }
        assert!(
            both.params()[1].equal(&only_present.params()[0]),
            "{kind:?}: skipped steps disturbed the parameter's state"
        );
        assert!(!both.params()[1].equal(&init[1]));
    }
}

/// Updates are in place: other handles to the parameter see them.
#[test]
fn updates_are_in_place() {
    let p = Tensor::zeros([2], (Kind::Float, Device::Cpu));
    let mut opt = LocalOptimizer::new(OptimizerKind::sgd(0.5), vec![p.shallow_clone()]).unwrap();
    opt.step(&[Some(Tensor::from_slice(&[1.0f32, -2.0]))])
        .unwrap();
    assert!(p.equal(&Tensor::from_slice(&[-0.5f32, 1.0])));

    // Also for a parameter that requires grad (a leaf of the autograd graph).
    let p = Tensor::ones([2], (Kind::Double, Device::Cpu)).set_requires_grad(true);
    let mut opt = LocalOptimizer::new(OptimizerKind::adam(0.1), vec![p.shallow_clone()]).unwrap();
    opt.step(&[Some(Tensor::from_slice(&[1.0f64, -1.0]))])
        .unwrap();
    // First Adam step moves each coordinate by lr * sign(g) (up to eps).
    let expected = Tensor::from_slice(&[0.9f64, 1.1]);
    assert!(rel_err(&p.detach(), &expected) < 1e-6);
    assert!(p.requires_grad());
}

fn invalid(kind: OptimizerKind) -> OptimError {
    LocalOptimizer::new(kind, vec![]).expect_err("hyper-parameters should be rejected")
}

#[test]
fn invalid_hyper_parameters_are_rejected() {
    let cases: Vec<(OptimizerKind, &str, f64)> = vec![
        (OptimizerKind::sgd(-0.1), "lr", -0.1),
        (OptimizerKind::sgd(0.1).momentum(-0.5), "momentum", -0.5),
        (
            OptimizerKind::sgd(0.1).weight_decay(-1.0),
            "weight_decay",
            -1.0,
        ),
        (OptimizerKind::adam(-1e-3), "lr", -1e-3),
        (OptimizerKind::adam(1e-3).eps(-1e-8), "eps", -1e-8),
        (OptimizerKind::adam(1e-3).betas(1.0, 0.999), "beta1", 1.0),
        (OptimizerKind::adam(1e-3).betas(-0.1, 0.999), "beta1", -0.1),
        (OptimizerKind::adamw(1e-3).betas(0.9, 1.5), "beta2", 1.5),
        (
            OptimizerKind::adamw(1e-3).weight_decay(-0.01),
            "weight_decay",
            -0.01,
        ),
    ];
    for (kind, name, value) in cases {
        match invalid(kind.clone()) {
            err @ OptimError::InvalidHyperParameter { .. } => {
                let OptimError::InvalidHyperParameter {
                    name: n, value: v, ..
                } = &err
                else {
                    unreachable!()
                };
                assert_eq!((*n, *v), (name, value), "{kind:?}");
                let msg = err.to_string();
                assert!(
                    msg.contains(name) && msg.contains(&value.to_string()),
                    "{msg}"
                );
            }
            other => panic!("{kind:?}: unexpected error {other:?}"),
        }
        assert!(kind.validate().is_err());
    }

    // NaN fails every range check.
    assert!(matches!(
        invalid(OptimizerKind::adamw(f64::NAN)),
        OptimError::InvalidHyperParameter { name: "lr", .. }
    ));

    // Nesterov needs momentum > 0 and zero dampening.
    for kind in [
        OptimizerKind::sgd(0.1).nesterov(true),
        OptimizerKind::sgd(0.1)
            .momentum(0.9)
            .dampening(0.1)
            .nesterov(true),
    ] {
        let err = invalid(kind);
        assert!(
            matches!(err, OptimError::NesterovRequiresMomentum { .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("nesterov"), "{err}");
    }

    // Boundary values that torch accepts.
    for kind in [
        OptimizerKind::sgd(0.0),
        OptimizerKind::adam(0.0).betas(0.0, 0.0).eps(0.0),
        OptimizerKind::sgd(0.1).momentum(0.9).nesterov(true),
    ] {
        kind.validate().unwrap();
    }
}

fn two_params() -> (LocalOptimizer, Vec<Tensor>) {
    let init = vec![
        Tensor::ones([3, 4], (Kind::Float, Device::Cpu)),
        Tensor::ones([5], (Kind::Float, Device::Cpu)),
    ];
    let opt = LocalOptimizer::new(
        OptimizerKind::adam(0.1),
        init.iter().map(Tensor::copy).collect(),
    )
    .unwrap();
    (opt, init)
}

fn assert_unchanged(opt: &LocalOptimizer, init: &[Tensor]) {
    for (p, i) in opt.params().iter().zip(init) {
        assert!(p.equal(i), "a failed step changed a parameter");
    }
}

#[test]
fn mismatched_gradients_are_typed_errors() {
    let ok0 = || Some(Tensor::ones([3, 4], (Kind::Float, Device::Cpu)));

    let (mut opt, init) = two_params();
    let err = opt.step(&[ok0()]).unwrap_err();
    assert!(
        matches!(
            err,
            OptimError::GradCountMismatch {
                expected: 2,
                actual: 1
            }
        ),
        "{err:?}"
    );
    assert_unchanged(&opt, &init);

    // Shape mismatch on the second parameter: the first must not be updated.
    let err = opt
        .step(&[
            ok0(),
            Some(Tensor::ones([5, 1], (Kind::Float, Device::Cpu))),
        ])
        .unwrap_err();
    match &err {
        OptimError::ShapeMismatch { index, param, grad } => {
            assert_eq!(
                (*index, param.as_slice(), grad.as_slice()),
                (1, &[5][..], &[5, 1][..])
            );
        }
        other => panic!("unexpected error {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("parameter 1") && msg.contains("[5]") && msg.contains("[5, 1]"),
        "{msg}"
    );
    assert_unchanged(&opt, &init);

    let err = opt
        .step(&[Some(Tensor::ones([4, 3], (Kind::Float, Device::Cpu))), None])
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("parameter 0") && msg.contains("[3, 4]") && msg.contains("[4, 3]"),
        "{msg}"
    );

    let err = opt
        .step(&[ok0(), Some(Tensor::ones([5], (Kind::Double, Device::Cpu)))])
        .unwrap_err();
    assert!(
        matches!(
            err,
            OptimError::DtypeMismatch {
                index: 1,
                param: Kind::Float,
                grad: Kind::Double
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("parameter 1"), "{err}");
    assert_unchanged(&opt, &init);

    // The optimizer still works after rejected steps.
    opt.step(&[ok0(), None]).unwrap();
    assert!(!opt.params()[0].equal(&init[0]));
    assert!(opt.params()[1].equal(&init[1]));
}

#[test]
fn undefined_parameter_is_rejected() {
    let err = LocalOptimizer::new(
        OptimizerKind::sgd(0.1),
        vec![Tensor::ones([1], (Kind::Float, Device::Cpu)), Tensor::new()],
    )
    .unwrap_err();
    assert!(
        matches!(err, OptimError::UndefinedParameter { index: 1 }),
        "{err:?}"
    );
}

#[test]
fn libtorch_errors_are_mapped() {
    // An expanded tensor cannot be written in place: libtorch rejects the
    // update, which must come back as an error naming the parameter, not a
    // panic.
    for kind in [
        OptimizerKind::sgd(0.1).momentum(0.9).weight_decay(0.1),
        OptimizerKind::adam(0.1).weight_decay(0.1),
        OptimizerKind::adamw(0.1),
    ] {
        let ok = Tensor::ones([2], (Kind::Float, Device::Cpu));
        let expanded = Tensor::ones([1], (Kind::Float, Device::Cpu)).expand([3], false);
        let mut opt = LocalOptimizer::new(kind.clone(), vec![ok, expanded]).unwrap();
        let err = opt
            .step(&[
                Some(Tensor::ones([2], (Kind::Float, Device::Cpu))),
                Some(Tensor::ones([3], (Kind::Float, Device::Cpu))),
            ])
            .unwrap_err();
        assert!(
            matches!(err, OptimError::Torch { index: 1, .. }),
            "{kind:?}: {err:?}"
        );
        assert!(err.to_string().contains("parameter 1"), "{err}");
    }
}

#[test]
fn unsupported_parameter_dtypes_are_rejected() {
    for dtype in [Kind::Int64, Kind::Bool, Kind::ComplexFloat] {
        let err = LocalOptimizer::new(
            OptimizerKind::adam(0.1),
            vec![
                Tensor::ones([2], (Kind::Float, Device::Cpu)),
                Tensor::ones([2], (dtype, Device::Cpu)),
            ],
        )
        .unwrap_err();
        assert!(
            matches!(err, OptimError::UnsupportedDtype { index: 1, dtype: d } if d == dtype),
            "{err:?}"
        );
    }
}

fn sparse_grad() -> Tensor {
    // Rows 0 and 2 of a 4x3 gradient.
    let dense = Tensor::zeros([4, 3], (Kind::Double, Device::Cpu));
    let rows = Tensor::from_slice(&[0i64, 2]);
    let values = Tensor::randn([2, 3], (Kind::Double, Device::Cpu));
    dense.index_copy(0, &rows, &values).to_sparse_sparse_dim(1)
}

#[test]
fn adam_rejects_sparse_gradients() {
    for kind in [OptimizerKind::adam(0.1), OptimizerKind::adamw(0.1)] {
        let p = Tensor::ones([4, 3], (Kind::Double, Device::Cpu));
        let mut opt = LocalOptimizer::new(kind, vec![p.copy()]).unwrap();
        let err = opt.step(&[Some(sparse_grad())]).unwrap_err();
        assert!(
            matches!(err, OptimError::SparseGradient { index: 0 }),
            "{err:?}"
        );
        assert!(opt.params()[0].equal(&p));
    }
}

/// torch's SGD accepts sparse gradients; they must give the dense result.
#[test]
fn sgd_sparse_gradients_match_dense() {
    tch::manual_seed(7);
    let kind = OptimizerKind::sgd(0.1).momentum(0.9).dampening(0.1);
    let init = Tensor::randn([4, 3], (Kind::Double, Device::Cpu));
    let mut sparse = LocalOptimizer::new(kind.clone(), vec![init.copy()]).unwrap();
    let mut dense = LocalOptimizer::new(kind, vec![init.copy()]).unwrap();
    for _ in 0..5 {
        let g = sparse_grad();
        sparse.step(&[Some(g.shallow_clone())]).unwrap();
        dense.step(&[Some(g.to_dense(None, false))]).unwrap();
    }
    assert!(rel_err(&sparse.params()[0], &dense.params()[0]) < 1e-12);
    assert!(!sparse.params()[0].equal(&init));

    // As in torch, weight decay cannot be added to a sparse gradient
    // (`add(sparse, dense)` is unsupported): an error, not a panic.
    let mut opt = LocalOptimizer::new(
        OptimizerKind::sgd(0.1).weight_decay(1e-2),
        vec![init.copy()],
    )
    .unwrap();
    let err = opt.step(&[Some(sparse_grad())]).unwrap_err();
    assert!(matches!(err, OptimError::Torch { index: 0, .. }), "{err:?}");
}

#[test]
fn defaults_and_builders() {
    assert_eq!(
        OptimizerKind::sgd(0.1),
        OptimizerKind::Sgd {
            lr: 0.1,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false
        }
    );
    assert_eq!(
        OptimizerKind::adam(1e-3),
        OptimizerKind::Adam {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false
        }
    );
    assert_eq!(
        OptimizerKind::adamw(1e-3),
        OptimizerKind::AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            amsgrad: false
        }
    );
    assert_eq!(OptimizerKind::adam(0.1).with_lr(0.2).lr(), 0.2);
    // Options of another algorithm are ignored.
    assert_eq!(
        OptimizerKind::adam(0.1).momentum(0.9).nesterov(true),
        OptimizerKind::adam(0.1)
    );
    assert_eq!(
        OptimizerKind::sgd(0.1)
            .betas(0.5, 0.5)
            .eps(1.0)
            .amsgrad(true),
        OptimizerKind::sgd(0.1)
    );
}

#[test]
fn kind_round_trips_through_serde() {
    for kind in [
        OptimizerKind::sgd(0.1).momentum(0.9).nesterov(true),
        OptimizerKind::adam(1e-3).amsgrad(true),
        OptimizerKind::adamw(1e-3).betas(0.8, 0.9),
    ] {
        let json = serde_json::to_string(&kind).unwrap();
        let back: OptimizerKind = serde_json::from_str(&json).unwrap();
        assert_eq!(back, kind);
    }
}

#[test]
fn optimizer_is_send() {
    fn assert_send<T: Send>() {}
    assert_send::<LocalOptimizer>();
    assert_send::<OptimError>();
}

/// `step_scaled(g, s)` against `step(g * s)`: the same parameters, the
/// gradients untouched. Bit for bit with a power-of-two scale (what a
/// pipeline of 2^k microbatches hands over), to 1e-6 otherwise.
#[test]
fn step_scaled_matches_stepping_on_scaled_gradients() {
    let kinds = [
        OptimizerKind::sgd(0.1),
        OptimizerKind::Sgd {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 1e-2,
            nesterov: false,
        },
        OptimizerKind::adam(1e-2),
        OptimizerKind::adamw(1e-2),
    ];
    for kind in kinds {
        for (scale, exact) in [(0.25, true), (1.0 / 3.0, false)] {
            let (init, grads) = problem(Kind::Float);
            let copies = || init.iter().map(Tensor::copy).collect::<Vec<_>>();
            let mut folded = LocalOptimizer::new(kind.clone(), copies()).unwrap();
            let mut scaled_first = LocalOptimizer::new(kind.clone(), copies()).unwrap();
            for step_grads in &grads {
                let given: Vec<Option<Tensor>> =
                    step_grads.iter().map(|g| Some(g.shallow_clone())).collect();
                folded.step_scaled(&given, scale).unwrap();
                for (g, original) in given.iter().zip(step_grads) {
                    assert!(
                        g.as_ref().unwrap().equal(original),
                        "{kind:?}: a gradient changed"
                    );
                }
                let scaled: Vec<Option<Tensor>> =
                    step_grads.iter().map(|g| Some(g * scale)).collect();
                scaled_first.step(&scaled).unwrap();
            }
            for (i, (a, b)) in folded
                .params()
                .iter()
                .zip(scaled_first.params())
                .enumerate()
            {
                if exact && kind == OptimizerKind::sgd(0.1) {
                    assert!(
                        a.equal(b),
                        "{kind:?}: parameter {i} differs with scale {scale}"
                    );
                } else {
                    let err = rel_err(a, b);
                    assert!(
                        err <= 1e-6,
                        "{kind:?}: parameter {i} differs by {err:e} with scale {scale}"
                    );
                }
            }
        }
    }
    let mut opt = LocalOptimizer::new(
        OptimizerKind::sgd(0.1),
        vec![Tensor::ones([2], (Kind::Float, Device::Cpu))],
    )
    .unwrap();
    let err = opt.step_scaled(&[None], f64::NAN).unwrap_err();
    assert!(
        matches!(
            err,
            OptimError::InvalidHyperParameter {
                name: "grad_scale",
                ..
            }
        ),
        "{err}"
    );
}
