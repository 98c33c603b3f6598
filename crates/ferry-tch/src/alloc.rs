//! Receiving: each incoming tensor's bytes land straight in a freshly
//! allocated libtorch tensor, which the payload's tensor type then takes
//! as it is: a [`Tensor`](crate::Tensor) the libtorch tensor, a
//! [`RawTensor`] a view of the same memory (host tensors). Which one a
//! value asks for is up to its type, tensor by tensor, so one worker serves
//! functions of either kind, or of both at once, without a copy.

use std::any::Any;
use std::sync::Arc;

use ferry_transport::{
    host_destination_len, Allocator, RawTensor, RecvBuffer, Storage, TransportError, STORAGE_ALIGN,
};
use ferry_wire::{Limits, TensorDescriptor};

use crate::dtype::kind_of;

/// The receive hook of a worker that speaks libtorch: allocates a
/// `tch::Tensor` for each incoming tensor from its descriptor (the view's
/// own shape and strides), and the channel writes the bytes into it. No
/// intermediate buffer.
///
/// A host tensor finishes as a [`RawTensor`] whose [`Storage`] owns the
/// libtorch tensor ([`Storage::from_owner`]): a `RawTensor` in the payload
/// takes it as it is, and a [`Tensor`](crate::Tensor) takes the libtorch
/// tensor back out of it ([`Storage::into_owner`]); neither copies. A
/// tensor on a CUDA device, or one past the default `Limits` a `RawTensor`
/// keeps to, finishes as the libtorch tensor alone (a `RawTensor` holds
/// host memory only), which only a [`Tensor`](crate::Tensor) takes.
#[derive(Debug, Default, Clone, Copy)]
pub struct TchAllocator;

struct TchBuffer {
    /// The allocation the bytes go into: one-dimensional, `byte_len` bytes.
    storage: tch::Tensor,
    /// The view the sender sent, over `storage`.
    view: tch::Tensor,
    len: usize,
    /// Whether `storage` is on a CUDA device (the channel then fills it
    /// through its device address).
    on_device: bool,
    /// The descriptor of the view, on the host (for a `RawTensor` of it).
    descriptor: TensorDescriptor,
}

// SAFETY: the buffer owns its freshly allocated tensors; no other handle
// on them exists until `finish` hands the view over.
unsafe impl Send for TchBuffer {}

impl RecvBuffer for TchBuffer {
    fn as_mut_bytes(&mut self) -> &mut [u8] {
        if self.len == 0 || self.on_device {
            return &mut [];
        }
        // SAFETY: `storage` is a contiguous allocation of exactly `len`
        // bytes owned by this buffer, and `&mut self` makes this borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.storage.data_ptr() as *mut u8, self.len) }
    }

    fn device_ptr(&mut self) -> Option<u64> {
        self.on_device.then(|| self.storage.data_ptr() as u64)
    }

    fn finish(self: Box<Self>) -> Result<Box<dyn Any + Send>, TransportError> {
        let TchBuffer {
            storage,
            view,
            len,
            on_device,
            descriptor,
        } = *self;
        let ptr = if len == 0 {
            std::ptr::null_mut()
        } else {
            storage.data_ptr() as *mut u8
        };
        // The view keeps the storage alive.
        drop(storage);
        // What a `RawTensor` cannot hold stays a libtorch tensor alone: device
        // memory, a view past the default `Limits` that `RawTensor` keeps to
        // (this connection's may be raised), or memory not aligned to
        // `STORAGE_ALIGN` (libtorch's host allocator aligns to 64 bytes).
        if on_device
            || descriptor.validate(&Limits::default()).is_err()
            || ptr as usize % STORAGE_ALIGN != 0
        {
            return Ok(Box::new(Received(view)));
        }
        // SAFETY: `ptr` is the start of the allocation of `len` bytes that
        // `view` keeps alive, and `Landed` keeps `view` out of reach until
        // the storage gives it back (`into_owner`): while the storage holds
        // it, no one else reads or writes those bytes.
        let storage = unsafe { Storage::from_owner(ptr, len, Box::new(Landed(view))) }?;
        let raw = RawTensor::from_storage(Arc::new(storage), descriptor)?;
        Ok(Box::new(raw))
    }
}

