//! The split backward (zero-bubble I then W) gives exactly the gradients of
//! one full backward: on a chain of layers, with a parameter shared by two
//! layers, with several roots, with a parameter on a branch off the input
//! path, and with a root that does not depend on the inputs (where the
//! weight half goes back from the roots).
#![allow(clippy::unwrap_used, missing_docs)]

use tch::{Device, Kind, Tensor};

const F64: (Kind, Device) = (Kind::Double, Device::Cpu);

fn leaf(shape: &[i64], seed: i64) -> Tensor {
    tch::manual_seed(seed);
    Tensor::randn(shape, F64).set_requires_grad(true)
}

fn shallow(ts: &[Tensor]) -> Vec<Tensor> {
    ts.iter().map(Tensor::shallow_clone).collect()
}

/// Split and full backward agree on `roots` built from `inputs` and `params`.
fn check(
    build: impl Fn(&[Tensor], &[Tensor]) -> Vec<Tensor>,
    inputs: &[Tensor],
    params: &[Tensor],
    captured: bool,
) {
    let roots = build(inputs, params);
    let seeds: Vec<Tensor> = roots
        .iter()
        .enumerate()
        .map(|(i, r)| r.ones_like() * (i as f64 + 0.5))
        .collect();
    let mut all = shallow(inputs);
    all.extend(shallow(params));
    let want = ferry_autograd::grad(&roots, &seeds, &all, false).unwrap();

    let roots = build(inputs, params);
    let (dx, weight) =
        ferry_autograd::backward_input(&roots, &seeds, &shallow(inputs), &shallow(params)).unwrap();
    assert_eq!(weight.is_captured(), captured);
    let dw = weight.run(&roots, &seeds, &shallow(params)).unwrap();
    for (i, (got, want)) in dx.iter().chain(&dw).zip(&want).enumerate() {
        match (got, want) {
            (Some(g), Some(w)) => assert!(g.allclose(w, 1e-12, 1e-12, false), "gradient {i}"),
            (None, None) => {}
            _ => panic!("gradient {i}: one side has none"),
        }
    }
}

#[test]
fn a_chain_of_layers_splits_exactly_and_w_runs_from_the_capture() {
    let params: Vec<Tensor> = (0..4)
        .flat_map(|l| [leaf(&[5, 5], 10 + l), leaf(&[5], 20 + l)])
        .collect();
    let x = leaf(&[3, 5], 1);
    check(
        |inputs, p| {
            let mut h = inputs[0].shallow_clone();
            for l in 0..4 {
                h = h.linear(&p[2 * l], Some(&p[2 * l + 1])).relu();
            }
            vec![h]
        },
        &[x],
        &params,
        true,
    );
}

#[test]
fn a_parameter_shared_by_two_layers_and_several_roots_split_exactly() {
    let w = leaf(&[4, 4], 3);
    let v = leaf(&[4, 4], 4);
    let x = leaf(&[2, 4], 5);
    let x2 = leaf(&[2, 4], 6);
    check(
        |inputs, p| {
            let h = inputs[0].matmul(&p[0]).tanh();
            let h = h.matmul(&p[1]).sigmoid().matmul(&p[0]);
            vec![h.shallow_clone(), (h * &inputs[1]).sum(Kind::Double)]
        },
        &[x, x2],
        &[w, v],
        true,
    );
}

#[test]
fn a_parameter_on_a_branch_off_the_input_path_is_captured_where_the_branch_leaves() {
    let w = leaf(&[3, 3], 7);
    let b = leaf(&[3], 8);
    let x = leaf(&[2, 3], 9);
    check(
        |inputs, p| vec![inputs[0].matmul(&p[0]) + (&p[1] * 2.0).exp()],
        &[x],
        &[w, b],
        true,
    );
}

