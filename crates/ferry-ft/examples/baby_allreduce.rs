//! Allreduce time of two replica groups on this host, in-process
//! [`ProcessGroup`] against [`BabyProcessGroup`] (shared buffers, no
//! copies), float32 buffers of 1, 16 and 64 MB, and the Baby group's
//! recovery: from a child SIGKILLed mid-allreduce to the next successful
//! allreduce (a new quorum, fresh children).
//!
//! `cargo run --release -p ferry-ft --example baby_allreduce [-- ROUNDS]`
//! prints one line per measurement (median of ROUNDS, default 10). The
//! Baby children are `ferry-ft-baby` (`cargo build --release -p ferry-ft
//! --bins` first) or this example re-executed when it is not there.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ferry_ft::baby::{
    run_child_if_requested, BabyOptions, BabyProcessGroup, ChildProgram, CHILD_BIN_NAME,
};
use ferry_ft::collective::{ProcessGroup, ProcessGroupOptions, ReduceOp};
use ferry_store::TcpStoreServer;

const SIZES_MB: [usize; 3] = [1, 16, 64];

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn ids() -> Vec<String> {
    vec!["bench_a".to_owned(), "bench_b".to_owned()]
}

fn child_program() -> ChildProgram {
    let exe = std::env::current_exe().ok();
    let installed = exe
        .as_deref()
        .and_then(|e| e.parent()?.parent().map(|d| d.join(CHILD_BIN_NAME)))
        .filter(|p| p.is_file());
    match installed {
        Some(path) => ChildProgram::Program(path),
        None => ChildProgram::CurrentExe,
    }
}

async fn in_process(store: &str, len: usize, rounds: usize) -> Result<Duration> {
    let ids = ids();
    let mut a = ProcessGroup::bind("127.0.0.1:0", ProcessGroupOptions::new(&ids[0])).await?;
    let mut b = ProcessGroup::bind("127.0.0.1:0", ProcessGroupOptions::new(&ids[1])).await?;
    let quorum = 1_000 + len as i64;
    let (ra, rb) = tokio::join!(
        a.configure_with(store, quorum, &ids, 0),
        b.configure_with(store, quorum, &ids, 1)
    );
    ra?;
    rb?;
    let mut da = vec![1.0f32; len];
    let mut db = vec![2.0f32; len];
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let started = Instant::now();
        let (ra, rb) = tokio::join!(
            a.allreduce(&mut da, ReduceOp::Mean),
            b.allreduce(&mut db, ReduceOp::Mean)
        );
        ra?;
        rb?;
        times.push(started.elapsed());
    }
    Ok(median(times))
}

async fn baby_pair(store: &str, quorum: i64) -> Result<(BabyProcessGroup, BabyProcessGroup)> {
    let ids = ids();
    let options = |id: &str| BabyOptions::new(id).with_child(child_program());
    let mut a = BabyProcessGroup::new(options(&ids[0]));
    let mut b = BabyProcessGroup::new(options(&ids[1]));
    let (ra, rb) = tokio::join!(
        a.configure_with(store, quorum, &ids, 0),
        b.configure_with(store, quorum, &ids, 1)
    );
    ra?;
    rb?;
    Ok((a, b))
}

async fn baby(store: &str, len: usize, rounds: usize) -> Result<Duration> {
    let (a, b) = baby_pair(store, 2_000 + len as i64).await?;
    let mut ba = a.buffer(len)?;
    let mut bb = b.buffer(len)?;
    ba.fill(1.0);
    bb.fill(2.0);
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let started = Instant::now();
        let (ra, rb) = tokio::join!(
            a.allreduce_buffer(ba, ReduceOp::Mean),
            b.allreduce_buffer(bb, ReduceOp::Mean)
        );
        ba = ra?;
        bb = rb?;
        times.push(started.elapsed());
    }
    a.shutdown().await;
    b.shutdown().await;
    Ok(median(times))
}

/// From a SIGKILL of one child with an allreduce in flight to the next
/// successful allreduce (both groups reconfigured for a new quorum).
async fn recovery(store: &str, len: usize, round: i64) -> Result<Duration> {
    let (mut a, mut b) = baby_pair(store, 3_000 + 2 * round).await?;
    let ba = a.buffer(len)?;
    let bb = b.buffer(len)?;
    let pid = a.child_pid().context("no child")?;
    let work = a.allreduce_buffer(ba, ReduceOp::Mean);
    let started = Instant::now();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).context("pid")?,
        rustix::process::Signal::KILL,
    )?;
    let (fa, fb) = tokio::join!(work, b.allreduce_buffer(bb, ReduceOp::Mean));
    let (ba, bb) = match (fa, fb) {
        (Err(fa), Err(fb)) => (fa.buffer.context("buffer")?, fb.buffer.context("buffer")?),
        _ => anyhow::bail!("an allreduce survived its peer's death"),
    };
    let ids = ids();
    let quorum = 3_001 + 2 * round;
    let (ra, rb) = tokio::join!(
        a.configure_with(store, quorum, &ids, 0),
        b.configure_with(store, quorum, &ids, 1)
    );
    ra?;
    rb?;
    let (ra, rb) = tokio::join!(
        a.allreduce_buffer(ba, ReduceOp::Mean),
        b.allreduce_buffer(bb, ReduceOp::Mean)
    );
    ra?;
    rb?;
    let elapsed = started.elapsed();
    a.shutdown().await;
    b.shutdown().await;
    Ok(elapsed)
}

fn main() -> Result<()> {
    run_child_if_requested();
    let rounds: usize = std::env::args()
        .nth(1)
        .map(|r| r.parse())
        .transpose()?
        .unwrap_or(10)
        .max(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let server = TcpStoreServer::bind(([127, 0, 0, 1], 0).into()).await?;
        let store = server.local_addr().to_string();
        println!("child program: {:?}", child_program());
        for mb in SIZES_MB {
            let len = mb * (1 << 20) / 4;
            let inproc = in_process(&store, len, rounds).await?;
            let baby = baby(&store, len, rounds).await?;
            println!(
                "allreduce {mb:>2} MB: in-process {:>8.2} ms, baby {:>8.2} ms, baby/in-process {:.2}",
                inproc.as_secs_f64() * 1e3,
                baby.as_secs_f64() * 1e3,
                baby.as_secs_f64() / inproc.as_secs_f64()
            );
        }
        let mut times = Vec::new();
        for round in 0..rounds as i64 {
            times.push(recovery(&store, (1 << 20) / 4, round).await?);
        }
        println!(
            "recovery (1 MB, child SIGKILLed mid-allreduce -> next allreduce done): {:.2} ms",
            median(times).as_secs_f64() * 1e3
        );
        Ok(())
    })
}
