//! [`RawTensor`]: a host-memory tensor with no framework attached, the type
//! the layers above wrap (libtorch's tensors get their own later).

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

use ferry_wire::payload::{self, OutgoingTensor};
use ferry_wire::{contiguous_strides, DType, Device, Dims, TensorDescriptor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::pool::Block;
use crate::{BufferPool, TransportError};

/// Alignment of every [`Storage`] (enough for any element type and for SIMD).
pub const STORAGE_ALIGN: usize = 64;

/// A buffer aligned to [`STORAGE_ALIGN`]: zero-initialised heap memory
/// ([`Storage::zeroed`]), or a destination from a
/// [`BufferPool`] that goes back to its pool when dropped.
///
/// Large heap buffers come from `calloc`-style zeroed pages, so allocating
/// one costs no pass over its bytes.
pub struct Storage {
    ptr: NonNull<u8>,
    len: usize,
    pooled: Option<(Block, BufferPool)>,
}

// SAFETY: Storage owns its allocation exclusively; shared access is read-only
// through `&self` and mutation needs `&mut self`.
unsafe impl Send for Storage {}
// SAFETY: see above; no interior mutability.
unsafe impl Sync for Storage {}

impl Storage {
    /// Allocates `len` zeroed bytes.
    pub fn zeroed(len: usize) -> Result<Self, TransportError> {
        if len == 0 {
            return Ok(Self {
                ptr: NonNull::<u64>::dangling().cast(),
                len: 0,
                pooled: None,
            });
        }
        let layout = Layout::from_size_align(len, STORAGE_ALIGN)
            .map_err(|_| TransportError::Alloc(format!("{len} bytes is not a valid layout")))?;
        // SAFETY: layout has non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            TransportError::Alloc(format!("out of memory allocating {len} bytes"))
        })?;
        Ok(Self {
            ptr,
            len,
            pooled: None,
        })
    }

    /// The first `len` bytes of a pool block.
    pub(crate) fn pooled(block: Block, len: usize, pool: BufferPool) -> Self {
        Self {
            ptr: block.ptr(),
            len,
            pooled: Some((block, pool)),
        }
    }

    /// Makes the first `upto` bytes resident before they are written, for a
    /// storage from a [`BufferPool`] (one pass of huge-page faults instead
    /// of faults during the copy); does nothing for heap storage. The
    /// receive path calls it in step with the bytes that arrive.
    pub fn prepare(&mut self, upto: usize) {
        if let Some((block, _)) = self.pooled.as_mut() {
            block.populate(upto.min(self.len));
        }
    }

    /// Whether this storage came from a [`BufferPool`] (and returns to it).
    pub fn is_pooled(&self) -> bool {
        self.pooled.is_some()
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed or written) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the storage holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        if let Some((block, pool)) = self.pooled.take() {
            pool.give_back(block);
        } else if self.len > 0 {
            // SAFETY: allocated in `zeroed` with this exact layout.
            unsafe {
                std::alloc::dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.len, STORAGE_ALIGN),
                )
            }
        }
    }
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Storage({} bytes)", self.len)
    }
}

/// Rust element types that map to a [`DType`].
pub trait Element: Copy + Send + Sync + 'static {
    /// The matching dtype.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(bool => Bool, u8 => U8, i8 => I8, i16 => I16, i32 => I32, i64 => I64, f32 => F32, f64 => F64);

/// A host-memory tensor: shared storage plus a view (dtype, shape, strides,
/// offset). Cloning shares the storage.
///
/// Inside a Ferry payload it travels out of band: only its table index is in
/// the payload. On the wire, the smallest span of storage covering the view
/// travels, and the receiver gets the same shape and strides (offset rebased
/// to that span).
#[derive(Clone)]
pub struct RawTensor {
    storage: Arc<Storage>,
    desc: TensorDescriptor,
}

