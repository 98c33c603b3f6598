//! Property tests: every encoder round-trips, and no decoder panics on any input.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use ferry_wire::payload::{self, IncomingTensor, OutgoingTensor};
use ferry_wire::{
    needs_escape, DType, Device, Flags, Frame, FrameHeader, Handshake, Limits, MessageKind,
    PeerText, TensorDescriptor, HEADER_LEN,
};
use proptest::prelude::*;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A minimal tensor type for the tests: a descriptor and owned bytes.
#[derive(Debug, Clone, PartialEq)]
struct TestTensor {
    desc: TensorDescriptor,
    bytes: Vec<u8>,
}

impl OutgoingTensor for TestTensor {
    fn descriptor(&self) -> TensorDescriptor {
        self.desc.clone()
    }
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl Serialize for TestTensor {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        payload::serialize_tensor(Arc::new(self.clone()), s)
    }
}

impl<'de> Deserialize<'de> for TestTensor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let t = payload::deserialize_tensor(d)?;
        let bytes = *t
            .storage
            .downcast::<Vec<u8>>()
            .map_err(|_| payload::custom_error::<D::Error>("unexpected storage type"))?;
        Ok(TestTensor {
            desc: t.descriptor,
            bytes,
        })
    }
}

/// What a receiver does: allocate from the descriptor, copy the bytes in.
fn receive(encoded: &ferry_wire::Encoded) -> Vec<IncomingTensor> {
    encoded
        .tensors
        .iter()
        .map(|t| IncomingTensor {
            descriptor: t.descriptor(),
            storage: Box::new(t.bytes().to_vec()),
        })
        .collect()
}

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

fn device() -> impl Strategy<Value = Device> {
    prop_oneof![Just(Device::Cpu), (0u16..8).prop_map(Device::Cuda)]
}

/// Valid descriptors, contiguous or permuted/strided views with an offset.
fn descriptor() -> impl Strategy<Value = TensorDescriptor> {
    (
        dtype(),
        prop::collection::vec(0i64..5, 0..4),
        device(),
        0i64..3,
        any::<bool>(),
    )
        .prop_map(|(dtype, shape, device, offset, reverse)| {
            let mut d = TensorDescriptor::contiguous(dtype, &shape, device);
            if reverse {
                d.shape.reverse();
                d.strides.reverse();
            }
            d.storage_offset = offset;
            d.byte_len = d
                .required_bytes()
                .unwrap()
                .max(offset as u64 * dtype.size() as u64);
            d
        })
}

