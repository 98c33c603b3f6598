//! CUDA's driver API for the channels (feature `cuda`): the probe, a
//! device's primary context, pinned host staging memory, and the copy
//! engine of the `cuda_staged` channel.
//!
//! Everything here is reached only after [`super::availability`] said the
//! driver is loaded (cudarc panics on a call without it); the public
//! constructors check it themselves.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use std::any::Any;

use cudarc::driver::{result, sys};
use ferry_wire::payload::OutgoingTensor;
use ferry_wire::{Device, TensorDescriptor};

use crate::{Allocator, RawAllocator, RecvBuffer, TransportError};

use super::staged::{CopyEngine, StagedError, StagedOptions};
use super::CudaUnavailable;

/// The driver's error as text: the error's name and description.
pub(crate) fn text(e: result::DriverError) -> String {
    e.to_string()
}

/// Loads the driver, initialises it and counts the devices.
pub(super) fn probe() -> Result<usize, CudaUnavailable> {
    // SAFETY: only tries to open the library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaUnavailable::NoDriver);
    }
    result::init().map_err(|e| CudaUnavailable::Init(text(e)))?;
    let count = result::device::get_count().map_err(|e| CudaUnavailable::Init(text(e)))?;
    match usize::try_from(count) {
        Ok(0) | Err(_) => Err(CudaUnavailable::NoDevice),
        Ok(n) => Ok(n),
    }
}

/// The process's context for `device` (created once, then shared), made
/// current on the calling thread.
pub fn context(device: Device) -> Result<Arc<DeviceContext>, CudaUnavailable> {
    static CONTEXTS: OnceLock<Mutex<HashMap<Device, Arc<DeviceContext>>>> = OnceLock::new();
    let mut contexts = CONTEXTS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let ctx = match contexts.get(&device) {
        Some(ctx) => ctx.clone(),
        None => {
            let ctx = Arc::new(DeviceContext::new(device)?);
            contexts.insert(device, ctx.clone());
            ctx
        }
    };
    ctx.make_current().map_err(CudaUnavailable::Init)?;
    Ok(ctx)
}

/// A device's primary context made current on the calling thread, with a
/// stream of its own; released when dropped.
///
/// The stream is a blocking one (not `CU_STREAM_NON_BLOCKING`): its work is
/// ordered after the work queued before it on the legacy default stream,
/// which is where libtorch (and so `tch`) runs its kernels unless told
/// otherwise, and the other way round. A tensor a kernel is still writing
/// is therefore not copied out early, and one Ferry is filling is not read
/// early, without a host synchronisation. A GPU run found the need: with a
/// non-blocking stream, a device-to-host copy started right after an
/// upload read bytes the upload's DMA had not yet written.
#[derive(Debug)]
pub struct DeviceContext {
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    /// Pinned staging buffers of finished transfers, reused by the next
    /// ones (page-locking memory costs milliseconds).
    staging: Mutex<Vec<Pinned>>,
}

/// Pinned buffers a context keeps for reuse, at most.
const STAGING_KEPT: usize = 16;

// SAFETY: a primary context and a stream may be used from any thread once
// made current there (`make_current`); the handles are plain pointers and
// the driver's calls on them are thread-safe.
unsafe impl Send for DeviceContext {}
// SAFETY: as above.
unsafe impl Sync for DeviceContext {}

impl DeviceContext {
    /// Retains `device`'s primary context, makes it current on this
    /// thread and creates a stream.
    pub fn new(device: Device) -> Result<Self, CudaUnavailable> {
        super::check_device(device)?;
        let Device::Cuda(ordinal) = device else {
            return Err(CudaUnavailable::NoSuchDevice { device, count: 0 });
        };
        let init = |e| CudaUnavailable::Init(text(e));
        let dev = result::device::get(i32::from(ordinal)).map_err(init)?;
        // SAFETY: `dev` came from `device::get`.
        let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(init)?;
        // SAFETY: a context just retained.
        unsafe { result::ctx::set_current(ctx) }.map_err(init)?;
        let stream = result::stream::create(result::stream::StreamKind::Default).map_err(init)?;
        Ok(DeviceContext {
            device: dev,
            ctx,
            stream,
            staging: Mutex::new(Vec::new()),
        })
    }

    /// Makes the context current on the calling thread.
    pub fn make_current(&self) -> Result<(), String> {
        // SAFETY: the context is retained while `self` lives.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(text)
    }

    /// The context's stream.
    pub fn stream(&self) -> sys::CUstream {
        self.stream
    }

