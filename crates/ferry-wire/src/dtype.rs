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
    /// `torch.complex32` (two halves).
    C32 = 10,
    /// `torch.complex64` (two float32).
    C64 = 11,
    /// `torch.complex128` (two float64).
    C128 = 12,
    /// `torch.float8_e5m2`.
    F8E5M2 = 13,
    /// `torch.float8_e4m3fn`.
    F8E4M3FN = 14,
    /// `torch.float8_e5m2fnuz`.
    F8E5M2FNUZ = 15,
    /// `torch.float8_e4m3fnuz`.
    F8E4M3FNUZ = 16,
}

impl DType {
    /// Every element type, in wire-code order.
    pub const ALL: [DType; 17] = [
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
        DType::C32,
        DType::C64,
        DType::C128,
        DType::F8E5M2,
        DType::F8E4M3FN,
        DType::F8E5M2FNUZ,
        DType::F8E4M3FNUZ,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::Bool
            | DType::U8
            | DType::I8
            | DType::F8E5M2
            | DType::F8E4M3FN
            | DType::F8E5M2FNUZ
            | DType::F8E4M3FNUZ => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 | DType::C32 => 4,
            DType::I64 | DType::F64 | DType::C64 => 8,
            DType::C128 => 16,
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
            DType::C32 => "complex32",
            DType::C64 => "complex64",
            DType::C128 => "complex128",
            DType::F8E5M2 => "float8_e5m2",
            DType::F8E4M3FN => "float8_e4m3fn",
            DType::F8E5M2FNUZ => "float8_e5m2fnuz",
            DType::F8E4M3FNUZ => "float8_e4m3fnuz",
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
        assert_eq!(DType::from_code(17), Err(WireError::UnknownDType(17)));
        assert_eq!(DType::from_code(255), Err(WireError::UnknownDType(255)));
    }
}