impl RawTensor {
    /// A contiguous tensor of zeros.
    pub fn zeros(dtype: DType, shape: &[i64]) -> Result<Self, TransportError> {
        let desc = TensorDescriptor::contiguous(dtype, shape, Device::Cpu);
        let storage = Storage::zeroed(desc.byte_len as usize)?;
        Ok(Self {
            storage: Arc::new(storage),
            desc,
        })
    }

    /// A contiguous tensor holding a copy of `data` with the given shape.
    pub fn from_slice<T: Element>(data: &[T], shape: &[i64]) -> Result<Self, TransportError> {
        // SAFETY: Element types are plain data with no padding.
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
        };
        Self::from_bytes(T::DTYPE, shape, bytes)
    }

    /// A contiguous tensor of `dtype` holding a copy of raw little-endian `bytes`
    /// (the way to build f16/bf16 tensors).
    pub fn from_bytes(dtype: DType, shape: &[i64], bytes: &[u8]) -> Result<Self, TransportError> {
        let mut t = Self::zeros(dtype, shape)?;
        if bytes.len() as u64 != t.desc.byte_len {
            return Err(TransportError::InvalidTensor(format!(
                "{} bytes given for a {dtype} tensor of shape {shape:?} ({} bytes)",
                bytes.len(),
                t.desc.byte_len
            )));
        }
        Arc::get_mut(&mut t.storage)
            .expect("freshly allocated storage is unshared")
            .as_bytes_mut()
            .copy_from_slice(bytes);
        Ok(t)
    }

    /// Wraps a storage with a view, checking that the view fits.
    pub fn from_storage(
        storage: Arc<Storage>,
        desc: TensorDescriptor,
    ) -> Result<Self, TransportError> {
        if desc.byte_len != storage.len() as u64 {
            return Err(TransportError::InvalidTensor(format!(
                "descriptor says {} bytes, storage has {}",
                desc.byte_len,
                storage.len()
            )));
        }
        desc.validate(&ferry_wire::Limits::default())?;
        Ok(Self { storage, desc })
    }

    /// A view of the same storage with another shape, strides and offset
    /// (in elements), like `torch.as_strided`.
    pub fn as_strided(
        &self,
        shape: &[i64],
        strides: &[i64],
        storage_offset: i64,
    ) -> Result<Self, TransportError> {
        let desc = TensorDescriptor {
            shape: Dims::from_slice(shape),
            strides: Dims::from_slice(strides),
            storage_offset,
            ..self.desc.clone()
        };
        Self::from_storage(self.storage.clone(), desc)
    }

    /// The transpose of a 2-D tensor (a non-contiguous view).
    pub fn t(&self) -> Result<Self, TransportError> {
        if self.desc.shape.len() != 2 {
            return Err(TransportError::InvalidTensor(format!(
                "t() needs a 2-D tensor, got shape {:?}",
                self.desc.shape
            )));
        }
        let (s, st) = (&self.desc.shape, &self.desc.strides);
        self.as_strided(&[s[1], s[0]], &[st[1], st[0]], self.desc.storage_offset)
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.desc.dtype
    }
    /// Shape.
    pub fn shape(&self) -> &[i64] {
        &self.desc.shape
    }
    /// Strides, in elements.
    pub fn strides(&self) -> &[i64] {
        &self.desc.strides
    }
    /// Offset of the first element in the storage, in elements.
    pub fn storage_offset(&self) -> i64 {
        self.desc.storage_offset
    }
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.desc.numel()
    }
    /// Whether the view is contiguous over its whole storage.
    pub fn is_contiguous(&self) -> bool {
        self.desc.is_contiguous()
    }
    /// The whole storage.
    pub fn storage(&self) -> &Arc<Storage> {
        &self.storage
    }

    /// The elements as a slice, when the tensor is contiguous and of type `T`.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        if T::DTYPE != self.desc.dtype || !self.is_contiguous() {
            return None;
        }
        let bytes = self.storage.as_bytes();
        // SAFETY: storage is STORAGE_ALIGN-aligned, holds numel elements of T,
        // and every bit pattern of these element types is valid except bool,
        // whose bytes only ever come from bools or the wire (checked below).
        let s = unsafe {
            std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), self.numel() as usize)
        };
        if T::DTYPE == DType::Bool && bytes.iter().any(|&b| b > 1) {
            return None;
        }
        Some(s)
    }

    /// The view's elements gathered in row-major order, as bytes (a copy).
    pub fn to_contiguous_bytes(&self) -> Vec<u8> {
        let es = self.desc.dtype.size();
        let bytes = self.storage.as_bytes();
        if self.is_contiguous() {
            let (start, end) = self.span();
            return bytes[start..end].to_vec();
        }
        let mut out = Vec::with_capacity(self.numel() as usize * es);
        let shape = &self.desc.shape;
        if shape.contains(&0) {
            return out;
        }
        let mut index = vec![0i64; shape.len()];
        loop {
            let elem: i64 = self.desc.storage_offset
                + index
                    .iter()
                    .zip(&self.desc.strides)
                    .map(|(i, s)| i * s)
                    .sum::<i64>();
            let at = elem as usize * es;
            out.extend_from_slice(&bytes[at..at + es]);
            // Advance the multi-index, last dimension fastest.
            let mut d = shape.len();
            loop {
                if d == 0 {
                    return out;
                }
                d -= 1;
                index[d] += 1;
                if index[d] < shape[d] {
                    break;
                }
                index[d] = 0;
            }
        }
    }

    /// The span of storage the view covers, as (first byte, end byte).
    fn span(&self) -> (usize, usize) {
        if self.desc.numel() == 0 {
            return (0, 0);
        }
        let es = self.desc.dtype.size();
        let start = self.desc.storage_offset as usize * es;
        // The view was validated, so required_bytes cannot fail.
        let end = self.desc.required_bytes().unwrap_or(0) as usize;
        (start, end)
    }

    /// A copy with contiguous storage (like `torch.contiguous`, but always copies).
    pub fn contiguous(&self) -> Result<Self, TransportError> {
        Self::from_bytes(
            self.desc.dtype,
            &self.desc.shape,
            &self.to_contiguous_bytes(),
        )
    }
}

