//! Receiving: each incoming tensor's bytes land straight in a freshly
//! allocated libtorch tensor.

use std::any::Any;

use ferry_transport::{host_destination_len, Allocator, RecvBuffer, TransportError};
use ferry_wire::TensorDescriptor;

use crate::dtype::kind_of;

/// The receive hook of a worker that speaks libtorch: allocates a
/// `tch::Tensor` for each incoming tensor from its descriptor (the view's
/// own shape and strides), and the channel writes the bytes into it. No
/// intermediate buffer.
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
        Ok(Box::new(Received(self.view)))
    }
}

/// What a [`TchAllocator`] destination finishes as.
pub(crate) struct Received(pub(crate) tch::Tensor);

// SAFETY: a fresh tensor with no other handle; moved, never shared.
unsafe impl Send for Received {}

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
        Ok(Box::new(TchBuffer {
            storage,
            view,
            len,
            on_device,
        }))
    }
}
