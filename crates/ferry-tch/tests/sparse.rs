//! Sparse COO tensors on the wire: they travel as their indices and values
//! plus their layout and arrive as the same sparse tensor (coalesced or
//! not, any split of sparse and dense dimensions, any element type, no
//! specified element at all), between two worker processes on 127.0.0.1;
//! and forged layouts are typed errors on the receiver, never panics
//! (received without sockets).
#![allow(clippy::unwrap_used, missing_docs)]

use ferry_rpc::{Function, Functions, RpcOptions};
use ferry_tch::{TchAllocator, Tensor};
use ferry_testkit::world_ok;
use ferry_transport::{Allocator, RawTensor};
use ferry_wire::payload::{self, IncomingTensor};
use ferry_wire::sparse::SparseCoo;
use serde::Serialize;
use tch::{Device, Kind};

const ECHO: Function<Tensor, Tensor> = Function::new("echo");
/// Named tensors.
type Named = Vec<(String, Tensor)>;

const ECHO_ALL: Function<Named, Named> = Function::new("echo_all");
const ADD: Function<(Tensor, Tensor), Tensor> = Function::new("add");
/// The dense form of the tensor received, and whether it arrived sparse.
const TO_DENSE: Function<Tensor, (Tensor, bool)> = Function::new("to_dense");

fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(ECHO, |t| t);
    f.add(ECHO_ALL, |ts| ts);
    f.add(ADD, |(a, b)| Tensor::from(a.f_add(&b).unwrap()));
    f.add(TO_DENSE, |t| {
        (Tensor::from(t.to_dense(None, false)), t.is_sparse())
    });
    f
}

fn init(rank: u32) -> ferry_rpc::Agent {
    let mut options = RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(functions());
    ferry_tch::install(&mut options);
    let agent = ferry_rpc::Agent::start(options).unwrap();
    ferry_rpc::set_process_agent(&agent).unwrap();
    agent
}

/// A sparse tensor of `size` with `sparse_dim` sparse dimensions, `nnz`
/// specified elements (in reverse order, the first one twice when
/// `duplicate`: not coalesced) and values of `kind`.
fn sparse(kind: Kind, size: &[i64], sparse_dim: usize, nnz: i64, duplicate: bool) -> tch::Tensor {
    let rows: Vec<Vec<i64>> = (0..sparse_dim)
        .map(|d| {
            let mut row: Vec<i64> = (0..nnz).rev().map(|i| i % size[d]).collect();
            if duplicate && nnz > 0 {
                row.push(row[0]);
            }
            row
        })
        .collect();
    let n = if duplicate && nnz > 0 { nnz + 1 } else { nnz };
    let flat: Vec<i64> = rows.concat();
    let indices = tch::Tensor::from_slice(&flat).reshape([sparse_dim as i64, n]);
    let mut value_shape = vec![n];
    value_shape.extend_from_slice(&size[sparse_dim..]);
    let count: i64 = value_shape.iter().product();
    let values = tch::Tensor::arange(count, (Kind::Int64, Device::Cpu))
        .remainder(7)
        .f_add_scalar(1)
        .unwrap()
        .to_kind(kind)
        .reshape(&value_shape);
    tch::Tensor::sparse_coo_tensor_indices_size(&indices, &values, size, (kind, Device::Cpu), false)
}

/// Same layout, indices, values (in order), size and coalesced flag.
fn same_sparse(a: &tch::Tensor, b: &tch::Tensor) -> bool {
    a.is_sparse()
        && b.is_sparse()
        && a.kind() == b.kind()
        && a.size() == b.size()
        && a.sparse_dim() == b.sparse_dim()
        && a.dense_dim() == b.dense_dim()
        && a.is_coalesced() == b.is_coalesced()
        && a.internal_indices().equal(&b.internal_indices())
        && a.internal_values().equal(&b.internal_values())
}

/// The cases: (what, tensor).
fn cases() -> Vec<(String, tch::Tensor)> {
    let mut out = Vec::new();
    for kind in [
        Kind::Float,
        Kind::Double,
        Kind::Half,
        Kind::BFloat16,
        Kind::Int8,
        Kind::Int64,
        Kind::Bool,
        Kind::ComplexFloat,
    ] {
        out.push((
            format!("{kind:?} uncoalesced"),
            sparse(kind, &[5, 4], 2, 4, true),
        ));
        out.push((
            format!("{kind:?} coalesced"),
            sparse(kind, &[5, 4], 2, 4, true).coalesce(),
        ));
    }
    for sparse_dim in 0..=3usize {
        let nnz = if sparse_dim == 0 { 1 } else { 3 };
        let t = sparse(Kind::Float, &[4, 3, 2], sparse_dim, nnz, false);
        out.push((format!("sparse_dim {sparse_dim} of 3"), t.shallow_clone()));
        out.push((
            format!("sparse_dim {sparse_dim} of 3, coalesced"),
            t.coalesce(),
        ));
    }
    out.push(("zero nnz".into(), sparse(Kind::Float, &[6, 6], 2, 0, false)));
    out.push((
        "zero nnz, hybrid, coalesced".into(),
        sparse(Kind::Double, &[6, 6, 2], 1, 0, false).coalesce(),
    ));
    out.push((
        "to_sparse of a dense tensor".into(),
        tch::Tensor::eye(4, (Kind::Float, Device::Cpu)).to_sparse_sparse_dim(2),
    ));
    out.push((
        "size with a zero dimension".into(),
        sparse(Kind::Float, &[3, 0], 1, 2, false),
    ));
    out
}

