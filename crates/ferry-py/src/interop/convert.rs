//! Python values to and from [`Dyn`]s, by a described shape: the mapping
//! between Python's types and serde's data model that calls between
//! Python and Rust functions use.
//!
//! | shape | Python |
//! |---|---|
//! | `bool` | `bool` |
//! | integers | `int` (not `bool`), range-checked |
//! | `f32`, `f64` | `float` (or `int`) |
//! | `char`, `String` | `str` (one character for `char`) |
//! | `bytes` | `bytes` (or `bytearray`) |
//! | `()`, unit struct | `None` |
//! | `Option<T>` | `None` or a `T` |
//! | `[T]` | `list` (or `tuple`; `bytes` for `[u8]`); read as `list` |
//! | tuple, tuple struct | `tuple` (or `list`); read as `tuple` |
//! | `[T; N]` | `list` (or `tuple`) of `N` |
//! | `Map<K, V>` | `dict` |
//! | `struct S { a, b }` | `dict` with exactly the keys `"a"`, `"b"` (or an object with those attributes); read as `dict` |
//! | newtype struct | its field's value |
//! | `enum`: unit variant | its name, `"Stop"` |
//! | `enum`: other variants | a one-entry `dict`, `{"Move": payload}` (a value, a `tuple`, a `dict`) |
//! | `Tensor`, `RawTensor` | `torch.Tensor` (out of band, no copy) |
//! | `RRef<T>` | `ferry.rpc.RRef` to a value a Rust function made |

use std::sync::Arc;

use ferry::rpc::describe::{OwnedShape, OwnedVariantData, ShapeNode};
use ferry::tensor::Tensor;
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple,
};

use crate::error::Error;
use crate::interop::value::{Dyn, MAX_DEPTH};
use crate::tensor;
use crate::wire::RustRRef;

/// Where in a value a conversion failed, and why.
#[derive(Debug)]
pub struct Mismatch {
    /// The path to the value (`[1].weights["w"]`), empty for the whole.
    pub path: String,
    /// What the shape wants there.
    pub expected: String,
    /// What was found.
    pub found: String,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path.is_empty() {
            write!(f, "expected {}, got {}", self.expected, self.found)
        } else {
            write!(
                f,
                "at {}: expected {}, got {}",
                self.path, self.expected, self.found
            )
        }
    }
}

/// A Python value described for an error: its type and a short `repr`.
fn describe(obj: &Bound<'_, PyAny>) -> String {
    let ty = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    let repr = obj
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "?".into());
    let mut repr: String = repr.chars().take(60).collect();
    if repr.len() < obj.repr().map(|r| r.to_string().len()).unwrap_or(0) {
        repr.push('…');
    }
    format!("{ty} {repr}")
}

/// Converts Python values into [`Dyn`]s of one shape.
pub struct ToDyn<'a> {
    shape: &'a OwnedShape,
    path: Vec<String>,
}

impl<'a> ToDyn<'a> {
    /// A converter to values of `shape`.
    pub fn new(shape: &'a OwnedShape) -> Self {
        ToDyn {
            shape,
            path: Vec::new(),
        }
    }

    fn mismatch(&self, node: u32, found: String) -> Mismatch {
        Mismatch {
            path: self.path.concat(),
            expected: self.shape.node_text(node),
            found,
        }
    }

