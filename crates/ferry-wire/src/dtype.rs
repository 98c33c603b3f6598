//! Element types of tensors on the wire.

use serde::{Deserialize, Serialize};

use crate::WireError;

/// The element type of a tensor, with a stable one-byte code on the wire.
///
/// The set and the names follow PyTorch's `torch.dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum DType {
    /// `torch.bool`, one byte per element.
    Bool = 0,
    /// `torch.uint8`.
    U8 = 1,
    /// `torch.int8`.
    I8 = 2,
    /// `torch.int16`.
    I16 = 3,
    /// `torch.int32`.
    I32 = 4,
    /// `torch.int64`.
    I64 = 5,
    /// `torch.float16` (IEEE half).
    F16 = 6,
    /// `torch.bfloat16`.
    BF16 = 7,
    /// `torch.float32`.
    F32 = 8,
    /// `torch.float64`.
    F64 = 9,
}

impl DType {
    /// Every element type, in wire-code order.
    pub const ALL: [DType; 10] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// The one-byte wire code.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// Parses a wire code; unknown codes are an error naming the code.
    pub fn from_code(code: u8) -> Result<Self, WireError> {
        DType::ALL
            .get(usize::from(code))
            .copied()
            .ok_or(WireError::UnknownDType(code))
    }

    /// PyTorch's name for the type (`"float32"`, `"bfloat16"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_codes_fail() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()).unwrap(), d);
        }
        assert_eq!(DType::from_code(10), Err(WireError::UnknownDType(10)));
        assert_eq!(DType::from_code(255), Err(WireError::UnknownDType(255)));
    }
}