fn tensor() -> impl Strategy<Value = TestTensor> {
    descriptor().prop_flat_map(|desc| {
        let len = desc.byte_len as usize;
        prop::collection::vec(any::<u8>(), len..=len).prop_map(move |bytes| TestTensor {
            desc: desc.clone(),
            bytes,
        })
    })
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Nested {
    name: String,
    single: TestTensor,
    list: Vec<TestTensor>,
    maybe: Option<TestTensor>,
    by_key: BTreeMap<String, (u8, TestTensor)>,
    deeper: Vec<Option<Vec<TestTensor>>>,
}

fn nested() -> impl Strategy<Value = Nested> {
    (
        ".{0,8}",
        tensor(),
        prop::collection::vec(tensor(), 0..3),
        prop::option::of(tensor()),
        prop::collection::btree_map("[a-z]{1,4}", (any::<u8>(), tensor()), 0..3),
        prop::collection::vec(
            prop::option::of(prop::collection::vec(tensor(), 0..2)),
            0..3,
        ),
    )
        .prop_map(|(name, single, list, maybe, by_key, deeper)| Nested {
            name,
            single,
            list,
            maybe,
            by_key,
            deeper,
        })
}

proptest! {
    #[test]
    fn descriptors_round_trip(d in descriptor()) {
        d.validate(&Limits::default()).unwrap();
        let mut buf = Vec::new();
        d.encode(&mut buf);
        let (back, used) = TensorDescriptor::decode(&buf, &Limits::default()).unwrap();
        prop_assert_eq!(back, d);
        prop_assert_eq!(used, buf.len());
    }

    #[test]
    fn frames_round_trip(
        kind in any::<u16>(),
        flags in any::<u16>(),
        id in any::<u64>(),
        body in prop::collection::vec(any::<u8>(), 0..64),
        tensors in prop::collection::vec(tensor(), 0..4),
    ) {
        let descs: Vec<_> = tensors.iter().map(|t| t.desc.clone()).collect();
        let slices: Vec<&[u8]> = tensors.iter().map(|t| t.bytes.as_slice()).collect();
        let bytes = Frame::encode(MessageKind(kind), Flags(flags), id, &descs, &body, &slices);
        let (frame, used) = Frame::decode(&bytes, &Limits::default()).unwrap();
        prop_assert_eq!(used, bytes.len());
        prop_assert_eq!(frame.header.kind, MessageKind(kind));
        prop_assert_eq!(frame.header.flags, Flags(flags));
        prop_assert_eq!(frame.header.request_id, id);
        prop_assert_eq!(frame.payload, body.as_slice());
        prop_assert_eq!(frame.descriptors, descs);
        prop_assert_eq!(frame.tensors, slices);
    }

    #[test]
    fn tensors_anywhere_in_a_value_round_trip(value in nested()) {
        let encoded = payload::encode(&value).unwrap();
        let count = 2 + value.list.len() + usize::from(value.maybe.is_some())
            + value.by_key.len()
            + value.deeper.iter().flatten().map(Vec::len).sum::<usize>() - 1;
        prop_assert_eq!(encoded.tensors.len(), count);
        // The tensor bytes are not in the payload: it only grows with the structure.
        let tensor_bytes: usize = encoded.tensors.iter().map(|t| t.bytes().len()).sum();
        prop_assert!(encoded.payload.len() < 64 + value.name.len() + 8 * count + 16 * value.by_key.len() || tensor_bytes == 0);
        let back: Nested = payload::decode(&encoded.payload, receive(&encoded)).unwrap();
        prop_assert_eq!(back, value);
    }

    /// A sender's check against the receiver's limits agrees with the
    /// receiver: `check_outgoing` passes exactly when the encoded frame
    /// decodes under those limits, and fails with the same error.
    #[test]
    fn the_senders_limit_check_agrees_with_the_receiver(
        body in prop::collection::vec(any::<u8>(), 0..64),
        tensors in prop::collection::vec(tensor(), 0..4),
        max_payload_bytes in 0u32..64,
        max_descriptor_bytes in 0u32..400,
        max_tensors in 0u32..4,
        max_dims in 0usize..4,
        max_tensor_bytes in 0u64..200,
        max_message_tensor_bytes in 0u64..400,
    ) {
        let limits = Limits {
            max_payload_bytes,
            max_descriptor_bytes,
            max_tensors,
            max_dims,
            max_tensor_bytes,
            max_message_tensor_bytes,
            ..Limits::default()
        };
        let descs: Vec<_> = tensors.iter().map(|t| t.desc.clone()).collect();
        let slices: Vec<&[u8]> = tensors.iter().map(|t| t.bytes.as_slice()).collect();
        let bytes = Frame::encode(MessageKind::REQUEST, Flags::NONE, 1, &descs, &body, &slices);
        let sender = limits.check_outgoing(body.len(), &descs);
        let receiver = Frame::decode(&bytes, &limits).map(|_| ());
        prop_assert_eq!(sender, receiver);
    }

    /// A peer's text, escaped: nothing that could forge or hide a log line
    /// is left, at most the bound's characters of it are shown (then a
    /// note with the exact bytes left out), text with nothing to escape is
    /// shown as it is, and escaping twice changes nothing.
    #[test]
    fn peer_text_is_escaped_and_bounded(text in any::<String>(), max in 0usize..40) {
        let shown = PeerText::bounded(&text, max).to_string();
        let (body, note) = match shown.rsplit_once("…(") {
            Some((body, note)) if text.chars().count() > max => (body.to_string(), Some(note.to_string())),
            _ => (shown.clone(), None),
        };
        prop_assert!(!body.chars().any(needs_escape), "{:?}", body);
        let kept: String = text.chars().take(max).collect();
        prop_assert_eq!(&body, &PeerText::new(&kept).to_string());
        match note {
            Some(note) => prop_assert_eq!(note, format!("{} more bytes)", text.len() - kept.len())),
            None => prop_assert_eq!(kept.len(), text.len()),
        }
        if !text.chars().any(needs_escape) && text.chars().count() <= max {
            prop_assert_eq!(&shown, &text);
        }
        let body_len = body.chars().count();
        prop_assert_eq!(PeerText::bounded(&body, body_len).to_string(), body.clone());
        let quoted = format!("{:?}", PeerText::bounded(&text, max));
        prop_assert!(quoted.starts_with('"') && quoted.ends_with('"'));
        prop_assert!(!quoted.chars().any(needs_escape));
    }

    /// A handshake decodes to what was encoded, UCX worker address (or its
    /// absence) included; an address over the cap is refused by name.
    #[test]
    fn handshakes_round_trip(
        name in "[a-z0-9:]{0,16}",
        rank in any::<u32>(),
        properties in prop::collection::vec(("[a-z.]{1,8}", "[ -~]{0,16}"), 0..3),
        ucx_address in prop::option::of(prop::collection::vec(any::<u8>(), 0..600)),
        transport in "[a-z]{1,6}",
        priority in any::<i32>(),
    ) {
        let h = Handshake {
            protocol_version: ferry_wire::PROTOCOL_VERSION,
            worker_name: name,
            rank,
            transports: vec![ferry_wire::TransportOffer {
                name: transport,
                priority,
                descriptor: "any".into(),
            }],
            channels: vec![ferry_wire::ChannelOffer {
                name: "ucx".into(),
                priority,
                devices: vec![ferry_wire::DeviceOffer {
                    device: Device::Cpu,
                    descriptor: "any".into(),
                }],
            }],
            selection: vec![],
            properties,
            limits: Limits::default(),
            ucx_address,
        };
        let bytes = h.encode().unwrap();
        prop_assert_eq!(Handshake::decode(&bytes).unwrap(), h.clone());
        let mut big = h;
        big.ucx_address = Some(vec![7; ferry_wire::MAX_UCX_ADDRESS_BYTES + 1]);
        let err = Handshake::decode(&big.encode().unwrap()).unwrap_err();
        prop_assert!(err.to_string().contains("UCX worker address"), "{}", err);
    }

    #[test]
    fn frame_decoder_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = Frame::decode(&bytes, &Limits::default());
        let _ = Handshake::decode(&bytes);
        let _ = payload::decode::<(u32, String, Vec<Option<i64>>)>(&bytes, vec![]);
        let _ = payload::decode::<Nested>(&bytes, vec![]);
    }

    #[test]
    fn corrupted_frames_never_panic(
        tensors in prop::collection::vec(tensor(), 0..3),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let descs: Vec<_> = tensors.iter().map(|t| t.desc.clone()).collect();
        let slices: Vec<&[u8]> = tensors.iter().map(|t| t.bytes.as_slice()).collect();
        let mut bytes = Frame::encode(MessageKind::REQUEST, Flags::NONE, 1, &descs, b"p", &slices);
        for (i, b) in flips {
            let at = i.index(bytes.len());
            bytes[at] ^= b;
        }
        let _ = Frame::decode(&bytes, &Limits::default());
        let _ = Frame::decode(&bytes[..bytes.len() / 2], &Limits::default());
    }
}

