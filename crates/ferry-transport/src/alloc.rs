//! The receive hook: the receiver allocates each tensor's destination from
//! its descriptor, and the channel writes the bytes straight into it.

use std::any::Any;
use std::sync::Arc;

use ferry_wire::TensorDescriptor;

use crate::{RawTensor, Storage, TransportError};

/// A destination for one incoming tensor's bytes.
pub trait RecvBuffer: Send {
    /// Exactly `descriptor.byte_len` bytes to be filled by the channel.
    fn as_mut_bytes(&mut self) -> &mut [u8];
    /// The channel is about to write the bytes up to `upto` (it fills a
    /// destination front to back, in steps, as the bytes arrive): a buffer
    /// that can make those pages resident in one pass does it here. Memory
    /// must not be committed for bytes that have not arrived: a peer may
    /// announce a large tensor and never send it. The default does nothing
    /// (pages fault in as they are written).
    fn prepare(&mut self, upto: usize) {
        let _ = upto;
    }
    /// The device address of a destination on a CUDA device (the
    /// descriptor's `byte_len` bytes there are filled; `as_mut_bytes` is
    /// then empty). `None` (the default) for host memory.
    fn device_ptr(&mut self) -> Option<u64> {
        None
    }
    /// Called once the bytes are in; returns the value that the payload's
    /// tensor type takes from the tensor table (e.g. a [`RawTensor`]).
    fn finish(self: Box<Self>) -> Result<Box<dyn Any + Send>, TransportError>;
}

/// Allocates destinations for incoming tensors. The layers above install
/// their own (libtorch allocates a fresh `Tensor`); the default produces
/// [`RawTensor`]s.
pub trait Allocator: Send + Sync + 'static {
    /// Allocates a destination for a tensor described by `descriptor`
    /// (already validated against the connection's limits).
    fn allocate(
        &self,
        descriptor: &TensorDescriptor,
    ) -> Result<Box<dyn RecvBuffer>, TransportError>;
}

/// The length in bytes of a host-memory destination for `descriptor`, for
/// allocators that serve only CPU tensors (`allocator` names the one asking,
/// in the error): another device, or a length that does not fit in this
/// process's address space, is an [`TransportError::Alloc`].
pub fn host_destination_len(
    descriptor: &TensorDescriptor,
    allocator: &str,
) -> Result<usize, TransportError> {
    if descriptor.device != ferry_wire::Device::Cpu {
        return Err(TransportError::Alloc(format!(
            "{allocator} serves cpu tensors only, got one on {}",
            descriptor.device
        )));
    }
    usize::try_from(descriptor.byte_len).map_err(|_| {
        TransportError::Alloc(format!(
            "{} bytes do not fit in memory",
            descriptor.byte_len
        ))
    })
}

/// The default allocator: aligned host memory from the process-wide
/// [`BufferPool`](crate::BufferPool) (reused for large tensors, and made
/// resident step by step as the bytes arrive), finished as [`RawTensor`].
#[derive(Debug, Default, Clone, Copy)]
pub struct RawAllocator;

struct RawBuffer {
    storage: Storage,
    descriptor: TensorDescriptor,
}

impl RecvBuffer for RawBuffer {
    fn as_mut_bytes(&mut self) -> &mut [u8] {
        self.storage.as_bytes_mut()
    }
    fn prepare(&mut self, upto: usize) {
        self.storage.prepare(upto);
    }
    fn finish(self: Box<Self>) -> Result<Box<dyn Any + Send>, TransportError> {
        let t = RawTensor::from_storage(Arc::new(self.storage), self.descriptor)?;
        Ok(Box::new(t))
    }
}

impl Allocator for RawAllocator {
    fn allocate(
        &self,
        descriptor: &TensorDescriptor,
    ) -> Result<Box<dyn RecvBuffer>, TransportError> {
        let len = host_destination_len(descriptor, "the raw allocator")?;
        Ok(Box::new(RawBuffer {
            storage: crate::BufferPool::global().storage(len)?,
            descriptor: descriptor.clone(),
        }))
    }
}
