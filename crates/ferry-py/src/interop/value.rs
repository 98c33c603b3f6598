//! A value in serde's data model whose type is a described shape
//! ([`OwnedShape`]), not a Rust type: [`Dyn`]. It is encoded into the
//! layout the shape's Rust type has ([`Shaped`], a `Serialize` that makes
//! the serde calls that type's own impl makes) and decoded from it
//! ([`Seed`], a `DeserializeSeed`), so a Rust function receives its own
//! argument type and its result is read as it wrote it. Tensors inside
//! travel out of band as `ferry_tch::Tensor`s (a `RawTensor` shape's as
//! [`AsRaw`]: a `RawTensor`'s layout, no autograd metadata), RRefs as
//! forks ([`DynRRef`]).
//!
//! Names of structs, fields and variants are not part of the payload
//! format (postcard writes none, and the signature's hash pins them on
//! both sides), so the serde calls here name none; variants are written by
//! their serde index, structs as their fields in order.

use std::fmt;
use std::sync::Arc;

use ferry::rpc::describe::{OwnedShape, OwnedVariantData, ShapeNode};
use ferry::rref::DynRRef;
use ferry::tensor::{AsRaw, Tensor};
use serde::de::{
    self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor,
};
use serde::ser::{self, Serialize, SerializeMap, SerializeSeq, SerializeTuple, Serializer};
use serde::Deserialize;

/// How deep a value may nest (through a recursive shape) before encoding
/// or decoding refuses it: a bound on the stack either takes.
pub const MAX_DEPTH: usize = 128;

/// The longest fixed-size array (`[T; N]`) a described shape may have
/// for a value to be read by it.
pub const MAX_ARRAY_LEN: usize = 1 << 20;

/// A value of a described shape.
pub enum Dyn {
    /// `()`, a unit struct.
    Unit,
    /// `bool`.
    Bool(bool),
    /// A signed integer (its width is the shape's).
    Int(i128),
    /// An unsigned integer.
    UInt(u128),
    /// `f32` or `f64`.
    Float(f64),
    /// `char`.
    Char(char),
    /// A string.
    Str(String),
    /// A byte string (`Shape::Bytes`).
    Bytes(Vec<u8>),
    /// An `Option`.
    Option(Option<Box<Dyn>>),
    /// The items of a sequence, tuple or array, or the fields of a struct
    /// or tuple struct, in order.
    List(Vec<Dyn>),
    /// A map's entries.
    Map(Vec<(Dyn, Dyn)>),
    /// An enum's variant: its position among the shape's variants, and
    /// what it holds (`Unit`, the value, or a `List` of fields).
    Variant(usize, Box<Dyn>),
    /// A tensor (of a `Tensor` or a `RawTensor` shape).
    Tensor(Tensor),
    /// An RRef.
    RRef(DynRRef),
}

/// `value` as the node `node` of `shape` lays it out: what a call's
/// arguments or a function's result are serialised through.
pub struct Shaped<'a> {
    /// The shape.
    pub shape: &'a OwnedShape,
    /// The node of `shape` the value is.
    pub node: u32,
    /// The value.
    pub value: &'a Dyn,
    /// How deep inside the outermost value this one is.
    pub depth: usize,
}

impl<'a> Shaped<'a> {
    /// The value `value` of the whole shape `shape`.
    pub fn root(shape: &'a OwnedShape, value: &'a Dyn) -> Self {
        Shaped {
            shape,
            node: 0,
            value,
            depth: 0,
        }
    }

    fn at(&self, node: u32, value: &'a Dyn) -> Shaped<'a> {
        Shaped {
            shape: self.shape,
            node,
            value,
            depth: self.depth + 1,
        }
    }

    fn mismatch<E: ser::Error>(&self) -> E {
        ferry::wire::payload::custom_ser_error(format!(
            "a value that is not a {}",
            self.shape.node_text(self.node)
        ))
    }
}

/// A value with its shape, owned: a Python function's result on its way
/// to a Rust caller (a registered function's `Value`).
pub struct OwnedDyn {
    /// The shape.
    pub shape: Arc<OwnedShape>,
    /// The value, of the shape's root.
    pub value: Dyn,
}

impl Serialize for OwnedDyn {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Shaped::root(&self.shape, &self.value).serialize(s)
    }
}