#[test]
fn oversized_lengths_fail_before_allocation() {
    let limits = Limits {
        max_payload_bytes: 1024,
        ..Limits::default()
    };
    let header = FrameHeader {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id: 1,
        payload_len: u32::MAX,
        descriptors_len: 0,
        tensor_count: 0,
    };
    let err = FrameHeader::decode(&header.encode(), &limits).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("payload length of {} exceeds the limit of 1024", u32::MAX)
    );

    let mut d = TensorDescriptor::contiguous(DType::F32, &[4], Device::Cpu);
    d.byte_len = u64::MAX - 3;
    d.shape = vec![i64::MAX / 4].into();
    d.strides = vec![1].into();
    let mut table = Vec::new();
    d.encode(&mut table);
    let err = TensorDescriptor::decode(&table, &Limits::default()).unwrap_err();
    assert!(err.to_string().contains("tensor byte length"), "{err}");

    // A tensor count that cannot fit in the descriptor table is malformed.
    let header = FrameHeader {
        tensor_count: 1000,
        descriptors_len: 24,
        payload_len: 0,
        ..header
    };
    assert!(FrameHeader::decode(&header.encode(), &limits).is_err());
}

#[test]
fn bad_magic_and_version_are_named() {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(b"GET ");
    let err = FrameHeader::decode(&h, &Limits::default()).unwrap_err();
    assert!(err.to_string().contains("bad magic"), "{err}");
    let mut good = FrameHeader {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id: 0,
        payload_len: 0,
        descriptors_len: 0,
        tensor_count: 0,
    }
    .encode();
    good[3] = 99;
    let err = FrameHeader::decode(&good, &Limits::default()).unwrap_err();
    assert!(err.to_string().contains("version 99"), "{err}");
}

