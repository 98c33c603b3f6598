//! Keeping freed tensor memory in the process.
//!
//! A pipeline step allocates and frees the same tensors every microbatch:
//! activations, output gradients and, above all, the weight gradients each
//! W (or B) produces before it accumulates them (4 MiB per
//! `Linear(1024, 1024)`). glibc's malloc serves blocks above its mmap
//! threshold (128 KiB, rising adaptively to at most 32 MiB) with fresh
//! `mmap`s and trims the heap's free top above 128 KiB, so each of those
//! tensors comes back as new pages that the kernel faults in and zeroes
//! one by one: about a tenth of a training step's time on the benchmark's
//! model. Raising both thresholds keeps freed blocks for the next
//! microbatch, as PyTorch users get by preloading jemalloc or tcmalloc.
//!
//! The thresholds alone do not cover the threads a worker computes on
//! (the RPC layer's blocking pool): glibc gives each new thread an arena of
//! its own, made of 64 MiB heaps that it unmaps as soon as one is wholly
//! free, whatever the trim threshold. A stage whose activations and
//! gradients outgrow one heap then maps, faults in and unmaps a heap every
//! microbatch (on the benchmark's model: 715k minor faults and 2.1 s of
//! system time in 60 steps, against 102k and 0.3 s in one arena). So the
//! tuning also keeps every thread in malloc's main arena ([`ARENA_MAX`]),
//! as PyTorch's own stages are, which run on Python's main thread.
//!
//! [`install`](crate::install) calls [`retain_freed_memory`] unless
//! `FERRY_PIPELINE_RETAIN_MEMORY=0`. The cost is that memory a worker freed
//! stays in its resident set, up to [`TRIM_THRESHOLD`] at the heap's top.

/// Blocks below this size are served from malloc's heaps and reused, not
/// mapped afresh.
pub const MMAP_THRESHOLD: usize = 256 << 20;
/// Free memory at a heap's top is returned to the kernel only above this.
pub const TRIM_THRESHOLD: usize = 1 << 30;
/// How many malloc arenas the process may have: one, so that every thread
/// allocates from the main heap, which honours [`TRIM_THRESHOLD`]. Takes
/// effect for threads that allocate for the first time after
/// [`retain_freed_memory`]: call it (or [`install`](crate::install))
/// before starting the RPC agent.
pub const ARENA_MAX: usize = 1;
/// The variable that turns the tuning off for [`install`](crate::install)
/// when set to `0`.
pub const RETAIN_MEMORY_ENV: &str = "FERRY_PIPELINE_RETAIN_MEMORY";

/// Sets this process's malloc to keep freed blocks of up to
/// [`MMAP_THRESHOLD`] for reuse, instead of returning them to the kernel
/// and faulting them in again on the next microbatch, on every thread
/// started afterwards ([`ARENA_MAX`]). Process-wide, and idempotent. Returns whether the allocator took the settings: `false`
/// off glibc (musl, other systems), where this does nothing.
///
/// ```
/// // A process that runs stages, or a one-process baseline measured
/// // against pipelined runs, calls it once at start.
/// let _tuned = ferry_pipeline::retain_freed_memory();
/// ```
pub fn retain_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; both values
        // fit in a c_int and are valid for these parameters.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int) == 1
                && libc::mallopt(libc::M_ARENA_MAX, ARENA_MAX as libc::c_int) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Whether [`install`](crate::install) should tune: unless the variable
/// says `0`.
pub(crate) fn wanted() -> bool {
    std::env::var(RETAIN_MEMORY_ENV).map_or(true, |v| v.trim() != "0")
}
