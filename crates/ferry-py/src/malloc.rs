//! Keeping freed tensor memory for the next message, an opt-in
//! ([`retain_freed_memory`], Python's `ferry.rpc.retain_freed_memory()`):
//! glibc hands blocks of 32 MiB and more straight back to the kernel when
//! they are freed (`mmap`/`munmap`), so every large tensor a worker
//! receives lands in fresh pages and pays a page fault per 2 MiB huge page
//! (ferry-tch advises them; per 4 KiB where THP is off) on both sides of
//! a call (about 5 ms of a 15 ms 40 MB round trip on a 2-vCPU host).
//! Ferry's Rust workers pool their receive buffers; a Python worker receives into fresh libtorch tensors. Keeping
//! blocks of up to [`KEEP_UP_TO`] in glibc's heap for reuse changes the
//! whole process's allocator and keeps freed memory in the process (up to
//! the largest tensors it has held at once), so it is the program's
//! choice, never a default, as `ferry::pipeline::retain_freed_memory` is.

/// The largest block kept for reuse (and the heap's free top kept before
/// it is trimmed).
pub const KEEP_UP_TO: i32 = 1 << 30;

/// Raises glibc's mmap and trim thresholds to [`KEEP_UP_TO`] for the
/// whole process, logging it; returns whether it did (off glibc it does
/// nothing).
pub fn retain_freed_memory() -> bool {
    let applied = set_thresholds();
    if applied {
        tracing::info!(
            keep_up_to = KEEP_UP_TO,
            "glibc keeps freed blocks for reuse (mmap and trim thresholds raised)"
        );
    }
    applied
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() -> bool {
    use std::ffi::c_int;
    // glibc's <malloc.h>.
    const M_TRIM_THRESHOLD: c_int = -1;
    const M_MMAP_THRESHOLD: c_int = -3;
    extern "C" {
        fn mallopt(param: c_int, value: c_int) -> c_int;
    }
    // SAFETY: mallopt only sets allocator parameters; any thread may call
    // it at any time (glibc takes its own locks).
    unsafe {
        mallopt(M_MMAP_THRESHOLD, KEEP_UP_TO) == 1 && mallopt(M_TRIM_THRESHOLD, KEEP_UP_TO) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_the_thresholds() {
        assert!(set_thresholds());
    }
}
