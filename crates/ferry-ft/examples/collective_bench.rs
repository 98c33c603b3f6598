//! Ferry's side of `cargo xtask bench --only collective`: allreduce time
//! and recovery of Ferry's [`ProcessGroup`] (in-process) and
//! [`BabyProcessGroup`] (in a killable child, buffers in shared memory),
//! two replica groups on this host, one process each, like the peer
//! script `benches/peers/tf_collective.py` does with torchft's
//! `ProcessGroupGloo` and `ProcessGroupBabyGloo`.
//!
//! This process starts a TCP store and two workers (itself with
//! `--worker RANK`); rank 0 measures, per float32 buffer size (`--sizes`):
//!
//! - `pg`: one `ProcessGroup::allreduce(.., Sum)`;
//! - `baby`: one `BabyProcessGroup::allreduce_buffer(.., Sum)` of a
//!   [`SharedBuffer`](ferry_ft::baby::SharedBuffer);
//!
//! `--rounds` timed calls after `--warmup` untimed ones, each group
//! configured once for all sizes. Recovery (`--recoveries` times, a
//! `--recovery-size` buffer): both configure a Baby group for quorum Q and
//! allreduce once; after a 200 ms pause, both start an allreduce and
//! rank 0 SIGKILLs its own child right after submitting it; both wait for
//! the failure, configure quorum Q+1 (fresh children) and allreduce again. `recovery`: from the
//! kill to that allreduce done; `recovery_detect`: to the failure seen.
//!
//! `cargo run --release -p ferry-ft --example collective_bench -- [--quick]
//! [--sizes 1MB 16MB 64MB] [--rounds N] [--warmup N] [--recoveries N]
//! [--out PATH]` (`--quick`: 5 rounds, 2 recoveries). The children are
//! `ferry-ft-baby` (`cargo build --release -p ferry-ft --bin
//! ferry-ft-baby` first) or this example re-executed when it is not there.
//! Prints the result as one JSON line and writes it to `--out`.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use ferry_ft::baby::{
    run_child_if_requested, BabyOptions, BabyProcessGroup, ChildProgram, CHILD_BIN_NAME,
};
use ferry_ft::collective::{ProcessGroup, ProcessGroupOptions, ReduceOp};
use ferry_store::TcpStoreServer;
use serde_json::{json, Value};

const WORLD: usize = 2;
/// Pause between a recovery round's first allreduce and the one killed
/// (not timed; the peer script pauses the same).
const SETTLE: Duration = Duration::from_millis(200);

#[derive(Parser, Debug)]
struct Args {
    /// Float32 buffer sizes (1MB = 2^20 bytes).
    #[arg(long, num_args = 1.., default_values = ["1MB", "16MB", "64MB"])]
    sizes: Vec<String>,
    /// Timed allreduces per size [default: 20; 5 with --quick].
    #[arg(long)]
    rounds: Option<usize>,
    /// Untimed allreduces before them.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Kill-and-recover rounds [default: 5; 2 with --quick].
    #[arg(long)]
    recoveries: Option<usize>,
    /// Buffer of the recovery rounds.
    #[arg(long, default_value = "16MB")]
    recovery_size: String,
    /// The groups' timeout, seconds (as the peer's).
    #[arg(long, default_value_t = 10.0)]
    timeout: f64,
    #[arg(long)]
    quick: bool,
    /// Where to write the result.
    #[arg(long)]
    out: Option<String>,
    #[arg(long, hide = true)]
    worker: Option<u64>,
    #[arg(long, hide = true)]
    store: Option<String>,
}

