//! Bandwidth of the CUDA channels against a local device-to-device copy
//! (feature `cuda`): `cargo run --release -p ferry-transport --features
//! cuda --example cuda_bench`. Prints `SKIPPED: no CUDA device (<reason>)`
//! on a host without one.
//!
//! - `d2d`: `cuMemcpyDtoDAsync` on one device, waited for;
//! - `cuda_staged`: a device tensor sent over a loopback connection and
//!   received into device memory (one way, the receiver's clock);
//! - `cuda_ipc`: another process opens this one's IPC handles and copies
//!   device to device (its clock, handle opening included).

use std::sync::Arc;
use std::time::Instant;

use ferry_transport::cuda::driver::{context, copy_device_to_device, CudaAllocator, CudaTensor};
use ferry_transport::cuda::ipc::{self, IpcExport, IpcRecord};
use ferry_transport::device_map::DeviceMaps;
use ferry_transport::{Endpoint, OutgoingMessage, PeerConnection};
use ferry_wire::{DType, Device, Flags, MessageKind, TensorDescriptor};

const SIZES: [usize; 2] = [4 << 20, 64 << 20];
const ROUNDS: usize = 10;

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn tensor(len: usize) -> CudaTensor {
    CudaTensor::from_host(Device::Cuda(0), DType::U8, &[len as i64], &vec![7u8; len])
        .expect("device tensor")
}

fn endpoint(name: &str, rank: u32, peer: &str) -> Endpoint {
    let mut maps = DeviceMaps::new();
    maps.set_device_map(peer, [(Device::Cuda(0), Device::Cuda(0))])
        .expect("map");
    let mut e = Endpoint::new(name, rank);
    e.config.device_maps = Arc::new(maps);
    e.allocator = Arc::new(CudaAllocator);
    // This column measures `cuda_staged` (on one host `cuda_ipc` would win).
    e.channels
        .retain(|o| o.name != ferry_transport::channel::CUDA_IPC);
    e
}

async fn staged(len: usize) -> f64 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = endpoint("s", 0, "c");
    let accept = tokio::spawn(async move {
        let (s, _) = listener.accept().await.expect("accept");
        PeerConnection::accept(s, &server).await.expect("handshake")
    });
    let mut client = PeerConnection::connect(addr, &endpoint("c", 1, "s"))
        .await
        .expect("connect");
    let mut server = accept.await.expect("join");
    let t: Arc<dyn ferry_wire::payload::OutgoingTensor> = Arc::new(tensor(len));
    let mut best = f64::MAX;
    for id in 0..ROUNDS as u64 {
        let m = OutgoingMessage {
            kind: MessageKind::REQUEST,
            flags: Flags::NONE,
            request_id: id,
            payload: Vec::new(),
            tensors: vec![t.clone()],
        };
        let start = Instant::now();
        let (sent, got) = tokio::join!(client.writer.write(&m), server.reader.read());
        sent.expect("send");
        got.expect("receive").expect("a message");
        best = best.min(start.elapsed().as_secs_f64());
    }
    gbps(len, best)
}

fn d2d(len: usize) -> f64 {
    let (a, b) = (tensor(len), tensor(len));
    let ctx = context(Device::Cuda(0)).expect("context");
    let mut best = f64::MAX;
    for _ in 0..ROUNDS {
        let start = Instant::now();
        // SAFETY: both tensors hold `len` bytes on cuda:0.
        unsafe { copy_device_to_device(&ctx, b.ptr(), a.ptr(), len) }.expect("copy");
        best = best.min(start.elapsed().as_secs_f64());
    }
    gbps(len, best)
}

fn ipc_parent(len: usize) -> f64 {
    let t = tensor(len);
    // SAFETY: the tensor outlives the export (the child has exited first).
    let export = unsafe { IpcExport::new(t.context(), t.ptr(), len) }.expect("export");
    let hex: String = export
        .record()
        .encode()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let out = std::process::Command::new(std::env::current_exe().expect("exe"))
        .args(["--ipc-child", &hex])
        .output()
        .expect("child");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let secs: f64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("seconds");
    drop(export);
    gbps(len, secs)
}

fn ipc_child(hex: &str) {
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect();
    let record = IpcRecord::decode(&bytes).expect("record");
    let ctx = context(Device::Cuda(0)).expect("context");
    let dst = CudaTensor::alloc(TensorDescriptor::contiguous(
        DType::U8,
        &[record.len as i64],
        Device::Cuda(0),
    ))
    .expect("alloc");
    let mut best = f64::MAX;
    for _ in 0..ROUNDS {
        let start = Instant::now();
        // SAFETY: `dst` holds `record.len` bytes; the parent waits for us.
        unsafe { ipc::receive(&ctx, &record, dst.ptr()) }.expect("ipc receive");
        best = best.min(start.elapsed().as_secs_f64());
    }
    println!("{best}");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 3 && args[1] == "--ipc-child" {
        return ipc_child(&args[2]);
    }
    if let Err(reason) = ferry_transport::cuda::availability() {
        println!("SKIPPED: no CUDA device ({reason})");
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "{:>10} {:>12} {:>14} {:>12}",
        "size", "d2d GB/s", "staged GB/s", "ipc GB/s"
    );
    for len in SIZES {
        let d = d2d(len);
        let s = rt.block_on(staged(len));
        let i = ipc_parent(len);
        println!("{:>9}M {d:>12.2} {s:>14.2} {i:>12.2}", len >> 20);
    }
}
