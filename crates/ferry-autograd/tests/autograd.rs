//! Distributed autograd across worker processes on 127.0.0.1. Every test
//! compares with the same computation done locally with libtorch (to 1e-6
//! relative), and ends only once no context is left on any worker.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use ferry_autograd::{AutogradError, DistributedOptimizer, OptimizerKind};
use ferry_rref::{RRef, RemoteExt};
use ferry_tch::Tensor;
use ferry_testkit::world_ok;

fn t(x: &tch::Tensor) -> Tensor {
    Tensor::from(x.shallow_clone())
}

/// The first example of PyTorch's distributed autograd design note:
/// `t3 = by_name(my_add).rpc_sync(worker1, (t1, t2))`,
/// `t5 = t3 * t4`, `loss = t5.sum()`.
#[test]
fn my_add_matches_local_autograd() {
    world_ok("my_add_matches_local_autograd", 2, |rank| {
        let container = init(rank);
        if rank == 0 {
            let t1 = tch::Tensor::rand([3, 3], F64).set_requires_grad(true);
            let t2 = tch::Tensor::rand([3, 3], F64).set_requires_grad(true);
            let t4 = tch::Tensor::rand([3, 3], F64).set_requires_grad(true);
            let ctx = ferry_autograd::context().unwrap();
            let t3: Tensor = MY_ADD.rpc_sync(name(1), (t(&t1), t(&t2))).unwrap();
            assert!(
                t3.requires_grad(),
                "the received result is a leaf of the graph"
            );
            let loss = (&*t3 * &t4).sum(tch::Kind::Double);
            ctx.backward(&[loss], false).unwrap();
            let grads = ctx.gradients();
            assert_eq!(
                grads.len(),
                3,
                "t1, t2 and t4 have gradients; the recv leaf does not"
            );
            // Locally.
            let (l1, l2, l4) = (leaf(&t1), leaf(&t2), leaf(&t4));
            let local = ((&l1 + &l2) * &l4).sum(tch::Kind::Double);
            let want = local_grads(&local, &[&l1, &l2, &l4]);
            assert_close(grads.get(&t1).unwrap(), &want[0], "t1");
            assert_close(grads.get(&t2).unwrap(), &want[1], "t2");
            assert_close(grads.get(&t4).unwrap(), &want[2], "t4");
            // Never into .grad.
            assert!(!t1.grad().defined() && !t4.grad().defined());
            let id = ctx.id();
            assert_eq!(
                id >> 48,
                0,
                "context ids carry the worker id in the top bits"
            );
            drop(ctx);
            assert!(matches!(
                ferry_autograd::get_gradients(id),
                Err(AutogradError::UnknownContext { .. })
            ));
        }
        finish(&container);
    });
}

/// The design note's "simple end to end example": two remote random tensors,
/// backward, then `DistributedOptimizer(SGD, lr=0.05).step`.
#[test]
fn simple_end_to_end_with_the_distributed_optimizer() {
    world_ok(
        "simple_end_to_end_with_the_distributed_optimizer",
        2,
        |rank| {
            let container = init(rank);
            let dst = name((rank + 1) % 2);
            let rref1: RRef<Tensor> = RANDOM_TENSOR
                .remote(dst.as_str(), 10 + rank as i64)
                .unwrap();
            let rref2: RRef<Tensor> = RANDOM_TENSOR
                .remote(dst.as_str(), 20 + rank as i64)
                .unwrap();
            let before1: Tensor = RREF_VALUE.rpc_sync(dst.as_str(), rref1.clone()).unwrap();
            let before2: Tensor = RREF_VALUE.rpc_sync(dst.as_str(), rref2.clone()).unwrap();
            {
                let ctx = ferry_autograd::context().unwrap();
                let loss = &*rref1.to_here().unwrap() + &*rref2.to_here().unwrap();
                ctx.backward(&[loss.sum(tch::Kind::Double)], false).unwrap();
                // The gradients live on the owner, in this context.
                let g1: Option<Tensor> = RREF_GRAD
                    .rpc_sync(dst.as_str(), (rref1.clone(), ctx.id()))
                    .unwrap();
                assert_close(
                    &g1.unwrap(),
                    &tch::Tensor::ones([3, 3], F64),
                    "gradient of rref1",
                );
                let opt = DistributedOptimizer::new(
                    OptimizerKind::sgd(0.05),
                    vec![rref1.clone(), rref2.clone()],
                )
                .unwrap();
                assert_eq!(opt.owners(), vec![dst.clone()]);
                opt.step(ctx.id()).unwrap();
            }
            let after1: Tensor = RREF_VALUE.rpc_sync(dst.as_str(), rref1).unwrap();
            let after2: Tensor = RREF_VALUE.rpc_sync(dst.as_str(), rref2).unwrap();
            // Locally: SGD with lr 0.05 on a gradient of ones.
            assert_close(&after1, &(&*before1 - 0.05), "rref1 after the step");
            assert_close(&after2, &(&*before2 - 0.05), "rref2 after the step");
            finish(&container);
        },
    );
}

