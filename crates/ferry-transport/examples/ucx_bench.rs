//! Ferry's `ucx` channel measured the way `ucx_perftest` measures UCX
//! (`cargo xtask bench --only ucx` runs both and prints the ratios): two
//! processes on this host, frames over the `ucx` transport and tensors
//! over the `ucx` channel (every tensor, whatever its size), with UCX's
//! transports chosen by `--tls`.
//!
//! - one-way bandwidth per size, in MiB/s as `ucx_perftest` prints it: a
//!   window of messages, each with one tensor of that size (from 256 KiB
//!   on, in transparent huge pages, like `ucx_perftest`'s buffers), sent
//!   back to back, then one acknowledged;
//! - small-message latency: half the median round trip of a message with
//!   one 8-byte tensor that the server echoes, with the configured spin
//!   and with none (the worker's event fd at once).
//!
//! `--channel` and `--transport` measure another channel the same way
//! (`cma` or `shm` over the `shm` transport: the same-host comparison that
//! sets the `ucx` channel's priority).
//!
//! Usage: `ucx_bench [--tls shm] [--channel ucx] [--transport ucx]
//! [--sizes 4194304,67108864] [--iters 20000]`
//! (`--serve` is the server side, which the client starts itself). Prints
//! one JSON object.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_transport::{channel, BufferPool, Endpoint, OutgoingMessage, PeerConnection, RawTensor};
use ferry_wire::{payload, DType, Device, Flags, MessageKind, TensorDescriptor};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Bandwidth is printed in MiB/s, the unit `ucx_perftest` prints (its
/// "MB/s" column divides by 2^20).
const MIB: f64 = (1u64 << 20) as f64;

/// Request ids with this bit want an echo.
const ACK: u64 = 1 << 62;

struct Args {
    serve: bool,
    tls: String,
    channel: String,
    transport: String,
    spin_us: u64,
    sizes: Vec<usize>,
    iters: usize,
    bytes_per_run: usize,
}

fn args() -> Result<Args, Error> {
    let mut a = Args {
        serve: false,
        tls: "shm".into(),
        channel: "ucx".into(),
        transport: "ucx".into(),
        spin_us: ferry_transport::spin::SPIN_BUDGET.as_micros() as u64,
        sizes: vec![4 << 20, 64 << 20],
        iters: 20_000,
        bytes_per_run: 2 << 30,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--serve" => a.serve = true,
            "--tls" => a.tls = value()?,
            "--channel" => a.channel = value()?,
            "--transport" => a.transport = value()?,
            "--spin-us" => a.spin_us = value()?.parse()?,
            "--iters" => a.iters = value()?.parse()?,
            "--bytes-per-run" => a.bytes_per_run = value()?.parse()?,
            "--sizes" => {
                a.sizes = value()?
                    .split(',')
                    .map(|s| s.trim().parse())
                    .collect::<Result<_, _>>()?
            }
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    Ok(a)
}

fn endpoint(a: &Args, spin_us: u64) -> Result<Endpoint, Error> {
    let mut e = Endpoint::new(if a.serve { "server" } else { "client" }, 0);
    e.channels = channel::parse_channels(&a.channel)?;
    e.transports = channel::parse_transports(&a.transport)?;
    e.config.small_tensor_bytes = 0;
    e.config.ucx_tls = Some(a.tls.clone());
    e.config.spin = Duration::from_micros(spin_us);
    Ok(e)
}

fn message(id: u64, tensors: &Vec<RawTensor>) -> Result<OutgoingMessage, Error> {
    let e = payload::encode(tensors)?;
    Ok(OutgoingMessage {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id: id,
        payload: e.payload,
        tensors: e.tensors,
    })
}

async fn serve(a: Args) -> Result<(), Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("PORT {}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    loop {
        let (s, _) = listener.accept().await?;
        let mut conn = PeerConnection::accept(s, &endpoint(&a, a.spin_us)?).await?;
        tokio::spawn(async move {
            while let Ok(Some(m)) = conn.reader.read().await {
                let id = m.header.request_id;
                let tensors: Vec<RawTensor> = match payload::decode(&m.payload, m.tensors) {
                    Ok(t) => t,
                    Err(_) => break,
                };
                if id & ACK != 0 {
                    let reply = message(id, &tensors).unwrap();
                    if conn.writer.write(&reply).await.is_err() {
                        break;
                    }
                }
            }
        });
    }
}

async fn connect(a: &Args, port: u16, spin_us: u64) -> Result<PeerConnection, Error> {
    let addr = format!("127.0.0.1:{port}").parse()?;
    let conn = PeerConnection::connect(addr, &endpoint(a, spin_us)?).await?;
    if conn.transport != a.transport || conn.outgoing_channels()[0].channel != a.channel {
        return Err(format!(
            "asked for transport {} and channel {}, got {} and {:?} (peer offers {:?} {:?})",
            a.transport,
            a.channel,
            conn.transport,
            conn.outgoing_channels(),
            conn.peer.transports,
            conn.peer.channels
        )
        .into());
    }
    Ok(conn)
}

async fn round_trip(conn: &mut PeerConnection, id: u64, t: &Vec<RawTensor>) -> Result<(), Error> {
    conn.writer.write(&message(id | ACK, t)?).await?;
    let reply = conn.reader.read().await?.ok_or("closed")?;
    let _: Vec<RawTensor> = payload::decode(&reply.payload, reply.tensors)?;
    Ok(())
}

/// Half the median round trip, in microseconds.
async fn latency(a: &Args, port: u16, spin_us: u64) -> Result<f64, Error> {
    let mut conn = connect(a, port, spin_us).await?;
    let t = vec![RawTensor::from_bytes(DType::U8, &[8], &[7u8; 8])?];
    for i in 0..(a.iters / 10).max(100) {
        round_trip(&mut conn, i as u64, &t).await?;
    }
    let mut lats = Vec::with_capacity(a.iters);
    for i in 0..a.iters {
        let s = Instant::now();
        round_trip(&mut conn, i as u64, &t).await?;
        lats.push(s.elapsed().as_secs_f64());
    }
    lats.sort_by(f64::total_cmp);
    Ok(lats[lats.len() / 2] / 2.0 * 1e6)
}

/// A `size`-byte tensor in memory of the kind `ucx_perftest` sends from:
/// it allocates its buffers with `ucp_mem_map`, which maps transparent huge
/// pages, and so does Ferry's receive pool (where the receiver's
/// destinations come from). A heap tensor of 4 KiB pages would make the
/// sender's copy into the socket slower than the peer's for a reason that
/// is not the transfer's. (Below [`POOL_MIN`](ferry_transport::POOL_MIN)
/// the pool hands out heap memory, as it does to the receiver.)
fn huge_page_tensor(size: usize) -> Result<RawTensor, Error> {
    let mut storage = BufferPool::global().storage(size)?;
    storage.prepare(size);
    for (i, b) in storage.as_bytes_mut().iter_mut().enumerate() {
        *b = i as u8;
    }
    let desc = TensorDescriptor::contiguous(DType::U8, &[size as i64], Device::Cpu);
    Ok(RawTensor::from_storage(Arc::new(storage), desc)?)
}

/// Median over three runs of bytes per second, one way.
async fn bandwidth(a: &Args, port: u16, size: usize) -> Result<f64, Error> {
    let mut conn = connect(a, port, a.spin_us).await?;
    let t = vec![huge_page_tensor(size)?];
    let empty = Vec::new();
    let count = (a.bytes_per_run / size).clamp(4, 1000);
    // Warm-up: the receiver's buffer pool and UCX's registrations.
    for i in 0..4 {
        conn.writer.write(&message(i, &t)?).await?;
    }
    round_trip(&mut conn, 0, &empty).await?;
    let mut runs = Vec::new();
    for _ in 0..3 {
        let s = Instant::now();
        for i in 0..count {
            conn.writer.write(&message(i as u64, &t)?).await?;
        }
        round_trip(&mut conn, 0, &empty).await?;
        runs.push((count * size) as f64 / s.elapsed().as_secs_f64());
    }
    runs.sort_by(f64::total_cmp);
    Ok(runs[1])
}

/// Starts the server side (this binary with `--serve`) with `spin_us`.
fn spawn_server(a: &Args, spin_us: u64) -> Result<(std::process::Child, u16), Error> {
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args([
            "--serve",
            "--tls",
            &a.tls,
            "--spin-us",
            &spin_us.to_string(),
        ])
        .args(["--channel", &a.channel, "--transport", &a.transport])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().ok_or("no stdout")?).read_line(&mut line)?;
    let port = line
        .trim()
        .strip_prefix("PORT ")
        .ok_or_else(|| format!("the server said {line:?}"))?
        .parse()?;
    Ok((child, port))
}