#[test]
fn sparse_tensors_round_trip_between_workers() {
    world_ok("sparse_tensors_round_trip_between_workers", 2, |rank| {
        let agent = init(rank);
        if rank == 0 {
            let cases = cases();
            for (what, t) in &cases {
                let back = ECHO
                    .rpc_sync("worker1", Tensor::from(t.shallow_clone()))
                    .unwrap();
                assert!(same_sparse(&back, t), "{what}: {back:?} vs {t:?}");
                let (dense, arrived_sparse) = TO_DENSE
                    .rpc_sync("worker1", Tensor::from(t.shallow_clone()))
                    .unwrap();
                assert!(arrived_sparse, "{what}");
                assert!(dense.equal(&t.to_dense(None, false)), "{what}");
            }
            // All at once, in one message, beside a dense tensor.
            let mut all: Vec<(String, Tensor)> = cases
                .iter()
                .map(|(w, t)| (w.clone(), Tensor::from(t.shallow_clone())))
                .collect();
            let dense = tch::Tensor::ones([3], (Kind::Float, Device::Cpu));
            all.push(("dense".into(), Tensor::from(dense.shallow_clone())));
            let back = ECHO_ALL.rpc_sync("worker1", all).unwrap();
            for ((what, t), (w, b)) in cases.iter().zip(&back) {
                assert_eq!(what, w);
                assert!(same_sparse(b, t), "{what} in one message");
            }
            assert!(back.last().unwrap().1.equal(&dense));
            // Computed on the other worker: equal to local libtorch.
            let a = sparse(Kind::Double, &[5, 4, 2], 2, 4, true);
            let b = sparse(Kind::Double, &[5, 4, 2], 2, 3, false).coalesce();
            let sum = ADD
                .rpc_sync(
                    "worker1",
                    (
                        Tensor::from(a.shallow_clone()),
                        Tensor::from(b.shallow_clone()),
                    ),
                )
                .unwrap();
            assert!(sum.is_sparse());
            assert!(sum
                .to_dense(None, false)
                .equal(&(&a + &b).to_dense(None, false)));
        }
        agent.shutdown().unwrap();
    });
}

/// What a sender forging a sparse tensor writes: the same wire form as a
/// `Tensor` (variant 1: indices, values, layout; then no autograd
/// metadata), with any parts and layout.
#[derive(Serialize)]
#[allow(dead_code)]
enum ForgedBody {
    Strided(RawTensor),
    SparseCoo(RawTensor, RawTensor, SparseCoo),
}

/// Receives `value` as a connection's reader does (`TchAllocator`) and
/// decodes it as a `Tensor`.
fn receive_as_tensor<T: Serialize>(value: &T) -> Result<Tensor, ferry_wire::WireError> {
    let encoded = payload::encode(value).unwrap();
    let tensors = encoded
        .tensors
        .iter()
        .map(|outgoing| {
            let descriptor = outgoing.descriptor();
            let mut dest = TchAllocator.allocate(&descriptor).unwrap();
            dest.as_mut_bytes().copy_from_slice(outgoing.bytes());
            IncomingTensor {
                descriptor,
                storage: dest.finish().unwrap(),
            }
        })
        .collect();
    payload::decode(&encoded.payload, tensors)
}

fn forged(
    indices: &[i64],
    index_shape: &[i64],
    values: &[f32],
    value_shape: &[i64],
    layout: SparseCoo,
) -> (ForgedBody, Option<()>) {
    (
        ForgedBody::SparseCoo(
            RawTensor::from_slice(indices, index_shape).unwrap(),
            RawTensor::from_slice(values, value_shape).unwrap(),
            layout,
        ),
        None,
    )
}

fn layout(size: &[i64], sparse_dim: u32, coalesced: bool) -> SparseCoo {
    SparseCoo {
        size: size.to_vec(),
        sparse_dim,
        dense_dim: size.len() as u32 - sparse_dim,
        coalesced,
    }
}

