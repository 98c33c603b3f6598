//! The receive path without sockets: what `TchAllocator` lands is taken,
//! without a copy, as whatever tensor type the value asks for at its place
//! (a `Tensor`, a `RawTensor`, `AsRaw`, or both kinds in one value); `AsRaw`
//! and `RawTensor` read what the other writes, views as views.
#![allow(clippy::unwrap_used, missing_docs)]

use ferry_tch::{AsRaw, TchAllocator, Tensor};
use ferry_transport::{Allocator, RawAllocator, RawTensor};
use ferry_wire::payload::{self, IncomingTensor};
use ferry_wire::{DType, Device, TensorDescriptor};
use serde::{Deserialize, Serialize};

/// Receives every tensor of `value` the way a connection's reader does:
/// one destination per descriptor from `allocator`, filled with the bytes
/// that travel. Returns the payload, the received tensors and the address
/// each one's bytes landed at.
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

fn raw_at(t: &RawTensor) -> usize {
    t.storage().as_bytes().as_ptr() as usize
}

fn floats(t: &tch::Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()
}

/// One tensor, received into libtorch memory, decodes as either type, and
/// either way its bytes stay where they landed. (Each type's payload is
/// its own: a `Tensor` carries its autograd metadata too.)
#[test]
fn a_landed_tensor_is_taken_as_either_type_in_place() {
    let sent = RawTensor::from_slice(&[1.5f32, -2.0, 3.25, 4.0], &[2, 2]).unwrap();
    let sent_tch =
        Tensor::from(tch::Tensor::from_slice(&[1.5f32, -2.0, 3.25, 4.0]).reshape([2, 2]));

    let (bytes, tensors, landed) = receive(&sent, &TchAllocator);
    let raw: RawTensor = payload::decode(&bytes, tensors).unwrap();
    assert_eq!(raw, sent);
    assert_eq!(raw.shape(), [2, 2]);
    assert_eq!(
        raw_at(&raw),
        landed[0],
        "the RawTensor is the landed memory"
    );

    let (bytes, tensors, landed) = receive(&sent_tch, &TchAllocator);
    let t: Tensor = payload::decode(&bytes, tensors).unwrap();
    assert_eq!(t.size(), [2, 2]);
    assert_eq!(floats(&t), [1.5, -2.0, 3.25, 4.0]);
    assert_eq!(
        t.data_ptr() as usize,
        landed[0],
        "the Tensor is the landed memory"
    );
}

/// A value holding both kinds, and a transposed view: each tensor is taken
/// as its place's type, views keep their strides, nothing is copied.
#[test]
fn a_value_holding_both_kinds_takes_each_in_place() {
    #[derive(Serialize, Deserialize)]
    struct Mixed {
        raw: RawTensor,
        tensor: Tensor,
        raws: Vec<RawTensor>,
        tensors: Vec<Tensor>,
    }
    let base =
        RawTensor::from_slice(&(0..12).map(|i| i as f64).collect::<Vec<_>>(), &[3, 4]).unwrap();
    let value = Mixed {
        raw: base.t().unwrap(),
        tensor: Tensor::from(tch::Tensor::from_slice(&[7i64, 8, 9]).reshape([3, 1])),
        raws: vec![
            RawTensor::from_slice::<i32>(&[], &[0, 5]).unwrap(),
            RawTensor::from_slice(&[true, false], &[2]).unwrap(),
        ],
        tensors: vec![Tensor::from(
            tch::Tensor::arange(6, (tch::Kind::Float, tch::Device::Cpu))
                .reshape([2, 3])
                .tr(),
        )],
    };
    let (bytes, tensors, landed) = receive(&value, &TchAllocator);
    let back: Mixed = payload::decode(&bytes, tensors).unwrap();

    assert_eq!(back.raw, base.t().unwrap());
    assert_eq!(back.raw.strides(), [1, 4], "a transpose arrives as one");
    assert_eq!(raw_at(&back.raw), landed[0]);

    assert_eq!(back.tensor.size(), [3, 1]);
    assert_eq!(
        Vec::<i64>::try_from(back.tensor.flatten(0, -1)).unwrap(),
        [7, 8, 9]
    );
    assert_eq!(back.tensor.data_ptr() as usize, landed[1]);

    assert_eq!(back.raws[0].shape(), [0, 5]);
    assert_eq!(back.raws[0].dtype(), DType::I32);
    assert_eq!(back.raws[1].as_slice::<bool>().unwrap(), [true, false]);
    assert_eq!(raw_at(&back.raws[1]), landed[3]);

    let t = &back.tensors[0];
    assert_eq!(t.size(), [3, 2]);
    assert_eq!(t.stride(), [1, 3], "a transpose arrives as one");
    assert_eq!(floats(&t.contiguous()), [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    assert_eq!(t.data_ptr() as usize, landed[4]);
}

/// A worker that keeps the default allocator still gives a `Tensor` (one
/// copy), and a `RawTensor` is what it received; a `RawTensor` received
/// with `TchAllocator` and then shared is taken as a `Tensor` by copy, and
/// the share is untouched.
#[test]
fn other_allocators_and_shared_tensors_still_decode() {
    let sent = RawTensor::from_slice(&[1u8, 2, 3], &[3]).unwrap();
    let sent_tch = Tensor::from(tch::Tensor::from_slice(&[1u8, 2, 3]));
    let (bytes, tensors, landed) = receive(&sent, &RawAllocator);
    let raw: RawTensor = payload::decode(&bytes, tensors).unwrap();
    assert_eq!(raw_at(&raw), landed[0]);
    let (bytes, tensors, _) = receive(&sent_tch, &RawAllocator);
    let t: Tensor = payload::decode(&bytes, tensors).unwrap();
    assert_eq!(Vec::<u8>::try_from(&*t).unwrap(), [1, 2, 3]);

    // A RawTensor received into libtorch memory and kept (a clone shares
    // its storage), whose storage a Tensor is then handed: the Tensor gets
    // a copy, and the kept RawTensor stays valid.
    let (bytes, tensors, _) = receive(&sent, &TchAllocator);
    let kept: RawTensor = payload::decode(&bytes, tensors).unwrap();
    let encoded = payload::encode(&sent_tch).unwrap();
    let incoming = IncomingTensor {
        descriptor: encoded.tensors[0].descriptor(),
        storage: Box::new(kept.clone()),
    };
    let t: Tensor = payload::decode(&encoded.payload, vec![incoming]).unwrap();
    assert_ne!(t.data_ptr() as usize, raw_at(&kept));
    assert_eq!(Vec::<u8>::try_from(&*t).unwrap(), [1, 2, 3]);
    assert_eq!(kept.as_slice::<u8>().unwrap(), [1, 2, 3]);
}

/// A `RawTensor` asked for where a device tensor arrived is a clear error
/// (a `RawTensor` holds host memory only).
#[test]
fn a_device_tensor_is_no_raw_tensor() {
    struct NotRaw;
    let sent = RawTensor::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
    let encoded = payload::encode(&sent).unwrap();
    let descriptor = TensorDescriptor {
        device: Device::Cuda(0),
        ..encoded.tensors[0].descriptor()
    };
    let incoming = IncomingTensor {
        descriptor,
        storage: Box::new(NotRaw),
    };
    let err = payload::decode::<RawTensor>(&encoded.payload, vec![incoming]).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("float32 tensor of shape [2] on cuda:0"),
        "{text}"
    );
    assert!(text.contains("host memory only"), "{text}");
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
