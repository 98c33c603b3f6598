//! `retain_freed_memory`: a tensor-sized block freed and allocated again
//! comes back without the kernel faulting its pages in afresh, which is
//! what glibc's default thresholds do to every microbatch's gradients,
//! also on threads started after the tuning (the RPC layer's blocking
//! pool, where stages compute).

#![cfg(all(target_os = "linux", target_env = "gnu"))]

/// Minor page faults this thread has taken so far.
fn minor_faults() -> libc::c_long {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a whole rusage into the pointer it gets.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) };
    assert_eq!(rc, 0, "getrusage failed");
    // SAFETY: initialised by the successful call above.
    unsafe { usage.assume_init() }.ru_minflt
}

const BLOCK: usize = 8 << 20;
const PAGES: libc::c_long = (BLOCK / 4096) as libc::c_long;
const ROUNDS: libc::c_long = 4;

/// Faults taken by `ROUNDS` rounds of allocating a gradient-sized block,
/// writing every page of it (as a GEMM's output does) and freeing it.
fn faults_of_reallocating() -> libc::c_long {
    let round = || {
        let mut block: Vec<u8> = Vec::with_capacity(BLOCK);
        block.extend((0..BLOCK).map(|i| i as u8));
        std::hint::black_box(&block);
    };
    round();
    let before = minor_faults();
    for _ in 0..ROUNDS {
        round();
    }
    minor_faults() - before
}

#[test]
fn freed_blocks_are_reused_instead_of_faulted_in_again() {
    // glibc's default: a fixed 128 KiB mmap threshold (as the dynamic one
    // starts) and trim threshold. Every round maps and faults fresh pages.
    // SAFETY: valid parameters and values for mallopt.
    unsafe {
        assert_eq!(libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10), 1);
        assert_eq!(libc::mallopt(libc::M_TRIM_THRESHOLD, 128 << 10), 1);
    }
    let untuned = faults_of_reallocating();
    assert!(
        untuned >= ROUNDS * PAGES * 9 / 10,
        "glibc's defaults should fault every page of every round: {untuned} faults"
    );

    ferry_pipeline::retain_freed_memory().expect("glibc takes the settings");
    let _ = faults_of_reallocating(); // the first round after tuning may map
    let tuned = faults_of_reallocating();
    assert!(
        tuned < PAGES / 8,
        "freed blocks should come back without faults: {tuned} faults in {ROUNDS} rounds of {PAGES} pages"
    );
}

/// Set in the child process [`threads_started_after_tuning_reuse_freed_heaps`]
/// runs itself in.
const CHILD_ENV: &str = "FERRY_PIPELINE_MEMORY_TEST_CHILD";
const THREAD_TEST: &str = "threads_started_after_tuning_reuse_freed_heaps";

/// In a fresh process (the child): tunes, then on a new thread keeps a
/// stage's worth of live blocks (most of one of glibc's 64 MiB per-thread
/// heaps) and reallocates a gradient-sized block that no longer fits
/// beside them. Prints the faults of the reallocating rounds.
fn child() {
    ferry_pipeline::retain_freed_memory().expect("glibc takes the settings");
    let faults = std::thread::spawn(|| {
        let live: Vec<Vec<u8>> = (0..8).map(|_| vec![1u8; 7 << 20]).collect();
        std::hint::black_box(&live);
        let _ = faults_of_reallocating(); // the first rounds may map
        faults_of_reallocating()
    })
    .join()
    .expect("the allocating thread panicked");
    println!("faults={faults}");
}

#[test]
fn threads_started_after_tuning_reuse_freed_heaps() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return child();
    }
    // A child process of its own: which arena a new thread gets depends on
    // the threads the process had before (other tests' among them).
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args(["--exact", THREAD_TEST, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .output()
        .expect("the test binary runs again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the child failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let faults: libc::c_long = stdout
        .split("faults=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the child printed no fault count: {stdout}"));
    // Per-thread arenas would map, fault in and unmap a fresh heap for
    // the block every round (ROUNDS * PAGES faults).
    assert!(
        faults < PAGES / 8,
        "a thread started after tuning faulted its freed block in again: {faults} faults in {ROUNDS} rounds of {PAGES} pages"
    );
}
