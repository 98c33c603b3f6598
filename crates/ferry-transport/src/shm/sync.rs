//! The one place that picks the atomics the ring uses: `std`'s normally,
//! loom's under `cfg(loom)` so the model checker sees every access.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64};

pub(crate) use std::sync::atomic::Ordering;

/// One byte of ring data. In shared memory it is a plain byte reached
/// through raw pointers; under loom it is a cell whose accesses loom checks
/// for races (a read of a byte not ordered after its write fails the model).
#[cfg(loom)]
pub(crate) type DataByte = loom::cell::UnsafeCell<u8>;
/// One byte of ring data (a plain byte in shared memory).
#[cfg(not(loom))]
pub(crate) type DataByte = u8;
