//! The GPU group (feature `cuda`): runs only where CUDA has a device, and
//! otherwise prints `SKIPPED: no CUDA device (<reason>)` and returns (a
//! runtime check, not `#[ignore]`, so the next host with a GPU runs it).
//!
//! - `cuda_staged` between two real connections: device → device, CPU →
//!   device and device → CPU through the device maps, sizes with partial
//!   last chunks, bytes checked;
//! - `cuda_ipc` between two connections of one process (CUDA does not open
//!   a process's own IPC handles: the receiver copies from the exporter's
//!   memory after its event), and records reaching outside the exported
//!   allocation refused in both processes;
//! - `cuda_ipc` over a connection between two processes (selected for
//!   cuda:0 → cuda:0 on one host; the sender's tensor is released by the
//!   receiver's release frame);
//! - `cuda_ipc`'s device side across two processes: this test binary re-runs itself as
//!   the receiving process, which opens the sender's memory and event
//!   handles, copies device to device and checks the bytes; the sender
//!   keeps its buffer until the child's exit acknowledges the copy.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::{assert_child_succeeded, pair, run_test_in_child};
use ferry_transport::cuda::driver::{context, CudaAllocator, CudaTensor};
use ferry_transport::cuda::ipc::{self, IpcExport, IpcRecord};
use ferry_transport::cuda::staged::StagedOptions;
use ferry_transport::device_map::DeviceMaps;
use ferry_transport::{Endpoint, IncomingMessage, OutgoingMessage, PeerConnection, RawTensor};
use ferry_wire::{DType, Device, Flags, MessageKind};

/// The device count, or `None` after printing why the group is skipped.
fn gpus() -> Option<usize> {
    match ferry_transport::cuda::availability() {
        Ok(n) => Some(n),
        Err(reason) => {
            println!("SKIPPED: no CUDA device ({reason})");
            None
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u8)
                .wrapping_mul(131)
                .wrapping_add(seed ^ (i >> 16) as u8)
        })
        .collect()
}

/// Adds to `failures`, under `what`, where `got` differs from `want`: how
/// many bytes, the first and last offsets and the bytes at the first.
fn check_bytes(failures: &mut Vec<String>, what: String, got: &[u8], want: &[u8]) {
    if let Some(d) = diff(got, want) {
        failures.push(format!("{what}: {d}"));
    }
}

fn diff(got: &[u8], want: &[u8]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} bytes, not {}", got.len(), want.len()));
    }
    let bad: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
    let (&first, &last) = (bad.first()?, bad.last()?);
    let end = (first + 8).min(got.len());
    Some(format!(
        "{} of {} bytes differ, offsets {first}..={last}; at {first}: got {:?}, want {:?}",
        bad.len(),
        got.len(),
        &got[first..end],
        &want[first..end]
    ))
}

/// Writes `message` on `from` while `to` reads it (both at once: the
/// stream holds less than a tensor); what `to` read.
async fn exchange(
    from: &mut PeerConnection,
    to: &mut PeerConnection,
    message: &OutgoingMessage,
) -> IncomingMessage {
    let (sent, got) = tokio::join!(from.writer.write(message), to.reader.read());
    sent.unwrap();
    got.unwrap().unwrap()
}

/// The first tensor of `m`, as the storage type its allocator made.
fn first<T: 'static>(m: IncomingMessage) -> Box<T> {
    m.tensors
        .into_iter()
        .next()
        .unwrap()
        .storage
        .downcast::<T>()
        .unwrap()
}

fn endpoint(name: &str, rank: u32, peer: &str, map: &[(Device, Device)]) -> Endpoint {
    let mut maps = DeviceMaps::new();
    maps.set_device_map(peer, map.iter().copied()).unwrap();
    let mut e = Endpoint::new(name, rank);
    e.config.device_maps = Arc::new(maps);
    e.config.cuda_staged = StagedOptions {
        chunk_bytes: 1 << 20,
        slots: 3,
    };
    e.allocator = Arc::new(CudaAllocator);
    e
}

/// `e` without the `cuda_ipc` channel, so device pairs on one host take
/// `cuda_staged`.
fn without_ipc(mut e: Endpoint) -> Endpoint {
    e.channels
        .retain(|o| o.name != ferry_transport::channel::CUDA_IPC);
    e
}

