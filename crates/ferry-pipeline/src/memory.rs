//! Keeping freed tensor memory in the process: an explicit, process-wide
//! option ([`retain_freed_memory`]) that a program running stages turns on
//! itself. [`install`](crate::install) never changes the allocator.
//!
//! A pipeline step allocates and frees the same tensors every microbatch:
//! activations, output gradients and, above all, the weight gradients each
//! W (or B) produces before it accumulates them (4 MiB per
//! `Linear(1024, 1024)`). glibc's malloc serves blocks above its mmap
//! threshold (128 KiB, rising adaptively to at most 32 MiB) with fresh
//! `mmap`s and trims the heap's free top above 128 KiB, so each of those
//! tensors comes back as new pages that the kernel faults in and zeroes
//! one by one: about a tenth of a training step's time on
//! `pipeline_bench`'s model. Raising both thresholds keeps freed blocks
//! for the next microbatch, as PyTorch users get by preloading jemalloc
//! or tcmalloc.
//!
//! The thresholds alone do not cover the threads a worker computes on
//! (the RPC layer's blocking pool): glibc gives each new thread an arena of
//! its own, made of 64 MiB heaps that it unmaps as soon as one is wholly
//! free, whatever the trim threshold. A stage whose activations and
//! gradients outgrow one heap then maps, faults in and unmaps a heap every
//! microbatch (on `pipeline_bench`'s GPipe and 1F1B runs with 4
//! microbatches, about 7 times the minor page faults and of the system
//! time of one arena). So the option also keeps every thread in malloc's
//! main arena ([`ARENA_MAX`]), as PyTorch's own stages are, which run on
//! Python's main thread.
//!
//! The cost: it applies to the whole process (every library's allocations,
//! not only tensors'), and memory a worker freed stays in its resident
//! set, up to [`TRIM_THRESHOLD`] at the heap's top.

/// Blocks below this size are served from malloc's heaps and reused, not
/// mapped afresh.
pub const MMAP_THRESHOLD: usize = 256 << 20;
/// Free memory at a heap's top is returned to the kernel only above this.
pub const TRIM_THRESHOLD: usize = 1 << 30;
/// How many malloc arenas the process may have: one, so that every thread
/// allocates from the main heap, which honours [`TRIM_THRESHOLD`]. Takes
/// effect for threads that allocate for the first time after
/// [`retain_freed_memory`]: call it before starting the RPC agent.
pub const ARENA_MAX: usize = 1;

/// Why [`retain_freed_memory`] left the allocator as it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RetainMemoryError {
    /// The process's allocator is not glibc's malloc (musl, another
    /// system): there is nothing to tune.
    #[error("keeping freed memory needs glibc's malloc, which this process does not use")]
    Unsupported,
    /// glibc's `mallopt` refused a setting; those before it were applied.
    #[error("glibc's mallopt refused {parameter} = {value}")]
    Refused {
        /// The `mallopt` parameter (`"M_MMAP_THRESHOLD"`, ...).
        parameter: &'static str,
        /// The value it refused.
        value: usize,
    },
}

/// Sets this process's malloc to keep freed blocks of up to
/// [`MMAP_THRESHOLD`] for reuse, instead of returning them to the kernel
/// and faulting them in again on the next microbatch, on every thread
/// started afterwards ([`ARENA_MAX`]): the pipeline runtime's reference
/// page says what it saves and what it costs.
///
/// Nothing calls it for you: a program that runs stages (or a one-process
/// baseline measured against pipelined runs) calls it once, before it
/// starts the RPC agent. Process-wide and idempotent; logged at `info`
/// when applied.
///
/// ```
/// // Once, at the start of a worker that runs stages.
/// match ferry_pipeline::retain_freed_memory() {
///     Ok(()) => {}
///     // musl or another system: the default allocator stays.
///     Err(e) => eprintln!("{e}"),
/// }
/// ```
pub fn retain_freed_memory() -> Result<(), RetainMemoryError> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        for (parameter, code, value) in [
            ("M_MMAP_THRESHOLD", libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            ("M_TRIM_THRESHOLD", libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            ("M_ARENA_MAX", libc::M_ARENA_MAX, ARENA_MAX),
        ] {
            let refused = RetainMemoryError::Refused { parameter, value };
            let value = libc::c_int::try_from(value).map_err(|_| refused.clone())?;
            // SAFETY: mallopt only changes allocator parameters, and
            // these values are valid for them.
            if unsafe { libc::mallopt(code, value) } != 1 {
                return Err(refused);
            }
        }
        tracing::info!(
            mmap_threshold = MMAP_THRESHOLD,
            trim_threshold = TRIM_THRESHOLD,
            arena_max = ARENA_MAX,
            "malloc keeps freed memory for reuse, process-wide (ferry_pipeline::retain_freed_memory)"
        );
        Ok(())
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        Err(RetainMemoryError::Unsupported)
    }
}
