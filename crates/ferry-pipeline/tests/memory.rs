//! `retain_freed_memory`: a tensor-sized block freed and allocated again
//! comes back without the kernel faulting its pages in afresh, which is
//! what glibc's default thresholds do to every microbatch's gradients.

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

    assert!(ferry_pipeline::retain_freed_memory());
    let _ = faults_of_reallocating(); // the first round after tuning may map
    let tuned = faults_of_reallocating();
    assert!(
        tuned < PAGES / 8,
        "freed blocks should come back without faults: {tuned} faults in {ROUNDS} rounds of {PAGES} pages"
    );
}