fn request(id: u64, tensor: Arc<dyn ferry_wire::payload::OutgoingTensor>) -> OutgoingMessage {
    OutgoingMessage {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id: id,
        payload: Vec::new(),
        tensors: vec![tensor],
    }
}

/// An empty reply to request `id`.
fn reply(id: u64) -> OutgoingMessage {
    OutgoingMessage {
        kind: MessageKind::RESPONSE,
        flags: Flags::NONE,
        request_id: id,
        payload: Vec::new(),
        tensors: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_staged_moves_device_tensors_between_connections() {
    let Some(n) = gpus() else { return };
    let last = Device::Cuda(u16::try_from(n - 1).unwrap());
    // The client's cuda:0 maps onto the server's last device; the server's
    // map is the reverse.
    let (mut server, mut client) = pair(
        without_ipc(endpoint(
            "s",
            0,
            "c",
            &[(last, Device::Cuda(0)), (Device::Cpu, Device::Cpu)],
        )),
        without_ipc(endpoint(
            "c",
            1,
            "s",
            &[(Device::Cuda(0), last), (Device::Cpu, Device::Cpu)],
        )),
    )
    .await;
    assert_eq!(
        client
            .writer
            .selection()
            .channel_for(Device::Cuda(0), last)
            .unwrap(),
        ferry_transport::channel::CUDA_STAGED
    );
    let mut failures = Vec::new();
    for (id, len) in [
        (1u64, 1usize),
        (2, 1 << 20),
        (3, (1 << 20) + 13),
        (4, (2 << 20) + 13),
        (5, 5 << 20),
        (6, (64 << 20) + 1),
    ] {
        let data = pattern(len, id as u8);
        let t = CudaTensor::from_host(Device::Cuda(0), DType::U8, &[len as i64], &data).unwrap();
        let got = exchange(&mut client, &mut server, &request(id, Arc::new(t))).await;
        assert_eq!(got.header.request_id, id);
        let incoming = got.tensors.into_iter().next().unwrap();
        assert_eq!(incoming.descriptor.device, last);
        let t = incoming.storage.downcast::<CudaTensor>().unwrap();
        assert_eq!(t.descriptor().device, last);
        check_bytes(
            &mut failures,
            format!("{len}-byte tensor"),
            &t.to_host().unwrap(),
            &data,
        );
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_staged_maps_cpu_onto_a_gpu_and_back() {
    let Some(_) = gpus() else { return };
    // The client's cpu lands on the server's cuda:0; the server's cuda:0
    // lands on the client's cpu.
    let (mut server, mut client) = pair(
        endpoint("s", 0, "c", &[(Device::Cuda(0), Device::Cpu)]),
        endpoint("c", 1, "s", &[(Device::Cpu, Device::Cuda(0))]),
    )
    .await;
    let mut failures = Vec::new();
    for (id, len) in [(1u64, 3usize << 20), (3, (3 << 20) + 7), (5, 13)] {
        let data = pattern(len, id as u8);
        let cpu = RawTensor::from_bytes(DType::U8, &[data.len() as i64], &data).unwrap();
        let got = exchange(&mut client, &mut server, &request(id, Arc::new(cpu))).await;
        let on_gpu = first::<CudaTensor>(got);
        assert_eq!(on_gpu.descriptor().device, Device::Cuda(0));
        let what = format!("{len} bytes, cpu to gpu");
        check_bytes(&mut failures, what, &on_gpu.to_host().unwrap(), &data);

        let message = request(id + 1, Arc::new(*on_gpu));
        let back = first::<RawTensor>(exchange(&mut server, &mut client, &message).await);
        let what = format!("{len} bytes, gpu to cpu");
        check_bytes(&mut failures, what, back.storage().as_bytes(), &data);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_ipc_between_connections_of_one_process() {
    let Some(_) = gpus() else { return };
    let (mut server, mut client) = pair(
        endpoint("s", 0, "c", &[(Device::Cuda(0), Device::Cuda(0))]),
        endpoint("c", 1, "s", &[(Device::Cuda(0), Device::Cuda(0))]),
    )
    .await;
    assert_eq!(
        client
            .writer
            .selection()
            .channel_for(Device::Cuda(0), Device::Cuda(0))
            .unwrap(),
        ferry_transport::channel::CUDA_IPC
    );
    for (id, len) in [(1u64, 1usize), (2, (3 << 20) + 5), (3, 64 << 20)] {
        let data = pattern(len, id as u8);
        let t = CudaTensor::from_host(Device::Cuda(0), DType::U8, &[len as i64], &data).unwrap();
        let got = exchange(&mut client, &mut server, &request(id, Arc::new(t))).await;
        assert_eq!(client.writer.tensors_in_flight(), 1, "kept until released");
        let t = first::<CudaTensor>(got);
        assert!(t.to_host().unwrap() == data, "{len} bytes differ");
        // The reply carries the release of the tensor's token.
        let got = exchange(&mut server, &mut client, &reply(id)).await;
        assert_eq!(got.header.request_id, id);
        assert_eq!(
            client.writer.tensors_in_flight(),
            0,
            "released by the reply"
        );
    }
}

/// `record` moved to start `shift` bytes further into its allocation.
fn shifted(record: IpcRecord, shift: u64) -> IpcRecord {
    IpcRecord {
        offset: record.offset + shift,
        ..record
    }
}

#[test]
fn a_record_outside_its_allocation_is_refused_within_one_process() {
    let Some(_) = gpus() else { return };
    let len = 1 << 20;
    let src =
        CudaTensor::from_host(Device::Cuda(0), DType::U8, &[len as i64], &pattern(len, 3)).unwrap();
    let dst = CudaTensor::alloc(ferry_wire::TensorDescriptor::contiguous(
        DType::U8,
        &[len as i64],
        Device::Cuda(0),
    ))
    .unwrap();
    // SAFETY: `src` outlives the export.
    let export = unsafe { IpcExport::new(src.context(), src.ptr(), len) }.unwrap();
    let ctx = context(Device::Cuda(0)).unwrap();
    // SAFETY: `dst` holds `len` bytes; the export is alive.
    unsafe { ipc::receive(&ctx, &export.record(), dst.ptr()) }.unwrap();
    assert!(dst.to_host().unwrap() == pattern(len, 3));
    // SAFETY: as above; the range check refuses before any copy.
    let err = unsafe { ipc::receive(&ctx, &shifted(export.record(), len as u64), dst.ptr()) }
        .unwrap_err();
    assert!(err.contains("outside the exported allocation"), "{err}");
    drop(export);
}

const IPC_CHILD: &str = "FERRY_CUDA_IPC_CHILD_RECORD";
const IPC_LEN: usize = (16 << 20) + 7;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn cuda_ipc_moves_a_device_buffer_to_another_process() {
    if std::env::var_os(IPC_CHILD).is_some() {
        return; // the child runs `cuda_ipc_child` only
    }
    let Some(_) = gpus() else { return };
    let data = pattern(IPC_LEN, 77);
    let t = CudaTensor::from_host(Device::Cuda(0), DType::U8, &[IPC_LEN as i64], &data).unwrap();
    // SAFETY: the tensor's allocation outlives the export (dropped below,
    // after the child's exit).
    let export = unsafe { IpcExport::new(t.context(), t.ptr(), IPC_LEN) }.unwrap();
    let out = run_test_in_child(
        "cuda_ipc_child",
        (IPC_CHILD, &hex(&export.record().encode())),
    );
    assert_child_succeeded(&out, "the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("IPC-OK"), "{stdout}");
    drop(export);
    drop(t);
}

#[test]
fn cuda_ipc_child() {
    let Some(record) = std::env::var_os(IPC_CHILD) else {
        return; // run by `cuda_ipc_moves_a_device_buffer_to_another_process`
    };
    let record = IpcRecord::decode(&unhex(record.to_str().unwrap())).unwrap();
    assert_eq!(record.len, IPC_LEN as u64);
    let ctx = context(Device::Cuda(0)).unwrap();
    let dst = CudaTensor::alloc(ferry_wire::TensorDescriptor::contiguous(
        DType::U8,
        &[IPC_LEN as i64],
        Device::Cuda(0),
    ))
    .unwrap();
    // SAFETY: `dst` holds `IPC_LEN` bytes; the parent keeps its export alive
    // until this process exits.
    unsafe { ipc::receive(&ctx, &record, dst.ptr()) }.unwrap();
    assert!(dst.to_host().unwrap() == pattern(IPC_LEN, 77));
    // A record reaching past the exported allocation is refused before any
    // copy (the allocation may be rounded up, but not by a whole length).
    // SAFETY: as above; nothing is copied.
    let err =
        unsafe { ipc::receive(&ctx, &shifted(record, IPC_LEN as u64), dst.ptr()) }.unwrap_err();
    assert!(err.contains("outside the exported allocation"), "{err}");
    println!("IPC-OK");
}

const CONN_CHILD: &str = "FERRY_CUDA_IPC_CHILD_CONNECT";
const CONN_LEN: usize = (8 << 20) + 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_ipc_carries_tensors_between_processes_over_a_connection() {
    if std::env::var_os(CONN_CHILD).is_some() {
        return;
    }
    let Some(_) = gpus() else { return };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let child = tokio::task::spawn_blocking(move || {
        run_test_in_child("cuda_ipc_connection_child", (CONN_CHILD, &addr.to_string()))
    });
    let server = async {
        let (s, _) = listener.accept().await.unwrap();
        let mut conn = ferry_transport::PeerConnection::accept(
            s,
            &endpoint("s", 0, "c", &[(Device::Cuda(0), Device::Cuda(0))]),
        )
        .await
        .unwrap();
        assert_eq!(
            conn.reader
                .selection()
                .channel_for(Device::Cuda(0), Device::Cuda(0))
                .unwrap(),
            ferry_transport::channel::CUDA_IPC
        );
        for id in 1..=3u64 {
            let got = conn.reader.read().await.unwrap().unwrap();
            let t = got
                .tensors
                .into_iter()
                .next()
                .unwrap()
                .storage
                .downcast::<CudaTensor>()
                .unwrap();
            assert!(
                t.to_host().unwrap() == pattern(CONN_LEN, id as u8),
                "tensor {id}"
            );
            // The reply carries the release of the tensor's token.
            conn.writer.write(&reply(id)).await.unwrap();
        }
        conn
    };
    let (out, _conn) = tokio::join!(child, server);
    let out = out.unwrap();
    assert_child_succeeded(&out, "the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("IPC-CONN-OK"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_ipc_connection_child() {
    let Some(addr) = std::env::var_os(CONN_CHILD) else {
        return; // run by `cuda_ipc_carries_tensors_between_processes_over_a_connection`
    };
    let addr = addr.to_str().unwrap().parse().unwrap();
    let mut conn = ferry_transport::PeerConnection::connect(
        addr,
        &endpoint("c", 1, "s", &[(Device::Cuda(0), Device::Cuda(0))]),
    )
    .await
    .unwrap();
    for id in 1..=3u64 {
        let data = pattern(CONN_LEN, id as u8);
        let t =
            CudaTensor::from_host(Device::Cuda(0), DType::U8, &[CONN_LEN as i64], &data).unwrap();
        conn.writer.write(&request(id, Arc::new(t))).await.unwrap();
        assert_eq!(conn.writer.tensors_in_flight(), 1, "kept until released");
        let reply = conn.reader.read().await.unwrap().unwrap();
        assert_eq!(reply.header.request_id, id);
        assert_eq!(
            conn.writer.tensors_in_flight(),
            0,
            "released by the reply's release frame"
        );
    }
    println!("IPC-CONN-OK");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disagreeing_device_maps_are_refused_not_misread() {
    let Some(_) = gpus() else { return };
    // The client sends its cuda:0 to the server's cuda:0 (cuda_ipc on one
    // host); the server's map lands the client's cuda:0 on its cpu
    // (cuda_staged): the server finds no cuda_staged record.
    let (mut server, mut client) = pair(
        endpoint("s", 0, "c", &[(Device::Cpu, Device::Cuda(0))]),
        endpoint("c", 1, "s", &[(Device::Cuda(0), Device::Cuda(0))]),
    )
    .await;
    let t = CudaTensor::from_host(Device::Cuda(0), DType::U8, &[64], &[1u8; 64]).unwrap();
    client.writer.write(&request(1, Arc::new(t))).await.unwrap();
    let err = server.reader.read().await.unwrap_err();
    assert!(err.to_string().contains("device maps agree"), "{err}");
}