/// Narrows an integer to the shape's width; the conversion from Python
/// checked the range, so a failure here is a value of another shape.
fn narrow<T: TryFrom<i128>, E: ser::Error>(v: i128, what: &str) -> Result<T, E> {
    T::try_from(v)
        .map_err(|_| ferry::wire::payload::custom_ser_error(format!("{v} is not an {what}")))
}

fn unarrow<T: TryFrom<u128>, E: ser::Error>(v: u128, what: &str) -> Result<T, E> {
    T::try_from(v)
        .map_err(|_| ferry::wire::payload::custom_ser_error(format!("{v} is not a {what}")))
}

impl Serialize for Shaped<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.depth > MAX_DEPTH {
            return Err(ferry::wire::payload::custom_ser_error(format!(
                "a value nested more than {MAX_DEPTH} deep"
            )));
        }
        match (self.shape.node(self.node), self.value) {
            (ShapeNode::Back(target), _) => self.at(*target, self.value).serialize(s),
            (ShapeNode::Bool, Dyn::Bool(b)) => s.serialize_bool(*b),
            (ShapeNode::I8, Dyn::Int(v)) => s.serialize_i8(narrow(*v, "i8")?),
            (ShapeNode::I16, Dyn::Int(v)) => s.serialize_i16(narrow(*v, "i16")?),
            (ShapeNode::I32, Dyn::Int(v)) => s.serialize_i32(narrow(*v, "i32")?),
            (ShapeNode::I64, Dyn::Int(v)) => s.serialize_i64(narrow(*v, "i64")?),
            (ShapeNode::I128, Dyn::Int(v)) => s.serialize_i128(*v),
            (ShapeNode::U8, Dyn::UInt(v)) => s.serialize_u8(unarrow(*v, "u8")?),
            (ShapeNode::U16, Dyn::UInt(v)) => s.serialize_u16(unarrow(*v, "u16")?),
            (ShapeNode::U32, Dyn::UInt(v)) => s.serialize_u32(unarrow(*v, "u32")?),
            (ShapeNode::U64, Dyn::UInt(v)) => s.serialize_u64(unarrow(*v, "u64")?),
            (ShapeNode::U128, Dyn::UInt(v)) => s.serialize_u128(*v),
            (ShapeNode::F32, Dyn::Float(v)) => s.serialize_f32(*v as f32),
            (ShapeNode::F64, Dyn::Float(v)) => s.serialize_f64(*v),
            (ShapeNode::Char, Dyn::Char(c)) => s.serialize_char(*c),
            (ShapeNode::String, Dyn::Str(v)) => s.serialize_str(v),
            (ShapeNode::Bytes, Dyn::Bytes(v)) => s.serialize_bytes(v),
            (ShapeNode::Unit, Dyn::Unit) => s.serialize_unit(),
            (ShapeNode::UnitStruct(_), Dyn::Unit) => s.serialize_unit_struct(""),
            (ShapeNode::Option(_), Dyn::Option(None)) => s.serialize_none(),
            (ShapeNode::Option(t), Dyn::Option(Some(v))) => s.serialize_some(&self.at(*t, v)),
            (ShapeNode::Seq(t), Dyn::List(items)) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(&self.at(*t, item))?;
                }
                seq.end()
            }
            (ShapeNode::Map { key, value }, Dyn::Map(entries)) => {
                let mut map = s.serialize_map(Some(entries.len()))?;
                for (k, v) in entries {
                    map.serialize_entry(&self.at(*key, k), &self.at(*value, v))?;
                }
                map.end()
            }
            (ShapeNode::Array { len, item }, Dyn::List(items)) if items.len() as u64 == *len => {
                let nodes = vec![*item; items.len()];
                self.tuple(s, &nodes, items)
            }
            (ShapeNode::Tuple(nodes), Dyn::List(items)) if items.len() == nodes.len() => {
                self.tuple(s, nodes, items)
            }
            (ShapeNode::TupleStruct { fields, .. }, Dyn::List(items))
                if items.len() == fields.len() =>
            {
                self.tuple(s, fields, items)
            }
            (ShapeNode::Struct { fields, .. }, Dyn::List(items)) if items.len() == fields.len() => {
                let nodes: Vec<u32> = fields.iter().map(|(_, t)| *t).collect();
                self.tuple(s, &nodes, items)
            }
            (ShapeNode::NewtypeStruct { inner, .. }, v) => {
                s.serialize_newtype_struct("", &self.at(*inner, v))
            }
            (ShapeNode::Enum { variants, .. }, Dyn::Variant(at, payload)) => {
                let Some(variant) = variants.get(*at) else {
                    return Err(self.mismatch());
                };
                let index = variant.index;
                match (&variant.data, &**payload) {
                    (OwnedVariantData::Unit, Dyn::Unit) => s.serialize_unit_variant("", index, ""),
                    (OwnedVariantData::Newtype(t), v) => {
                        s.serialize_newtype_variant("", index, "", &self.at(*t, v))
                    }
                    (OwnedVariantData::Tuple(nodes), Dyn::List(items))
                        if nodes.len() == items.len() =>
                    {
                        use serde::ser::SerializeTupleVariant;
                        let mut t = s.serialize_tuple_variant("", index, "", items.len())?;
                        for (node, item) in nodes.iter().zip(items) {
                            t.serialize_field(&self.at(*node, item))?;
                        }
                        t.end()
                    }
                    (OwnedVariantData::Struct(fields), Dyn::List(items))
                        if fields.len() == items.len() =>
                    {
                        use serde::ser::SerializeStructVariant;
                        let mut t = s.serialize_struct_variant("", index, "", items.len())?;
                        for ((_, node), item) in fields.iter().zip(items) {
                            t.serialize_field("", &self.at(*node, item))?;
                        }
                        t.end()
                    }
                    _ => Err(self.mismatch()),
                }
            }
            (ShapeNode::Opaque { name, .. }, Dyn::Tensor(t)) if name == "Tensor" => t.serialize(s),
            (ShapeNode::Opaque { name, .. }, Dyn::Tensor(t)) if name == "RawTensor" => {
                AsRaw(t.shallow_clone()).serialize(s)
            }
            (ShapeNode::Opaque { name, .. }, Dyn::RRef(r)) if name == "RRef" => r.serialize(s),
            _ => Err(self.mismatch()),
        }
    }
}