#[test]
fn forged_sparse_layouts_are_typed_errors() {
    // The honest form decodes: the forgery's wire form is the real one.
    let ok = receive_as_tensor(&forged(
        &[0, 2, 1, 3],
        &[2, 2],
        &[1.0, 2.0],
        &[2],
        layout(&[3, 4], 2, true),
    ))
    .unwrap();
    assert!(ok.is_sparse() && ok.is_coalesced());
    assert_eq!(ok.to_dense(None, false).double_value(&[2, 3]), 2.0);

    let cases: Vec<(&str, (ForgedBody, Option<()>))> = vec![
        (
            "values have shape",
            forged(
                &[0, 2, 1, 3],
                &[2, 2],
                &[1.0, 2.0, 3.0],
                &[3],
                layout(&[3, 4], 2, false),
            ),
        ),
        (
            "rows for 1 sparse",
            forged(
                &[0, 2, 1, 3],
                &[2, 2],
                &[1.0, 2.0],
                &[2],
                layout(&[3, 4], 1, false),
            ),
        ),
        (
            "dense_dim",
            forged(
                &[0, 2, 1, 3],
                &[2, 2],
                &[1.0, 2.0],
                &[2],
                SparseCoo {
                    dense_dim: 5,
                    ..layout(&[3, 4], 2, false)
                },
            ),
        ),
        (
            "sparse tensor dimension count",
            forged(&[0], &[1, 1], &[1.0], &[1], layout(&vec![1; 100], 1, false)),
        ),
        (
            "overflows",
            forged(
                &[0, 0],
                &[2, 1],
                &[1.0],
                &[1],
                layout(&[1 << 40, 1 << 40], 2, false),
            ),
        ),
        (
            "negative size",
            forged(&[0, 0], &[2, 1], &[1.0], &[1], layout(&[-3, 4], 2, false)),
        ),
        (
            "out of bounds",
            forged(
                &[0, 3, 1, 3],
                &[2, 2],
                &[1.0, 2.0],
                &[2],
                layout(&[3, 4], 2, false),
            ),
        ),
        (
            "negative index",
            forged(
                &[0, -1, 1, 3],
                &[2, 2],
                &[1.0, 2.0],
                &[2],
                layout(&[3, 4], 2, false),
            ),
        ),
        (
            "not sorted and unique",
            forged(
                &[2, 0, 1, 3],
                &[2, 2],
                &[1.0, 2.0],
                &[2],
                layout(&[3, 4], 2, true),
            ),
        ),
        (
            "not sorted and unique",
            forged(
                &[1, 1, 3, 3],
                &[2, 2],
                &[1.0, 2.0],
                &[2],
                layout(&[3, 4], 2, true),
            ),
        ),
    ];
    for (needle, value) in cases {
        let err = receive_as_tensor(&value).unwrap_err();
        assert!(err.to_string().contains(needle), "{err} lacks {needle}");
        assert!(err.to_string().contains("sparse"), "{err}");
    }
    // Indices of another element type.
    let value = (
        ForgedBody::SparseCoo(
            RawTensor::from_slice(&[0i32, 1], &[1, 2]).unwrap(),
            RawTensor::from_slice(&[1.0f32, 2.0], &[2]).unwrap(),
            layout(&[3], 1, false),
        ),
        None::<()>,
    );
    let err = receive_as_tensor(&value).unwrap_err();
    assert!(err.to_string().contains("not int64"), "{err}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// Any layout with any parts (random sizes, split, index values,
    /// coalesced claim, and shapes off by a little) decodes to a valid
    /// sparse tensor or is an error, never a panic; what decodes has every
    /// index in bounds, is coalesced when it says so, and densifies.
    #[test]
    fn forged_sparse_parts_never_panic(
        size in proptest::collection::vec(0i64..4, 0..4),
        split in proptest::prelude::any::<proptest::sample::Index>(),
        nnz in 0i64..5,
        index_values in proptest::collection::vec(-1i64..5, 0..20),
        coalesced in proptest::prelude::any::<bool>(),
        in_bounds in proptest::prelude::any::<bool>(),
        rows_off in proptest::prop_oneof![6 => proptest::strategy::Just(0i64), 1 => -1i64..=1],
        values_off in proptest::prop_oneof![6 => proptest::strategy::Just(0i64), 1 => -1i64..=1],
    ) {
        let sparse_dim = split.index(size.len() + 1);
        let rows = (sparse_dim as i64 + rows_off).max(0);
        let n = (rows * nnz) as usize;
        let indices: Vec<i64> = (0..n)
            .map(|i| {
                let v = index_values.get(i).copied().unwrap_or(0);
                // Mostly within the row's size, to reach the rebuild.
                match size.get(i / nnz.max(1) as usize) {
                    Some(&d) if in_bounds && d > 0 => v.rem_euclid(d),
                    _ => v,
                }
            })
            .collect();
        let mut value_shape = vec![(nnz + values_off).max(0)];
        value_shape.extend_from_slice(&size[sparse_dim..]);
        let count: i64 = value_shape.iter().product();
        let values: Vec<f32> = (0..count).map(|i| i as f32).collect();
        let value = forged(
            &indices,
            &[rows, nnz],
            &values,
            &value_shape,
            layout(&size, sparse_dim as u32, coalesced),
        );
        if let Ok(t) = receive_as_tensor(&value) {
            proptest::prop_assert!(t.is_sparse());
            proptest::prop_assert_eq!(t.size(), size.clone());
            proptest::prop_assert_eq!(t.is_coalesced(), coalesced);
            let dense = t.to_dense(None, false);
            proptest::prop_assert_eq!(dense.size(), size.clone());
            if coalesced {
                proptest::prop_assert!(t.internal_indices().equal(&t.coalesce().internal_indices()));
            }
        }
    }
}