#[test]
fn a_root_that_does_not_depend_on_the_inputs_makes_w_go_back_from_the_roots() {
    let w = leaf(&[3, 3], 7);
    let b = leaf(&[3], 8);
    let x = leaf(&[2, 3], 9);
    check(
        |inputs, p| {
            vec![
                inputs[0].matmul(&p[0]),
                (&p[1] * 2.0).exp().sum(Kind::Double),
            ]
        },
        &[x],
        &[w, b],
        false,
    );
}

#[test]
fn inputs_that_get_no_gradient_are_none() {
    let w = leaf(&[3, 3], 11);
    let x = leaf(&[2, 3], 12);
    let unused = leaf(&[2], 13);
    check(
        |inputs, p| vec![inputs[0].matmul(&p[0])],
        &[x, unused],
        &[w],
        true,
    );
}

/// `run_accumulating` adds linear layers' weight gradients into the
/// accumulated ones in place and returns the rest; accumulated plus rest
/// equals accumulated plus the full gradient. Covers `F.linear` with and
/// without a bias (the fused shapes), a weight shared by two linear layers
/// (fused once per layer), an elementwise scale (not fused: comes back), a
/// parameter with nothing accumulated yet (comes back whole), a plain
/// `mm` with the weight transposed, in float64 and float32.
#[test]
fn run_accumulating_adds_linear_weight_gradients_in_place() {
    for kind in [Kind::Double, Kind::Float] {
        let opts = (kind, Device::Cpu);
        tch::manual_seed(7);
        let p = |shape: &[i64]| Tensor::randn(shape, opts).set_requires_grad(true);
        // w1 with bias b1; w2 without bias, used twice; s elementwise; w3
        // through mm; w4 gets nothing accumulated.
        let params = vec![
            p(&[6, 5]),
            p(&[6]),
            p(&[6, 6]),
            p(&[6]),
            p(&[4, 6]),
            p(&[3, 4]),
        ];
        let x = Tensor::randn([7, 5], opts).set_requires_grad(true);
        let build = |x: &Tensor, p: &[Tensor]| {
            let h = x.linear(&p[0], Some(&p[1])).relu();
            let h = h.linear::<&Tensor>(&p[2], None).tanh();
            let h = h.linear::<&Tensor>(&p[2], None) * &p[3];
            let h = h.mm(&p[4].tr()) * 0.5;
            vec![h.linear::<&Tensor>(&p[5], None).sum(kind)]
        };
        let seeds = vec![Tensor::ones([], opts)];
        let mut all = vec![x.shallow_clone()];
        all.extend(shallow(&params));
        let full = ferry_autograd::grad(&build(&x, &params), &seeds, &all, false).unwrap();

        // Accumulated gradients from "earlier microbatches", none for w4.
        let before: Vec<Option<Tensor>> = params
            .iter()
            .enumerate()
            .map(|(i, q)| (i != 5).then(|| q.randn_like()))
            .collect();
        let mut acc: Vec<Option<Tensor>> = before
            .iter()
            .map(|b| b.as_ref().map(Tensor::copy))
            .collect();
        let roots = build(&x, &params);
        let (_, weight) =
            ferry_autograd::backward_input(&roots, &seeds, &[x.shallow_clone()], &shallow(&params))
                .unwrap();
        assert!(weight.is_captured());
        let rest = weight
            .run_accumulating(&roots, &seeds, &shallow(&params), &mut acc)
            .unwrap();
        let tol = if kind == Kind::Double { 1e-12 } else { 1e-5 };
        for i in 0..params.len() {
            let want = match &before[i] {
                Some(b) => b + full[i + 1].as_ref().unwrap(),
                None => full[i + 1].as_ref().unwrap().copy(),
            };
            let got = match (&acc[i], &rest[i]) {
                (Some(a), Some(r)) => a + r,
                (Some(a), None) => a.copy(),
                (None, Some(r)) => r.copy(),
                (None, None) => panic!("parameter {i}: no gradient at all"),
            };
            assert!(
                got.allclose(&want, tol, tol, false),
                "{kind:?} parameter {i}"
            );
        }
        // The fused ones came back empty; the others whole.
        assert!(rest[0].is_none(), "w1 (linear with bias) is fused");
        assert!(rest[1].is_some(), "b1 is a bias: not a GEMM's");
        assert!(
            rest[2].is_none(),
            "w2 (linear without bias, twice) is fused"
        );
        assert!(rest[3].is_some(), "s is elementwise");
        assert!(
            rest[4].is_none(),
            "w3 (mm with the weight transposed) is fused"
        );
        assert!(rest[5].is_some(), "w4 has nothing accumulated");
    }
}

