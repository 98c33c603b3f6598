//! [`RawTensor`]: a host-memory tensor with no framework attached, the type
//! the layers above wrap (libtorch's tensors get their own later).

use std::alloc::Layout;
use std::any::Any;
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
/// ([`Storage::zeroed`]), a destination from a [`BufferPool`] that goes
/// back to its pool when dropped, or memory another allocator made and an
/// owner value keeps alive ([`Storage::from_owner`]: a libtorch tensor's,
/// so that a received tensor lands once and is taken zero-copy as either a
/// [`RawTensor`] or the framework's own tensor).
///
/// Large heap buffers come from `calloc`-style zeroed pages, so allocating
/// one costs no pass over its bytes.
pub struct Storage {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

/// Who frees a [`Storage`]'s memory.
enum Backing {
    /// `std::alloc` with `STORAGE_ALIGN` (nothing to free when `len` is 0).
    Heap,
    /// A pool block, given back when the storage drops.
    Pooled(Block, BufferPool),
    /// Another allocator's memory, freed when its owner drops.
    Owned(Box<dyn Any + Send + Sync>),
}

// SAFETY: Storage owns its allocation exclusively (an owner's memory is
// the storage's alone while it holds the owner, by `from_owner`'s contract,
// and the owner is itself `Send + Sync`); shared access is read-only
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
                backing: Backing::Heap,
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
            backing: Backing::Heap,
        })
    }

    /// Wraps `len` bytes at `ptr` that another allocator made (a libtorch
    /// tensor's storage, say) and that `owner` keeps alive: the storage
    /// holds `owner` and drops it when it drops, which frees the memory.
    /// [`Storage::into_owner`] gives `owner` back. `ptr` is not read for an
    /// empty storage (it may be null).
    ///
    /// Fails with [`TransportError::Alloc`] when a non-empty `ptr` is null
    /// or not aligned to [`STORAGE_ALIGN`] (every storage is).
    ///
    /// # Safety
    ///
    /// For `len > 0`, `ptr` must be valid for reads and writes of `len`
    /// bytes for as long as `owner` lives, and no one else may read or
    /// write them (through `owner` or otherwise) while this storage holds
    /// `owner`.
    pub unsafe fn from_owner(
        ptr: *mut u8,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<Self, TransportError> {
        let ptr = if len == 0 {
            NonNull::<u64>::dangling().cast()
        } else {
            let ptr = NonNull::new(ptr).ok_or_else(|| {
                TransportError::Alloc(format!("a {len}-byte storage at a null address"))
            })?;
            if ptr.as_ptr() as usize % STORAGE_ALIGN != 0 {
                return Err(TransportError::Alloc(format!(
                    "a {len}-byte storage at {ptr:p}, not aligned to {STORAGE_ALIGN} bytes"
                )));
            }
            ptr
        };
        Ok(Self {
            ptr,
            len,
            backing: Backing::Owned(owner),
        })
    }

    /// The owner given to [`Storage::from_owner`], when it is a `T`: the
    /// memory belongs to it again. Any other storage (another owner's, the
    /// heap's, a pool's) comes back as it is.
    pub fn into_owner<T: Any>(mut self) -> Result<Box<T>, Storage> {
        match std::mem::replace(&mut self.backing, Backing::Heap) {
            Backing::Owned(owner) => match owner.downcast::<T>() {
                Ok(owner) => {
                    // Now an empty heap storage: dropping it frees nothing.
                    self.len = 0;
                    self.ptr = NonNull::<u64>::dangling().cast();
                    Ok(owner)
                }
                Err(owner) => {
                    self.backing = Backing::Owned(owner);
                    Err(self)
                }
            },
            other => {
                self.backing = other;
                Err(self)
            }
        }
    }

    /// The first `len` bytes of a pool block.
    pub(crate) fn pooled(block: Block, len: usize, pool: BufferPool) -> Self {
        Self {
            ptr: block.ptr(),
            len,
            backing: Backing::Pooled(block, pool),
        }
    }

    /// Makes the first `upto` bytes resident before they are written, for a
    /// storage from a [`BufferPool`] (one pass of huge-page faults instead
    /// of faults during the copy); does nothing for heap storage. The
    /// receive path calls it in step with the bytes that arrive.
    pub fn prepare(&mut self, upto: usize) {
        if let Backing::Pooled(block, _) = &mut self.backing {
            block.populate(upto.min(self.len));
        }
    }

    /// Whether this storage came from a [`BufferPool`] (and returns to it).
    pub fn is_pooled(&self) -> bool {
        matches!(self.backing, Backing::Pooled(..))
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
        match std::mem::replace(&mut self.backing, Backing::Heap) {
            Backing::Pooled(block, pool) => pool.give_back(block),
            // SAFETY: allocated in `zeroed` with this exact layout.
            Backing::Heap if self.len > 0 => unsafe {
                std::alloc::dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.len, STORAGE_ALIGN),
                )
            },
            // An owner frees its memory as it drops, here.
            Backing::Heap | Backing::Owned(_) => {}
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

    /// The owner of this tensor's memory and the view, when the storage is
    /// this tensor's alone (no clone shares it) and was made by
    /// [`Storage::from_owner`] with a `T`: how a framework's tensor type
    /// takes back, without a copy, a received tensor that its allocator
    /// landed in its own memory. Any other tensor comes back as it is.
    pub fn into_owner<T: Any>(self) -> Result<(Box<T>, TensorDescriptor), RawTensor> {
        let RawTensor { storage, desc } = self;
        let storage = match Arc::try_unwrap(storage) {
            Ok(storage) => storage,
            Err(storage) => return Err(RawTensor { storage, desc }),
        };
        match storage.into_owner::<T>() {
            Ok(owner) => Ok((owner, desc)),
            Err(storage) => Err(RawTensor {
                storage: Arc::new(storage),
                desc,
            }),
        }
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
            Err(_) if desc.device != Device::Cpu => {
                Err(payload::custom_error::<D::Error>(format!(
                    "received a {} tensor of shape {:?} on {} where a RawTensor was expected: \
                 a RawTensor holds host memory only",
                    desc.dtype, desc.shape, desc.device
                )))
            }
            Err(_) => Err(payload::custom_error::<D::Error>(format!(
                "received a {} tensor of shape {:?} into storage that is not a RawTensor \
                 (the receiving worker's allocator produced another type)",
                desc.dtype, desc.shape
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Memory from "another allocator": an aligned block that counts its drops.
    #[derive(Debug)]
    #[repr(align(64))]
    struct Aligned([u8; 256]);

    #[derive(Debug)]
    struct Owner {
        block: Box<Aligned>,
        drops: Arc<AtomicUsize>,
    }

    impl Drop for Owner {
        fn drop(&mut self) {
            self.drops.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn owned(drops: &Arc<AtomicUsize>) -> (Storage, *mut u8) {
        let mut block = Box::new(Aligned([0; 256]));
        for (i, b) in block.0.iter_mut().enumerate() {
            *b = i as u8;
        }
        let ptr = block.0.as_mut_ptr();
        let owner = Owner {
            block,
            drops: drops.clone(),
        };
        // SAFETY: the box's 256 bytes live as long as `owner`, and only the
        // storage touches them while it holds `owner`.
        let storage = unsafe { Storage::from_owner(ptr, 256, Box::new(owner)) }.unwrap();
        (storage, ptr)
    }

    /// A storage over an owner's memory reads that memory in place, gives
    /// the owner back unshared, and drops it exactly once.
    #[test]
    fn an_owners_memory_is_used_in_place_and_given_back() {
        let drops = Arc::new(AtomicUsize::new(0));
        let (storage, ptr) = owned(&drops);
        assert_eq!(storage.as_bytes().as_ptr(), ptr.cast_const());
        assert!(!storage.is_pooled());
        let desc = TensorDescriptor::contiguous(DType::F32, &[8, 8], Device::Cpu);
        let t = RawTensor::from_storage(Arc::new(storage), desc.clone()).unwrap();
        assert_eq!(t.to_contiguous_bytes(), (0..=255u8).collect::<Vec<_>>());
        // Shared, or asked for as another type: kept as it is.
        let shared = t.clone();
        let t = t.into_owner::<Owner>().unwrap_err();
        drop(shared);
        let t = t.into_owner::<String>().unwrap_err();
        assert_eq!(t.to_contiguous_bytes(), (0..=255u8).collect::<Vec<_>>());
        let (owner, back) = t.into_owner::<Owner>().unwrap();
        assert_eq!(back, desc);
        assert_eq!(drops.load(Ordering::SeqCst), 0, "given back, not dropped");
        assert_eq!(owner.block.0.as_ptr(), ptr.cast_const());
        drop(owner);
        assert_eq!(drops.load(Ordering::SeqCst), 1);

        let (storage, _) = owned(&drops);
        drop(storage);
        assert_eq!(drops.load(Ordering::SeqCst), 2, "dropped with the storage");
    }

    /// Memory that is not aligned to `STORAGE_ALIGN`, or a null address, is
    /// refused (and the owner dropped); an empty storage needs no address;
    /// a storage of this crate's own has no owner to give back.
    #[test]
    fn from_owner_checks_the_address_and_into_owner_keeps_other_storage() {
        let drops = Arc::new(AtomicUsize::new(0));
        let mut block = Box::new(Aligned([0; 256]));
        let ptr = block.0.as_mut_ptr();
        // SAFETY: refused before the memory is used.
        let err = unsafe { Storage::from_owner(ptr.wrapping_add(1), 8, Box::new(())) };
        assert!(
            err.unwrap_err().to_string().contains("not aligned to 64"),
            "misaligned"
        );
        // SAFETY: as above.
        let err = unsafe { Storage::from_owner(std::ptr::null_mut(), 8, Box::new(())) };
        assert!(err.unwrap_err().to_string().contains("null"));
        let owner = Owner {
            block,
            drops: drops.clone(),
        };
        // SAFETY: an empty storage reads nothing.
        let empty = unsafe { Storage::from_owner(std::ptr::null_mut(), 0, Box::new(owner)) };
        let empty = empty.unwrap();
        assert!(empty.is_empty() && empty.as_bytes().is_empty());
        drop(empty);
        assert_eq!(drops.load(Ordering::SeqCst), 1);

        let mut heap = Storage::zeroed(64).unwrap();
        heap.as_bytes_mut()[0] = 7;
        let heap = heap.into_owner::<Owner>().unwrap_err();
        assert_eq!(heap.as_bytes()[0], 7);
        assert_eq!(heap.len(), 64);
    }
}
