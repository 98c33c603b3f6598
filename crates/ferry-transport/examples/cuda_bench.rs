//! Bandwidth of the CUDA channels against a local device-to-device copy
//! (feature `cuda`): `cargo run --release -p ferry-transport --features
//! cuda --example cuda_bench` (or, on a machine without cargo, the GPU
//! bundle: `cargo xtask gpu-bundle`). Prints `SKIPPED: no CUDA device
//! (<reason>)` on a host without one.
//!
//! Each column is the best of [`ROUNDS`] transfers of one tensor, in GB/s,
//! and its ratio to `d2d`:
//! - `d2d`: `cuMemcpyDtoDAsync` on one device, waited for;
//! - `cuda_staged` and `cuda_ipc`: each channel between two processes
//!   over a connection on this host: a child process sends a device
//!   tensor, this one receives it into device memory (`cuda_staged`:
//!   device to pinned host memory, the connection's stream, pinned host
//!   memory to device, in overlapping chunks; `cuda_ipc`: opening the IPC
//!   handles, waiting on the sender's event, copying) and answers with a
//!   reply (for `cuda_ipc`, the one that releases the sender's tensor);
//!   the child's clock, from its write until that reply. The two ends run
//!   in two processes, as they do in use: in one task, the write and the
//!   read would take turns, and the copies of one side would wait for the
//!   other's stream work;
//! - `ipc copy`: the channel's device side alone: another process opens
//!   this one's IPC handles and copies device to device (its clock, handle
//!   opening included).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_transport::cuda::driver::{context, copy_device_to_device, CudaAllocator, CudaTensor};
use ferry_transport::cuda::ipc::{self, IpcExport, IpcRecord};
use ferry_transport::device_map::DeviceMaps;
use ferry_transport::{channel, Endpoint, OutgoingMessage, PeerConnection};
use ferry_wire::payload::OutgoingTensor;
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

/// An endpoint mapping the peer's cuda:0 onto this side's cuda:0, whose
/// device pairs on one host take `chosen`: `cuda_ipc`, or `cuda_staged`
/// (offered without `cuda_ipc`).
fn endpoint(name: &str, rank: u32, peer: &str, chosen: &str) -> Endpoint {
    let mut maps = DeviceMaps::new();
    maps.set_device_map(peer, [(Device::Cuda(0), Device::Cuda(0))])
        .expect("map");
    let mut e = Endpoint::new(name, rank);
    e.config.device_maps = Arc::new(maps);
    e.allocator = Arc::new(CudaAllocator);
    if chosen != channel::CUDA_IPC {
        e.channels.retain(|o| o.name != channel::CUDA_IPC);
    }
    e
}

fn message(kind: MessageKind, id: u64, tensors: Vec<Arc<dyn OutgoingTensor>>) -> OutgoingMessage {
    OutgoingMessage {
        kind,
        flags: Flags::NONE,
        request_id: id,
        payload: Vec::new(),
        tensors,
    }
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

/// The receiving side of `chosen` (`cuda_ipc` or `cuda_staged`) over a
/// connection: starts the child that sends ([`connection_child`]),
/// answers each of its tensors and returns the child's best time per size
/// in GB/s.
async fn over_connection(chosen: &'static str) -> Vec<f64> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let child = tokio::task::spawn_blocking(move || {
        std::process::Command::new(std::env::current_exe().expect("exe"))
            .args(["--connection-child", chosen, &addr])
            .output()
            .expect("child")
    });
    let serve = async {
        let (s, _) = listener.accept().await.expect("accept");
        let mut conn = PeerConnection::accept(s, &endpoint("s", 0, "c", chosen))
            .await
            .expect("handshake");
        let selected = conn
            .reader
            .selection()
            .channel_for(Device::Cuda(0), Device::Cuda(0))
            .expect("a channel for cuda:0");
        assert_eq!(selected, chosen, "{chosen} selected on one host");
        for id in 0..(SIZES.len() * ROUNDS) as u64 {
            // The tensor (received whole: its device copies are done) is
            // dropped, its device memory freed, at once.
            conn.reader
                .read()
                .await
                .expect("receive")
                .expect("a message");
            // The reply stops the sender's clock (over `cuda_ipc` it also
            // carries the release of the sender's tensor).
            conn.writer
                .write(&message(MessageKind::RESPONSE, id, Vec::new()))
                .await
                .expect("reply");
        }
    };
    tokio::time::timeout(Duration::from_secs(120), serve)
        .await
        .unwrap_or_else(|_| panic!("{chosen} over a connection: the child sent nothing for 120 s"));
    let out = child.await.expect("join");
    assert!(
        out.status.success(),
        "the sending child failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines.len(),
        SIZES.len(),
        "one time per size from the child: {stdout}"
    );
    lines
        .iter()
        .zip(SIZES)
        .map(|(secs, len)| gbps(len, secs.trim().parse().expect("seconds")))
        .collect()
}

/// The sending side of [`over_connection`] over `chosen`: per size,
/// [`ROUNDS`] tensors, each timed from its write until the reply; prints
/// the best time per size, one line each.
async fn connection_child(chosen: &str, addr: &str) {
    let addr = addr.parse().expect("address");
    let mut conn = PeerConnection::connect(addr, &endpoint("c", 1, "s", chosen))
        .await
        .expect("connect");
    let mut id = 0;
    for len in SIZES {
        let t: Arc<dyn OutgoingTensor> = Arc::new(tensor(len));
        let mut best = f64::MAX;
        for _ in 0..ROUNDS {
            let start = Instant::now();
            conn.writer
                .write(&message(MessageKind::REQUEST, id, vec![t.clone()]))
                .await
                .expect("send");
            let reply = conn.reader.read().await.expect("reply").expect("a reply");
            assert_eq!(reply.header.request_id, id);
            best = best.min(start.elapsed().as_secs_f64());
            id += 1;
        }
        println!("{best}");
    }
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

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("--ipc-child") if args.len() == 3 => return ipc_child(&args[2]),
        Some("--connection-child") if args.len() == 4 => {
            return runtime().block_on(connection_child(&args[2], &args[3]))
        }
        _ => {}
    }
    if let Err(reason) = ferry_transport::cuda::availability() {
        println!("SKIPPED: no CUDA device ({reason})");
        return;
    }
    let rt = runtime();
    let ipc_runs = rt.block_on(over_connection(channel::CUDA_IPC));
    let staged_runs = rt.block_on(over_connection(channel::CUDA_STAGED));
    println!(
        "{:>6} {:>9} {:>20} {:>20} {:>20}",
        "size", "d2d GB/s", "cuda_staged GB/s", "cuda_ipc GB/s", "ipc copy GB/s"
    );
    for ((len, ipc), staged) in SIZES.into_iter().zip(ipc_runs).zip(staged_runs) {
        let d = d2d(len);
        let copy = ipc_parent(len);
        let cell = |v: f64| format!("{v:.2} ({:.2} of d2d)", v / d);
        println!(
            "{:>5}M {d:>9.2} {:>20} {:>20} {:>20}",
            len >> 20,
            cell(staged),
            cell(ipc),
            cell(copy)
        );
    }
}