    /// `obj` as a value of node `node`.
    pub fn convert(&mut self, obj: &Bound<'_, PyAny>, node: u32) -> Result<Dyn, Mismatch> {
        if self.path.len() > MAX_DEPTH {
            return Err(self.mismatch(node, format!("a value nested more than {MAX_DEPTH} deep")));
        }
        let wrong = |me: &Self| me.mismatch(node, describe(obj));
        let is_int = obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>();
        let shape_node = self.shape.node(node).clone();
        match &shape_node {
            ShapeNode::Back(target) => self.convert(obj, *target),
            ShapeNode::Bool => obj
                .cast::<PyBool>()
                .map(|b| Dyn::Bool(b.is_true()))
                .map_err(|_| wrong(self)),
            ShapeNode::I8 | ShapeNode::I16 | ShapeNode::I32 | ShapeNode::I64 | ShapeNode::I128 => {
                let (lo, hi) = signed_range(&shape_node);
                match is_int.then(|| obj.extract::<i128>().ok()).flatten() {
                    Some(v) if v >= lo && v <= hi => Ok(Dyn::Int(v)),
                    Some(_) => {
                        Err(self.mismatch(node, format!("{} (out of range)", describe(obj))))
                    }
                    None if is_int => {
                        Err(self.mismatch(node, format!("{} (out of range)", describe(obj))))
                    }
                    None => Err(wrong(self)),
                }
            }
            ShapeNode::U8 | ShapeNode::U16 | ShapeNode::U32 | ShapeNode::U64 | ShapeNode::U128 => {
                let hi = unsigned_max(&shape_node);
                match is_int.then(|| obj.extract::<u128>().ok()).flatten() {
                    Some(v) if v <= hi => Ok(Dyn::UInt(v)),
                    _ if is_int => {
                        Err(self.mismatch(node, format!("{} (out of range)", describe(obj))))
                    }
                    _ => Err(wrong(self)),
                }
            }
            ShapeNode::F32 | ShapeNode::F64 => {
                if obj.is_instance_of::<PyFloat>() || is_int {
                    obj.extract::<f64>()
                        .map(Dyn::Float)
                        .map_err(|_| wrong(self))
                } else {
                    Err(wrong(self))
                }
            }
            ShapeNode::Char => {
                let s = obj.cast::<PyString>().map_err(|_| wrong(self))?;
                let s = s.to_str().map_err(|_| wrong(self))?;
                let mut chars = s.chars();
                match (chars.next(), chars.next()) {
                    (Some(c), None) => Ok(Dyn::Char(c)),
                    _ => Err(wrong(self)),
                }
            }
            ShapeNode::String => obj
                .cast::<PyString>()
                .ok()
                .and_then(|s| s.to_str().ok().map(|s| Dyn::Str(s.to_string())))
                .ok_or_else(|| wrong(self)),
            ShapeNode::Bytes => bytes_of(obj).map(Dyn::Bytes).ok_or_else(|| wrong(self)),
            ShapeNode::Unit | ShapeNode::UnitStruct(_) => {
                if obj.is_none() {
                    Ok(Dyn::Unit)
                } else {
                    Err(wrong(self))
                }
            }
            ShapeNode::Option(t) => {
                if obj.is_none() {
                    Ok(Dyn::Option(None))
                } else {
                    Ok(Dyn::Option(Some(Box::new(self.convert(obj, *t)?))))
                }
            }
            ShapeNode::Seq(t) => {
                if matches!(self.shape.node(*t), ShapeNode::U8) {
                    if let Some(bytes) = bytes_of(obj) {
                        return Ok(Dyn::List(
                            bytes.into_iter().map(|b| Dyn::UInt(b.into())).collect(),
                        ));
                    }
                }
                let items = sequence(obj).ok_or_else(|| wrong(self))?;
                self.items(&items, &vec![*t; items.len()])
            }
            ShapeNode::Array { len, item } => {
                let items = sequence(obj).ok_or_else(|| wrong(self))?;
                if items.len() as u64 != *len {
                    return Err(wrong(self));
                }
                self.items(&items, &vec![*item; items.len()])
            }
            ShapeNode::Tuple(nodes) | ShapeNode::TupleStruct { fields: nodes, .. } => {
                let items = sequence(obj).ok_or_else(|| wrong(self))?;
                if items.len() != nodes.len() {
                    return Err(wrong(self));
                }
                self.items(&items, nodes)
            }
            ShapeNode::Map { key, value } => {
                let dict = obj.cast::<PyDict>().map_err(|_| wrong(self))?;
                let mut entries = Vec::with_capacity(dict.len());
                for (k, v) in dict.iter() {
                    self.path.push(format!("[{}]", short_repr(&k)));
                    let entry = self
                        .convert(&k, *key)
                        .and_then(|k| Ok((k, self.convert(&v, *value)?)));
                    self.path.pop();
                    entries.push(entry?);
                }
                Ok(Dyn::Map(entries))
            }
            ShapeNode::Struct { fields, .. } => self.fields(obj, fields, node).map(Dyn::List),
            ShapeNode::NewtypeStruct { inner, .. } => self.convert(obj, *inner),
            ShapeNode::Enum { variants, .. } => {
                let (name, payload) = if let Ok(s) = obj.cast::<PyString>() {
                    (s.to_string(), None)
                } else if let Ok(d) = obj.cast::<PyDict>() {
                    let mut entries = d.iter();
                    match (entries.next(), entries.next()) {
                        (Some((k, v)), None) => match k.cast::<PyString>() {
                            Ok(k) => (k.to_string(), Some(v)),
                            Err(_) => return Err(wrong(self)),
                        },
                        _ => return Err(wrong(self)),
                    }
                } else {
                    return Err(wrong(self));
                };
                let Some(at) = variants.iter().position(|v| v.name == name) else {
                    return Err(self.mismatch(node, format!("no variant {name:?}")));
                };
                self.path.push(format!(".{name}"));
                let value = match (&variants[at].data, payload) {
                    (OwnedVariantData::Unit, None) => Ok(Dyn::Unit),
                    (OwnedVariantData::Unit, Some(p)) if p.is_none() => Ok(Dyn::Unit),
                    (OwnedVariantData::Newtype(t), Some(p)) => self.convert(&p, *t),
                    (OwnedVariantData::Tuple(nodes), Some(p)) => match sequence(&p) {
                        Some(items) if items.len() == nodes.len() => self.items(&items, nodes),
                        _ => Err(self.mismatch(node, describe(&p))),
                    },
                    (OwnedVariantData::Struct(fields), Some(p)) => {
                        self.fields(&p, fields, node).map(Dyn::List)
                    }
                    (_, _) => Err(self.mismatch(node, format!("variant {name} without its value"))),
                };
                self.path.pop();
                Ok(Dyn::Variant(at, Box::new(value?)))
            }
            ShapeNode::Opaque { name, .. } if name == "Tensor" || name == "RawTensor" => {
                if !tensor::is_tensor(obj) {
                    return Err(wrong(self));
                }
                tensor::from_python(obj)
                    .map(|t| Dyn::Tensor(Tensor::from(t)))
                    .map_err(|e| self.mismatch(node, format!("a tensor that cannot be sent: {e}")))
            }
            ShapeNode::Opaque { name, .. } if name == "RRef" => {
                let handle = obj.getattr("_handle").ok();
                match handle.as_ref().map(|h| h.cast::<RustRRef>()) {
                    Some(Ok(h)) => Ok(Dyn::RRef(h.get().rref.clone())),
                    Some(Err(_)) => Err(self.mismatch(
                        node,
                        "an RRef to a Python value (a Rust function takes RRefs to values of Rust functions)".into(),
                    )),
                    None => Err(wrong(self)),
                }
            }
            ShapeNode::Opaque { name, .. } => Err(self.mismatch(
                node,
                format!("{} (a {name} cannot be made from Python)", describe(obj)),
            )),
        }
    }