/// The paper's Listing 1 across 3 workers: the coordinator drives two
/// layers owned by workers 1 and 2; the activation goes from 1 to 2
/// directly. Gradients and an SGD step match the same model run locally.
#[test]
fn listing_1_matches_the_local_model() {
    world_ok("listing_1_matches_the_local_model", 3, |rank| {
        let container = init(rank);
        if rank == 0 {
            let l1: RRef<Layer> = LAYER_NEW.remote(name(1), (8i64, 6i64, 1i64)).unwrap();
            let l2: RRef<Layer> = LAYER_NEW.remote(name(2), (6i64, 4i64, 2i64)).unwrap();
            let mut params: Vec<RRef<Tensor>> = LAYER_PARAMS.rpc_sync(name(1), l1.clone()).unwrap();
            params.extend(LAYER_PARAMS.rpc_sync(name(2), l2.clone()).unwrap());
            let opt =
                DistributedOptimizer::new(OptimizerKind::sgd(0.1).momentum(0.9), params.clone())
                    .unwrap();
            // The same model, locally.
            let (m1, m2) = (Layer::new(8, 6, 1), Layer::new(6, 4, 2));
            let mut local_opt = ferry_autograd::optim::LocalOptimizer::new(
                OptimizerKind::sgd(0.1).momentum(0.9),
                vec![
                    m1.weight.shallow_clone(),
                    m1.bias.shallow_clone(),
                    m2.weight.shallow_clone(),
                    m2.bias.shallow_clone(),
                ],
            )
            .unwrap();
            tch::manual_seed(3);
            for step in 0..3 {
                let x = tch::Tensor::randn([5, 8], F64);
                let target = tch::Tensor::randn([5, 4], F64);
                let ctx = ferry_autograd::context().unwrap();
                let ri = RRef::new(t(&x)).unwrap();
                let rx: RRef<Tensor> = LAYER_FORWARD.remote(name(1), (l1.clone(), ri)).unwrap();
                let ry: RRef<Tensor> = LAYER_FORWARD.remote(name(2), (l2.clone(), rx)).unwrap();
                let y = ry.to_here().unwrap();
                let loss = (&*y - &target).square().mean(tch::Kind::Double);
                ctx.backward(&[loss.shallow_clone()], false).unwrap();
                // Locally.
                let ly = m2.forward(&m1.forward(&x));
                let local_loss = (&ly - &target).square().mean(tch::Kind::Double);
                assert_close(&loss, &local_loss, "loss");
                let want = local_grads(&local_loss, &[&m1.weight, &m1.bias, &m2.weight, &m2.bias]);
                let (w1, b1): (Option<Tensor>, Option<Tensor>) = LAYER_GRADS
                    .rpc_sync(name(1), (l1.clone(), ctx.id()))
                    .unwrap();
                let (w2, b2): (Option<Tensor>, Option<Tensor>) = LAYER_GRADS
                    .rpc_sync(name(2), (l2.clone(), ctx.id()))
                    .unwrap();
                assert_close(
                    &w1.unwrap(),
                    &want[0],
                    &format!("step {step}: layer 1 weight"),
                );
                assert_close(
                    &b1.unwrap(),
                    &want[1],
                    &format!("step {step}: layer 1 bias"),
                );
                assert_close(
                    &w2.unwrap(),
                    &want[2],
                    &format!("step {step}: layer 2 weight"),
                );
                assert_close(
                    &b2.unwrap(),
                    &want[3],
                    &format!("step {step}: layer 2 bias"),
                );
                opt.step(ctx.id()).unwrap();
                local_opt
                    .step(&want.into_iter().map(Some).collect::<Vec<_>>())
                    .unwrap();
            }
            // After three steps the parameters still match.
            for (i, p) in params.iter().enumerate() {
                let remote: Tensor = RREF_VALUE.rpc_sync(p.owner(), p.clone()).unwrap();
                assert_close(
                    &remote,
                    &local_opt.params()[i],
                    &format!("parameter {i} after 3 steps"),
                );
            }
        }
        finish(&container);
    });
}