    /// Waits until all work on the stream is done.
    pub fn synchronize(&self) -> Result<(), String> {
        // SAFETY: a stream of this context.
        unsafe { result::stream::synchronize(self.stream) }.map_err(text)
    }

    /// Allocates `len` bytes of device memory (freed by the caller with
    /// [`DeviceContext::free`]).
    pub fn alloc(&self, len: usize) -> Result<sys::CUdeviceptr, String> {
        self.make_current()?;
        // SAFETY: the context is current.
        unsafe { result::malloc_sync(len.max(1)) }.map_err(text)
    }

    /// Frees device memory from [`DeviceContext::alloc`].
    ///
    /// # Safety
    /// `ptr` came from `alloc` of this context and is not used afterwards.
    pub unsafe fn free(&self, ptr: sys::CUdeviceptr) -> Result<(), String> {
        self.make_current()?;
        // SAFETY: the caller's promise.
        unsafe { result::free_sync(ptr) }.map_err(text)
    }

    /// Copies host bytes to device memory on the context's stream and waits
    /// until they are there (a synchronous copy from pageable memory may
    /// return before its DMA has landed).
    ///
    /// # Safety
    /// `dst` points to at least `src.len()` bytes of device memory.
    pub unsafe fn upload(&self, dst: sys::CUdeviceptr, src: &[u8]) -> Result<(), String> {
        self.make_current()?;
        // SAFETY: the caller's promise; the slice outlives the copy, which
        // is waited for below.
        unsafe { result::memcpy_htod_async(dst, src, self.stream) }.map_err(text)?;
        self.synchronize()
    }

    /// Copies device memory into host bytes on the context's stream (after
    /// the work queued there) and waits.
    ///
    /// # Safety
    /// `src` points to at least `dst.len()` bytes of device memory.
    pub unsafe fn download(&self, dst: &mut [u8], src: sys::CUdeviceptr) -> Result<(), String> {
        self.make_current()?;
        // SAFETY: the caller's promise; waited for below.
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream) }.map_err(text)?;
        self.synchronize()
    }
}

impl Drop for DeviceContext {
    fn drop(&mut self) {
        // SAFETY: the stream and the context were created in `new`.
        unsafe {
            let _ = result::ctx::set_current(self.ctx);
            let _ = result::stream::synchronize(self.stream);
            self.staging
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
            let _ = result::stream::synchronize(self.stream);
            let _ = result::stream::destroy(self.stream);
            let _ = result::primary_ctx::release(self.device);
        }
    }
}

/// Page-locked host memory, so device copies run asynchronously (DMA).
#[derive(Debug)]
struct Pinned {
    ptr: *mut u8,
    len: usize,
}