impl Shaped<'_> {
    /// Fields or items in order, as serde writes a tuple (and postcard a
    /// struct: the same bytes).
    fn tuple<S: Serializer>(&self, s: S, nodes: &[u32], items: &[Dyn]) -> Result<S::Ok, S::Error> {
        let mut t = s.serialize_tuple(items.len())?;
        for (node, item) in nodes.iter().zip(items) {
            t.serialize_element(&self.at(*node, item))?;
        }
        t.end()
    }
}

/// Decodes a value of node `node` of `shape` into a [`Dyn`].
#[derive(Clone, Copy)]
pub struct Seed<'a> {
    /// The shape.
    pub shape: &'a OwnedShape,
    /// The node to decode.
    pub node: u32,
    /// How deep inside the outermost value this one is.
    pub depth: usize,
}

impl<'a> Seed<'a> {
    /// The whole shape's value.
    pub fn root(shape: &'a OwnedShape) -> Self {
        Self::at_node(shape, 0)
    }

    /// The value of node `node` of `shape`.
    pub fn at_node(shape: &'a OwnedShape, node: u32) -> Self {
        Seed {
            shape,
            node,
            depth: 0,
        }
    }

    fn at(&self, node: u32) -> Seed<'a> {
        Seed {
            shape: self.shape,
            node,
            depth: self.depth + 1,
        }
    }
}

/// The most items preallocated for a sequence or map whose length came
/// from the peer.
const PREALLOCATE: usize = 1024;

/// Reads what a node is made of; `Seed` picks the serde call by the node,
/// this takes what it gives.
struct Reader<'a> {
    seed: Seed<'a>,
    /// The nodes of a tuple-like value's items (tuple, array, struct).
    items: Vec<u32>,
}