/// Tensors going back and forth between two workers several times, a
/// nested call, two roots, and a tensor sent but not used by the loss.
#[test]
fn round_trips_nested_calls_multiple_roots_and_unused_sends() {
    world_ok(
        "round_trips_nested_calls_multiple_roots_and_unused_sends",
        3,
        |rank| {
            let container = init(rank);
            if rank == 0 {
                let x = tch::Tensor::randn([4], F64).set_requires_grad(true);
                let w = tch::Tensor::randn([4], F64).set_requires_grad(true);
                let ctx = ferry_autograd::context().unwrap();
                // 0 -> 1 -> 0 -> 1 -> 0, with local work in between.
                let a: Tensor = SIN.rpc_sync(name(1), t(&x)).unwrap();
                let b = &*a * &w;
                let c: Tensor = MUL
                    .rpc_sync(name(1), (Tensor::from(b.shallow_clone()), t(&x)))
                    .unwrap();
                // A nested call: worker 1 forwards to worker 2.
                let d: Tensor = NESTED_SCALE
                    .rpc_sync(name(1), (c.clone(), name(2), 3.0))
                    .unwrap();
                // Sent, returned, and never used by the losses.
                let _unused: Tensor = SCALE.rpc_sync(name(2), (t(&w), 5.0)).unwrap();
                // The context exists on every worker the forward touched (asked
                // from a thread outside it).
                let id = ctx.id();
                std::thread::spawn(move || {
                    for w in 1..3 {
                        let ids: Vec<u64> = CONTEXT_IDS.rpc_sync(name(w), ()).unwrap();
                        assert_eq!(ids, vec![id], "worker {w}");
                    }
                })
                .join()
                .unwrap();
                let loss1 = d.sum(tch::Kind::Double);
                let loss2 = (&*c * &*c).sum(tch::Kind::Double);
                ctx.backward(&[loss1, loss2], false).unwrap();
                let grads = ctx.gradients();
                // Locally.
                let (lx, lw) = (leaf(&x), leaf(&w));
                let lc = (lx.sin() * &lw) * &lx;
                let local = (&lc * 3.0).sum(tch::Kind::Double) + (&lc * &lc).sum(tch::Kind::Double);
                let want = local_grads(&local, &[&lx, &lw]);
                assert_close(grads.get(&x).unwrap(), &want[0], "x");
                assert_close(grads.get(&w).unwrap(), &want[1], "w");
            }
            finish(&container);
        },
    );
}

