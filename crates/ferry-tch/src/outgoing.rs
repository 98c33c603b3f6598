//! Sending: a tensor's bytes leave from its own storage (host memory, or a
//! CUDA tensor's device memory, which the `cuda_staged` and `cuda_ipc`
//! channels of ferry-transport's `cuda` feature read).

use ferry_wire::payload::OutgoingTensor;
use ferry_wire::{Device, TensorDescriptor};

use crate::dtype::dtype_of;
use crate::TchError;

/// A tensor on its way out: a handle on the tensor (keeping its storage
/// alive until the channel is done) and the span of bytes that travels.
pub(crate) struct Outgoing {
    /// Keeps the storage `ptr` points into alive; never read or written
    /// through.
    _tensor: tch::Tensor,
    descriptor: TensorDescriptor,
    ptr: *const u8,
}

// SAFETY: `Outgoing` only reads the tensor's bytes through `ptr`, which
// points into the storage that `tensor` keeps alive; libtorch tensors may be
// read from several threads, and nothing here mutates the tensor.
unsafe impl Send for Outgoing {}
// SAFETY: as above: shared access is read-only.
unsafe impl Sync for Outgoing {}

impl Outgoing {
    /// Describes `tensor` for the wire. A non-contiguous view travels as the
    /// smallest span of its storage that covers it, with its strides, so it
    /// arrives as the same view; nothing is copied.
    pub(crate) fn new(tensor: &tch::Tensor) -> Result<Outgoing, TchError> {
        if !tensor.defined() {
            return Err(TchError::Undefined);
        }
        let device = match tensor.device() {
            tch::Device::Cpu => Device::Cpu,
            tch::Device::Cuda(i) => {
                let i = u16::try_from(i).map_err(|_| TchError::Device(format!("cuda:{i}")))?;
                Device::Cuda(i)
            }
            other => return Err(TchError::Device(format!("{other:?}"))),
        };
        let kind = tensor.f_kind()?;
        let dtype = dtype_of(kind).ok_or(TchError::Kind(kind))?;
        let shape = tensor.size();
        let strides = tensor.stride();
        let numel: i64 = shape.iter().product();
        // One past the last element, in elements, from the view's first one.
        let span = if numel == 0 {
            0
        } else {
            1 + shape
                .iter()
                .zip(&strides)
                .map(|(&n, &s)| (n - 1) * s)
                .sum::<i64>()
        };
        let descriptor = TensorDescriptor {
            dtype,
            shape: shape.into(),
            strides: strides.into(),
            storage_offset: 0,
            byte_len: span as u64 * dtype.size() as u64,
            device,
        };
        let tensor = tensor.shallow_clone();
        if let Device::Cuda(i) = device {
            // The channels copy on streams of their own: the work queued on
            // the device (on libtorch's streams) that produces these bytes
            // must be done first.
            tch::Cuda::synchronize(i64::from(i));
        }
        let ptr = tensor.data_ptr() as *const u8;
        Ok(Outgoing {
            _tensor: tensor,
            descriptor,
            ptr,
        })
    }
}

impl OutgoingTensor for Outgoing {
    fn descriptor(&self) -> TensorDescriptor {
        self.descriptor.clone()
    }

    fn device_ptr(&self) -> Option<u64> {
        self.cuda_ptr()
    }

    fn bytes(&self) -> &[u8] {
        if self.descriptor.byte_len == 0 || self.descriptor.device != Device::Cpu {
            return &[];
        }
        // SAFETY: `ptr` is the data pointer of the view's first element and
        // the descriptor's span (computed from the view's sizes and strides)
        // lies inside the storage `self._tensor` keeps alive.
        unsafe { std::slice::from_raw_parts(self.ptr, self.descriptor.byte_len as usize) }
    }
}

impl Outgoing {
    /// The device address of a CUDA tensor's bytes (the channel reads the
    /// descriptor's span there).
    fn cuda_ptr(&self) -> Option<u64> {
        (self.descriptor.device != Device::Cpu).then_some(self.ptr as u64)
    }
}
