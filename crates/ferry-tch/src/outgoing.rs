//! Sending: a tensor's bytes leave from its own storage (host memory, or a
//! CUDA tensor's device memory, which the `cuda_staged` and `cuda_ipc`
//! channels of ferry-transport's `cuda` feature read).

use std::ffi::CStr;

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
        let (shape, strides) = strided_view(tensor)?;
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
        let ptr = data_ptr(&tensor)?;
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

/// The error libtorch raised in the last call of torch-sys's C API on this
/// thread, if any (clearing it): its first line, without the C++ frames.
fn last_torch_error() -> Option<String> {
    // SAFETY: torch-sys returns null or a NUL-ended string allocated with
    // malloc, which the caller owns and frees.
    unsafe {
        let ptr = torch_sys::get_and_reset_last_err();
        if ptr.is_null() {
            return None;
        }
        let text = CStr::from_ptr(ptr).to_string_lossy().into_owned();
        libc::free(ptr.cast());
        Some(text.lines().next().unwrap_or_default().to_owned())
    }
}

/// The error for a tensor whose view libtorch could not give.
fn not_strided(tensor: &tch::Tensor, reason: String) -> TchError {
    TchError::NotStrided {
        layout: if tensor.is_sparse() { "sparse " } else { "" },
        reason,
    }
}

/// `tensor`'s sizes and strides, asked of libtorch fallibly: a tensor that
/// has none (sparse, nested, mkldnn) is [`TchError::NotStrided`], where
/// tch's `size()` and `stride()` would panic.
fn strided_view(tensor: &tch::Tensor) -> Result<(Vec<i64>, Vec<i64>), TchError> {
    let c = tensor.as_ptr() as *mut torch_sys::C_tensor;
    // SAFETY: `c` is a live tensor for the calls (`tensor` is borrowed);
    // `at_shape` and `at_stride` write `dim` values, and on a libtorch
    // error write nothing and leave the error for `last_torch_error`.
    let dim = unsafe { torch_sys::at_dim(c) };
    if let Some(e) = last_torch_error() {
        return Err(not_strided(tensor, e));
    }
    let mut shape = vec![0i64; dim];
    let mut strides = vec![0i64; dim];
    // SAFETY: as above; both buffers hold `dim` values.
    unsafe { torch_sys::at_shape(c, shape.as_mut_ptr()) };
    if let Some(e) = last_torch_error() {
        return Err(not_strided(tensor, e));
    }
    // SAFETY: as above.
    unsafe { torch_sys::at_stride(c, strides.as_mut_ptr()) };
    if let Some(e) = last_torch_error() {
        return Err(not_strided(tensor, e));
    }
    Ok((shape, strides))
}

/// `tensor`'s sizes, asked of libtorch fallibly (a sparse tensor has
/// them, though no strides).
pub(crate) fn sizes(tensor: &tch::Tensor) -> Result<Vec<i64>, TchError> {
    let c = tensor.as_ptr() as *mut torch_sys::C_tensor;
    // SAFETY: as in `strided_view`.
    let dim = unsafe { torch_sys::at_dim(c) };
    if let Some(e) = last_torch_error() {
        return Err(not_strided(tensor, e));
    }
    let mut shape = vec![0i64; dim];
    // SAFETY: as in `strided_view`; the buffer holds `dim` values.
    unsafe { torch_sys::at_shape(c, shape.as_mut_ptr()) };
    if let Some(e) = last_torch_error() {
        return Err(not_strided(tensor, e));
    }
    Ok(shape)
}

/// The address of `tensor`'s first element, asked of libtorch fallibly: a
/// tensor without storage is [`TchError::NotStrided`], where tch's
/// `data_ptr()` would panic.
fn data_ptr(tensor: &tch::Tensor) -> Result<*const u8, TchError> {
    // SAFETY: a live tensor (borrowed); on a libtorch error the call
    // returns null and leaves the error for `last_torch_error`.
    let ptr = unsafe { torch_sys::at_data_ptr(tensor.as_ptr() as *mut torch_sys::C_tensor) };
    match last_torch_error() {
        Some(e) => Err(not_strided(tensor, e)),
        None => Ok(ptr as *const u8),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tensor_without_strides_is_a_typed_error_not_a_panic() {
        let sparse =
            tch::Tensor::eye(3, (tch::Kind::Float, tch::Device::Cpu)).to_sparse_sparse_dim(2);
        match Outgoing::new(&sparse) {
            Err(TchError::NotStrided { layout, reason }) => {
                assert_eq!(layout, "sparse ");
                assert!(!reason.is_empty());
            }
            Err(e) => panic!("another error: {e}"),
            Ok(_) => panic!("a sparse tensor was taken as strided"),
        }
        // libtorch's error was taken: the next call sees none.
        assert!(last_torch_error().is_none());
        let dense = tch::Tensor::ones([2, 3], (tch::Kind::Float, tch::Device::Cpu));
        let out = Outgoing::new(&dense.tr()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(out.descriptor.strides.to_vec(), vec![1, 3]);
    }
}