impl<'de> DeserializeSeed<'de> for Seed<'_> {
    type Value = Dyn;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Dyn, D::Error> {
        if self.depth > MAX_DEPTH {
            return Err(ferry::wire::payload::custom_error(format!(
                "a value nested more than {MAX_DEPTH} deep"
            )));
        }
        let reader = |items: Vec<u32>| Reader { seed: self, items };
        match self.shape.node(self.node) {
            ShapeNode::Back(target) => self.at(*target).deserialize(d),
            ShapeNode::Bool => d.deserialize_bool(reader(vec![])),
            ShapeNode::I8 => d.deserialize_i8(reader(vec![])),
            ShapeNode::I16 => d.deserialize_i16(reader(vec![])),
            ShapeNode::I32 => d.deserialize_i32(reader(vec![])),
            ShapeNode::I64 => d.deserialize_i64(reader(vec![])),
            ShapeNode::I128 => d.deserialize_i128(reader(vec![])),
            ShapeNode::U8 => d.deserialize_u8(reader(vec![])),
            ShapeNode::U16 => d.deserialize_u16(reader(vec![])),
            ShapeNode::U32 => d.deserialize_u32(reader(vec![])),
            ShapeNode::U64 => d.deserialize_u64(reader(vec![])),
            ShapeNode::U128 => d.deserialize_u128(reader(vec![])),
            ShapeNode::F32 => d.deserialize_f32(reader(vec![])),
            ShapeNode::F64 => d.deserialize_f64(reader(vec![])),
            ShapeNode::Char => d.deserialize_char(reader(vec![])),
            ShapeNode::String => d.deserialize_string(reader(vec![])),
            ShapeNode::Bytes => d.deserialize_byte_buf(reader(vec![])),
            ShapeNode::Unit => d.deserialize_unit(reader(vec![])),
            ShapeNode::UnitStruct(_) => d.deserialize_unit_struct("", reader(vec![])),
            ShapeNode::Option(_) => d.deserialize_option(reader(vec![])),
            ShapeNode::Seq(_) => d.deserialize_seq(reader(vec![])),
            ShapeNode::Map { .. } => d.deserialize_map(reader(vec![])),
            ShapeNode::Tuple(items) => d.deserialize_tuple(items.len(), reader(items.clone())),
            ShapeNode::Array { len, item } => {
                let len = usize::try_from(*len)
                    .ok()
                    .filter(|len| *len <= MAX_ARRAY_LEN)
                    .ok_or_else(|| {
                        de::Error::custom(format!("an array of more than {MAX_ARRAY_LEN} items"))
                    })?;
                d.deserialize_tuple(len, reader(vec![*item; len]))
            }
            ShapeNode::TupleStruct { fields, .. } => {
                d.deserialize_tuple_struct("", fields.len(), reader(fields.clone()))
            }
            // postcard reads a struct as the tuple of its fields.
            ShapeNode::Struct { fields, .. } => {
                let nodes: Vec<u32> = fields.iter().map(|(_, t)| *t).collect();
                d.deserialize_tuple(nodes.len(), reader(nodes))
            }
            ShapeNode::NewtypeStruct { .. } => d.deserialize_newtype_struct("", reader(vec![])),
            ShapeNode::Enum { .. } => d.deserialize_enum("", &[], reader(vec![])),
            ShapeNode::Opaque { name, .. } if name == "Tensor" => {
                Tensor::deserialize(d).map(Dyn::Tensor)
            }
            ShapeNode::Opaque { name, .. } if name == "RawTensor" => {
                AsRaw::deserialize(d).map(|t| Dyn::Tensor(Tensor::from(t.0)))
            }
            ShapeNode::Opaque { name, .. } if name == "RRef" => {
                DynRRef::deserialize(d).map(Dyn::RRef)
            }
            ShapeNode::Opaque { name, .. } => Err(ferry::wire::payload::custom_error(format!(
                "a {name} cannot be read without its Rust type"
            ))),
        }
    }
}

