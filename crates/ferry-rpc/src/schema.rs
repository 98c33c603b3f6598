//! Schemas: the structure of remote functions' argument and result types,
//! as serde's data model sees them, for the callee's type check.
//!
//! A [`Schema`] type declares its [`Shape`] as a compile-time constant:
//! primitives, options, sequences, maps, tuples, and named structs and
//! enums with their field and variant names, in declaration order. A typed
//! call ([`Function`](crate::Function)) carries the [`hash`] of its
//! argument and result shapes; the callee compares it with its own
//! registration's and refuses a mismatch with an error that shows both
//! shapes as text. The shape depends on the declaration alone, never on
//! `std::any::type_name`, so two builds of a program made with different
//! compilers agree.
//!
//! Derive it beside serde's derives (it honours the serde attributes that
//! change what serde writes; see [`ferry_rpc_macros`]):
//!
//! ```
//! use ferry_rpc::schema::{self, Schema};
//!
//! #[derive(serde::Serialize, serde::Deserialize, Schema)]
//! struct Point {
//!     x: i64,
//!     y: i64,
//! }
//!
//! #[derive(serde::Serialize, serde::Deserialize, Schema)]
//! enum Op {
//!     Move(Point),
//!     #[serde(rename = "stop")]
//!     Stop,
//! }
//!
//! assert_eq!(Point::SHAPE.to_string(), "Point { x: i64, y: i64 }");
//! assert_eq!(
//!     Op::SHAPE.to_string(),
//!     "enum Op { Move(Point { x: i64, y: i64 }), stop }"
//! );
//! // A different layout, a different hash.
//! assert_ne!(schema::hash(<(i64, i64)>::SHAPE), schema::hash(Point::SHAPE));
//! ```
//!
//! Why not JSON Schema (`schemars`)? It describes a type's JSON form, where
//! fields are a map: a canonical JSON Schema loses the field order that
//! ferry's positional payload format (postcard) depends on, carries doc
//! comments as descriptions (editing a comment would change the
//! signature), is built at run time (a per-type cache on every call), and
//! its text is not promised stable between schemars versions, the very
//! problem `type_name` has between compilers. A [`Shape`] is serde's data
//! model, defined here, and its hash is computed by the compiler.

use std::fmt;

pub use ferry_rpc_macros::Schema;

/// A type whose structure a typed remote call checks: its [`Shape`] as
/// serde's data model sees it. Derive it (`#[derive(Schema)]`) or, for a
/// type with its own `Serialize` impl, write the shape serde produces.
///
/// ```
/// use ferry_rpc::schema::{Schema, Shape};
///
/// /// Serialised by hand as its number of milliseconds.
/// struct Millis(std::time::Duration);
///
/// impl Schema for Millis {
///     const SHAPE: &'static Shape = <u64 as Schema>::SHAPE;
/// }
/// assert_eq!(Millis::SHAPE.to_string(), "u64");
/// ```
pub trait Schema {
    /// The type's shape.
    const SHAPE: &'static Shape;
}

/// The structure of a type in serde's data model.
///
/// Names are the ones serde writes (after `rename`); `usize` and `isize`
/// are `u64` and `i64`, as serde writes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Shape {
    /// `bool`.
    Bool,
    /// `i8`.
    I8,
    /// `i16`.
    I16,
    /// `i32`.
    I32,
    /// `i64` (and `isize`).
    I64,
    /// `i128`.
    I128,
    /// `u8`.
    U8,
    /// `u16`.
    U16,
    /// `u32`.
    U32,
    /// `u64` (and `usize`).
    U64,
    /// `u128`.
    U128,
    /// `f32`.
    F32,
    /// `f64`.
    F64,
    /// `char`.
    Char,
    /// A string (`String`, `str`).
    String,
    /// A byte array written with `serialize_bytes`.
    Bytes,
    /// `()`.
    Unit,
    /// `Option<T>`.
    Option(&'static Shape),
    /// A sequence of any length (`Vec<T>`, `[T]`, sets, ...).
    Seq(&'static Shape),
    /// A map (`HashMap`, `BTreeMap`).
    Map {
        /// The keys' shape.
        key: &'static Shape,
        /// The values' shape.
        value: &'static Shape,
    },
    /// A tuple.
    Tuple(&'static [&'static Shape]),
    /// An array of a fixed length (`[T; N]`).
    Array {
        /// Its length.
        len: usize,
        /// Its items' shape.
        item: &'static Shape,
    },
    /// `struct Name;`.
    UnitStruct(&'static str),
    /// `struct Name(T);`.
    NewtypeStruct {
        /// The struct's name.
        name: &'static str,
        /// Its field's shape.
        inner: &'static Shape,
    },
    /// `struct Name(A, B, ..);`.
    TupleStruct {
        /// The struct's name.
        name: &'static str,
        /// Its fields' shapes.
        fields: &'static [&'static Shape],
    },
    /// `struct Name { a: A, .. }`.
    Struct {
        /// The struct's name.
        name: &'static str,
        /// Its fields.
        fields: &'static [Field],
    },
    /// `enum Name { .. }`.
    Enum {
        /// The enum's name.
        name: &'static str,
        /// Its variants (those serde writes).
        variants: &'static [Variant],
    },
    /// A type with a wire format of its own (a tensor, an RRef), known by
    /// its name and its type parameters' shapes.
    Opaque {
        /// The type's name.
        name: &'static str,
        /// Its type parameters' shapes.
        params: &'static [&'static Shape],
    },
    /// A reference back to the enclosing named type `name`, for recursive
    /// types (whose shape cannot contain itself).
    Recursive(&'static str),
}