#[test]
fn tensor_outside_an_encoder_is_an_error() {
    let t = TestTensor {
        desc: TensorDescriptor::contiguous(DType::U8, &[1], Device::Cpu),
        bytes: vec![1],
    };
    // postcard keeps no message, but the encoder refuses: the tensor is not silently dropped.
    assert!(postcard::to_stdvec(&t).is_err());
    // Inside an encoder, a tensor nested in another encoder's value is fine.
    let encoded = payload::encode(&vec![t.clone(), t]).unwrap();
    assert_eq!(encoded.tensors.len(), 2);
}

#[test]
fn tensor_index_out_of_range_and_reuse_are_errors() {
    let t = TestTensor {
        desc: TensorDescriptor::contiguous(DType::U8, &[1], Device::Cpu),
        bytes: vec![1],
    };
    let encoded = payload::encode(&(t.clone(), t)).unwrap();
    // Decode the two-tensor payload with only one tensor received.
    let mut one = receive(&encoded);
    one.truncate(1);
    let err = payload::decode::<(TestTensor, TestTensor)>(&encoded.payload, one).unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
    // Payload that points both tensors at index 0.
    let both_zero = [0u8, 0u8];
    let err =
        payload::decode::<(TestTensor, TestTensor)>(&both_zero, receive(&encoded)).unwrap_err();
    assert!(err.to_string().contains("used twice"), "{err}");
}

#[test]
fn hashmap_of_tensors_round_trips() {
    let mut map = HashMap::new();
    for (i, dt) in DType::ALL.iter().enumerate() {
        let d = TensorDescriptor::contiguous(*dt, &[2, 3], Device::Cpu);
        let bytes = (0..d.byte_len as usize).map(|b| (b + i) as u8).collect();
        map.insert(dt.name().to_string(), TestTensor { desc: d, bytes });
    }
    let encoded = payload::encode(&map).unwrap();
    assert_eq!(encoded.tensors.len(), DType::ALL.len());
    let back: HashMap<String, TestTensor> =
        payload::decode(&encoded.payload, receive(&encoded)).unwrap();
    assert_eq!(back, map);
}

#[test]
fn a_custom_serialization_error_keeps_its_text() {
    struct Refuses;
    impl Serialize for Refuses {
        fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
            Err(serde::ser::Error::custom(
                "this value refuses to be encoded",
            ))
        }
    }
    let err = payload::encode(&(7u32, "x", Refuses))
        .unwrap_err()
        .to_string();
    assert!(err.contains("this value refuses to be encoded"), "{err}");
    assert!(!err.contains("Serde Serialization Error"), "{err}");
}