/// `grad_accumulating` (a full backward that accumulates): accumulated
/// plus rest equals accumulated plus the full gradient, with and without
/// an input that requires grad (a pipeline's first stage has none, so its
/// first layer's product feeds only the weight and the bias), for linear
/// layers with and without a bias, a shared weight, `mm`, an elementwise
/// scale and a parameter with nothing accumulated.
#[test]
fn grad_accumulating_adds_linear_weight_gradients_in_place() {
    for (kind, input_grad) in [
        (Kind::Double, true),
        (Kind::Double, false),
        (Kind::Float, true),
        (Kind::Float, false),
    ] {
        let opts = (kind, Device::Cpu);
        tch::manual_seed(11);
        let p = |shape: &[i64]| Tensor::randn(shape, opts).set_requires_grad(true);
        let params = vec![p(&[6, 5]), p(&[6, 6]), p(&[6]), p(&[4, 6]), p(&[3, 4])];
        let x = Tensor::randn([7, 5], opts).set_requires_grad(input_grad);
        // The first layer has no bias, so without an input gradient its
        // product feeds nothing but the weight.
        let build = |x: &Tensor, p: &[Tensor]| {
            let h = x.linear::<&Tensor>(&p[0], None).relu();
            let h = h.linear::<&Tensor>(&p[1], None).tanh();
            let h = h.linear::<&Tensor>(&p[1], None) * &p[2];
            let h = h.mm(&p[3].tr());
            vec![h.linear::<&Tensor>(&p[4], None).sum(kind)]
        };
        let seeds = vec![Tensor::ones([], opts)];
        let mut inputs: Vec<Tensor> = if input_grad {
            vec![x.shallow_clone()]
        } else {
            vec![]
        };
        let offset = inputs.len();
        inputs.extend(shallow(&params));
        let full = ferry_autograd::grad(&build(&x, &params), &seeds, &inputs, false).unwrap();
        let before: Vec<Option<Tensor>> = (0..inputs.len())
            .map(|i| (i >= offset && i != offset + 4).then(|| inputs[i].randn_like()))
            .collect();
        let mut acc: Vec<Option<Tensor>> = before
            .iter()
            .map(|b| b.as_ref().map(Tensor::copy))
            .collect();
        let rest =
            ferry_autograd::grad_accumulating(&build(&x, &params), &seeds, &inputs, &mut acc)
                .unwrap();
        let tol = if kind == Kind::Double { 1e-12 } else { 1e-5 };
        for i in 0..inputs.len() {
            let want = match &before[i] {
                Some(b) => b + full[i].as_ref().unwrap(),
                None => full[i].as_ref().unwrap().copy(),
            };
            let got = match (&acc[i], &rest[i]) {
                (Some(a), Some(r)) => a + r,
                (Some(a), None) => a.copy(),
                (None, Some(r)) => r.copy(),
                (None, None) => panic!("input {i}: no gradient at all"),
            };
            assert!(got.allclose(&want, tol, tol, false), "{kind:?} input {i}");
        }
        for i in [0, 1, 3] {
            assert!(
                rest[offset + i].is_none(),
                "{kind:?}: parameter {i} is fused"
            );
        }
        assert!(rest[offset + 2].is_some(), "the scale is elementwise");
        assert!(
            rest[offset + 4].is_some(),
            "nothing accumulated for the last"
        );
    }
}