/// An RRef owned by a third worker, fetched by the callee inside the
/// context: its gradient arrives on its owner.
#[test]
fn an_rref_owned_by_a_third_worker_in_the_forward() {
    world_ok(
        "an_rref_owned_by_a_third_worker_in_the_forward",
        3,
        |rank| {
            let container = init(rank);
            if rank == 0 {
                let p: RRef<Tensor> = RANDOM_TENSOR.remote(name(2), 5i64).unwrap();
                let pv: Tensor = RREF_VALUE.rpc_sync(name(2), p.clone()).unwrap();
                let x = tch::Tensor::randn([3, 3], F64).set_requires_grad(true);
                let ctx = ferry_autograd::context().unwrap();
                let y: Tensor = MUL_BY_RREF.rpc_sync(name(1), (p.clone(), t(&x))).unwrap();
                let loss = y.pow_tensor_scalar(2).sum(tch::Kind::Double);
                ctx.backward(&[loss], false).unwrap();
                let gp: Option<Tensor> =
                    RREF_GRAD.rpc_sync(name(2), (p.clone(), ctx.id())).unwrap();
                let (lp, lx) = (leaf(&pv), leaf(&x));
                let local = (&lp * &lx).pow_tensor_scalar(2).sum(tch::Kind::Double);
                let want = local_grads(&local, &[&lp, &lx]);
                assert_close(&gp.unwrap(), &want[0], "the third worker's parameter");
                assert_close(ctx.gradients().get(&x).unwrap(), &want[1], "x");
            }
            finish(&container);
        },
    );
}

/// Backward twice with `retain_graph` accumulates; without it the graph
/// goes, and another backward is a clear error.
#[test]
fn repeated_backward_with_retain_graph_accumulates() {
    world_ok(
        "repeated_backward_with_retain_graph_accumulates",
        2,
        |rank| {
            let container = init(rank);
            if rank == 0 {
                let x = tch::Tensor::randn([5], F64).set_requires_grad(true);
                let ctx = ferry_autograd::context().unwrap();
                let y: Tensor = SIN.rpc_sync(name(1), t(&x)).unwrap();
                let loss = (&*y * &*y).sum(tch::Kind::Double);
                ctx.backward(&[loss.shallow_clone()], true).unwrap();
                let lx = leaf(&x);
                let once =
                    local_grads(&(lx.sin() * lx.sin()).sum(tch::Kind::Double), &[&lx]).remove(0);
                assert_close(
                    ctx.gradients().get(&x).unwrap(),
                    &once,
                    "after one backward",
                );
                ctx.backward(&[loss.shallow_clone()], true).unwrap();
                assert_close(
                    ctx.gradients().get(&x).unwrap(),
                    &(&once * 2.0),
                    "after two",
                );
                ctx.backward(&[loss.shallow_clone()], false).unwrap();
                assert_close(
                    ctx.gradients().get(&x).unwrap(),
                    &(&once * 3.0),
                    "after three",
                );
                let err = ctx.backward(&[loss], false).unwrap_err();
                assert!(matches!(err, AutogradError::GraphReleased(_)), "{err}");
            }
            finish(&container);
        },
    );
}

/// A parameter server and 3 trainers, each running concurrent contexts
/// from several threads: every context sees exactly its own gradient.
#[test]
fn a_parameter_server_with_concurrent_trainers() {
    world_ok("a_parameter_server_with_concurrent_trainers", 4, |rank| {
        let container = init(rank);
        if rank != 0 {
            std::thread::scope(|s| {
                for thread in 0..3 {
                    s.spawn(move || {
                        for i in 0..10 {
                            let k = (rank * 100 + thread * 10 + i) as f64;
                            let x = (tch::Tensor::arange(4, F64) + k).set_requires_grad(true);
                            let ctx = ferry_autograd::context().unwrap();
                            let y: Tensor = PS_FORWARD.rpc_sync(name(0), t(&x)).unwrap();
                            let loss = (&*y * k).sum(tch::Kind::Double);
                            ctx.backward(&[loss], false).unwrap();
                            // d/dw sum(k * x * w) = k * x; d/dx = k * w.
                            let gw: Option<Tensor> = PS_GRAD.rpc_sync(name(0), ctx.id()).unwrap();
                            assert_close(
                                &gw.unwrap(),
                                &(x.detach() * k),
                                "the server's gradient in this context",
                            );
                            assert_close(
                                ctx.gradients().get(&x).unwrap(),
                                &(ps_weight().detach() * k),
                                "x",
                            );
                        }
                    });
                }
            });
        }
        finish(&container);
    });
}

