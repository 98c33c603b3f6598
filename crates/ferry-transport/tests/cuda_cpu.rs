//! CUDA tensors on a host without CUDA (or a build without the `cuda`
//! feature), end to end over real connections: the transfer is refused
//! with "CUDA not available on this host", typed, and the connection keeps
//! working. With CUDA present these tests check the same paths' success
//! cases belong to `tests/cuda.rs`, so they return early there.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::{decode, message, pair};
use ferry_transport::cuda::{availability, CudaUnavailable};
use ferry_transport::device_map::DeviceMaps;
use ferry_transport::{Endpoint, RawTensor, TransportError};
use ferry_wire::payload::OutgoingTensor;
use ferry_wire::{DType, Device, TensorDescriptor};

/// A tensor that says it lives on `cuda:0` at some device address: what a
/// CUDA tensor of the layers above hands the transport. Its bytes are
/// never read here (the transfer is refused before).
struct OnDevice(TensorDescriptor);

impl OutgoingTensor for OnDevice {
    fn descriptor(&self) -> TensorDescriptor {
        self.0.clone()
    }
    fn bytes(&self) -> &[u8] {
        &[]
    }
    fn device_ptr(&self) -> Option<u64> {
        Some(0x7f00_0000_0000)
    }
}

fn no_cuda() -> Option<CudaUnavailable> {
    match availability() {
        Ok(n) => {
            println!("SKIPPED: this host has {n} CUDA device(s); tests/cuda.rs covers it");
            None
        }
        Err(reason) => Some(reason),
    }
}

fn endpoint(name: &str, rank: u32, maps: DeviceMaps) -> Endpoint {
    let mut e = Endpoint::new(name, rank);
    e.config.device_maps = Arc::new(maps);
    e
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sending_a_cuda_tensor_says_cuda_is_not_available_and_the_connection_lives_on() {
    let Some(reason) = no_cuda() else { return };
    let mut maps = DeviceMaps::new();
    maps.set_device_map("s", [(Device::Cuda(0), Device::Cuda(0))])
        .unwrap();
    let (mut server, mut client) =
        pair(endpoint("s", 0, DeviceMaps::new()), endpoint("c", 1, maps)).await;
    let t = OnDevice(TensorDescriptor::contiguous(
        DType::F32,
        &[1024],
        Device::Cuda(0),
    ));
    let mut m = message(1, &"a cuda tensor");
    m.tensors.push(Arc::new(t));
    let err = client.writer.write(&m).await.unwrap_err();
    match &err {
        TransportError::CudaUnavailable(r) => assert_eq!(r, &reason),
        other => panic!("{other}"),
    }
    assert!(
        err.to_string()
            .starts_with("CUDA not available on this host"),
        "{err}"
    );

    // Nothing of the refused message was written: the next one arrives.
    let cpu = RawTensor::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
    client.writer.write(&message(2, &cpu)).await.unwrap();
    let got = server.reader.read().await.unwrap().unwrap();
    assert_eq!(got.header.request_id, 2);
    let back: RawTensor = decode(got);
    assert_eq!(back.as_slice::<f32>().unwrap(), [1.0, 2.0, 3.0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiving_a_cuda_descriptor_says_cuda_is_not_available() {
    let Some(reason) = no_cuda() else { return };
    let (mut server, mut client) = pair(
        endpoint("s", 0, DeviceMaps::new()),
        endpoint("c", 1, DeviceMaps::new()),
    )
    .await;
    // A frame from a peer that has CUDA: one tensor on its cuda:1.
    let descriptor = TensorDescriptor::contiguous(DType::U8, &[16], Device::Cuda(1));
    let mut table = Vec::new();
    ferry_wire::encode_descriptors(std::slice::from_ref(&descriptor), &mut table);
    let header = ferry_wire::FrameHeader {
        kind: ferry_wire::MessageKind::REQUEST,
        flags: ferry_wire::Flags::NONE,
        request_id: 7,
        payload_len: 0,
        descriptors_len: table.len() as u32,
        tensor_count: 1,
    };
    let frame = [&header.encode()[..], &table, &[0u8; 16]].concat();
    client.writer.write_raw_for_tests(&frame).await;
    let err = server.reader.read().await.unwrap_err();
    match &err {
        TransportError::CudaUnavailable(r) => assert_eq!(r, &reason),
        other => panic!("{other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cpu_tensor_mapped_onto_a_gpu_says_cuda_is_not_available() {
    let Some(reason) = no_cuda() else { return };
    // The receiver maps the sender's cpu onto its cuda:0 (the reverse of
    // its map), which this host does not have.
    let mut maps = DeviceMaps::new();
    maps.set_device_map("c", [(Device::Cuda(0), Device::Cpu)])
        .unwrap();
    let (mut server, mut client) =
        pair(endpoint("s", 0, maps), endpoint("c", 1, DeviceMaps::new())).await;
    let cpu = RawTensor::from_slice(&[1u8; 8], &[8]).unwrap();
    client.writer.write(&message(3, &cpu)).await.unwrap();
    let err = server.reader.read().await.unwrap_err();
    match &err {
        TransportError::CudaUnavailable(r) => assert_eq!(r, &reason),
        other => panic!("{other}"),
    }
}

#[test]
fn device_maps_naming_a_gpu_fail_validation_without_cuda() {
    let Some(reason) = no_cuda() else { return };
    let mut maps = DeviceMaps::new();
    maps.set_device_map_str("w1", &[("cuda:0", "cuda:0")])
        .unwrap();
    let err = maps.validate(None, availability()).unwrap_err();
    assert!(err.to_string().contains(&reason.to_string()), "{err}");
    assert!(err.to_string().contains("\"w1\""), "{err}");
}

#[test]
fn without_cuda_no_channel_offers_cuda_devices() {
    let Some(_) = no_cuda() else { return };
    for offer in ferry_transport::channel::default_channels() {
        assert!(
            offer.devices.iter().all(|d| d.device == Device::Cpu),
            "{} offers {:?}",
            offer.name,
            offer.devices
        );
    }
    assert!(ferry_transport::channel::cuda_viability().is_err());
}
