//! `AsRaw`, a libtorch tensor in a `RawTensor`'s payload layout: each
//! reads what the other writes, views as views, and what `TchAllocator`
//! lands is taken without a copy.
#![allow(clippy::unwrap_used, missing_docs)]

use ferry_tch::{AsRaw, TchAllocator};
use ferry_transport::{Allocator, RawAllocator, RawTensor};
use ferry_wire::payload::{self, IncomingTensor};
use serde::Serialize;

/// Receives every tensor of `value` as a connection's reader does, into
/// destinations from `allocator`; the payload, the tensors and where each
/// one's bytes landed.
fn receive<T: Serialize>(
    value: &T,
    allocator: &dyn Allocator,
) -> (Vec<u8>, Vec<IncomingTensor>, Vec<usize>) {
    let encoded = payload::encode(value).unwrap();
    let mut tensors = Vec::new();
    let mut landed = Vec::new();
    for outgoing in &encoded.tensors {
        let descriptor = outgoing.descriptor();
        let mut dest = allocator.allocate(&descriptor).unwrap();
        let bytes = dest.as_mut_bytes();
        bytes.copy_from_slice(outgoing.bytes());
        landed.push(bytes.as_ptr() as usize);
        tensors.push(IncomingTensor {
            descriptor,
            storage: dest.finish().unwrap(),
        });
    }
    (encoded.payload, tensors, landed)
}

/// A transposed libtorch view sent as `AsRaw` arrives as a `RawTensor`
/// of the same view, with the same payload bytes a `RawTensor` writes.
#[test]
fn as_raw_is_read_as_a_raw_tensor() {
    let base = tch::Tensor::arange(12, (tch::Kind::Float, tch::Device::Cpu)).reshape([3, 4]);
    let view = base.tr();
    for allocator in [&TchAllocator as &dyn Allocator, &RawAllocator] {
        let (bytes, tensors, _) = receive(&AsRaw(view.shallow_clone()), allocator);
        let raw: RawTensor = payload::decode(&bytes, tensors).unwrap();
        assert_eq!(raw.shape(), [4, 3]);
        assert_eq!(raw.strides(), [1, 4]);
        let values: Vec<f32> = (0..4)
            .flat_map(|i| (0..3).map(move |j| (j * 4 + i) as f32))
            .collect();
        let expected = RawTensor::from_slice(&values, &[4, 3]).unwrap();
        assert_eq!(raw.to_contiguous_bytes(), expected.to_contiguous_bytes());
        assert_eq!(payload::encode(&raw).unwrap().payload, bytes);
    }
}

/// A `RawTensor` is read as `AsRaw`: in place where `TchAllocator` landed
/// it, copied once from another allocator's memory; the same values and
/// view either way.
#[test]
fn a_raw_tensor_is_read_as_as_raw() {
    let sent = RawTensor::from_slice(&[1.5f32, -2.0, 3.25, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
    let expected = tch::Tensor::from_slice(&[1.5f32, -2.0, 3.25, 4.0, 5.0, 6.0]).reshape([2, 3]);
    for (allocator, in_place) in [
        (&TchAllocator as &dyn Allocator, true),
        (&RawAllocator, false),
    ] {
        let (bytes, tensors, landed) = receive(&sent, allocator);
        let got: AsRaw = payload::decode(&bytes, tensors).unwrap();
        assert!(got.0.equal(&expected));
        assert_eq!(got.0.data_ptr() as usize == landed[0], in_place);
    }
    // Zero elements and no dimensions.
    for shape in [&[0i64, 3][..], &[]] {
        let n = shape.iter().product::<i64>() as usize;
        let sent = RawTensor::from_slice(&vec![7i64; n], shape).unwrap();
        let (bytes, tensors, _) = receive(&sent, &TchAllocator);
        let got: AsRaw = payload::decode(&bytes, tensors).unwrap();
        assert_eq!(got.0.size(), shape);
        assert_eq!(got.0.kind(), tch::Kind::Int64);
    }
}