/// An error in another worker's part of backward arrives named by that
/// worker, and every worker stays usable; bad roots and nested contexts
/// are refused.
#[test]
fn errors_name_the_worker_and_leave_everyone_usable() {
    world_ok(
        "errors_name_the_worker_and_leave_everyone_usable",
        2,
        |rank| {
            let container = init(rank);
            if rank == 0 {
                let x = tch::Tensor::randn([3], F64).set_requires_grad(true);
                {
                    let ctx = ferry_autograd::context().unwrap();
                    let y: Tensor = SIGMOID_KEPT.rpc_sync(name(1), t(&x)).unwrap();
                    // Worker 1 modifies the output its backward needs, in place.
                    CORRUPT.rpc_sync(name(1), ()).unwrap();
                    let err = ctx
                        .backward(&[y.sum(tch::Kind::Double)], false)
                        .unwrap_err();
                    let text = err.to_string();
                    assert!(text.starts_with("error on worker worker1: "), "{text}");
                    assert!(text.contains("inplace"), "{text}");
                    // Nested contexts are refused.
                    assert!(matches!(
                        ferry_autograd::context().unwrap_err(),
                        AutogradError::NestedContext { .. }
                    ));
                    // Bad roots are refused before anything runs.
                    let not_scalar = (&x * 2.0).shallow_clone();
                    assert!(matches!(
                        ctx.backward(&[not_scalar], false).unwrap_err(),
                        AutogradError::RootNotScalar { index: 0, .. }
                    ));
                }
                // An optimizer that cannot be built names the owner.
                let ints: RRef<Tensor> = INT_TENSOR.remote(name(1), ()).unwrap();
                let err =
                    DistributedOptimizer::new(OptimizerKind::adam(0.1), vec![ints]).unwrap_err();
                let text = err.to_string();
                assert!(text.starts_with("optimizer on worker worker1: "), "{text}");
                // Both workers still work.
                let ctx = ferry_autograd::context().unwrap();
                let y: Tensor = SIN.rpc_sync(name(1), t(&x)).unwrap();
                ctx.backward(&[y.sum(tch::Kind::Double)], false).unwrap();
                assert_close(
                    ctx.gradients().get(&x).unwrap(),
                    &x.detach().cos(),
                    "after the error",
                );
            }
            finish(&container);
        },
    );
}

#[test]
fn backward_refuses_no_roots_and_leaf_roots_without_touching_the_graph() {
    world_ok(
        "backward_refuses_no_roots_and_leaf_roots_without_touching_the_graph",
        2,
        |rank| {
            let container = init(rank);
            if rank == 0 {
                let x = tch::Tensor::randn([3], F64).set_requires_grad(true);
                let ctx = ferry_autograd::context().unwrap();
                let y: Tensor = SIN.rpc_sync(name(1), t(&x)).unwrap();
                let err = ctx.backward(&[], false).unwrap_err();
                assert!(matches!(err, AutogradError::NoRoots), "{err}");
                assert!(
                    err.to_string()
                        .contains("no tensors provided for gradient computation"),
                    "{err}"
                );
                // A leaf that requires grad has no gradient function.
                let leaf = tch::Tensor::ones([1], F64).set_requires_grad(true);
                let err = ctx.backward(&[leaf], false).unwrap_err();
                assert!(
                    matches!(err, AutogradError::RootWithoutGradFn { index: 0 }),
                    "{err}"
                );
                assert!(err.to_string().contains("gradient function"), "{err}");
                // The graph is intact: the correct backward still works.
                ctx.backward(&[y.sum(tch::Kind::Double)], false).unwrap();
                assert_close(
                    ctx.gradients().get(&x).unwrap(),
                    &x.detach().cos(),
                    "after the refused backwards",
                );
            }
            finish(&container);
        },
    );
}

