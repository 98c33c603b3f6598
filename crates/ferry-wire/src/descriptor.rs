//! Tensor descriptors: everything a receiver needs to allocate a tensor's
//! destination before its bytes arrive.

use smallvec::SmallVec;

use crate::{DType, Device, Limits, WireError};

/// A tensor's sizes or strides, one entry per dimension. Up to four
/// dimensions are stored inline, so describing a typical tensor allocates
/// nothing; it derefs to `[i64]` and converts from `Vec<i64>` and slices
/// (`Dims::from_slice`).
pub type Dims = SmallVec<[i64; 4]>;

/// Metadata of one tensor in a message: element type, view geometry, the
/// number of bytes that travel and the device they live on.
///
/// The bytes that travel are the smallest span of the tensor's storage that
/// covers the view; `storage_offset` and `strides` are relative to that span,
/// so a non-contiguous view arrives as the same view (strides are kept).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorDescriptor {
    /// Element type.
    pub dtype: DType,
    /// Size of each dimension.
    pub shape: Dims,
    /// Stride of each dimension, in elements.
    pub strides: Dims,
    /// Offset of the first element in the transferred bytes, in elements.
    pub storage_offset: i64,
    /// Number of bytes that travel for this tensor.
    pub byte_len: u64,
    /// Device of the bytes on the sender.
    pub device: Device,
}

/// Size of the fixed part of an encoded descriptor.
const FIXED_LEN: usize = 24;

impl TensorDescriptor {
    /// A contiguous (row-major) tensor whose bytes start at offset 0.
    pub fn contiguous(dtype: DType, shape: &[i64], device: Device) -> Self {
        let strides = contiguous_strides(shape);
        let numel: i64 = shape.iter().product();
        Self {
            dtype,
            shape: Dims::from_slice(shape),
            strides,
            storage_offset: 0,
            byte_len: (numel.max(0) as u64) * dtype.size() as u64,
            device,
        }
    }

    /// Number of elements of the view (product of the shape).
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d.max(0) as u64).product()
    }

    /// Whether the view is row-major contiguous starting at the first transferred byte.
    pub fn is_contiguous(&self) -> bool {
        self.storage_offset == 0
            && self.strides == contiguous_strides(&self.shape)
            && self.byte_len == self.numel() * self.dtype.size() as u64
    }

    /// Bytes the view needs: one past its highest element, in bytes.
    ///
    /// Errors on arithmetic overflow or negative fields.
    pub fn required_bytes(&self) -> Result<u64, WireError> {
        let bad = |m: &str| WireError::InvalidDescriptor(m.to_string());
        if self.shape.len() != self.strides.len() {
            return Err(bad("shape and strides have different lengths"));
        }
        if self.storage_offset < 0 {
            return Err(bad("negative storage offset"));
        }
        let mut numel: u64 = 1;
        let mut last: u64 = self.storage_offset as u64;
        for (&size, &stride) in self.shape.iter().zip(&self.strides) {
            if size < 0 {
                return Err(bad("negative dimension size"));
            }
            if stride < 0 {
                return Err(bad("negative stride"));
            }
            numel = numel
                .checked_mul(size as u64)
                .ok_or_else(|| bad("element count overflows"))?;
            if size > 0 {
                last = (size as u64 - 1)
                    .checked_mul(stride as u64)
                    .and_then(|x| x.checked_add(last))
                    .ok_or_else(|| bad("view extent overflows"))?;
            }
        }
        if numel == 0 {
            return Ok(0);
        }
        last.checked_add(1)
            .and_then(|n| n.checked_mul(self.dtype.size() as u64))
            .ok_or_else(|| bad("view extent overflows"))
    }

    /// Checks the descriptor against itself and the limits.
    pub fn validate(&self, limits: &Limits) -> Result<(), WireError> {
        if self.shape.len() > limits.max_dims {
            return Err(WireError::TooLarge {
                what: "tensor dimension count",
                len: self.shape.len() as u64,
                max: limits.max_dims as u64,
            });
        }
        if self.byte_len > limits.max_tensor_bytes {
            return Err(WireError::TooLarge {
                what: "tensor byte length",
                len: self.byte_len,
                max: limits.max_tensor_bytes,
            });
        }
        let need = self.required_bytes()?;
        if need > self.byte_len {
            return Err(WireError::InvalidDescriptor(format!(
                "view needs {need} bytes but only {} travel",
                self.byte_len
            )));
        }
        if self.byte_len % self.dtype.size() as u64 != 0 {
            return Err(WireError::InvalidDescriptor(format!(
                "byte length {} is not a multiple of the {} element size {}",
                self.byte_len,
                self.dtype,
                self.dtype.size()
            )));
        }
        Ok(())
    }

    /// Length of this descriptor once encoded.
    pub fn encoded_len(&self) -> usize {
        FIXED_LEN + 16 * self.shape.len()
    }

    /// Appends the binary encoding (little-endian) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let (tag, index) = self.device.encode();
        out.push(self.dtype.code());
        out.push(tag);
        out.extend_from_slice(&index.to_le_bytes());
        out.extend_from_slice(&(self.shape.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.storage_offset.to_le_bytes());
        out.extend_from_slice(&self.byte_len.to_le_bytes());
        for d in &self.shape {
            out.extend_from_slice(&d.to_le_bytes());
        }
        for s in &self.strides {
            out.extend_from_slice(&s.to_le_bytes());
        }
    }

    /// Decodes one descriptor from the front of `input`, returning it and the
    /// number of bytes it took. Validates it against `limits`.
    pub fn decode(input: &[u8], limits: &Limits) -> Result<(Self, usize), WireError> {
        let fixed = input.get(..FIXED_LEN).ok_or(WireError::Truncated {
            what: "tensor descriptor",
            needed: FIXED_LEN as u64,
            available: input.len() as u64,
        })?;
        let dtype = DType::from_code(fixed[0])?;
        let device = Device::decode(fixed[1], u16::from_le_bytes([fixed[2], fixed[3]]))?;
        let ndim = u32::from_le_bytes(le4(&fixed[4..8])) as usize;
        if ndim > limits.max_dims {
            return Err(WireError::TooLarge {
                what: "tensor dimension count",
                len: ndim as u64,
                max: limits.max_dims as u64,
            });
        }
        let storage_offset = i64::from_le_bytes(le8(&fixed[8..16]));
        let byte_len = u64::from_le_bytes(le8(&fixed[16..24]));
        let total = FIXED_LEN + 16 * ndim;
        let rest = input.get(FIXED_LEN..total).ok_or(WireError::Truncated {
            what: "tensor descriptor dimensions",
            needed: total as u64,
            available: input.len() as u64,
        })?;
        let (shape_bytes, stride_bytes) = rest.split_at(8 * ndim);
        let read = |b: &[u8]| -> Dims {
            b.chunks_exact(8)
                .map(|c| i64::from_le_bytes(le8(c)))
                .collect()
        };
        let desc = TensorDescriptor {
            dtype,
            shape: read(shape_bytes),
            strides: read(stride_bytes),
            storage_offset,
            byte_len,
            device,
        };
        desc.validate(limits)?;
        Ok((desc, total))
    }
}

