//! Property tests of [`SparseCoo::check`]: every consistent layout passes
//! with its nnz, every single inconsistency is a typed error, and no input
//! (decoded from arbitrary bytes, against arbitrary descriptors) panics.
#![allow(clippy::unwrap_used)]

use ferry_wire::sparse::SparseCoo;
use ferry_wire::{payload, DType, Device, Limits, TensorDescriptor, WireError};
use proptest::prelude::*;

/// A consistent layout and the descriptors of its indices and values.
fn consistent() -> impl Strategy<Value = (SparseCoo, TensorDescriptor, TensorDescriptor)> {
    (
        prop::collection::vec(0i64..6, 0..5),
        any::<prop::sample::Index>(),
        0i64..9,
        any::<bool>(),
        prop::sample::select(DType::ALL.to_vec()),
        prop_oneof![Just(Device::Cpu), (0u16..4).prop_map(Device::Cuda)],
    )
        .prop_map(|(size, split, nnz, coalesced, dtype, device)| {
            let sparse_dim = split.index(size.len() + 1);
            let layout = SparseCoo {
                size: size.clone(),
                sparse_dim: sparse_dim as u32,
                dense_dim: (size.len() - sparse_dim) as u32,
                coalesced,
            };
            let indices =
                TensorDescriptor::contiguous(DType::I64, &[sparse_dim as i64, nnz], device);
            let mut shape = vec![nnz];
            shape.extend_from_slice(&size[sparse_dim..]);
            let values = TensorDescriptor::contiguous(dtype, &shape, device);
            (layout, indices, values)
        })
}

/// One change that makes a consistent layout inconsistent.
#[derive(Debug, Clone)]
enum Break {
    IndicesDtype(DType),
    IndicesRows(i64),
    ValuesExtraDim(i64),
    NnzMismatch(i64),
    DenseDim(u32),
    NegativeSize(prop::sample::Index),
    Device(u16),
}

fn breakage() -> impl Strategy<Value = Break> {
    prop_oneof![
        prop::sample::select(DType::ALL.to_vec())
            .prop_filter("not int64", |d| *d != DType::I64)
            .prop_map(Break::IndicesDtype),
        (1i64..4).prop_map(Break::IndicesRows),
        (0i64..4).prop_map(Break::ValuesExtraDim),
        (1i64..4).prop_map(Break::NnzMismatch),
        (1u32..4).prop_map(Break::DenseDim),
        any::<prop::sample::Index>().prop_map(Break::NegativeSize),
        (0u16..4).prop_map(Break::Device),
    ]
}

proptest! {
    #[test]
    fn consistent_layouts_pass((layout, indices, values) in consistent()) {
        let nnz = indices.shape[1] as u64;
        prop_assert_eq!(layout.check(&indices, &values, &Limits::default()), Ok(nnz));
        // The layout round-trips through a payload.
        let encoded = payload::encode(&layout).unwrap();
        let back: SparseCoo = payload::decode(&encoded.payload, vec![]).unwrap();
        prop_assert_eq!(back, layout);
    }

    #[test]
    fn every_single_inconsistency_is_an_error(
        (mut layout, mut indices, mut values) in consistent(),
        what in breakage(),
    ) {
        match what {
            Break::IndicesDtype(d) => indices.dtype = d,
            Break::IndicesRows(n) => indices.shape[0] += n,
            Break::ValuesExtraDim(n) => values.shape.push(n),
            Break::NnzMismatch(n) => values.shape[0] += n,
            Break::DenseDim(n) => layout.dense_dim += n,
            Break::NegativeSize(i) => {
                if layout.size.is_empty() {
                    layout.size.push(-1);
                } else {
                    let at = i.index(layout.size.len());
                    layout.size[at] = -1 - layout.size[at];
                }
            }
            Break::Device(i) => {
                values.device = if values.device == Device::Cpu {
                    Device::Cuda(i)
                } else {
                    Device::Cpu
                }
            }
        }
        let err = layout.check(&indices, &values, &Limits::default()).unwrap_err();
        prop_assert!(
            matches!(err, WireError::InvalidDescriptor(_) | WireError::TooLarge { .. }),
            "{}", err
        );
    }

    #[test]
    fn decoded_garbage_never_panics(
        bytes in prop::collection::vec(any::<u8>(), 0..128),
        shapes in prop::collection::vec(prop::collection::vec(-2i64..1 << 40, 0..4), 2..=2),
        max_dims in 0usize..8,
    ) {
        let limits = Limits { max_dims, ..Limits::default() };
        if let Ok(layout) = payload::decode::<SparseCoo>(&bytes, vec![]) {
            let indices = TensorDescriptor::contiguous(DType::I64, &shapes[0], Device::Cpu);
            let values = TensorDescriptor::contiguous(DType::F32, &shapes[1], Device::Cpu);
            let _ = layout.check(&indices, &values, &limits);
        }
    }
}

#[test]
fn huge_sizes_and_dimension_counts_are_refused() {
    let limits = Limits::default();
    let indices = TensorDescriptor::contiguous(DType::I64, &[2, 1], Device::Cpu);
    let values = TensorDescriptor::contiguous(DType::F32, &[1], Device::Cpu);
    let layout = SparseCoo {
        size: vec![1 << 32, 1 << 32],
        sparse_dim: 2,
        dense_dim: 0,
        coalesced: false,
    };
    let err = layout.check(&indices, &values, &limits).unwrap_err();
    assert!(err.to_string().contains("overflows"), "{err}");
    let layout = SparseCoo {
        size: vec![1; 1000],
        sparse_dim: 2,
        dense_dim: 998,
        coalesced: false,
    };
    let err = layout.check(&indices, &values, &limits).unwrap_err();
    assert!(
        matches!(err, WireError::TooLarge { len: 1000, .. }),
        "{err}"
    );
}
