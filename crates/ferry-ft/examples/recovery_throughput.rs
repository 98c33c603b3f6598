//! Live-recovery throughput: a healing replica fetches a 1 GiB checkpoint
//! from a source replica in another process over `ferry-transport`
//! (loopback TCP), and the example prints GB/s.
//!
//! The parent process spawns itself as the source (`serve`): it builds a
//! state of several f32 tensors filled with a known pattern, serves it with
//! a [`CheckpointServer`] on 127.0.0.1:0 and prints its address. The parent
//! then fetches the state several times, both into tensors it already holds
//! ([`fetch_checkpoint_into`], what a healing replica does: its model is
//! allocated) and into fresh destinations ([`fetch_checkpoint`]), checks
//! every byte after each fetch (outside the timing) and reports the best
//! and median rate. GB/s is 10^9 bytes per second.
//!
//! ```text
//! cargo run --release -p ferry-ft --example recovery_throughput -- \
//!     [--mib 1024] [--tensors 8] [--lanes 2] [--chunk-mib 8] [--rounds 5]
//! ```

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, Subcommand};
use ferry_ft::recovery::{
    fetch_checkpoint, fetch_checkpoint_into, CheckpointServer, CheckpointServerOptions,
    CheckpointState, FetchOptions,
};
use ferry_transport::{RawTensor, Storage};
use ferry_wire::{DType, Device, TensorDescriptor};

/// The step the source serves.
const STEP: i64 = 7;

/// Live-recovery throughput of a 1 GiB checkpoint between two processes.
#[derive(Debug, Clone, Parser)]
#[command(name = "recovery_throughput")]
struct Args {
    /// The source's role (the parent spawns itself with it).
    #[command(subcommand)]
    role: Option<Role>,
    /// MiB of f32 in the checkpoint.
    #[arg(long, global = true, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    mib: u64,
    /// Tensors the checkpoint is split into (of unequal sizes).
    #[arg(long, global = true, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    tensors: u64,
    /// TCP lanes of the fetch.
    #[arg(long, global = true, default_value_t = 2)]
    lanes: u32,
    /// MiB per chunk of the fetch.
    #[arg(long, global = true, default_value_t = 8)]
    chunk_mib: u64,
    /// Timed fetches of each kind.
    #[arg(long, global = true, default_value_t = 5)]
    rounds: usize,
}

/// What the process does besides the default (fetching).
#[derive(Debug, Clone, Copy, Subcommand)]
enum Role {
    /// Serve the checkpoint on 127.0.0.1:0 and print the address.
    #[command(hide = true)]
    Serve,
}

/// Element counts of the tensors: `mib` MiB of f32 over `tensors` tensors
/// of unequal sizes (the last takes the rest).
fn tensor_sizes(args: &Args) -> Vec<u64> {
    let total = args.mib << 18; // f32 elements
    let base = total / args.tensors;
    let mut sizes: Vec<u64> = (0..args.tensors).map(|i| base - (i % 3) * 1000).collect();
    let used: u64 = sizes.iter().sum();
    if let Some(last) = sizes.last_mut() {
        *last += total - used;
    }
    sizes
}

/// The pattern of tensor `t`: 8-byte words that differ everywhere.
fn word(t: u64, k: u64) -> u64 {
    (t << 48) ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn fill(storage: &mut Storage, t: u64) {
    for (k, chunk) in storage.as_bytes_mut().chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(t, k as u64).to_le_bytes());
    }
}

fn check(state: &CheckpointState, sizes: &[u64]) -> Result<()> {
    if state.step != STEP || state.tensors.len() != sizes.len() {
        bail!(
            "wrong state: step {}, {} tensors",
            state.step,
            state.tensors.len()
        );
    }
    for (t, (name, tensor)) in state.tensors.iter().enumerate() {
        if name != &format!("layer{t}.weight") || tensor.numel() != sizes[t] {
            bail!("tensor {t}: {name} with {} elements", tensor.numel());
        }
        let bytes = tensor.storage().as_bytes();
        for (k, chunk) in bytes.chunks_exact(8).enumerate() {
            if chunk != word(t as u64, k as u64).to_le_bytes() {
                bail!("tensor {name}: wrong bytes at word {k}");
            }
        }
    }
    Ok(())
}

fn tensor(storage: Storage, elements: u64) -> Result<RawTensor> {
    let descriptor = TensorDescriptor::contiguous(DType::F32, &[elements as i64], Device::Cpu);
    Ok(RawTensor::from_storage(Arc::new(storage), descriptor)?)
}