impl Pinned {
    fn new(len: usize) -> Result<Self, String> {
        // SAFETY: a fresh allocation; zeroed below before any read.
        let ptr = unsafe { result::malloc_host(len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(text)?
            .cast::<u8>();
        // SAFETY: `len` bytes were just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(Pinned { ptr, len })
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

// SAFETY: the pinned memory is owned by the value and only reached
// through it.
unsafe impl Send for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host`, freed once.
        let _ = unsafe { result::free_host(self.ptr.cast::<c_void>()) };
    }
}

/// The `cuda_staged` channel's copy engine: one device buffer, pinned
/// staging slots, and the copies issued on the context's stream with an
/// event recorded after each (a copy is waited for through its event, so
/// copies of later chunks keep running).
#[derive(Debug)]
pub struct CudaCopyEngine<'c> {
    ctx: &'c DeviceContext,
    device: sys::CUdeviceptr,
    capacity: usize,
    slots: Vec<Pinned>,
    events: Vec<sys::CUevent>,
}

// SAFETY: the raw pointers are a device address, pinned host memory owned
// by the engine and events; the context is made current before each use.
unsafe impl Send for CudaCopyEngine<'_> {}

impl<'c> CudaCopyEngine<'c> {
    /// An engine over `capacity` bytes of device memory at `device` (on
    /// `ctx`'s device), with `options.slots` pinned slots of
    /// `options.chunk_bytes` bytes.
    ///
    /// # Safety
    /// `device` points to `capacity` bytes of device memory of `ctx`'s
    /// device that stay allocated while the engine lives.
    pub unsafe fn new(
        ctx: &'c DeviceContext,
        device: sys::CUdeviceptr,
        capacity: usize,
        options: &StagedOptions,
    ) -> Result<Self, StagedError> {
        options.validate()?;
        ctx.make_current().map_err(StagedError::Copy)?;
        let mut slots = Vec::with_capacity(options.slots);
        let mut events = Vec::with_capacity(options.slots);
        let mut kept = ctx.staging.lock().unwrap_or_else(|p| p.into_inner());
        for _ in 0..options.slots {
            let reused = kept
                .iter()
                .position(|p| p.len == options.chunk_bytes)
                .map(|i| kept.swap_remove(i));
            slots.push(match reused {
                Some(p) => p,
                None => Pinned::new(options.chunk_bytes).map_err(StagedError::Copy)?,
            });
            events.push(
                result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| StagedError::Copy(text(e)))?,
            );
        }
        drop(kept);
        Ok(CudaCopyEngine {
            ctx,
            device,
            capacity,
            slots,
            events,
        })
    }

    fn check(&self, offset: usize, len: usize, slot: usize) -> Result<(), StagedError> {
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.capacity)
        {
            return Err(StagedError::OutOfRange {
                offset,
                len,
                capacity: self.capacity,
            });
        }
        if slot >= self.slots.len() || len > self.slots[slot].len {
            return Err(StagedError::Copy(format!(
                "{len} bytes do not fit staging slot {slot}"
            )));
        }
        self.ctx.make_current().map_err(StagedError::Copy)
    }

    fn record(&self, slot: usize) -> Result<usize, StagedError> {
        // SAFETY: an event of this engine on the context's stream.
        unsafe { result::event::record(self.events[slot], self.ctx.stream()) }
            .map_err(|e| StagedError::Copy(text(e)))?;
        Ok(slot)
    }
}

impl CopyEngine for CudaCopyEngine<'_> {
    /// The slot whose event marks the copy's end.
    type Pending = usize;

    fn slots(&self) -> usize {
        self.slots.len()
    }

    fn slot_len(&self) -> usize {
        self.slots.first().map_or(0, |s| s.len)
    }

    fn start_to_host(
        &mut self,
        offset: usize,
        len: usize,
        slot: usize,
    ) -> Result<usize, StagedError> {
        self.check(offset, len, slot)?;
        // SAFETY: range checked against the device buffer and the slot;
        // the slot is not touched by the host until the event completes.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                self.slots[slot].ptr.cast::<c_void>(),
                self.device + offset as u64,
                len,
                self.ctx.stream(),
            )
        }
        .result()
        .map_err(|e| StagedError::Copy(text(e)))?;
        self.record(slot)
    }

    fn start_to_device(
        &mut self,
        slot: usize,
        offset: usize,
        len: usize,
    ) -> Result<usize, StagedError> {
        self.check(offset, len, slot)?;
        // SAFETY: as in `start_to_host`.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                self.device + offset as u64,
                self.slots[slot].ptr.cast::<c_void>(),
                len,
                self.ctx.stream(),
            )
        }
        .result()
        .map_err(|e| StagedError::Copy(text(e)))?;
        self.record(slot)
    }

    fn wait(&mut self, slot: usize) -> Result<(), StagedError> {
        // SAFETY: an event of this engine.
        unsafe { result::event::synchronize(self.events[slot]) }
            .map_err(|e| StagedError::Copy(text(e)))
    }

    fn slot_mut(&mut self, slot: usize) -> &mut [u8] {
        self.slots[slot].bytes_mut()
    }
}

impl Drop for CudaCopyEngine<'_> {
    fn drop(&mut self) {
        // No copy may still run into or out of a slot when it is freed
        // or reused.
        let synced = self.ctx.synchronize().is_ok();
        for e in &self.events {
            // SAFETY: created in `new`, destroyed once.
            let _ = unsafe { result::event::destroy(*e) };
        }
        if synced {
            let mut kept = self.ctx.staging.lock().unwrap_or_else(|p| p.into_inner());
            for slot in self.slots.drain(..) {
                if kept.len() < STAGING_KEPT {
                    kept.push(slot);
                }
            }
        }
    }
}

/// A tensor in device memory owned by Ferry (allocated on a device's
/// context, freed when dropped): what [`CudaAllocator`] receives into, and
/// a CUDA tensor to send (it travels on `cuda_staged`).
#[derive(Debug)]
pub struct CudaTensor {
    ctx: Arc<DeviceContext>,
    ptr: sys::CUdeviceptr,
    descriptor: TensorDescriptor,
}

impl CudaTensor {
    /// Device memory for `descriptor` (its device must be `cuda:N`), not
    /// initialised.
    pub fn alloc(descriptor: TensorDescriptor) -> Result<Self, TransportError> {
        let ctx = context(descriptor.device)?;
        let len = usize::try_from(descriptor.byte_len).map_err(|_| {
            TransportError::Alloc(format!(
                "{} bytes do not fit in memory",
                descriptor.byte_len
            ))
        })?;
        let ptr = ctx.alloc(len).map_err(|e| {
            TransportError::Alloc(format!("{len} bytes on {}: {e}", descriptor.device))
        })?;
        Ok(CudaTensor {
            ctx,
            ptr,
            descriptor,
        })
    }

    /// A tensor on `device` holding `bytes` (copied there).
    pub fn from_host(
        device: Device,
        dtype: ferry_wire::DType,
        shape: &[i64],
        bytes: &[u8],
    ) -> Result<Self, TransportError> {
        let descriptor = TensorDescriptor::contiguous(dtype, shape, device);
        if descriptor.byte_len != bytes.len() as u64 {
            return Err(TransportError::InvalidTensor(format!(
                "{} bytes for a {}-byte tensor",
                bytes.len(),
                descriptor.byte_len
            )));
        }
        let t = Self::alloc(descriptor)?;
        // SAFETY: `t` holds `bytes.len()` bytes of device memory.
        unsafe { t.ctx.upload(t.ptr, bytes) }
            .map_err(|e| TransportError::Alloc(format!("upload to {device}: {e}")))?;
        Ok(t)
    }

    /// The tensor's bytes, copied to the host.
    pub fn to_host(&self) -> Result<Vec<u8>, TransportError> {
        let mut out = vec![0u8; self.descriptor.byte_len as usize];
        // SAFETY: the allocation holds `byte_len` bytes.
        unsafe { self.ctx.download(&mut out, self.ptr) }.map_err(|e| {
            TransportError::InvalidTensor(format!("download from {}: {e}", self.descriptor.device))
        })?;
        Ok(out)
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The context the memory belongs to.
    pub fn context(&self) -> &Arc<DeviceContext> {
        &self.ctx
    }

    /// The tensor's descriptor.
    pub fn descriptor(&self) -> &TensorDescriptor {
        &self.descriptor
    }
}

impl Drop for CudaTensor {
    fn drop(&mut self) {
        // Work queued on the stream may still read or write the memory.
        let _ = self.ctx.synchronize();
        // SAFETY: allocated by `alloc` on this context, freed once.
        let _ = unsafe { self.ctx.free(self.ptr) };
    }
}

impl OutgoingTensor for CudaTensor {
    fn descriptor(&self) -> TensorDescriptor {
        self.descriptor.clone()
    }
    fn bytes(&self) -> &[u8] {
        &[]
    }
    fn device_ptr(&self) -> Option<u64> {
        Some(self.ptr)
    }
}

impl RecvBuffer for CudaTensor {
    fn as_mut_bytes(&mut self) -> &mut [u8] {
        &mut []
    }
    fn device_ptr(&mut self) -> Option<u64> {
        Some(self.ptr)
    }
    fn finish(self: Box<Self>) -> Result<Box<dyn Any + Send>, TransportError> {
        Ok(self)
    }
}

/// An allocator that puts tensors landing on a CUDA device into
/// [`CudaTensor`]s and the others into [`RawTensor`](crate::RawTensor)s
/// (as [`RawAllocator`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct CudaAllocator;

impl Allocator for CudaAllocator {
    fn allocate(
        &self,
        descriptor: &TensorDescriptor,
    ) -> Result<Box<dyn RecvBuffer>, TransportError> {
        match descriptor.device {
            Device::Cpu => RawAllocator.allocate(descriptor),
            Device::Cuda(_) => Ok(Box::new(CudaTensor::alloc(descriptor.clone())?)),
        }
    }
}

/// Copies `len` bytes device to device on `ctx`'s stream and waits: the
/// reference the channels' bandwidth is measured against.
///
/// # Safety
/// Both addresses point to at least `len` bytes of device memory of
/// `ctx`'s device.
pub unsafe fn copy_device_to_device(
    ctx: &DeviceContext,
    dst: u64,
    src: u64,
    len: usize,
) -> Result<(), String> {
    ctx.make_current()?;
    // SAFETY: the caller's promise.
    unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, ctx.stream()) }
        .result()
        .map_err(text)?;
    ctx.synchronize()
}