impl OutgoingTensor for RawTensor {
    fn descriptor(&self) -> TensorDescriptor {
        let (start, end) = self.span();
        TensorDescriptor {
            storage_offset: 0,
            byte_len: (end - start) as u64,
            strides: if self.desc.numel() == 0 {
                contiguous_strides(&self.desc.shape)
            } else {
                self.desc.strides.clone()
            },
            ..self.desc.clone()
        }
    }

    fn bytes(&self) -> &[u8] {
        let (start, end) = self.span();
        &self.storage.as_bytes()[start..end]
    }
}

impl std::fmt::Debug for RawTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawTensor")
            .field("dtype", &self.desc.dtype)
            .field("shape", &self.desc.shape)
            .field("strides", &self.desc.strides)
            .field("storage_offset", &self.desc.storage_offset)
            .finish()
    }
}

/// Two tensors are equal when dtype, shape and every element's bytes match
/// (strides and storage may differ).
impl PartialEq for RawTensor {
    fn eq(&self, other: &Self) -> bool {
        self.desc.dtype == other.desc.dtype
            && self.desc.shape == other.desc.shape
            && self.to_contiguous_bytes() == other.to_contiguous_bytes()
    }
}

impl Serialize for RawTensor {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        payload::serialize_tensor(Arc::new(self.clone()), s)
    }
}

impl<'de> Deserialize<'de> for RawTensor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let incoming = payload::deserialize_tensor(d)?;
        let desc = incoming.descriptor;
        match incoming.storage.downcast::<RawTensor>() {
            Ok(t) => Ok(*t),
            Err(_) => Err(payload::custom_error::<D::Error>(format!(
                "received a {} tensor of shape {:?} into storage that is not a RawTensor \
                 (the receiving worker's allocator produced another type)",
                desc.dtype, desc.shape
            ))),
        }
    }
}