/// Row-major strides for `shape`, in elements.
pub fn contiguous_strides(shape: &[i64]) -> Dims {
    let mut strides: Dims = smallvec::smallvec![0i64; shape.len()];
    let mut acc: i64 = 1;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(d.max(1));
    }
    strides
}

fn le4(b: &[u8]) -> [u8; 4] {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    a
}

fn le8(b: &[u8]) -> [u8; 8] {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_descriptor_round_trips() {
        let d = TensorDescriptor::contiguous(DType::F32, &[2, 3, 4], Device::Cpu);
        assert_eq!(d.strides[..], [12, 4, 1]);
        assert_eq!(d.byte_len, 96);
        assert!(d.is_contiguous());
        let mut buf = Vec::new();
        d.encode(&mut buf);
        assert_eq!(buf.len(), d.encoded_len());
        let (back, used) = TensorDescriptor::decode(&buf, &Limits::default()).unwrap();
        assert_eq!(back, d);
        assert_eq!(used, buf.len());
    }

    #[test]
    fn view_outside_its_bytes_is_rejected() {
        let mut d = TensorDescriptor::contiguous(DType::I64, &[4], Device::Cpu);
        d.storage_offset = 1;
        let err = d.validate(&Limits::default()).unwrap_err();
        assert!(err.to_string().contains("needs 40 bytes"), "{err}");
    }

    #[test]
    fn empty_and_transposed_views_are_valid() {
        let e = TensorDescriptor::contiguous(DType::F16, &[0, 5], Device::Cpu);
        assert_eq!(e.byte_len, 0);
        e.validate(&Limits::default()).unwrap();
        let t = TensorDescriptor {
            strides: [1, 3].into_iter().collect(),
            shape: [3, 2].into_iter().collect(),
            ..TensorDescriptor::contiguous(DType::F32, &[2, 3], Device::Cpu)
        };
        t.validate(&Limits::default()).unwrap();
        assert!(!t.is_contiguous());
    }
}
