//! The `cuda_ipc` channel's device side (feature `cuda`, one host only):
//! the sender exports the tensor's allocation as a CUDA IPC memory handle
//! and an interprocess event recorded after the work that produced the
//! bytes; the receiver opens both, makes its stream wait on the event
//! (`cuStreamWaitEvent`, no host sync) and copies device to device into
//! its destination. The sender keeps the buffer (and the event) alive until
//! the receiver acknowledged the copy, i.e. until [`IpcExport`] is dropped
//! after the ack.
//!
//! CUDA refuses to open a process's own IPC handles
//! (`CUDA_ERROR_INVALID_CONTEXT`), so two connections of one process (a
//! loopback pair, or two workers sharing a process) cannot use them. Every
//! export is therefore also registered in this process, by its event
//! handle; a receiver that finds the record there waits on the exporter's
//! own event and copies from its memory directly. Either way the copy is
//! bounded by the exported allocation: a record whose offset and length
//! reach outside it is refused before anything is copied.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::{result, sys};
use ferry_wire::payload::OutgoingTensor;

use super::driver::{text, DeviceContext};

/// Bytes of an encoded [`IpcRecord`].
pub const IPC_RECORD_LEN: usize = 64 + 64 + 8 + 8;

/// What travels from the sender to the receiver for one tensor: the
/// allocation's memory handle, the tensor's offset in it and length, and
/// the handle of the event to wait on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcRecord {
    /// `CUipcMemHandle` of the allocation holding the bytes.
    pub mem: [u8; 64],
    /// `CUipcEventHandle` of the event marking the bytes ready.
    pub event: [u8; 64],
    /// Offset of the bytes from the allocation's base.
    pub offset: u64,
    /// Bytes to copy.
    pub len: u64,
}

impl IpcRecord {
    /// Encodes the record (little-endian integers after the handles).
    pub fn encode(&self) -> [u8; IPC_RECORD_LEN] {
        let mut out = [0u8; IPC_RECORD_LEN];
        out[..64].copy_from_slice(&self.mem);
        out[64..128].copy_from_slice(&self.event);
        out[128..136].copy_from_slice(&self.offset.to_le_bytes());
        out[136..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Decodes a record; `None` unless `bytes` has exactly
    /// [`IPC_RECORD_LEN`] bytes.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != IPC_RECORD_LEN {
            return None;
        }
        let mut mem = [0u8; 64];
        let mut event = [0u8; 64];
        mem.copy_from_slice(&bytes[..64]);
        event.copy_from_slice(&bytes[64..128]);
        let word = |r: std::ops::Range<usize>| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[r]);
            u64::from_le_bytes(w)
        };
        Some(IpcRecord {
            mem,
            event,
            offset: word(128..136),
            len: word(136..144),
        })
    }
}

fn handle_bytes<T: Copy>(handle: &T) -> [u8; 64] {
    assert_eq!(
        std::mem::size_of::<T>(),
        64,
        "CUDA IPC handles are 64 bytes"
    );
    let mut out = [0u8; 64];
    // SAFETY: `T` is a 64-byte plain C struct (checked above).
    unsafe {
        std::ptr::copy_nonoverlapping((handle as *const T).cast::<u8>(), out.as_mut_ptr(), 64)
    };
    out
}

fn handle_from<T: Copy>(bytes: &[u8; 64], empty: T) -> T {
    assert_eq!(
        std::mem::size_of::<T>(),
        64,
        "CUDA IPC handles are 64 bytes"
    );
    let mut out = empty;
    // SAFETY: as in `handle_bytes`.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), (&mut out as *mut T).cast::<u8>(), 64) };
    out
}

/// An export as its own process sees it: the event and the allocation
/// (`CUevent` as an address: the map is shared between threads).
struct LocalExport {
    event: usize,
    base: sys::CUdeviceptr,
    size: usize,
}

/// This process's live exports, by their event handle's bytes. An entry
/// lives exactly as long as its [`IpcExport`]; a same-process receiver
/// copies while holding the lock, so an export cannot go mid-copy.
fn local_exports() -> MutexGuard<'static, HashMap<[u8; 64], LocalExport>> {
    static LOCAL: OnceLock<Mutex<HashMap<[u8; 64], LocalExport>>> = OnceLock::new();
    LOCAL
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Refuses a record whose bytes do not lie inside the `size`-byte
/// allocation they claim to come from.
fn check_range(record: &IpcRecord, size: usize) -> Result<(), String> {
    match record.offset.checked_add(record.len) {
        Some(end) if end <= size as u64 => Ok(()),
        _ => Err(format!(
            "the record's {} bytes at offset {} lie outside the exported allocation of {size} bytes",
            record.len, record.offset
        )),
    }
}

