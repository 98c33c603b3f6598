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
