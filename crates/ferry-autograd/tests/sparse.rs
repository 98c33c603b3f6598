//! Distributed autograd with sparse COO tensors across worker processes on
//! 127.0.0.1: sparse tensors that require grad get their send and recv
//! functions recorded like dense ones, sparse gradients flow back, and
//! every gradient equals local libtorch's (to 1e-6 relative).
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Arc, OnceLock};

use common::*;
use ferry_autograd::DistAutogradContainer;
use ferry_rpc::{BoxError, Function, RpcOptions};
use ferry_rref::{RRef, RemoteExt};
use ferry_tch::Tensor;
use ferry_testkit::world_ok;
use tch::Kind;

/// The parameter server's sparse weight, which requires grad.
const SPARSE_WEIGHT: Function<(), Tensor> = Function::new("sparse_weight");
/// The parameter server's gradient of its sparse weight in a context.
const SPARSE_WEIGHT_GRAD: Function<u64, Option<Tensor>> = Function::new("sparse_weight_grad");

static WEIGHT: OnceLock<Tensor> = OnceLock::new();

/// One per process: a 6×2 weight with rows 1, 4 and 5 specified.
fn weight() -> tch::Tensor {
    WEIGHT
        .get_or_init(|| {
            let w = sparse(&[1, 4, 5], &[6, 2], 0.5).set_requires_grad(true);
            Tensor::from(w)
        })
        .shallow_clone()
}

fn init_sparse(rank: u32) -> Arc<DistAutogradContainer> {
    let mut f = functions();
    f.add(SPARSE_WEIGHT, |()| Tensor::from(weight()));
    f.add(SPARSE_WEIGHT_GRAD, |ctx| -> Result<_, BoxError> {
        let g = ferry_autograd::get_gradients(ctx)?;
        Ok(g.get(&weight()).map(|g| Tensor::from(g.shallow_clone())))
    });
    let mut options = RpcOptions::from_env(name(rank)).unwrap().functions(f);
    let container = ferry_autograd::install(&mut options);
    let agent = ferry_rpc::Agent::start(options).unwrap();
    ferry_rpc::set_process_agent(&agent).unwrap();
    container
}

/// A sparse tensor of `size` (sparse in its first dimension) with the rows
/// `rows` specified (repeats allowed: not coalesced), values from `scale`.
fn sparse(rows: &[i64], size: &[i64], scale: f64) -> tch::Tensor {
    let nnz = rows.len() as i64;
    let indices = tch::Tensor::from_slice(rows).reshape([1, nnz]);
    let mut shape = vec![nnz];
    shape.extend_from_slice(&size[1..]);
    let count: i64 = shape.iter().product();
    let values = (tch::Tensor::arange(count, F64) * scale + 1.0).reshape(&shape);
    tch::Tensor::sparse_coo_tensor_indices_size(&indices, &values, size, F64, false)
}

fn t(x: &tch::Tensor) -> Tensor {
    Tensor::from(x.shallow_clone())
}

/// A fresh sparse leaf that requires grad, with `x`'s indices and values.
fn sparse_leaf(x: &tch::Tensor) -> tch::Tensor {
    x.detach().copy().set_requires_grad(true)
}

/// `torch.sparse.sum`.
fn sparse_sum(x: &tch::Tensor) -> tch::Tensor {
    x.f_internal_sparse_sum().unwrap()
}

/// `a` and `b` are both sparse and equal to 1e-6 relative.
#[track_caller]
fn assert_sparse_close(a: &tch::Tensor, b: &tch::Tensor, what: &str) {
    assert!(a.is_sparse(), "{what}: not sparse");
    assert!(b.is_sparse(), "{what}: the local one is not sparse");
    assert_close(&a.to_dense(None, false), &b.to_dense(None, false), what);
}

/// PyTorch's `test_backward_simple_sparse`: `torch.add` of two sparse
/// tensors on another worker (by `rpc_sync` and by `remote`), then
/// `torch.sparse.sum` and backward; the gradients are sparse and equal to
/// local autograd's.
#[test]
fn sparse_add_on_another_worker_matches_local_autograd() {
    world_ok(
        "sparse_add_on_another_worker_matches_local_autograd",
        2,
        |rank| {
            let container = init_sparse(rank);
            if rank == 0 {
                let t1 = sparse(&[0, 3, 3, 1], &[5, 3], 0.25).set_requires_grad(true);
                let t2 = sparse(&[4, 1], &[5, 3], -0.5)
                    .coalesce()
                    .set_requires_grad(true);
                let (l1, l2) = (sparse_leaf(&t1), sparse_leaf(&t2));
                let local = sparse_sum(&(&l1 + &l2));
                let want = local_grads(&local, &[&l1, &l2]);
                for by_remote in [false, true] {
                    let ctx = ferry_autograd::context().unwrap();
                    let ret: Tensor = if by_remote {
                        let r: RRef<Tensor> =
                            MY_ADD.remote(name(1).as_str(), (t(&t1), t(&t2))).unwrap();
                        r.to_here().unwrap()
                    } else {
                        MY_ADD.rpc_sync(name(1), (t(&t1), t(&t2))).unwrap()
                    };
                    assert!(ret.is_sparse() && ret.requires_grad());
                    ctx.backward(&[sparse_sum(&ret)], false).unwrap();
                    let grads = ctx.gradients();
                    assert_eq!(grads.len(), 2);
                    assert_sparse_close(grads.get(&t1).unwrap(), &want[0], "t1");
                    assert_sparse_close(grads.get(&t2).unwrap(), &want[1], "t2");
                    assert!(!t1.grad().defined(), "never into .grad");
                }
            }
            finish(&container);
        },
    );
}