/// The sender's side of one `cuda_ipc` transfer; keeps the event alive
/// (the caller keeps the tensor's memory alive) until dropped, which it
/// must be only after the receiver's ack.
#[derive(Debug)]
pub struct IpcExport {
    event: sys::CUevent,
    record: IpcRecord,
}

// SAFETY: the event handle may be destroyed from any thread.
unsafe impl Send for IpcExport {}

impl IpcExport {
    /// Exports `len` bytes at device address `ptr` (on `ctx`'s device):
    /// records an interprocess event on `ctx`'s stream after the work
    /// queued so far, and takes the handles.
    ///
    /// # Safety
    /// `ptr` points to `len` bytes of device memory allocated with
    /// `cuMemAlloc` (IPC handles exist only for those) that stay allocated
    /// until the export is dropped.
    pub unsafe fn new(
        ctx: &DeviceContext,
        ptr: sys::CUdeviceptr,
        len: usize,
    ) -> Result<Self, String> {
        ctx.make_current()?;
        let mut base: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: out-parameters; `ptr` is device memory (caller).
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
            .result()
            .map_err(text)?;
        let mut mem = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
        // SAFETY: as above.
        unsafe { sys::cuIpcGetMemHandle(mem.as_mut_ptr(), base) }
            .result()
            .map_err(text)?;
        // SAFETY: written by the driver on success.
        let mem = unsafe { mem.assume_init() };
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        let mut event = std::ptr::null_mut();
        // SAFETY: an out-parameter.
        unsafe { sys::cuEventCreate(&mut event, flags) }
            .result()
            .map_err(text)?;
        let export = IpcExport {
            event,
            record: IpcRecord {
                mem: handle_bytes(&mem),
                event: [0; 64],
                offset: ptr - base,
                len: len as u64,
            },
        };
        // SAFETY: the event was just created; the stream is the context's.
        unsafe { result::event::record(export.event, ctx.stream()) }.map_err(text)?;
        let mut handle = std::mem::MaybeUninit::<sys::CUipcEventHandle>::zeroed();
        // SAFETY: an interprocess event of this process.
        unsafe { sys::cuIpcGetEventHandle(handle.as_mut_ptr(), export.event) }
            .result()
            .map_err(text)?;
        // SAFETY: written by the driver on success.
        let handle = unsafe { handle.assume_init() };
        let mut export = export;
        export.record.event = handle_bytes(&handle);
        local_exports().insert(
            export.record.event,
            LocalExport {
                event: export.event as usize,
                base,
                size,
            },
        );
        Ok(export)
    }

    /// The record to send to the receiver.
    pub fn record(&self) -> IpcRecord {
        self.record
    }
}

impl Drop for IpcExport {
    fn drop(&mut self) {
        // Waits for a same-process copy from this export to finish.
        local_exports().remove(&self.record.event);
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { result::event::destroy(self.event) };
    }
}

/// A tensor in flight on `cuda_ipc`: kept, with its export, in the
/// connection's pending map until the receiver's release names its token.
pub(crate) struct IpcKept {
    pub(crate) tensor: Arc<dyn OutgoingTensor>,
    pub(crate) _export: IpcExport,
}

impl OutgoingTensor for IpcKept {
    fn descriptor(&self) -> ferry_wire::TensorDescriptor {
        self.tensor.descriptor()
    }
    fn bytes(&self) -> &[u8] {
        self.tensor.bytes()
    }
    fn device_ptr(&self) -> Option<u64> {
        self.tensor.device_ptr()
    }
}

// SAFETY: the export holds an event handle, usable from any thread.
unsafe impl Sync for IpcExport {}