/// A named field of a struct or a struct variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// The field's name, as serde writes it.
    pub name: &'static str,
    /// The field's shape.
    pub shape: &'static Shape,
}

/// A variant of an enum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    /// The index serde writes for it (its position among all the enum's
    /// variants, skipped ones included).
    pub index: u32,
    /// The variant's name, as serde writes it.
    pub name: &'static str,
    /// What it holds.
    pub data: VariantData,
}

/// What an enum variant holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VariantData {
    /// Nothing.
    Unit,
    /// One unnamed field.
    Newtype(&'static Shape),
    /// Several unnamed fields.
    Tuple(&'static [&'static Shape]),
    /// Named fields.
    Struct(&'static [Field]),
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
/// Put in front of every schema hash, so that it never equals a hash of
/// something else (the type-name signature of string-named calls).
const DOMAIN: &str = "ferry-schema-v1";

/// A stable 64-bit hash (FNV-1a) of a shape: its structure and names,
/// independent of the compiler, the platform and the crate's version
/// (until the encoding's version, `ferry-schema-v1`, changes).
///
/// ```
/// use ferry_rpc::schema::{hash, Schema};
///
/// const H: u64 = hash(<(i64, String)>::SHAPE); // computed by the compiler
/// assert_eq!(H, hash(<(i64, String)>::SHAPE));
/// assert_ne!(H, hash(<(String, i64)>::SHAPE));
/// ```
pub const fn hash(shape: &Shape) -> u64 {
    hash_shape(hash_str(FNV_OFFSET, DOMAIN), shape)
}

/// The hash of a function's signature: its argument and result shapes.
pub(crate) const fn hash_signature(args: &Shape, result: &Shape) -> u64 {
    let h = hash_str(FNV_OFFSET, DOMAIN);
    let h = hash_str(h, "fn");
    hash_shape(hash_shape(h, args), result)
}

const fn hash_byte(h: u64, b: u8) -> u64 {
    (h ^ b as u64).wrapping_mul(FNV_PRIME)
}

const fn hash_u64(mut h: u64, v: u64) -> u64 {
    let bytes = v.to_le_bytes();
    let mut i = 0;
    while i < bytes.len() {
        h = hash_byte(h, bytes[i]);
        i += 1;
    }
    h
}

const fn hash_str(mut h: u64, s: &str) -> u64 {
    let bytes = s.as_bytes();
    h = hash_u64(h, bytes.len() as u64);
    let mut i = 0;
    while i < bytes.len() {
        h = hash_byte(h, bytes[i]);
        i += 1;
    }
    h
}

const fn hash_shapes(mut h: u64, shapes: &[&Shape]) -> u64 {
    h = hash_u64(h, shapes.len() as u64);
    let mut i = 0;
    while i < shapes.len() {
        h = hash_shape(h, shapes[i]);
        i += 1;
    }
    h
}

const fn hash_fields(mut h: u64, fields: &[Field]) -> u64 {
    h = hash_u64(h, fields.len() as u64);
    let mut i = 0;
    while i < fields.len() {
        h = hash_str(h, fields[i].name);
        h = hash_shape(h, fields[i].shape);
        i += 1;
    }
    h
}

const fn hash_shape(h: u64, shape: &Shape) -> u64 {
    match shape {
        Shape::Bool => hash_byte(h, 1),
        Shape::I8 => hash_byte(h, 2),
        Shape::I16 => hash_byte(h, 3),
        Shape::I32 => hash_byte(h, 4),
        Shape::I64 => hash_byte(h, 5),
        Shape::I128 => hash_byte(h, 6),
        Shape::U8 => hash_byte(h, 7),
        Shape::U16 => hash_byte(h, 8),
        Shape::U32 => hash_byte(h, 9),
        Shape::U64 => hash_byte(h, 10),
        Shape::U128 => hash_byte(h, 11),
        Shape::F32 => hash_byte(h, 12),
        Shape::F64 => hash_byte(h, 13),
        Shape::Char => hash_byte(h, 14),
        Shape::String => hash_byte(h, 15),
        Shape::Bytes => hash_byte(h, 16),
        Shape::Unit => hash_byte(h, 17),
        Shape::Option(t) => hash_shape(hash_byte(h, 18), t),
        Shape::Seq(t) => hash_shape(hash_byte(h, 19), t),
        Shape::Map { key, value } => hash_shape(hash_shape(hash_byte(h, 20), key), value),
        Shape::Tuple(items) => hash_shapes(hash_byte(h, 21), items),
        Shape::Array { len, item } => hash_shape(hash_u64(hash_byte(h, 22), *len as u64), item),
        Shape::UnitStruct(name) => hash_str(hash_byte(h, 23), name),
        Shape::NewtypeStruct { name, inner } => hash_shape(hash_str(hash_byte(h, 24), name), inner),
        Shape::TupleStruct { name, fields } => {
            hash_shapes(hash_str(hash_byte(h, 25), name), fields)
        }
        Shape::Struct { name, fields } => hash_fields(hash_str(hash_byte(h, 26), name), fields),
        Shape::Enum { name, variants } => {
            let mut h = hash_str(hash_byte(h, 27), name);
            h = hash_u64(h, variants.len() as u64);
            let mut i = 0;
            while i < variants.len() {
                let v = &variants[i];
                h = hash_u64(h, v.index as u64);
                h = hash_str(h, v.name);
                h = match &v.data {
                    VariantData::Unit => hash_byte(h, 1),
                    VariantData::Newtype(t) => hash_shape(hash_byte(h, 2), t),
                    VariantData::Tuple(items) => hash_shapes(hash_byte(h, 3), items),
                    VariantData::Struct(fields) => hash_fields(hash_byte(h, 4), fields),
                };
                i += 1;
            }
            h
        }
        Shape::Opaque { name, params } => hash_shapes(hash_str(hash_byte(h, 28), name), params),
        Shape::Recursive(name) => hash_str(hash_byte(h, 29), name),
    }
}

/// Rust-like text: `(i64, String)`, `Option<[f32]>`, `Point { x: i64 }`,
/// `enum Op { Add(i64), Stop }`, `Tensor`, `RRef<i64>`.
impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let simple = match self {
            Shape::Bool => "bool",
            Shape::I8 => "i8",
            Shape::I16 => "i16",
            Shape::I32 => "i32",
            Shape::I64 => "i64",
            Shape::I128 => "i128",
            Shape::U8 => "u8",
            Shape::U16 => "u16",
            Shape::U32 => "u32",
            Shape::U64 => "u64",
            Shape::U128 => "u128",
            Shape::F32 => "f32",
            Shape::F64 => "f64",
            Shape::Char => "char",
            Shape::String => "String",
            Shape::Bytes => "bytes",
            Shape::Unit => "()",
            _ => "",
        };
        if !simple.is_empty() {
            return f.write_str(simple);
        }
        match self {
            Shape::Option(t) => write!(f, "Option<{t}>"),
            Shape::Seq(t) => write!(f, "[{t}]"),
            Shape::Map { key, value } => write!(f, "Map<{key}, {value}>"),
            Shape::Tuple(items) => write_list(f, "(", items, ")"),
            Shape::Array { len, item } => write!(f, "[{item}; {len}]"),
            Shape::UnitStruct(name) | Shape::Recursive(name) => f.write_str(name),
            Shape::NewtypeStruct { name, inner } => write!(f, "{name}({inner})"),
            Shape::TupleStruct { name, fields } => {
                f.write_str(name)?;
                write_list(f, "(", fields, ")")
            }
            Shape::Struct { name, fields } => {
                f.write_str(name)?;
                write_fields(f, fields)
            }
            Shape::Enum { name, variants } => {
                write!(f, "enum {name} {{")?;
                for (i, v) in variants.iter().enumerate() {
                    f.write_str(if i == 0 { " " } else { ", " })?;
                    f.write_str(v.name)?;
                    match &v.data {
                        VariantData::Unit => {}
                        VariantData::Newtype(t) => write!(f, "({t})")?,
                        VariantData::Tuple(items) => write_list(f, "(", items, ")")?,
                        VariantData::Struct(fields) => write_fields(f, fields)?,
                    }
                }
                f.write_str(if variants.is_empty() { "}" } else { " }" })
            }
            Shape::Opaque { name, params } => {
                f.write_str(name)?;
                if params.is_empty() {
                    Ok(())
                } else {
                    write_list(f, "<", params, ">")
                }
            }
            _ => Ok(()),
        }
    }
}