impl<'de> Visitor<'de> for Reader<'_> {
    type Value = Dyn;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a {}", self.seed.shape.node_text(self.seed.node))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Dyn, E> {
        Ok(Dyn::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Dyn, E> {
        Ok(Dyn::Int(v.into()))
    }
    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Dyn, E> {
        Ok(Dyn::Int(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Dyn, E> {
        Ok(Dyn::UInt(v.into()))
    }
    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Dyn, E> {
        Ok(Dyn::UInt(v))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Dyn, E> {
        Ok(Dyn::Float(v))
    }
    fn visit_char<E: de::Error>(self, v: char) -> Result<Dyn, E> {
        Ok(Dyn::Char(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Dyn, E> {
        Ok(Dyn::Str(v.to_string()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Dyn, E> {
        Ok(Dyn::Str(v))
    }
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Dyn, E> {
        Ok(Dyn::Bytes(v.to_vec()))
    }
    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Dyn, E> {
        Ok(Dyn::Bytes(v))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Dyn, E> {
        Ok(Dyn::Unit)
    }
    fn visit_none<E: de::Error>(self) -> Result<Dyn, E> {
        Ok(Dyn::Option(None))
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Dyn, D::Error> {
        let ShapeNode::Option(t) = self.seed.shape.node(self.seed.node) else {
            return Err(de::Error::custom("an option where the shape has none"));
        };
        Ok(Dyn::Option(Some(Box::new(
            self.seed.at(*t).deserialize(d)?,
        ))))
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Dyn, D::Error> {
        let ShapeNode::NewtypeStruct { inner, .. } = self.seed.shape.node(self.seed.node) else {
            return Err(de::Error::custom("a newtype where the shape has none"));
        };
        self.seed.at(*inner).deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Dyn, A::Error> {
        if let ShapeNode::Seq(t) = self.seed.shape.node(self.seed.node) {
            let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(PREALLOCATE));
            while let Some(item) = seq.next_element_seed(self.seed.at(*t))? {
                items.push(item);
            }
            return Ok(Dyn::List(items));
        }
        let mut items = Vec::with_capacity(self.items.len().min(PREALLOCATE));
        for (i, node) in self.items.iter().enumerate() {
            match seq.next_element_seed(self.seed.at(*node))? {
                Some(item) => items.push(item),
                None => return Err(de::Error::invalid_length(i, &self)),
            }
        }
        Ok(Dyn::List(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Dyn, A::Error> {
        let ShapeNode::Map { key, value } = self.seed.shape.node(self.seed.node) else {
            return Err(de::Error::custom("a map where the shape has none"));
        };
        let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(0).min(PREALLOCATE));
        while let Some(k) = map.next_key_seed(self.seed.at(*key))? {
            let v = map.next_value_seed(self.seed.at(*value))?;
            entries.push((k, v));
        }
        Ok(Dyn::Map(entries))
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Dyn, A::Error> {
        let ShapeNode::Enum { variants, .. } = self.seed.shape.node(self.seed.node) else {
            return Err(de::Error::custom("an enum where the shape has none"));
        };
        let (index, access) = data.variant_seed(VariantIndex)?;
        let Some(at) = variants.iter().position(|v| v.index == index) else {
            return Err(de::Error::custom(format!(
                "variant index {index} of {}, which has no such variant",
                self.seed.shape.node_text(self.seed.node)
            )));
        };
        let payload = match &variants[at].data {
            OwnedVariantData::Unit => {
                access.unit_variant()?;
                Dyn::Unit
            }
            OwnedVariantData::Newtype(t) => access.newtype_variant_seed(self.seed.at(*t))?,
            OwnedVariantData::Tuple(nodes) => access.tuple_variant(
                nodes.len(),
                Reader {
                    seed: self.seed,
                    items: nodes.clone(),
                },
            )?,
            // postcard reads a struct variant as the tuple of its fields.
            OwnedVariantData::Struct(fields) => {
                let nodes: Vec<u32> = fields.iter().map(|(_, t)| *t).collect();
                access.tuple_variant(
                    nodes.len(),
                    Reader {
                        seed: self.seed,
                        items: nodes,
                    },
                )?
            }
        };
        Ok(Dyn::Variant(at, Box::new(payload)))
    }
}

/// Reads a variant's serde index.
struct VariantIndex;

impl<'de> DeserializeSeed<'de> for VariantIndex {
    type Value = u32;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<u32, D::Error> {
        d.deserialize_u32(self)
    }
}

impl Visitor<'_> for VariantIndex {
    type Value = u32;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a variant index")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u32, E> {
        u32::try_from(v).map_err(|_| E::custom(format!("variant index {v}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry::rpc::schema::Schema;
    use ferry::wire::payload;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize, Schema)]
    struct Point {
        x: i64,
        y: Option<f32>,
        tags: Vec<String>,
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize, Schema)]
    enum Op {
        Add(i64),
        Scale { by: u8 },
        Pair(i16, char),
        Neg,
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize, Schema)]
    struct List {
        head: u32,
        tail: Option<Box<List>>,
    }

    type Value = (
        Point,
        Vec<Op>,
        std::collections::BTreeMap<String, (bool, u128)>,
        List,
    );

    fn sample() -> Value {
        (
            Point {
                x: -7,
                y: Some(1.5),
                tags: vec!["a".into(), "é".into()],
            },
            vec![
                Op::Add(3),
                Op::Scale { by: 200 },
                Op::Pair(-2, 'z'),
                Op::Neg,
            ],
            [("k".to_string(), (true, u128::MAX))].into_iter().collect(),
            List {
                head: 1,
                tail: Some(Box::new(List {
                    head: 2,
                    tail: None,
                })),
            },
        )
    }

    /// A value a Rust type wrote decodes by its described shape, and
    /// encodes back by it to the very same bytes, which the Rust type
    /// reads as the value it wrote.
    #[test]
    fn values_read_and_write_the_rust_types_layout() {
        let shape = OwnedShape::of(<Value as Schema>::SHAPE).unwrap();
        let encoded = payload::encode(&sample()).unwrap();
        let value = payload::decode_seed(Seed::root(&shape), &encoded.payload, Vec::new()).unwrap();
        let again = payload::encode(&Shaped::root(&shape, &value)).unwrap();
        assert_eq!(again.payload, encoded.payload);
        let back: Value = payload::decode(&again.payload, Vec::new()).unwrap();
        assert_eq!(back, sample());
    }

    /// Tensors of both kinds by their shapes: a `RawTensor`'s entry read
    /// and written as a `RawTensor` writes it, a `Tensor`'s with its
    /// autograd metadata; the bytes a Rust value wrote are written again,
    /// and read back as that value.
    #[test]
    fn tensors_and_raw_tensors_keep_their_layouts() {
        use ferry::tensor::{tch, TchAllocator};
        use ferry::transport::Allocator;

        type Tensors = (ferry::RawTensor, Tensor, Vec<ferry::RawTensor>);
        let loopback = |encoded: &payload::Encoded| -> Vec<payload::IncomingTensor> {
            encoded
                .tensors
                .iter()
                .map(|t| {
                    let descriptor = t.descriptor();
                    let mut dest = TchAllocator.allocate(&descriptor).unwrap();
                    dest.as_mut_bytes().copy_from_slice(t.bytes());
                    payload::IncomingTensor {
                        descriptor,
                        storage: dest.finish().unwrap(),
                    }
                })
                .collect()
        };
        let raw = |v: &[f32], shape: &[i64]| ferry::RawTensor::from_slice(v, shape).unwrap();
        let value: Tensors = (
            raw(&[1.0, 2.0, 3.0, 4.0], &[2, 2]),
            Tensor::from(
                tch::Tensor::from_slice(&[5i64, 6, 7, 8, 9, 10])
                    .reshape([2, 3])
                    .tr(),
            ),
            vec![raw(&[], &[0, 2]), raw(&[8.5], &[])],
        );
        let shape = OwnedShape::of(<Tensors as Schema>::SHAPE).unwrap();
        assert_eq!(shape.to_string(), "(RawTensor, Tensor, [RawTensor])");
        let encoded = payload::encode(&value).unwrap();
        let dynv =
            payload::decode_seed(Seed::root(&shape), &encoded.payload, loopback(&encoded)).unwrap();
        let again = payload::encode(&Shaped::root(&shape, &dynv)).unwrap();
        assert_eq!(again.payload, encoded.payload);
        let back: Tensors = payload::decode(&again.payload, loopback(&again)).unwrap();
        assert_eq!(back.0, value.0);
        assert!(back.1.equal(&value.1) && back.1.stride() == [1, 3]);
        assert_eq!(back.2, value.2);
    }

    /// Any bytes decode to a value or an error by any shape: never a panic,
    /// never a wait.
    #[test]
    fn any_bytes_give_a_value_or_an_error() {
        let shape = OwnedShape::of(<Value as Schema>::SHAPE).unwrap();
        let good = payload::encode(&sample()).unwrap().payload;
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..20_000 {
            let mut bytes = good.clone();
            match round % 3 {
                0 => {
                    let at = next() as usize % bytes.len();
                    bytes[at] = next() as u8;
                }
                1 => bytes.truncate(next() as usize % bytes.len()),
                _ => bytes = (0..next() % 64).map(|_| next() as u8).collect(),
            }
            let _ = payload::decode_seed(Seed::root(&shape), &bytes, Vec::new());
        }
    }

    /// A value nested past the bound is refused, not followed down.
    #[test]
    fn deep_values_are_refused() {
        let shape = OwnedShape::of(<List as Schema>::SHAPE).unwrap();
        let mut list = List {
            head: 0,
            tail: None,
        };
        for i in 1..(MAX_DEPTH as u32 * 2) {
            list = List {
                head: i,
                tail: Some(Box::new(list)),
            };
        }
        let encoded = payload::encode(&list).unwrap();
        let e = payload::decode_seed(Seed::root(&shape), &encoded.payload, Vec::new())
            .err()
            .expect("a list deeper than the bound decoded");
        assert!(e.to_string().contains("nested more than"), "{e}");
        // Dropped in a loop: a list this long would recurse on drop.
        let mut next = list.tail.take();
        while let Some(mut l) = next {
            next = l.tail.take();
        }
    }
}
