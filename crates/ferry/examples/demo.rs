//! A tour of Ferry's RPC: 4 local worker processes rendezvous, exchange
//! tensors through typed remote functions (`rpc_sync` and `rpc_async`),
//! and print what they measured.
//! (`cargo xtask demo` runs a different program: `ferry-autograd`'s `train`
//! example, Listing 1 trained across 3 processes.)
//!
//! Run it with `cargo run --release -p ferry --example demo`; it launches
//! its own workers (like `torchrun`) and exits when all of them have shut
//! down gracefully.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use ferry::launch::{self, Role};
use ferry::{Function, Functions, RawTensor, RpcFuture, RpcOptions};

const WORLD_SIZE: u32 = 4;
static SERVED: AtomicU64 = AtomicU64::new(0);

/// An empty call, answered on the agent's runtime.
const PING: Function<(), ()> = Function::new("ping");
/// Multiplies a contiguous f32 tensor by a factor.
const SCALE: Function<(RawTensor, f32), RawTensor> = Function::new("scale");
/// Sends the tensor back.
const ECHO: Function<RawTensor, RawTensor> = Function::new("echo");

fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(PING, |()| async {
        SERVED.fetch_add(1, Ordering::Relaxed);
        Ok::<_, std::convert::Infallible>(())
    });
    f.add(SCALE, |(t, k): (RawTensor, f32)| {
        SERVED.fetch_add(1, Ordering::Relaxed);
        let v = t
            .as_slice::<f32>()
            .context("scale takes a contiguous f32 tensor")?;
        let out: Vec<f32> = v.iter().map(|x| x * k).collect();
        Ok::<_, anyhow::Error>(RawTensor::from_slice(&out, t.shape())?)
    });
    f.add(ECHO, |t: RawTensor| async move {
        SERVED.fetch_add(1, Ordering::Relaxed);
        Ok::<_, std::convert::Infallible>(t)
    });
    f
}

fn name(rank: u32) -> String {
    format!("worker{rank}")
}

fn main() -> Result<()> {
    let (rank, world_size) = match launch::local(WORLD_SIZE)? {
        Role::Worker { rank, world_size } => (rank, world_size),
        Role::Launcher => {
            println!("demo: all {WORLD_SIZE} workers shut down cleanly");
            return Ok(());
        }
    };
    let started = Instant::now();
    ferry::init_rpc(RpcOptions::from_env(name(rank))?.functions(functions()))?;
    if rank == 0 {
        println!(
            "demo: {world_size} workers joined the rendezvous in {:.1} ms",
            started.elapsed().as_secs_f64() * 1e3
        );
    }

    // Every worker sends a tensor to every worker (itself included) at once.
    let mine: Vec<f32> = (0..1024).map(|i| (rank * 10_000 + i) as f32).collect();
    let tensor = RawTensor::from_slice(&mine, &[32, 32])?;
    let replies: Vec<_> = (0..world_size)
        .map(|peer| SCALE.rpc_async(peer, (tensor.clone(), peer as f32 + 1.0)))
        .collect();
    for (peer, reply) in replies.into_iter().enumerate() {
        let back = reply.wait()?;
        let got = back.as_slice::<f32>().context("f32 reply")?;
        ensure!(
            got.iter()
                .zip(&mine)
                .all(|(g, m)| *g == m * (peer as f32 + 1.0)),
            "wrong values from {}",
            name(peer as u32)
        );
    }
    println!(
        "{}: exchanged 4 KB tensors with all {world_size} workers, values checked",
        name(rank)
    );

    if rank == 0 {
        println!();
        println!(
            "{:<10} {:>16} {:>22} {:>20}",
            "peer", "rpc_sync median", "rpc_async 64 in flight", "4 MB tensor echo"
        );
        for peer in 0..world_size {
            let (lat, tput, bw) = measure(peer)?;
            println!(
                "{:<10} {:>13.1} µs {:>15.0} calls/s {:>15.2} GB/s",
                name(peer),
                lat.as_secs_f64() * 1e6,
                tput,
                bw
            );
        }
        println!();
    }
    ferry::shutdown()?;
    println!(
        "{}: served {} calls, shut down",
        name(rank),
        SERVED.load(Ordering::Relaxed)
    );
    Ok(())
}

/// Median empty round trip, empty calls per second with 64 in flight, and
/// effective bandwidth (both directions) of a 4 MB tensor echo.
fn measure(peer: u32) -> Result<(Duration, f64, f64)> {
    let mut lat = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let t = Instant::now();
        PING.rpc_sync(peer, ())?;
        lat.push(t.elapsed());
    }
    lat.sort();
    let median = lat[lat.len() / 2];

    let calls = 20_000;
    let t = Instant::now();
    let mut inflight = std::collections::VecDeque::with_capacity(64);
    for _ in 0..calls {
        if inflight.len() == 64 {
            let f: RpcFuture<()> = inflight.pop_front().context("queue")?;
            f.wait()?;
        }
        inflight.push_back(PING.rpc_async(peer, ()));
    }
    for f in inflight {
        f.wait()?;
    }
    let tput = calls as f64 / t.elapsed().as_secs_f64();

    let big = RawTensor::zeros(ferry::DType::F32, &[1 << 20])?;
    let reps = 20;
    let t = Instant::now();
    for _ in 0..reps {
        let back = ECHO.rpc_sync(peer, big.clone())?;
        ensure!(back.numel() == big.numel(), "echo lost elements");
    }
    let per = t.elapsed().as_secs_f64() / reps as f64;
    let bw = 2.0 * (4 << 20) as f64 / per / 1e9;
    Ok((median, tput, bw))
}