#[test]
fn an_error_three_hops_away_names_its_origin_once() {
    world_ok(
        "an_error_three_hops_away_names_its_origin_once",
        4,
        |rank| {
            let container = init(rank);
            if rank == 1 {
                let x = tch::Tensor::randn([3], F64).set_requires_grad(true);
                let ctx = ferry_autograd::context().unwrap();
                // worker1 -> worker3 -> worker0 -> worker2 (sigmoid, kept there).
                let path = vec![name(0), name(2)];
                let y: Tensor = CHAIN.rpc_sync(name(3), (t(&x), path)).unwrap();
                CORRUPT.rpc_sync(name(2), ()).unwrap();
                let err = ctx
                    .backward(&[y.sum(tch::Kind::Double)], false)
                    .unwrap_err();
                let AutogradError::Remote(remote) = &err else {
                    panic!("want a remote error, got {err:?}");
                };
                assert_eq!(remote.origin(), "worker2");
                assert_eq!(remote.hops(), ["worker2", "worker0", "worker3"]);
                assert!(remote.message().contains("inplace"), "{err}");
                let text = err.to_string();
                assert!(text.starts_with("error on worker worker2: "), "{text}");
                assert_eq!(text.matches("error on worker").count(), 1, "{text}");
                assert!(text.ends_with("(relayed by worker0 -> worker3)"), "{text}");
                // libtorch's C++ backtrace stays out of the message.
                assert!(!text.contains("Exception raised from"), "{text}");
                assert!(!text.contains("frame #"), "{text}");
            }
            finish(&container);
        },
    );
}

/// Gradients land in the context by libtorch's rules for `.grad`, as in
/// PyTorch's distributed autograd: `a + b` hands both leaves one
/// expanded (stride 0) gradient, which each leaf gets as a contiguous copy
/// of its own, so accumulating into one never changes the other; and a
/// gradient arriving from another worker, which nothing else holds,
/// accumulates like a local one.
#[test]
fn shared_and_expanded_gradients_become_each_leafs_own() {
    world_ok(
        "shared_and_expanded_gradients_become_each_leafs_own",
        2,
        |rank| {
            let container = init(rank);
            if rank == 0 {
                let a = tch::Tensor::randn([3, 4], F64).set_requires_grad(true);
                let b = tch::Tensor::randn([3, 4], F64).set_requires_grad(true);
                let ctx = ferry_autograd::context().unwrap();
                let loss = (&a + &b).sum(tch::Kind::Double);
                ctx.backward(&[loss.shallow_clone()], true).unwrap();
                let grads = ctx.gradients();
                let (ga, gb) = (grads.get(&a).unwrap(), grads.get(&b).unwrap());
                assert!(ga.is_contiguous() && gb.is_contiguous());
                assert_ne!(ga.data_ptr(), gb.data_ptr(), "one buffer per leaf");
                let ones = tch::Tensor::ones([3, 4], F64);
                assert_close(ga, &ones, "a");
                // Again, plus a gradient from worker1 for a: a's grows, b's
                // keeps its own.
                let y: Tensor = SCALE.rpc_sync(name(1), (t(&a), 3.0)).unwrap();
                let more = loss + y.sum(tch::Kind::Double);
                ctx.backward(&[more], false).unwrap();
                let grads = ctx.gradients();
                assert_close(grads.get(&a).unwrap(), &(&ones * 5.0), "a after both");
                assert_close(grads.get(&b).unwrap(), &(&ones * 2.0), "b after both");
            }
            finish(&container);
        },
    );
}