async fn client(a: Args) -> Result<(), Error> {
    // With the configured spin on both sides: bandwidth and latency.
    let (mut child, port) = spawn_server(&a, a.spin_us)?;
    let measured = async {
        let mut bw = Vec::new();
        for &size in &a.sizes {
            let b = bandwidth(&a, port, size).await?;
            bw.push(format!("\"{size}\": {:.1}", b / MIB));
        }
        let lat = latency(&a, port, a.spin_us).await?;
        Ok::<_, Error>((bw, lat))
    }
    .await;
    let _ = child.kill();
    let _ = child.wait();
    let (bw, lat) = measured?;
    // With no spin on either side: every wait sleeps on the event fd.
    let (mut child, port) = spawn_server(&a, 0)?;
    let lat_nospin = latency(&a, port, 0).await;
    let _ = child.kill();
    let _ = child.wait();
    let lat_nospin = lat_nospin?;
    println!(
        "{{\"channel\": \"{}\", \"transport\": \"{}\", \"tls\": \"{}\", \"spin_us\": {}, \"bandwidth_mib_s\": {{{}}}, \"latency_us\": {lat:.3}, \"latency_us_no_spin\": {lat_nospin:.3}}}",
        a.channel,
        a.transport,
        a.tls,
        a.spin_us,
        bw.join(", ")
    );
    Ok(())
}

fn main() -> Result<(), Error> {
    let a = args()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if a.serve {
        rt.block_on(serve(a))
    } else {
        rt.block_on(client(a))
    }
}
