//! One-way bandwidth between two processes over loopback: one plain TCP
//! stream, then the multi-lane TCP (`mpt`) channel with 1, 2 and 4 lanes.
//!
//! The example re-executes itself as a child process that receives; the
//! parent sends the same tensor (filled with data, so its pages are
//! resident) `repeats` times per mode:
//!
//! - `plain`: `write_all` of the tensor's bytes into one `TcpStream`; the
//!   child `read_exact`s them into one pre-faulted buffer, reused;
//! - `mpt xN`: [`MptSender::send`] over N lanes; the child receives into a
//!   pre-faulted buffer, reused (a [`RecvBuffer`] that hands its `Vec` back).
//!
//! Each repeat is timed from the start of the send to the child's one-byte
//! acknowledgement (on a separate control connection) that every byte is
//! in, so a repeat is one full transfer and nothing overlaps. GB/s are 10^9
//! bytes per second; the median of the repeats is the figure to read.
//!
//! Run it with
//! `cargo run --release -p ferry-transport --example mpt_bandwidth -- [size_mib] [repeats] [lanes,...]`
//! (defaults: 256 MiB, 20 repeats, lanes 1,2,4).

use std::any::Any;
use std::error::Error;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use ferry_transport::mpt::{connect_lanes, LaneListener, MptReceiver, MptSender};
use ferry_transport::{RawTensor, RecvBuffer, Storage, TransportError};
use ferry_wire::{DType, Device, TensorDescriptor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The example's error type.
type BoxError = Box<dyn Error + Send + Sync>;

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const SETUP: Duration = Duration::from_secs(30);
const CHILD_FLAG: &str = "--receiver";

/// Control command: a plain-stream run, an mpt run, or the end.
const PLAIN: u8 = 0;
const MPT: u8 = 1;
const EXIT: u8 = 2;

/// The byte at index `i` of the test pattern.
fn pattern(i: usize) -> u8 {
    (i % 251) as u8
}

/// One-way loopback bandwidth: plain TCP, then `mpt` with several lanes.
#[derive(Debug, Parser)]
#[command(name = "mpt_bandwidth")]
struct Args {
    /// Tensor size in MiB.
    #[arg(default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    size_mib: u64,
    /// Transfers per mode.
    #[arg(default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    repeats: u32,
    /// Lane counts of the mpt runs, comma-separated.
    #[arg(value_delimiter = ',', default_value = "1,2,4")]
    lanes: Vec<u32>,
    /// Run as the receiving child (the parent starts it).
    #[arg(long = "receiver", hide = true)]
    receiver: bool,
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if args.receiver {
        return runtime.block_on(receiver());
    }
    let size = usize::try_from(args.size_mib << 20)?;
    runtime.block_on(sender(size, args.repeats, &args.lanes))
}

/// The parent: starts the child, sends, prints the figures.
async fn sender(size: usize, repeats: u32, lanes: &[u32]) -> Result<(), BoxError> {
    let mut child = Command::new(std::env::current_exe()?)
        .arg(CHILD_FLAG)
        .stdout(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("no child stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let ports: Vec<u16> = line
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let [control_port, data_port, lane_port] = ports[..] else {
        return Err(format!("unexpected line from the child: {line:?}").into());
    };

    let tensor = Arc::new(filled_tensor(size)?);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "one-way loopback bandwidth, {} MiB x {repeats} per mode, {cores} cores, \
         tokio multi-thread runtime in both processes",
        size >> 20
    );
    println!(
        "{:<10} {:>12} {:>10} {:>10}",
        "mode", "median GB/s", "min", "max"
    );

    let mut control = TcpStream::connect(SocketAddr::new(LOCALHOST, control_port)).await?;
    control.set_nodelay(true)?;

    // One plain stream.
    control
        .write_all(&command(PLAIN, 1, repeats, size, 0))
        .await?;
    let mut data = TcpStream::connect(SocketAddr::new(LOCALHOST, data_port)).await?;
    data.set_nodelay(true)?;
    let mut times = Vec::new();
    for _ in 0..repeats {
        let start = Instant::now();
        data.write_all(tensor.storage().as_bytes()).await?;
        ack(&mut control).await?;
        times.push(start.elapsed());
    }
    report("plain", size, &times);
    drop(data);

    // mpt with each lane count.
    for (run, &n) in lanes.iter().enumerate() {
        let nonce = 0x6d70_7400 + run as u64;
        control
            .write_all(&command(MPT, n, repeats, size, nonce))
            .await?;
        let streams = connect_lanes(
            SocketAddr::new(LOCALHOST, lane_port),
            nonce,
            n as usize,
            SETUP,
        )
        .await?;
        let mpt = MptSender::new(streams, "the child");
        let mut times = Vec::new();
        for seq in 0..repeats {
            let start = Instant::now();
            mpt.send(u64::from(seq), tensor.clone())?;
            ack(&mut control).await?;
            times.push(start.elapsed());
        }
        // Every byte is in (acknowledged); the child closes its lanes next.
        drop(mpt);
        report(&format!("mpt x{n}"), size, &times);
    }

    control.write_all(&command(EXIT, 0, 0, 0, 0)).await?;
    let status = child.wait()?;
    if !status.success() {
        return Err(format!("the child failed: {status}").into());
    }
    Ok(())
}

/// A u8 tensor of `size` bytes holding the test pattern (every page written).
fn filled_tensor(size: usize) -> Result<RawTensor, TransportError> {
    let mut storage = Storage::zeroed(size)?;
    for (i, b) in storage.as_bytes_mut().iter_mut().enumerate() {
        *b = pattern(i);
    }
    let desc = TensorDescriptor::contiguous(DType::U8, &[size as i64], Device::Cpu);
    RawTensor::from_storage(Arc::new(storage), desc)
}

fn command(kind: u8, lanes: u32, repeats: u32, size: usize, nonce: u64) -> [u8; 25] {
    let mut c = [0u8; 25];
    c[0] = kind;
    c[1..5].copy_from_slice(&lanes.to_le_bytes());
    c[5..9].copy_from_slice(&repeats.to_le_bytes());
    c[9..17].copy_from_slice(&(size as u64).to_le_bytes());
    c[17..25].copy_from_slice(&nonce.to_le_bytes());
    c
}

async fn ack(control: &mut TcpStream) -> std::io::Result<()> {
    let mut b = [0u8; 1];
    control.read_exact(&mut b).await?;
    Ok(())
}

fn report(mode: &str, size: usize, times: &[Duration]) {
    let mut rates: Vec<f64> = times
        .iter()
        .map(|t| size as f64 / t.as_secs_f64() / 1e9)
        .collect();
    rates.sort_by(f64::total_cmp);
    if rates.is_empty() {
        return;
    }
    let mid = rates.len() / 2;
    let median = if rates.len() % 2 == 0 {
        (rates[mid - 1] + rates[mid]) / 2.0
    } else {
        rates[mid]
    };
    println!(
        "{mode:<10} {median:>12.2} {:>10.2} {:>10.2}",
        rates[0],
        rates[rates.len() - 1]
    );
}

/// A reused receive buffer: hands its `Vec` back from `finish`.
struct Reused(Vec<u8>);

impl RecvBuffer for Reused {
    fn as_mut_bytes(&mut self) -> &mut [u8] {
        &mut self.0
    }
    fn finish(self: Box<Self>) -> Result<Box<dyn Any + Send>, TransportError> {
        Ok(self)
    }
}

/// Checks a few bytes of a received buffer against the pattern.
fn check(buf: &[u8]) -> Result<(), BoxError> {
    let n = buf.len();
    for i in [
        0,
        1,
        n / 3,
        n / 2,
        n.saturating_sub(4097),
        n.saturating_sub(1),
    ] {
        if i < n && buf[i] != pattern(i) {
            return Err(format!("byte {i} is {}, expected {}", buf[i], pattern(i)).into());
        }
    }
    Ok(())
}

/// The child: receives what the parent sends, acknowledging each transfer.
async fn receiver() -> Result<(), BoxError> {
    let control_listener = TcpListener::bind((LOCALHOST, 0)).await?;
    let data_listener = TcpListener::bind((LOCALHOST, 0)).await?;
    let lane_listener = LaneListener::bind(LOCALHOST).await?;
    println!(
        "{} {} {}",
        control_listener.local_addr()?.port(),
        data_listener.local_addr()?.port(),
        lane_listener.local_addr().port()
    );
    let (mut control, _) = control_listener.accept().await?;
    control.set_nodelay(true)?;
    // Pre-faulted (every byte written) and reused by every transfer.
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let mut c = [0u8; 25];
        control.read_exact(&mut c).await?;
        let lanes = u32::from_le_bytes(c[1..5].try_into()?) as usize;
        let repeats = u32::from_le_bytes(c[5..9].try_into()?);
        let size = u64::from_le_bytes(c[9..17].try_into()?) as usize;
        let nonce = u64::from_le_bytes(c[17..25].try_into()?);
        if buf.len() != size {
            buf = vec![0xa5; size];
        }
        match c[0] {
            PLAIN => {
                let (mut data, _) = data_listener.accept().await?;
                data.set_nodelay(true)?;
                for _ in 0..repeats {
                    data.read_exact(&mut buf).await?;
                    control.write_all(&[1]).await?;
                    check(&buf)?;
                    if let Some(b) = buf.first_mut() {
                        // A transfer that skipped byte 0 fails the next check.
                        *b = !*b;
                    }
                }
            }
            MPT => {
                let streams = lane_listener.accept(nonce, lanes, SETUP).await?;
                let mpt = MptReceiver::new(streams, "the parent");
                for seq in 0..repeats {
                    let dest = Box::new(Reused(std::mem::take(&mut buf)));
                    let got = mpt.receive(u64::from(seq), dest).await?;
                    control.write_all(&[1]).await?;
                    let reused = got
                        .finish()?
                        .downcast::<Reused>()
                        .map_err(|_| "not our buffer")?;
                    buf = reused.0;
                    check(&buf)?;
                    if let Some(b) = buf.first_mut() {
                        // A transfer that skipped byte 0 fails the next check.
                        *b = !*b;
                    }
                }
            }
            _ => return Ok(()),
        }
    }
}