fn write_list(
    f: &mut fmt::Formatter<'_>,
    open: &str,
    items: &[&Shape],
    close: &str,
) -> fmt::Result {
    f.write_str(open)?;
    for (i, t) in items.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{t}")?;
    }
    if open == "(" && items.len() == 1 {
        // `(T,)` is a tuple; `(T)` would read as T.
        f.write_str(",")?;
    }
    f.write_str(close)
}

fn write_fields(f: &mut fmt::Formatter<'_>, fields: &[Field]) -> fmt::Result {
    if fields.is_empty() {
        return f.write_str(" {}");
    }
    f.write_str(" { ")?;
    for (i, field) in fields.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{}: {}", field.name, field.shape)?;
    }
    f.write_str(" }")
}

#[cfg(test)]
mod tests {
    use super::*;

    const PINNED_I64: u64 = 0x1664_3af1_75ad_ce37;
    const PINNED_PAIR: u64 = 0x6162_0772_4618_a17d;
    const PINNED_ADD: u64 = 0x812c_4d52_a11c_8a20;

    fn fnv(bytes: &[u8]) -> u64 {
        bytes.iter().fold(FNV_OFFSET, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(FNV_PRIME)
        })
    }

    fn text(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(s.as_bytes());
        v
    }

    /// The hash is the documented encoding's FNV-1a, and pinned: a build
    /// with another compiler, on another platform, computes the same
    /// values (they are part of the protocol).
    #[test]
    fn hashes_follow_the_encoding_and_are_pinned() {
        let mut i64_bytes = text(DOMAIN);
        i64_bytes.push(5);
        assert_eq!(hash(<i64 as Schema>::SHAPE), fnv(&i64_bytes));

        // (i64, String): tag 21, two items, i64 (5), String (15).
        let mut pair = text(DOMAIN);
        pair.push(21);
        pair.extend_from_slice(&2u64.to_le_bytes());
        pair.extend_from_slice(&[5, 15]);
        assert_eq!(hash(<(i64, String)>::SHAPE), fnv(&pair));

        assert_eq!(hash(<i64 as Schema>::SHAPE), PINNED_I64);
        assert_eq!(hash(<(i64, String)>::SHAPE), PINNED_PAIR);
        assert_eq!(
            hash_signature(<(i64, i64)>::SHAPE, <i64>::SHAPE),
            PINNED_ADD
        );
    }

    #[test]
    fn shapes_read_like_rust() {
        assert_eq!(<(i64, i64)>::SHAPE.to_string(), "(i64, i64)");
        assert_eq!(<(String,)>::SHAPE.to_string(), "(String,)");
        assert_eq!(<Vec<Option<f32>>>::SHAPE.to_string(), "[Option<f32>]");
        assert_eq!(<[u8; 4]>::SHAPE.to_string(), "[u8; 4]");
        assert_eq!(
            <std::collections::HashMap<String, Vec<u64>>>::SHAPE.to_string(),
            "Map<String, [u64]>"
        );
        assert_eq!(
            <Result<usize, String>>::SHAPE.to_string(),
            "enum Result { Ok(u64), Err(String) }"
        );
    }

    #[test]
    fn serde_equivalent_types_have_one_shape() {
        assert_eq!(<usize>::SHAPE, <u64>::SHAPE);
        assert_eq!(<&str>::SHAPE, <String>::SHAPE);
        assert_eq!(<Box<[i32]>>::SHAPE, <Vec<i32>>::SHAPE);
        assert_eq!(<std::sync::Arc<String>>::SHAPE, <String>::SHAPE);
    }
}