    fn items(&mut self, items: &[Bound<'_, PyAny>], nodes: &[u32]) -> Result<Dyn, Mismatch> {
        let mut out = Vec::with_capacity(items.len());
        for (i, (item, node)) in items.iter().zip(nodes).enumerate() {
            self.path.push(format!("[{i}]"));
            let v = self.convert(item, *node);
            self.path.pop();
            out.push(v?);
        }
        Ok(Dyn::List(out))
    }

    /// A struct's fields from a `dict` with exactly those keys, or from an
    /// object's attributes of those names.
    fn fields(
        &mut self,
        obj: &Bound<'_, PyAny>,
        fields: &[(String, u32)],
        node: u32,
    ) -> Result<Vec<Dyn>, Mismatch> {
        let dict = obj.cast::<PyDict>().ok();
        if let Some(d) = &dict {
            for key in d.keys() {
                let known = key
                    .cast::<PyString>()
                    .ok()
                    .map(|k| fields.iter().any(|(name, _)| k.to_str().ok() == Some(name)))
                    .unwrap_or(false);
                if !known {
                    return Err(
                        self.mismatch(node, format!("a dict with the key {}", short_repr(&key)))
                    );
                }
            }
        }
        let mut out = Vec::with_capacity(fields.len());
        for (name, t) in fields {
            let value = match &dict {
                Some(d) => d.get_item(name).ok().flatten(),
                None => obj.getattr(name.as_str()).ok(),
            };
            let Some(value) = value else {
                return Err(self.mismatch(
                    node,
                    format!("{} without the field {name:?}", describe(obj)),
                ));
            };
            self.path.push(format!(".{name}"));
            let v = self.convert(&value, *t);
            self.path.pop();
            out.push(v?);
        }
        Ok(out)
    }
}

fn signed_range(node: &ShapeNode) -> (i128, i128) {
    match node {
        ShapeNode::I8 => (i8::MIN.into(), i8::MAX.into()),
        ShapeNode::I16 => (i16::MIN.into(), i16::MAX.into()),
        ShapeNode::I32 => (i32::MIN.into(), i32::MAX.into()),
        ShapeNode::I64 => (i64::MIN.into(), i64::MAX.into()),
        _ => (i128::MIN, i128::MAX),
    }
}

fn unsigned_max(node: &ShapeNode) -> u128 {
    match node {
        ShapeNode::U8 => u8::MAX.into(),
        ShapeNode::U16 => u16::MAX.into(),
        ShapeNode::U32 => u32::MAX.into(),
        ShapeNode::U64 => u64::MAX.into(),
        _ => u128::MAX,
    }
}

fn bytes_of(obj: &Bound<'_, PyAny>) -> Option<Vec<u8>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Some(b.as_bytes().to_vec());
    }
    obj.cast::<PyByteArray>().ok().map(|b| b.to_vec())
}

