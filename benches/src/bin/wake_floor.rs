//! The host's floor under a hand-off between two processes, without
//! Ferry: how long after one process signals an eventfd (as a
//! shared-memory ring's writer does) the other, blocked in `epoll_wait`,
//! runs again. `cargo xtask bench --only pipeline` prints it next to the
//! pipeline's measured hand-off, to tell what the host costs from what
//! Ferry's runtime adds.
//!
//! Two processes (a `fork` before any thread exists). The sender computes
//! for 100-300 µs (a stage's action), stamps `CLOCK_MONOTONIC` into shared
//! memory, writes the eventfd, and computes on; the receiver wakes, reads
//! the stamp, computes 100 µs and acknowledges. Measured twice:
//! - `idle`: the receiver's process has nothing else to run, so its core
//!   idles (on a virtual machine a halted vCPU, whose wake-up is the cost
//!   a sleeping ring reader pays);
//! - `busy`: a thread of the receiver's process polls and yields the CPU
//!   between rounds (as Ferry's waits spin), so its core stays awake.
//!
//! With two CPUs or more, the sender runs on the first and the receiver
//! (both its threads) on the second, so that the poller keeps the
//! receiver's own core awake rather than the sender's.
//!
//! Usage: `wake_floor [--samples N] [--out PATH]`.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Parser;
use ferry_benches::{pct, write_result};
use serde_json::{json, Value};

/// The host's eventfd wake-up latency between two processes.
#[derive(Debug, Parser)]
#[command(name = "wake_floor")]
struct Args {
    /// Hand-offs measured per variant.
    #[arg(long, default_value_t = 2000)]
    samples: usize,
    /// Where to write the JSON result (stdout when absent).
    #[arg(long, value_name = "PATH")]
    out: Option<String>,
}

/// Nanoseconds of `CLOCK_MONOTONIC` (the same clock in both processes).
fn now_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec to write.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Computes (spins on the clock) for `ns`.
fn compute(ns: u64) {
    let end = now_ns() + ns;
    while now_ns() < end {
        std::hint::spin_loop();
    }
}

fn check(rc: libc::c_int, what: &str) -> Result<libc::c_int> {
    if rc < 0 {
        return Err(io::Error::last_os_error()).context(what.to_string());
    }
    Ok(rc)
}

/// Pins this process (its threads to come) to `cpu`.
fn pin(cpu: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes into it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below the set's size (checked by the caller).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: sets this process's affinity from a valid set.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    check(rc, "sched_setaffinity").map(drop)
}

/// Whether the sender and the receiver can get a CPU each (asked before
/// either is pinned: the answer follows this process's affinity).
fn can_pin() -> bool {
    std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2)
}

fn signal(fd: libc::c_int) -> Result<()> {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a valid u64 to an eventfd.
    let n = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    check(n as libc::c_int, "writing an eventfd").map(drop)
}

fn drain(fd: libc::c_int) -> Result<()> {
    let mut v = 0u64;
    // SAFETY: reads 8 bytes into a valid u64 from an eventfd.
    let n = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
    check(n as libc::c_int, "reading an eventfd").map(drop)
}

/// The receiving process: `samples` wake-ups, each latency written into
/// `out` (shared memory); with `busy`, a yielding poller keeps its core
/// awake.
fn receive(
    data: libc::c_int,
    ack: libc::c_int,
    stamp: &AtomicU64,
    out: &[AtomicU64],
    busy: bool,
) -> Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    let poller = busy.then(|| {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
                std::thread::yield_now();
            }
        })
    });
    // SAFETY: plain epoll calls on descriptors this process owns.
    let ep = check(unsafe { libc::epoll_create1(0) }, "epoll_create1")?;
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: 0,
    };
    // SAFETY: registers `data` with `ep`, both this process's.
    let added = unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, data, &mut ev) };
    check(added, "epoll_ctl")?;
    for slot in out {
        let mut got = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: waits on `ep` for one event, written into `got`.
        let ready = unsafe { libc::epoll_wait(ep, &mut got, 1, -1) };
        check(ready, "epoll_wait")?;
        let woke = now_ns();
        drain(data)?;
        slot.store(
            woke.saturating_sub(stamp.load(Ordering::Acquire)),
            Ordering::Relaxed,
        );
        compute(100_000);
        signal(ack)?;
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(p) = poller {
        let _ = p.join();
    }
    Ok(())
}

/// One variant: forks the receiver, sends `samples` signals, returns the
/// latencies in µs, sorted.
fn measure(samples: usize, busy: bool, pinned: bool) -> Result<Vec<f64>> {
    // SAFETY: a new eventfd, checked.
    let data = check(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) }, "eventfd")?;
    // SAFETY: as above.
    let ack = check(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) }, "eventfd")?;
    let len = (samples + 1) * 8;
    // SAFETY: a fresh anonymous shared mapping of `len` bytes.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(io::Error::last_os_error()).context("mmap");
    }
    // SAFETY: the mapping holds `samples + 1` zeroed u64s, shared across the
    // fork, accessed only through atomics; it lives until `munmap` below.
    let words = unsafe { std::slice::from_raw_parts(map as *const AtomicU64, samples + 1) };
    let (stamp, out) = (&words[0], &words[1..]);
    // SAFETY: no other thread exists in this process here (the receiver
    // starts its poller after the fork).
    let pid = check(unsafe { libc::fork() }, "fork")?;
    if pid == 0 {
        let code = match (if pinned { pin(1) } else { Ok(()) })
            .and_then(|()| receive(data, ack, stamp, out, busy))
        {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("wake_floor receiver: {e:#}");
                1
            }
        };
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    if pinned {
        pin(0)?;
    }
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..samples {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        compute(100_000 + (seed >> 33) % 200_000);
        stamp.store(now_ns(), Ordering::Release);
        signal(data)?;
        compute(200_000);
        drain(ack)?;
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    check(unsafe { libc::waitpid(pid, &mut status, 0) }, "waitpid")?;
    let mut lat: Vec<f64> = out
        .iter()
        .map(|w| w.load(Ordering::Relaxed) as f64 / 1e3)
        .collect();
    // SAFETY: unmaps the mapping made above (`words` is not used after)
    // and closes the eventfds.
    unsafe {
        libc::munmap(map, len);
        libc::close(data);
        libc::close(ack);
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!("the receiving process failed (status {status})");
    }
    lat.sort_by(f64::total_cmp);
    Ok(lat)
}

fn summary(lat: &[f64]) -> Value {
    json!({
        "median_us": pct(lat, 0.5),
        "p10_us": pct(lat, 0.1),
        "p90_us": pct(lat, 0.9),
        "samples": lat.len(),
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.samples == 0 {
        bail!("--samples must be at least 1");
    }
    let pinned = can_pin();
    let idle = measure(args.samples, false, pinned)?;
    let busy = measure(args.samples, true, pinned)?;
    let result = json!({
        "bench": "wake_floor",
        "pinned": pinned,
        "idle": summary(&idle),
        "busy": summary(&busy),
    });
    eprintln!(
        "[wake_floor] eventfd wake-up between two processes: idle core {:.1} us median, \
         busy core {:.1} us median",
        pct(&idle, 0.5),
        pct(&busy, 0.5)
    );
    write_result(&result, args.out.as_deref())
}