/// Receives one `cuda_ipc` transfer: opens the sender's handles, makes
/// `ctx`'s stream wait for the sender's event, copies `record.len` bytes
/// device to device into `dst`, waits for the copy and closes the handles.
/// A record exported by this very process is copied from the exporter's
/// memory after its event instead (CUDA does not open a process's own
/// handles). A record reaching outside the exported allocation is refused.
/// After it returns the sender may be acked.
///
/// # Safety
/// `dst` points to at least `record.len` bytes of device memory of `ctx`'s
/// device; the record came from an [`IpcExport`] on this host that is
/// still alive.
pub unsafe fn receive(
    ctx: &DeviceContext,
    record: &IpcRecord,
    dst: sys::CUdeviceptr,
) -> Result<(), String> {
    ctx.make_current()?;
    let len = usize::try_from(record.len).map_err(|e| e.to_string())?;
    {
        let local = local_exports();
        if let Some(export) = local.get(&record.event) {
            check_range(record, export.size)?;
            // SAFETY: the event and the allocation are the live export's
            // (its entry is held until the copy is done); the source range
            // lies inside the allocation (checked); `dst` as the caller
            // promised.
            return unsafe {
                copy_after(
                    ctx,
                    export.event as sys::CUevent,
                    export.base + record.offset,
                    dst,
                    len,
                )
            };
        }
    }
    // SAFETY: zeroed plain C structs, filled from the record's bytes.
    let (mem, event_handle) = unsafe {
        (
            handle_from(&record.mem, std::mem::zeroed::<sys::CUipcMemHandle>()),
            handle_from(&record.event, std::mem::zeroed::<sys::CUipcEventHandle>()),
        )
    };
    let mut base: sys::CUdeviceptr = 0;
    // SAFETY: an out-parameter; the handle is the sender's (caller).
    unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut base,
            mem,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    }
    .result()
    .map_err(text)?;
    let copied = (|| {
        let mut mapped_base: sys::CUdeviceptr = 0;
        let mut mapped: usize = 0;
        // SAFETY: out-parameters; `base` was just mapped.
        unsafe { sys::cuMemGetAddressRange_v2(&mut mapped_base, &mut mapped, base) }
            .result()
            .map_err(text)?;
        check_range(record, mapped)?;
        let mut event = std::ptr::null_mut();
        // SAFETY: an out-parameter.
        unsafe { sys::cuIpcOpenEventHandle(&mut event, event_handle) }
            .result()
            .map_err(text)?;
        // SAFETY: the event was just opened; the source range lies inside
        // the mapping (checked); `dst` as the caller promised.
        let done = unsafe { copy_after(ctx, event, base + record.offset, dst, len) };
        // SAFETY: opened above, destroyed once.
        let _ = unsafe { result::event::destroy(event) };
        done
    })();
    // Nothing reads the mapping any more (`copy_after` waited for the
    // stream, and nothing was queued if it did not run): it may go.
    // SAFETY: opened above, closed once.
    let closed = unsafe { sys::cuIpcCloseMemHandle(base) }
        .result()
        .map_err(text);
    copied.and(closed)
}

/// Makes `ctx`'s stream wait for `event`, copies `len` bytes device to
/// device from `src` to `dst` on it, and waits for the stream, also when
/// the copy could not be queued (so nothing is in flight afterwards).
///
/// # Safety
/// `event` is live; `src` and `dst` each hold `len` bytes of device memory
/// that stay allocated until this returns.
unsafe fn copy_after(
    ctx: &DeviceContext,
    event: sys::CUevent,
    src: sys::CUdeviceptr,
    dst: sys::CUdeviceptr,
    len: usize,
) -> Result<(), String> {
    // SAFETY: the caller's promises; the stream is ours.
    let queued = unsafe { sys::cuStreamWaitEvent(ctx.stream(), event, 0) }
        .result()
        // SAFETY: as above.
        .and_then(|()| unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, ctx.stream()) }.result())
        .map_err(text);
    let synced = ctx.synchronize();
    queued.and(synced)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_roundtrip_and_wrong_lengths_are_refused() {
        let r = IpcRecord {
            mem: [7; 64],
            event: [9; 64],
            offset: 4096,
            len: 1 << 30,
        };
        assert_eq!(IpcRecord::decode(&r.encode()), Some(r));
        assert_eq!(IpcRecord::decode(&r.encode()[1..]), None);
    }

    #[test]
    fn records_outside_their_allocation_are_refused() {
        let r = |offset, len| IpcRecord {
            mem: [0; 64],
            event: [0; 64],
            offset,
            len,
        };
        assert!(check_range(&r(0, 4096), 4096).is_ok());
        assert!(check_range(&r(4000, 96), 4096).is_ok());
        assert!(check_range(&r(0, 0), 0).is_ok());
        let e = check_range(&r(4000, 97), 4096).unwrap_err();
        assert!(e.contains("97 bytes at offset 4000"), "{e}");
        assert!(e.contains("4096 bytes"), "{e}");
        assert!(check_range(&r(u64::MAX, 2), 4096).is_err());
    }
}
