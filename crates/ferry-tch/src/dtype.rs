//! libtorch element types (`tch::Kind`) and Ferry's wire types (`DType`).

use ferry_wire::DType;
use tch::Kind;

/// The wire type of a libtorch kind. Quantized kinds (which need a scale
/// and zero point the wire does not carry) have none.
pub fn dtype_of(kind: Kind) -> Option<DType> {
    Some(match kind {
        Kind::Bool => DType::Bool,
        Kind::Uint8 => DType::U8,
        Kind::Int8 => DType::I8,
        Kind::Int16 => DType::I16,
        Kind::Int => DType::I32,
        Kind::Int64 => DType::I64,
        Kind::Half => DType::F16,
        Kind::BFloat16 => DType::BF16,
        Kind::Float => DType::F32,
        Kind::Double => DType::F64,
        Kind::ComplexHalf => DType::C32,
        Kind::ComplexFloat => DType::C64,
        Kind::ComplexDouble => DType::C128,
        Kind::Float8e5m2 => DType::F8E5M2,
        Kind::Float8e4m3fn => DType::F8E4M3FN,
        Kind::Float8e5m2fnuz => DType::F8E5M2FNUZ,
        Kind::Float8e4m3fnuz => DType::F8E4M3FNUZ,
        Kind::QInt8 | Kind::QUInt8 | Kind::QInt32 => return None,
    })
}

/// The libtorch kind of a wire type (every wire type has one).
pub fn kind_of(dtype: DType) -> Kind {
    match dtype {
        DType::Bool => Kind::Bool,
        DType::U8 => Kind::Uint8,
        DType::I8 => Kind::Int8,
        DType::I16 => Kind::Int16,
        DType::I32 => Kind::Int,
        DType::I64 => Kind::Int64,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
        DType::C32 => Kind::ComplexHalf,
        DType::C64 => Kind::ComplexFloat,
        DType::C128 => Kind::ComplexDouble,
        DType::F8E5M2 => Kind::Float8e5m2,
        DType::F8E4M3FN => Kind::Float8e4m3fn,
        DType::F8E5M2FNUZ => Kind::Float8e5m2fnuz,
        DType::F8E4M3FNUZ => Kind::Float8e4m3fnuz,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wire_type_round_trips_with_the_same_element_size() {
        for d in DType::ALL {
            let k = kind_of(d);
            assert_eq!(dtype_of(k), Some(d));
            assert_eq!(k.elt_size_in_bytes(), d.size(), "{d}");
        }
        assert_eq!(dtype_of(Kind::QInt8), None);
    }
}