/// A [`TchAllocator`] destination on a CUDA device, finished: the libtorch
/// tensor alone.
pub(crate) struct Received(pub(crate) tch::Tensor);

// SAFETY: a fresh tensor with no other handle; moved, never shared.
unsafe impl Send for Received {}

/// The owner of a host [`TchAllocator`] destination's memory, inside the
/// `RawTensor` it finishes as: the libtorch view over it.
pub(crate) struct Landed(pub(crate) tch::Tensor);

// SAFETY: the only handle on a fresh tensor; it is moved, and never read
// through a shared reference (the storage holding it exposes it only by
// giving it back, by value).
unsafe impl Send for Landed {}
// SAFETY: as above: no `&Landed` ever reaches the tensor.
unsafe impl Sync for Landed {}

/// Takes the libtorch tensor back out of a `RawTensor` that a
/// [`TchAllocator`] received into, without a copy; any other `RawTensor`
/// (another allocator's, or a shared one) comes back as it is.
pub(crate) fn take_landed(raw: RawTensor) -> Result<tch::Tensor, RawTensor> {
    raw.into_owner::<Landed>().map(|(landed, _)| landed.0)
}

/// Host destinations this large or larger are advised as transparent huge
/// pages ([`ferry_transport::advise_huge_pages`]): two huge pages.
const ADVISE_HUGE_PAGES_FROM: usize = 4 << 20;

impl Allocator for TchAllocator {
    fn allocate(
        &self,
        descriptor: &TensorDescriptor,
    ) -> Result<Box<dyn RecvBuffer>, TransportError> {
        // A CUDA tensor lands on the device the device maps chose (the
        // transport has checked that it exists here).
        let device = match descriptor.device {
            ferry_wire::Device::Cpu => tch::Device::Cpu,
            ferry_wire::Device::Cuda(i) => tch::Device::Cuda(usize::from(i)),
        };
        let on_device = device != tch::Device::Cpu;
        let host = ferry_wire::TensorDescriptor {
            device: ferry_wire::Device::Cpu,
            ..descriptor.clone()
        };
        let len = host_destination_len(&host, "ferry-tch's allocator")?;
        let kind = kind_of(descriptor.dtype);
        let esize = descriptor.dtype.size();
        let alloc = |what: &str, e: tch::TchError| {
            TransportError::Alloc(format!("libtorch could not allocate {what}: {e}"))
        };
        let (storage, view) = if descriptor.is_contiguous() {
            let t = tch::Tensor::f_empty(&descriptor.shape[..], (kind, device))
                .map_err(|e| alloc("the tensor", e))?;
            (t.shallow_clone(), t)
        } else {
            let elems = (len / esize) as i64;
            let storage = tch::Tensor::f_empty([elems], (kind, device))
                .map_err(|e| alloc("the tensor's storage", e))?;
            let view = storage
                .f_as_strided(
                    &descriptor.shape[..],
                    &descriptor.strides[..],
                    Some(descriptor.storage_offset),
                )
                .map_err(|e| alloc("the view", e))?;
            (storage, view)
        };
        // The bytes are about to land: in 2 MiB pages where THP allows
        // (a `cma` reader of them then walks 2 MiB pages too).
        if !on_device && len >= ADVISE_HUGE_PAGES_FROM {
            // SAFETY: the storage's `len` bytes are its live allocation.
            unsafe { ferry_transport::advise_huge_pages(storage.data_ptr().cast(), len) };
        }
        Ok(Box::new(TchBuffer {
            storage,
            view,
            len,
            on_device,
            descriptor: host,
        }))
    }
}
