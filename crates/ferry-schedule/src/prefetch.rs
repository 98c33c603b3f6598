//! A cache hint for the hot loops of lowering and simulation.
//!
//! Both walk one list per rank, a step on one rank, then a step on
//! another: with tens of ranks that is more streams than the CPU's own
//! prefetcher follows, and once a schedule outgrows the core's cache
//! (about 64 ranks × 256 microbatches) every new cache line of every list
//! would stall. The loops ask for the line a few actions ahead instead.

/// Asks the CPU to bring the cache line holding `value` into its caches.
/// A hint only: it changes no result, and does nothing off x86_64.
#[inline(always)]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` needs SSE, which every x86_64 CPU has (it is
    // part of the target's baseline); a prefetch reads nothing the program
    // sees and never faults, and `value` is a valid reference anyway.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// How many actions ahead of the one in hand the loops ask for: two cache
/// lines of 16-byte actions, far enough to arrive in time.
pub(crate) const AHEAD: usize = 8;

/// Prefetches the slot `AHEAD` places after `i` in `row`, if there is one.
#[inline(always)]
pub(crate) fn ahead<T>(row: &[T], i: usize) {
    if let Some(slot) = row.get(i + AHEAD) {
        prefetch(slot);
    }
}

/// Prefetches the place `AHEAD` pushes ahead in `list`, if its capacity
/// reaches that far.
#[inline(always)]
pub(crate) fn push_ahead<T>(list: &mut Vec<T>) {
    if let Some(slot) = list.spare_capacity_mut().get(AHEAD) {
        prefetch(slot);
    }
}