/// The child: serves the patterned state until its stdin closes.
fn serve(args: &Args) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let sizes = tensor_sizes(args);
        let mut state = CheckpointState::new(STEP);
        for (t, &elements) in sizes.iter().enumerate() {
            let mut storage = Storage::zeroed(elements as usize * 4)?;
            fill(&mut storage, t as u64);
            state = state.with_tensor(format!("layer{t}.weight"), tensor(storage, elements)?);
        }
        let server =
            CheckpointServer::bind("127.0.0.1:0", CheckpointServerOptions::new("source")).await?;
        server.allow(state)?;
        println!("READY {}", server.address());
        // Serve until the parent closes our stdin.
        tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
        })
        .await?;
        server.shutdown().await;
        Ok(())
    })
}

/// Rates in GB/s: (best, median).
fn summary(mut rates: Vec<f64>) -> (f64, f64) {
    rates.sort_by(f64::total_cmp);
    let best = rates.last().copied().unwrap_or(0.0);
    let median = rates.get(rates.len() / 2).copied().unwrap_or(0.0);
    (best, median)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if matches!(args.role, Some(Role::Serve)) {
        return serve(&args);
    }
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args([
            "serve",
            "--mib",
            &args.mib.to_string(),
            "--tensors",
            &args.tensors.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("spawn the source process")?;
    let result = fetch_rounds(&args, &mut child);
    // Closing stdin stops the source; kill it if it does not go.
    drop(child.stdin.take());
    if result.is_err() {
        let _ = child.kill();
    }
    let _ = child.wait();
    result
}

fn fetch_rounds(args: &Args, child: &mut std::process::Child) -> Result<()> {
    let stdout = child.stdout.take().context("source stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let address = line
        .trim()
        .strip_prefix("READY ")
        .ok_or_else(|| anyhow!("source said {line:?}"))?
        .to_owned();

    let sizes = tensor_sizes(args);
    let total_bytes: u64 = sizes.iter().sum::<u64>() * 4;
    let options = FetchOptions::new("healer")
        .with_lanes(args.lanes)
        .with_chunk_bytes(args.chunk_mib << 20)
        .with_io_timeout(Duration::from_secs(30));
    println!(
        "source {address} (another process), {:.3} GiB in {} f32 tensors, {} lane(s), {} MiB chunks",
        total_bytes as f64 / (1u64 << 30) as f64,
        sizes.len(),
        args.lanes,
        args.chunk_mib
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        // The healing replica's own state: allocated and touched (pages
        // mapped), as a live model's parameters are.
        let mut dest = CheckpointState::new(0);
        for (t, &elements) in sizes.iter().enumerate() {
            let mut storage = Storage::zeroed(elements as usize * 4)?;
            storage.as_bytes_mut().fill(0xff);
            dest = dest.with_tensor(format!("layer{t}.weight"), tensor(storage, elements)?);
        }

        let mut into_rates = Vec::new();
        for round in 0..args.rounds {
            let started = Instant::now();
            let state = fetch_checkpoint_into(&address, STEP, dest, &options).await?;
            let elapsed = started.elapsed();
            check(&state, &sizes)?;
            let rate = total_bytes as f64 / elapsed.as_secs_f64() / 1e9;
            println!(
                "  fetch_checkpoint_into round {round}: {:.1} ms, {rate:.2} GB/s",
                elapsed.as_secs_f64() * 1e3
            );
            into_rates.push(rate);
            dest = state;
        }
        drop(dest);

        let mut fresh_rates = Vec::new();
        for round in 0..args.rounds.min(3) {
            let started = Instant::now();
            let state = fetch_checkpoint(&address, STEP, &options).await?;
            let elapsed = started.elapsed();
            check(&state, &sizes)?;
            let rate = total_bytes as f64 / elapsed.as_secs_f64() / 1e9;
            println!(
                "  fetch_checkpoint (fresh destinations) round {round}: {:.1} ms, {rate:.2} GB/s",
                elapsed.as_secs_f64() * 1e3
            );
            fresh_rates.push(rate);
        }

        let (best, median) = summary(into_rates);
        println!(
            "recovery throughput into existing tensors: {best:.2} GB/s best, {median:.2} GB/s median"
        );
        let (best, median) = summary(fresh_rates);
        println!(
            "recovery throughput into fresh allocations: {best:.2} GB/s best, {median:.2} GB/s median"
        );
        Ok(())
    })
}
