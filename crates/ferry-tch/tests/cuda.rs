//! CUDA `tch::Tensor`s on the wire. On a host without CUDA (here: the
//! .venv's libtorch and no driver): a CUDA descriptor arriving over a real
//! connection into ferry-tch's allocator is refused with "CUDA not
//! available on this host", and the allocator itself refuses a CUDA
//! destination with a typed error, never a panic. With CUDA (feature
//! `cuda`, a device, and a libtorch that sees it): two worker processes
//! echo CUDA tensors through device maps, received on the mapped device,
//! alone and nested in a payload beside CPU tensors.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use ferry_rpc::{Function, Functions, RpcOptions};
use ferry_tch::{TchAllocator, Tensor};
use ferry_transport::{Allocator, Endpoint, PeerConnection, TransportError};
use ferry_wire::{DType, Device, TensorDescriptor};

fn cuda_here() -> bool {
    #[cfg(feature = "cuda")]
    let _ = ferry_tch::load_cuda_backend();
    ferry_transport::cuda::availability().is_ok() && tch::Cuda::is_available()
}

#[test]
fn the_allocator_refuses_a_cuda_destination_without_cuda_with_a_typed_error() {
    if cuda_here() {
        println!("SKIPPED: this host has CUDA (the GPU case is below)");
        return;
    }
    let d = TensorDescriptor::contiguous(DType::F32, &[4], Device::Cuda(0));
    match TchAllocator.allocate(&d) {
        Err(TransportError::Alloc(reason)) => {
            assert!(reason.contains("libtorch could not allocate"), "{reason}")
        }
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("a CUDA destination without CUDA"),
    }
}

#[test]
fn a_cuda_descriptor_over_a_connection_says_cuda_is_not_available() {
    let Err(reason) = ferry_transport::cuda::availability() else {
        println!("SKIPPED: this host has CUDA");
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut server = Endpoint::new("s", 0);
        server.allocator = Arc::new(TchAllocator);
        let accept = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            PeerConnection::accept(s, &server).await.unwrap()
        });
        let mut client = PeerConnection::connect(addr, &Endpoint::new("c", 1))
            .await
            .unwrap();
        let mut server = accept.await.unwrap();
        // What a peer with a GPU sends for a tensor on its cuda:0.
        let descriptor = TensorDescriptor::contiguous(DType::F32, &[4], Device::Cuda(0));
        let mut table = Vec::new();
        ferry_wire::encode_descriptors(std::slice::from_ref(&descriptor), &mut table);
        let header = ferry_wire::FrameHeader {
            kind: ferry_wire::MessageKind::REQUEST,
            flags: ferry_wire::Flags::NONE,
            request_id: 1,
            payload_len: 0,
            descriptors_len: table.len() as u32,
            tensor_count: 1,
        };
        let frame = [&header.encode()[..], &table, &[0u8; 16]].concat();
        client.writer.write_raw_for_tests(&frame).await;
        match server.reader.read().await {
            Err(TransportError::CudaUnavailable(r)) => assert_eq!(r, reason),
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("a CUDA tensor was received without CUDA"),
        }
    });
}

const ECHO: Function<Tensor, Tensor> = Function::new("echo");
/// A payload with CUDA and CPU tensors nested in it.
type Nested = (String, Vec<Tensor>, Option<Tensor>);
const ECHO_NESTED: Function<Nested, Nested> = Function::new("echo_nested");

#[test]
fn cuda_tensors_are_echoed_onto_the_mapped_device() {
    if !cuda_here() {
        println!(
            "SKIPPED: no CUDA device ({})",
            ferry_transport::cuda::availability()
                .err()
                .map_or("libtorch sees no CUDA device".to_owned(), |r| r.to_string())
        );
        return;
    }
    ferry_testkit::world_ok(
        "cuda_tensors_are_echoed_onto_the_mapped_device",
        2,
        |rank| {
            let peer = format!("worker{}", 1 - rank);
            let mut functions = Functions::new();
            functions.add(ECHO, |t| t);
            functions.add(ECHO_NESTED, |n| n);
            let mut options = RpcOptions::from_env(format!("worker{rank}"))
                .unwrap()
                .functions(functions)
                .set_device_map(&peer, &[("cuda:0", "cuda:0")])
                .unwrap();
            ferry_tch::install(&mut options);
            init_rpc(options).unwrap();
            if rank == 0 {
                let t = tch::Tensor::arange(1 << 20, (tch::Kind::Float, tch::Device::Cuda(0)));
                let back: Tensor = ECHO
                    .rpc_sync("worker1", Tensor::from(t.shallow_clone()))
                    .unwrap();
                assert_eq!(back.device(), tch::Device::Cuda(0));
                assert!(back.equal(&t));
                // Nested, mixed with CPU tensors, shapes of their own.
                let gpu = tch::Tensor::randn([3, 5], (tch::Kind::Float, tch::Device::Cuda(0)));
                let cpu = tch::Tensor::arange(7, (tch::Kind::Int64, tch::Device::Cpu));
                let big = tch::Tensor::ones([257, 1031], (tch::Kind::Double, tch::Device::Cuda(0)));
                let sent: Nested = (
                    "mixed".into(),
                    vec![
                        Tensor::from(gpu.shallow_clone()),
                        Tensor::from(cpu.shallow_clone()),
                    ],
                    Some(Tensor::from(big.shallow_clone())),
                );
                let (name, list, last) = ECHO_NESTED.rpc_sync("worker1", sent).unwrap();
                assert_eq!(name, "mixed");
                assert_eq!(list[0].device(), tch::Device::Cuda(0));
                assert!(list[0].equal(&gpu));
                assert_eq!(list[1].device(), tch::Device::Cpu);
                assert!(list[1].equal(&cpu));
                let last = last.unwrap();
                assert_eq!(last.device(), tch::Device::Cuda(0));
                assert!(last.equal(&big));
            }
            ferry_rpc::shutdown().unwrap();
        },
    );
}

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