/// The items of a `list` or `tuple`.
fn sequence<'py>(obj: &Bound<'py, PyAny>) -> Option<Vec<Bound<'py, PyAny>>> {
    if let Ok(l) = obj.cast::<PyList>() {
        return Some(l.iter().collect());
    }
    obj.cast::<PyTuple>().ok().map(|t| t.iter().collect())
}

/// A short `repr` of a Python value (40 characters at most), for an error.
pub(crate) fn short_repr(obj: &Bound<'_, PyAny>) -> String {
    let r = obj
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "?".into());
    r.chars().take(40).collect()
}

/// Whether `obj`, given alone for a struct argument, is the whole struct
/// rather than its first field: a `dict` whose keys all name fields, or an
/// object with every field as an attribute that is no tensor, number,
/// string, byte string, `list`, `tuple` or `None`.
pub fn is_whole_struct(obj: &Bound<'_, PyAny>, fields: &[(String, u32)]) -> bool {
    if let Ok(d) = obj.cast::<PyDict>() {
        return d.keys().iter().all(|k| {
            k.cast::<PyString>()
                .ok()
                .and_then(|k| k.to_str().ok().map(|k| fields.iter().any(|(n, _)| n == k)))
                .unwrap_or(false)
        });
    }
    let plain = obj.is_none()
        || tensor::is_tensor(obj)
        || obj.is_instance_of::<PyInt>()
        || obj.is_instance_of::<PyFloat>()
        || obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
        || obj.is_instance_of::<PyList>()
        || obj.is_instance_of::<PyTuple>();
    !plain
        && !fields.is_empty()
        && fields
            .iter()
            .all(|(name, _)| obj.hasattr(name.as_str()).unwrap_or(false))
}