/// A sparse tensor sent twice in one call and once more in another (three
/// send functions of one tensor), and a hybrid sparse tensor through a
/// nested call over three workers: the sparse gradients of each send
/// accumulate in the context, sparse, and equal local autograd's.
#[test]
fn sparse_gradients_accumulate_over_sends_and_nested_calls() {
    world_ok(
        "sparse_gradients_accumulate_over_sends_and_nested_calls",
        3,
        |rank| {
            let container = init_sparse(rank);
            if rank == 0 {
                let t1 = sparse(&[2, 0, 2], &[4, 3], 1.0).set_requires_grad(true);
                let h = sparse(&[1, 3], &[4, 2, 2], 0.5).set_requires_grad(true);
                let ctx = ferry_autograd::context().unwrap();
                let twice: Tensor = MY_ADD.rpc_sync(name(1), (t(&t1), t(&t1))).unwrap();
                let scaled: Tensor = SCALE.rpc_sync(name(2), (t(&t1), 3.0)).unwrap();
                // h goes to worker1, which sends it on to worker2.
                let nested: Tensor = NESTED_SCALE
                    .rpc_sync(name(1), (t(&h), name(2), -2.0))
                    .unwrap();
                let loss = sparse_sum(&(&*twice + &*scaled)) + sparse_sum(&nested);
                ctx.backward(&[loss], false).unwrap();
                let grads = ctx.gradients();
                let (l1, lh) = (sparse_leaf(&t1), sparse_leaf(&h));
                let local = sparse_sum(&(&(&l1 + &l1) + &(&l1 * 3.0))) + sparse_sum(&(&lh * -2.0));
                let want = local_grads(&local, &[&l1, &lh]);
                assert_sparse_close(grads.get(&t1).unwrap(), &want[0], "t1");
                assert_sparse_close(grads.get(&h).unwrap(), &want[1], "hybrid h");
            }
            finish(&container);
        },
    );
}

/// PyTorch's `test_trainer_ps_sparse` in small: a parameter server holds a
/// sparse weight that requires grad; each trainer fetches it (a send on
/// the server, a recv on the trainer), uses it, and runs backward; each
/// trainer's context on the server holds the sparse gradient of its own
/// pass only.
#[test]
fn a_sparse_parameter_on_a_server_gets_each_trainers_gradient() {
    world_ok(
        "a_sparse_parameter_on_a_server_gets_each_trainers_gradient",
        3,
        |rank| {
            let container = init_sparse(rank);
            if rank != 0 {
                let k = f64::from(rank) + 1.0;
                let ctx = ferry_autograd::context().unwrap();
                let w: Tensor = SPARSE_WEIGHT.rpc_sync(name(0), ()).unwrap();
                assert!(w.is_sparse() && w.requires_grad());
                ctx.backward(&[sparse_sum(&(&*w * k))], false).unwrap();
                let g = SPARSE_WEIGHT_GRAD
                    .rpc_sync(name(0), ctx.id())
                    .unwrap()
                    .expect("the server has the weight's gradient");
                let lw = sparse_leaf(&weight());
                let want = local_grads(&sparse_sum(&(&lw * k)), &[&lw]);
                assert_sparse_close(&g, &want[0], "the server's gradient");
            }
            finish(&container);
        },
    );
}

/// Sparse tensors that do not require grad travel as plain data inside a
/// context, beside ones that do; an integer sparse tensor arrives as it
/// was.
#[test]
fn sparse_tensors_without_grad_travel_as_data_in_a_context() {
    world_ok(
        "sparse_tensors_without_grad_travel_as_data_in_a_context",
        2,
        |rank| {
            let container = init_sparse(rank);
            if rank == 0 {
                let plain = sparse(&[1, 2], &[4, 3], 1.0);
                let wants = sparse(&[0, 2], &[4, 3], 2.0).set_requires_grad(true);
                let ctx = ferry_autograd::context().unwrap();
                let sum: Tensor = MY_ADD.rpc_sync(name(1), (t(&plain), t(&wants))).unwrap();
                ctx.backward(&[sparse_sum(&sum)], false).unwrap();
                let grads = ctx.gradients();
                assert_eq!(grads.len(), 1, "only the tensor that requires grad");
                let lw = sparse_leaf(&wants);
                let want = local_grads(&sparse_sum(&(&plain + &lw)), &[&lw]);
                assert_sparse_close(grads.get(&wants).unwrap(), &want[0], "wants");
                let ints = plain.to_kind(Kind::Int64);
                let back: Tensor = SCALE.rpc_sync(name(1), (t(&ints), 1.0)).unwrap();
                assert!(back.is_sparse() && !back.requires_grad());
                assert!(back
                    .to_dense(None, false)
                    .equal(&ints.to_dense(None, false).to_kind(back.kind())));
            }
            finish(&container);
        },
    );
}