fn parse_size(text: &str) -> Result<usize> {
    let t = text.trim().to_ascii_uppercase();
    for (unit, scale) in [("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)] {
        if let Some(n) = t.strip_suffix(unit) {
            return Ok(n.parse::<usize>().context("a size")? * scale);
        }
    }
    t.parse().context("a size")
}

/// The peers' statistics schema, in milliseconds.
fn stats_ms(secs: &[f64]) -> Value {
    let mut ms: Vec<f64> = secs.iter().map(|s| s * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let n = ms.len();
    if n == 0 {
        return Value::Null;
    }
    let pct = |p: f64| {
        let at = p * (n - 1) as f64;
        let (lo, hi) = (at as usize, (at as usize + 1).min(n - 1));
        ms[lo] + (ms[hi] - ms[lo]) * (at - lo as f64)
    };
    let mean = ms.iter().sum::<f64>() / n as f64;
    let std = if n > 1 {
        (ms.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
    } else {
        0.0
    };
    json!({"n": n, "median_ms": pct(0.5), "p10_ms": pct(0.1), "p90_ms": pct(0.9),
           "mean_ms": mean, "std_ms": std, "min_ms": ms[0], "max_ms": ms[n - 1]})
}

fn ids() -> Vec<String> {
    (0..WORLD).map(|r| format!("replica_{r}")).collect()
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

fn baby_options(rank: u64, timeout: Duration) -> BabyOptions {
    BabyOptions::new(&ids()[rank as usize])
        .with_timeout(timeout)
        .with_child(child_program())
}

fn kill(pid: u32) -> Result<()> {
    let pid = rustix::process::Pid::from_raw(i32::try_from(pid)?).context("a child pid")?;
    rustix::process::kill_process(pid, rustix::process::Signal::KILL)?;
    Ok(())
}

/// One kill-and-recover round: (detect, total, whether the allreduce
/// failed as it should) on rank 0.
async fn recovery_round(
    store: &str,
    rank: u64,
    quorum: i64,
    len: usize,
    timeout: Duration,
) -> Result<(f64, f64, bool)> {
    let ids = ids();
    let mut pg = BabyProcessGroup::new(baby_options(rank, timeout));
    pg.configure_with(store, quorum, &ids, rank).await?;
    let mut buf = pg.buffer(len)?;
    buf.fill(1.0);
    let buf = pg.allreduce_buffer(buf, ReduceOp::Sum).await?;
    let pid = pg.child_pid().context("no child")?;
    // The peer's allreduce may not be done when this side's is (it may
    // still have this side's last message to read): let it finish, so
    // that only the allreduce below sees the kill.
    tokio::time::sleep(SETTLE).await;
    let work = pg.allreduce_buffer(buf, ReduceOp::Sum);
    let started = Instant::now();
    if rank == 0 {
        kill(pid)?;
    }
    let (buf, failed) = match work.await {
        Ok(buf) => (buf, false),
        Err(failure) => (failure.buffer.context("the buffer back")?, true),
    };
    let detect = started.elapsed().as_secs_f64();
    pg.configure_with(store, quorum + 1, &ids, rank).await?;
    pg.allreduce_buffer(buf, ReduceOp::Sum).await?;
    let total = started.elapsed().as_secs_f64();
    pg.shutdown().await;
    Ok((detect, total, failed))
}

async fn worker(args: &Args, rank: u64, store: &str) -> Result<Option<Value>> {
    let rounds = args.rounds.unwrap_or(if args.quick { 5 } else { 20 });
    let recoveries = args.recoveries.unwrap_or(if args.quick { 2 } else { 5 });
    let timeout = Duration::from_secs_f64(args.timeout);
    let ids = ids();
    let id = &ids[rank as usize];
    let mut pg = ProcessGroup::bind(
        "127.0.0.1:0",
        ProcessGroupOptions::new(id).with_timeout(timeout),
    )
    .await?;
    pg.configure_with(store, 1, &ids, rank).await?;
    let mut baby = BabyProcessGroup::new(baby_options(rank, timeout));
    baby.configure_with(store, 2, &ids, rank).await?;

    let mut rows = Vec::new();
    for size in &args.sizes {
        let bytes = parse_size(size)?;
        let len = bytes / 4;
        let mut data = vec![rank as f32 + 1.0; len];
        let mut times = Vec::with_capacity(rounds);
        for i in 0..args.warmup + rounds {
            let started = Instant::now();
            pg.allreduce(&mut data, ReduceOp::Sum).await?;
            if i >= args.warmup {
                times.push(started.elapsed().as_secs_f64());
            }
        }
        let pg_stats = stats_ms(&times);
        drop(data);

        let mut buf = baby.buffer(len)?;
        buf.fill(rank as f32 + 1.0);
        let mut times = Vec::with_capacity(rounds);
        for i in 0..args.warmup + rounds {
            let started = Instant::now();
            buf = baby.allreduce_buffer(buf, ReduceOp::Sum).await?;
            if i >= args.warmup {
                times.push(started.elapsed().as_secs_f64());
            }
        }
        let baby_stats = stats_ms(&times);
        let ratio = baby_stats["median_ms"].as_f64().unwrap_or(f64::NAN)
            / pg_stats["median_ms"].as_f64().unwrap_or(f64::NAN);
        if rank == 0 {
            eprintln!(
                "collective_bench: {size}: in-process {:.2} ms, baby {:.2} ms",
                pg_stats["median_ms"], baby_stats["median_ms"]
            );
        }
        rows.push(
            json!({"size": size, "bytes": bytes, "pg": pg_stats, "baby": baby_stats,
                         "baby_over_pg": ratio}),
        );
    }
    baby.shutdown().await;
    drop(pg);

    let len = parse_size(&args.recovery_size)? / 4;
    let (mut detect, mut total, mut unfailed) = (Vec::new(), Vec::new(), 0);
    for i in 0..recoveries {
        let (d, t, failed) = recovery_round(store, rank, 100 + 2 * i as i64, len, timeout).await?;
        detect.push(d);
        total.push(t);
        unfailed += usize::from(!failed);
    }
    Ok((rank == 0).then(|| {
        json!({
            "bench": "ferry_collective",
            "world_size": WORLD,
            "rows": rows,
            "recovery": stats_ms(&total),
            "recovery_detect": stats_ms(&detect),
            "recovery_bytes": len * 4,
            "recovery_unfailed": unfailed,
            "timeout_s": args.timeout,
            "settings": {"rounds": rounds, "warmup": args.warmup, "recoveries": recoveries},
            "child": format!("{:?}", child_program()),
        })
    }))
}

/// Starts the store and the two workers; rank 0's result.
async fn coordinator(args: &Args) -> Result<Value> {
    let server = TcpStoreServer::bind(([127, 0, 0, 1], 0).into()).await?;
    let store = server.local_addr().to_string();
    let exe = std::env::current_exe()?;
    let mut forwarded: Vec<String> = vec!["--sizes".into()];
    forwarded.extend(args.sizes.iter().cloned());
    forwarded.extend(["--warmup".into(), args.warmup.to_string()]);
    forwarded.extend(["--recovery-size".into(), args.recovery_size.clone()]);
    forwarded.extend(["--timeout".into(), args.timeout.to_string()]);
    if let Some(r) = args.rounds {
        forwarded.extend(["--rounds".into(), r.to_string()]);
    }
    if let Some(r) = args.recoveries {
        forwarded.extend(["--recoveries".into(), r.to_string()]);
    }
    if args.quick {
        forwarded.push("--quick".into());
    }
    let mut children = Vec::new();
    for rank in 0..WORLD {
        let child = tokio::process::Command::new(&exe)
            .args(["--worker", &rank.to_string(), "--store", &store])
            .args(&forwarded)
            .stdout(if rank == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .kill_on_drop(true)
            .spawn()
            .context("starting a worker")?;
        children.push(child);
    }
    let rank1 = children.pop().context("rank 1")?;
    let rank0 = children.pop().context("rank 0")?;
    let (out0, out1) = tokio::join!(rank0.wait_with_output(), rank1.wait_with_output());
    let (out0, out1) = (out0?, out1?);
    if !out0.status.success() || !out1.status.success() {
        bail!(
            "a worker failed: rank 0 {}, rank 1 {}",
            out0.status,
            out1.status
        );
    }
    let text = String::from_utf8_lossy(&out0.stdout);
    let line = text.lines().last().context("rank 0 printed no result")?;
    serde_json::from_str(line).context("rank 0's result")
}

fn main() -> Result<()> {
    run_child_if_requested();
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        if let Some(rank) = args.worker {
            let store = args.store.as_deref().context("--worker needs --store")?;
            if let Some(result) = worker(&args, rank, store).await? {
                println!("{result}");
            }
            return Ok(());
        }
        let result = coordinator(&args).await?;
        if let Some(out) = &args.out {
            std::fs::write(out, serde_json::to_string_pretty(&result)? + "\n")
                .with_context(|| format!("writing {out}"))?;
        }
        println!("{result}");
        Ok(())
    })
}