/// `value`, of node `node` of `shape`, as a Python object. Tensors become
/// `torch.Tensor`s on the memory they arrived in (each libtorch handle
/// dropped as soon as Python holds the tensor); RRefs `ferry.rpc.RRef`s.
pub fn to_python<'py>(
    py: Python<'py>,
    shape: &Arc<OwnedShape>,
    node: u32,
    value: Dyn,
) -> Result<Bound<'py, PyAny>, Error> {
    let bad = || Error::Argument(format!("a value that is not a {}", shape.node_text(node)));
    Ok(match (shape.node(node), value) {
        (ShapeNode::Back(target), v) => return to_python(py, shape, *target, v),
        (_, Dyn::Unit) => py.None().into_bound(py),
        (_, Dyn::Bool(b)) => PyBool::new(py, b).to_owned().into_any(),
        (_, Dyn::Int(v)) => match v.into_pyobject(py) {
            Ok(i) => i.into_any(),
            Err(never) => match never {},
        },
        (_, Dyn::UInt(v)) => match v.into_pyobject(py) {
            Ok(i) => i.into_any(),
            Err(never) => match never {},
        },
        (_, Dyn::Float(v)) => PyFloat::new(py, v).into_any(),
        (_, Dyn::Char(c)) => PyString::new(py, c.encode_utf8(&mut [0; 4])).into_any(),
        (_, Dyn::Str(s)) => PyString::new(py, &s).into_any(),
        (_, Dyn::Bytes(b)) => PyBytes::new(py, &b).into_any(),
        (ShapeNode::Option(t), Dyn::Option(v)) => match v {
            None => py.None().into_bound(py),
            Some(v) => to_python(py, shape, *t, *v)?,
        },
        (ShapeNode::NewtypeStruct { inner, .. }, v) => to_python(py, shape, *inner, v)?,
        (ShapeNode::Seq(t), Dyn::List(items)) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_python(py, shape, *t, item)?)?;
            }
            list.into_any()
        }
        (ShapeNode::Array { item, .. }, Dyn::List(items)) => {
            let list = PyList::empty(py);
            for v in items {
                list.append(to_python(py, shape, *item, v)?)?;
            }
            list.into_any()
        }
        (
            ShapeNode::Tuple(nodes) | ShapeNode::TupleStruct { fields: nodes, .. },
            Dyn::List(items),
        ) => tuple(py, shape, nodes, items)?,
        (ShapeNode::Struct { fields, .. }, Dyn::List(items)) => {
            struct_dict(py, shape, fields, items)?.into_any()
        }
        (ShapeNode::Map { key, value }, Dyn::Map(entries)) => {
            let dict = PyDict::new(py);
            for (k, v) in entries {
                let k = to_python(py, shape, *key, k)?;
                let k = hashable(&k)?;
                dict.set_item(k, to_python(py, shape, *value, v)?)?;
            }
            dict.into_any()
        }
        (ShapeNode::Enum { variants, .. }, Dyn::Variant(at, payload)) => {
            let variant = variants.get(at).ok_or_else(bad)?;
            let name = PyString::new(py, &variant.name);
            let payload = match (&variant.data, *payload) {
                (OwnedVariantData::Unit, _) => return Ok(name.into_any()),
                (OwnedVariantData::Newtype(t), v) => to_python(py, shape, *t, v)?,
                (OwnedVariantData::Tuple(nodes), Dyn::List(items)) => {
                    tuple(py, shape, nodes, items)?
                }
                (OwnedVariantData::Struct(fields), Dyn::List(items)) => {
                    struct_dict(py, shape, fields, items)?.into_any()
                }
                _ => return Err(bad()),
            };
            let dict = PyDict::new(py);
            dict.set_item(name, payload)?;
            dict.into_any()
        }
        (_, Dyn::Tensor(t)) => {
            let obj = tensor::to_python(py, &t)?;
            drop(t);
            obj
        }
        (ShapeNode::Opaque { params, .. }, Dyn::RRef(rref)) => {
            let handle = Bound::new(
                py,
                RustRRef {
                    rref,
                    shape: shape.clone(),
                    node: params.first().copied().unwrap_or(0),
                },
            )?;
            py.import("ferry.rpc.rref")?
                .getattr("RRef")?
                .call_method1("_from_handle", (handle,))?
        }
        _ => return Err(bad()),
    })
}

fn tuple<'py>(
    py: Python<'py>,
    shape: &Arc<OwnedShape>,
    nodes: &[u32],
    items: Vec<Dyn>,
) -> Result<Bound<'py, PyAny>, Error> {
    let mut out = Vec::with_capacity(items.len());
    for (node, item) in nodes.iter().zip(items) {
        out.push(to_python(py, shape, *node, item)?);
    }
    Ok(PyTuple::new(py, out)?.into_any())
}

fn struct_dict<'py>(
    py: Python<'py>,
    shape: &Arc<OwnedShape>,
    fields: &[(String, u32)],
    items: Vec<Dyn>,
) -> Result<Bound<'py, PyDict>, Error> {
    let dict = PyDict::new(py);
    for ((name, node), item) in fields.iter().zip(items) {
        dict.set_item(name, to_python(py, shape, *node, item)?)?;
    }
    Ok(dict)
}

/// A map key as Python can hash it: lists become tuples, dicts tuples of
/// their items (a Rust map keyed by a struct or a sequence).
fn hashable<'py>(key: &Bound<'py, PyAny>) -> Result<Bound<'py, PyAny>, Error> {
    let py = key.py();
    if let Ok(l) = key.cast::<PyList>() {
        let items = l
            .iter()
            .map(|i| hashable(&i))
            .collect::<Result<Vec<_>, _>>()?;
        return Ok(PyTuple::new(py, items)?.into_any());
    }
    if let Ok(d) = key.cast::<PyDict>() {
        let mut items = Vec::new();
        for (k, v) in d.iter() {
            items.push(PyTuple::new(py, [k, hashable(&v)?])?.into_any());
        }
        return Ok(PyTuple::new(py, items)?.into_any());
    }
    Ok(key.clone())
}
