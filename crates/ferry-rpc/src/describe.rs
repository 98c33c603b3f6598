//! Functions described at run time, for callers that are not compiled
//! against their declarations (a binding to another language, a tool):
//! a shape as data ([`OwnedShape`]), a registration's [`Description`], and
//! the function [`DESCRIBE`] every agent serves to give it.
//!
//! A typed registration's [`Shape`]s are constants of its program; a
//! caller in Python has neither the types nor the shapes. It asks the
//! callee ([`DESCRIBE`]), which answers with the registration's argument
//! and result shapes as data, the signature a call must carry, and the
//! type names an RRef to its result travels with. The caller then encodes
//! its values into the function's own payload layout, shape-driven, and
//! decodes the result the same way: the callee runs its ordinary typed
//! body, and checks the call as it checks any typed call.
//!
//! ```
//! use ferry_rpc::describe::OwnedShape;
//! use ferry_rpc::schema::Schema;
//!
//! #[derive(serde::Serialize, serde::Deserialize, Schema)]
//! struct Point {
//!     x: i64,
//!     y: Option<f32>,
//! }
//!
//! let shape = OwnedShape::of(<(Point, Vec<String>)>::SHAPE).unwrap();
//! assert_eq!(shape.to_string(), "(Point { x: i64, y: Option<f32> }, [String])");
//! shape.check().unwrap();
//! ```
//!
//! An [`OwnedShape`] is a flat table of nodes, children after their
//! parent; a recursive type's reference back to itself names the node of
//! the enclosing type ([`ShapeNode::Back`]). A shape that arrives from a
//! peer is [`check`](OwnedShape::check)ed before it is used: every index
//! in range, children after their parents, back references to enclosing
//! named types, at most [`MAX_SHAPE_NODES`] nodes.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::schema::{Field, Schema, Shape, Variant, VariantData};
use crate::{Function, SignatureId};

/// The most nodes an [`OwnedShape`] may have (a larger one is refused by
/// [`OwnedShape::of`] and [`OwnedShape::check`]).
pub const MAX_SHAPE_NODES: usize = 4096;

/// Describes the function registered under the name it is given on the
/// callee: `None` if there is none. Every agent serves it.
pub const DESCRIBE: Function<String, Option<Description>> = Function::new("ferry.describe");

/// A registered function as a caller without its declaration sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Description {
    /// The name it is registered under.
    pub function: String,
    /// What a call of it carries for the callee's type check.
    pub signature: SignatureId,
    /// The argument type's shape.
    pub args: OwnedShape,
    /// The result type's shape.
    pub result: OwnedShape,
    /// `std::any::type_name` of the argument type.
    pub args_type: String,
    /// `std::any::type_name` of the result type: the type an RRef to a
    /// result of a `remote` call of it is checked against.
    pub result_type: String,
}

impl Schema for Description {
    const SHAPE: &'static Shape = &Shape::Opaque {
        name: "Description",
        params: &[],
    };
}

impl Description {
    /// The signature as text, as errors show it: `fn((i64, i64)) -> i64`.
    pub fn signature_text(&self) -> String {
        format!("fn({}) -> {}", self.args, self.result)
    }
}

/// A [`Shape`] as data: a table of nodes, the root first, every node's
/// children after it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnedShape {
    nodes: Vec<ShapeNode>,
}

/// One node of an [`OwnedShape`]; the `u32`s are indices of other nodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShapeNode {
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
    /// A string.
    String,
    /// A byte array written with `serialize_bytes`.
    Bytes,
    /// `()`.
    Unit,
    /// `Option<T>`: the node of `T`.
    Option(u32),
    /// A sequence: the node of its items.
    Seq(u32),
    /// A map.
    Map {
        /// The keys' node.
        key: u32,
        /// The values' node.
        value: u32,
    },
    /// A tuple: its items' nodes.
    Tuple(Vec<u32>),
    /// An array of a fixed length.
    Array {
        /// Its length.
        len: u64,
        /// Its items' node.
        item: u32,
    },
    /// `struct Name;`.
    UnitStruct(String),
    /// `struct Name(T);`.
    NewtypeStruct {
        /// The struct's name.
        name: String,
        /// Its field's node.
        inner: u32,
    },
    /// `struct Name(A, B, ..);`.
    TupleStruct {
        /// The struct's name.
        name: String,
        /// Its fields' nodes.
        fields: Vec<u32>,
    },
    /// `struct Name { a: A, .. }`.
    Struct {
        /// The struct's name.
        name: String,
        /// Its fields' names and nodes.
        fields: Vec<(String, u32)>,
    },
    /// `enum Name { .. }`.
    Enum {
        /// The enum's name.
        name: String,
        /// Its variants (those serde writes).
        variants: Vec<OwnedVariant>,
    },
    /// A type with a wire format of its own (`Tensor`, `RRef<T>`).
    Opaque {
        /// The type's name.
        name: String,
        /// Its type parameters' nodes.
        params: Vec<u32>,
    },
    /// A reference back to an enclosing named type's node (a recursive
    /// type).
    Back(u32),
}

/// A variant of an enum node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnedVariant {
    /// The index serde writes for it.
    pub index: u32,
    /// Its name.
    pub name: String,
    /// What it holds.
    pub data: OwnedVariantData,
}

/// What an enum variant holds (node indices).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum OwnedVariantData {
    /// Nothing.
    Unit,
    /// One unnamed field.
    Newtype(u32),
    /// Several unnamed fields.
    Tuple(Vec<u32>),
    /// Named fields.
    Struct(Vec<(String, u32)>),
}

/// Why a shape could not be made or used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// It would have more than [`MAX_SHAPE_NODES`] nodes.
    #[error("a shape of more than {MAX_SHAPE_NODES} nodes")]
    TooLarge,
    /// A table that breaks the rules [`OwnedShape::check`] states.
    #[error("malformed shape: {0}")]
    Malformed(String),
}

/// A named type being converted, with those around it.
struct Open<'a> {
    id: &'a str,
    name: &'a str,
    node: u32,
    outer: Option<&'a Open<'a>>,
}

impl OwnedShape {
    /// The shape `shape` as data.
    pub fn of(shape: &Shape) -> Result<OwnedShape, ShapeError> {
        let mut nodes = Vec::new();
        add(&mut nodes, shape, None)?;
        Ok(OwnedShape { nodes })
    }

    /// A shape of its nodes, checked ([`check`](Self::check)).
    pub fn from_nodes(nodes: Vec<ShapeNode>) -> Result<OwnedShape, ShapeError> {
        let shape = OwnedShape { nodes };
        shape.check()?;
        Ok(shape)
    }

    /// The nodes, the root first.
    pub fn nodes(&self) -> &[ShapeNode] {
        &self.nodes
    }

    /// The node at `index`; the root is 0. Out of range (only in a table
    /// that was never checked): the unit shape.
    pub fn node(&self, index: u32) -> &ShapeNode {
        self.nodes.get(index as usize).unwrap_or(&ShapeNode::Unit)
    }

    /// Checks the table: at least one and at most [`MAX_SHAPE_NODES`]
    /// nodes, every child after its parent and in range, every
    /// [`ShapeNode::Back`] to a named node before it that encloses it.
    pub fn check(&self) -> Result<(), ShapeError> {
        let n = self.nodes.len();
        if n == 0 {
            return Err(ShapeError::Malformed("no nodes".into()));
        }
        if n > MAX_SHAPE_NODES {
            return Err(ShapeError::TooLarge);
        }
        // The parent of each node, to check that back references point to
        // an enclosing node.
        let mut parent: Vec<Option<u32>> = vec![None; n];
        for (i, node) in self.nodes.iter().enumerate() {
            let i = i as u32;
            for child in children(node) {
                if child <= i || child as usize >= n {
                    return Err(ShapeError::Malformed(format!(
                        "node {i} refers to node {child}, not one after it"
                    )));
                }
                if parent[child as usize].replace(i).is_some() {
                    return Err(ShapeError::Malformed(format!(
                        "node {child} has two parents"
                    )));
                }
            }
        }
        for (i, node) in self.nodes.iter().enumerate() {
            if let ShapeNode::Back(target) = node {
                let mut at = parent[i];
                let mut found = false;
                while let Some(p) = at {
                    if p == *target {
                        found = true;
                        break;
                    }
                    at = parent[p as usize];
                }
                if !found || type_name(&self.nodes[*target as usize]).is_none() {
                    return Err(ShapeError::Malformed(format!(
                        "node {i} refers back to node {target}, not a named type enclosing it"
                    )));
                }
            }
        }
        for (i, node) in self.nodes.iter().enumerate().skip(1) {
            if parent[i].is_none() {
                return Err(ShapeError::Malformed(format!(
                    "node {i} ({node:?}) is not part of the shape"
                )));
            }
        }
        Ok(())
    }

    /// The name of the named type at `index` (for a back reference), if
    /// it is one.
    pub fn type_name(&self, index: u32) -> Option<&str> {
        type_name(self.node(index))
    }
}

/// The indices a node refers to as its parts (not back references).
fn children(node: &ShapeNode) -> Vec<u32> {
    match node {
        ShapeNode::Option(t) | ShapeNode::Seq(t) => vec![*t],
        ShapeNode::Map { key, value } => vec![*key, *value],
        ShapeNode::Array { item, .. } => vec![*item],
        ShapeNode::NewtypeStruct { inner, .. } => vec![*inner],
        ShapeNode::Tuple(items)
        | ShapeNode::TupleStruct { fields: items, .. }
        | ShapeNode::Opaque { params: items, .. } => items.clone(),
        ShapeNode::Struct { fields, .. } => fields.iter().map(|(_, t)| *t).collect(),
        ShapeNode::Enum { variants, .. } => variants
            .iter()
            .flat_map(|v| match &v.data {
                OwnedVariantData::Unit => Vec::new(),
                OwnedVariantData::Newtype(t) => vec![*t],
                OwnedVariantData::Tuple(items) => items.clone(),
                OwnedVariantData::Struct(fields) => fields.iter().map(|(_, t)| *t).collect(),
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The name of a named type's node.
fn type_name(node: &ShapeNode) -> Option<&str> {
    match node {
        ShapeNode::UnitStruct(name)
        | ShapeNode::NewtypeStruct { name, .. }
        | ShapeNode::TupleStruct { name, .. }
        | ShapeNode::Struct { name, .. }
        | ShapeNode::Enum { name, .. } => Some(name),
        _ => None,
    }
}

/// The name of a named [`Shape`] (after looking through a declaration).
fn shape_name(shape: &Shape) -> &'static str {
    match shape.resolve() {
        Shape::UnitStruct(name)
        | Shape::NewtypeStruct { name, .. }
        | Shape::TupleStruct { name, .. }
        | Shape::Struct { name, .. }
        | Shape::Enum { name, .. } => name,
        _ => "",
    }
}

/// Appends `shape`'s nodes; returns the index of its root.
fn add(
    nodes: &mut Vec<ShapeNode>,
    shape: &Shape,
    open: Option<&Open<'_>>,
) -> Result<u32, ShapeError> {
    if nodes.len() >= MAX_SHAPE_NODES {
        return Err(ShapeError::TooLarge);
    }
    if let Shape::Declared(d) = shape {
        // A declaration of an unnamed shape (the derive makes none): the
        // shape itself, nothing refers back to it.
        if shape_name(d.shape()).is_empty() {
            return add(nodes, d.shape(), open);
        }
    }
    let at = nodes.len() as u32;
    // A placeholder, replaced once the children are in.
    nodes.push(ShapeNode::Unit);
    let node = match shape {
        Shape::Bool => ShapeNode::Bool,
        Shape::I8 => ShapeNode::I8,
        Shape::I16 => ShapeNode::I16,
        Shape::I32 => ShapeNode::I32,
        Shape::I64 => ShapeNode::I64,
        Shape::I128 => ShapeNode::I128,
        Shape::U8 => ShapeNode::U8,
        Shape::U16 => ShapeNode::U16,
        Shape::U32 => ShapeNode::U32,
        Shape::U64 => ShapeNode::U64,
        Shape::U128 => ShapeNode::U128,
        Shape::F32 => ShapeNode::F32,
        Shape::F64 => ShapeNode::F64,
        Shape::Char => ShapeNode::Char,
        Shape::String => ShapeNode::String,
        Shape::Bytes => ShapeNode::Bytes,
        Shape::Unit => ShapeNode::Unit,
        Shape::Option(t) => ShapeNode::Option(add(nodes, t, open)?),
        Shape::Seq(t) => ShapeNode::Seq(add(nodes, t, open)?),
        Shape::Map { key, value } => ShapeNode::Map {
            key: add(nodes, key, open)?,
            value: add(nodes, value, open)?,
        },
        Shape::Tuple(items) => ShapeNode::Tuple(add_all(nodes, items, open)?),
        Shape::Array { len, item } => ShapeNode::Array {
            len: *len as u64,
            item: add(nodes, item, open)?,
        },
        Shape::Opaque { name, params } => ShapeNode::Opaque {
            name: name.to_string(),
            params: add_all(nodes, params, open)?,
        },
        Shape::Recursive(name) => match find_open(open, |o| o.name == *name) {
            Some(target) => ShapeNode::Back(target),
            None => {
                return Err(ShapeError::Malformed(format!(
                    "a reference back to {name}, which does not enclose it"
                )))
            }
        },
        Shape::Declared(d) => match find_open(open, |o| !o.id.is_empty() && o.id == d.id()) {
            Some(target) => ShapeNode::Back(target),
            None => {
                let here = Open {
                    id: d.id(),
                    name: shape_name(d.shape()),
                    node: at,
                    outer: open,
                };
                named(nodes, d.shape(), &here)?
            }
        },
        other => {
            let here = Open {
                id: "",
                name: shape_name(other),
                node: at,
                outer: open,
            };
            named(nodes, other, &here)?
        }
    };
    nodes[at as usize] = node;
    Ok(at)
}

/// The node of a named type (struct or enum), `here` open inside it.
fn named(
    nodes: &mut Vec<ShapeNode>,
    shape: &Shape,
    here: &Open<'_>,
) -> Result<ShapeNode, ShapeError> {
    let inside = Some(here);
    Ok(match shape {
        Shape::UnitStruct(name) => ShapeNode::UnitStruct(name.to_string()),
        Shape::NewtypeStruct { name, inner } => ShapeNode::NewtypeStruct {
            name: name.to_string(),
            inner: add(nodes, inner, inside)?,
        },
        Shape::TupleStruct { name, fields } => ShapeNode::TupleStruct {
            name: name.to_string(),
            fields: add_all(nodes, fields, inside)?,
        },
        Shape::Struct { name, fields } => ShapeNode::Struct {
            name: name.to_string(),
            fields: add_fields(nodes, fields, inside)?,
        },
        Shape::Enum { name, variants } => ShapeNode::Enum {
            name: name.to_string(),
            variants: variants
                .iter()
                .map(|v| add_variant(nodes, v, inside))
                .collect::<Result<_, _>>()?,
        },
        // Only named shapes come here (`add` opens nothing else).
        other => {
            return Err(ShapeError::Malformed(format!(
                "{other} opened as a named type"
            )))
        }
    })
}

fn add_all(
    nodes: &mut Vec<ShapeNode>,
    shapes: &[&Shape],
    open: Option<&Open<'_>>,
) -> Result<Vec<u32>, ShapeError> {
    shapes.iter().map(|s| add(nodes, s, open)).collect()
}

fn add_fields(
    nodes: &mut Vec<ShapeNode>,
    fields: &[Field],
    open: Option<&Open<'_>>,
) -> Result<Vec<(String, u32)>, ShapeError> {
    fields
        .iter()
        .map(|f| Ok((f.name.to_string(), add(nodes, f.shape, open)?)))
        .collect()
}

fn add_variant(
    nodes: &mut Vec<ShapeNode>,
    v: &Variant,
    open: Option<&Open<'_>>,
) -> Result<OwnedVariant, ShapeError> {
    let data = match &v.data {
        VariantData::Unit => OwnedVariantData::Unit,
        VariantData::Newtype(t) => OwnedVariantData::Newtype(add(nodes, t, open)?),
        VariantData::Tuple(items) => OwnedVariantData::Tuple(add_all(nodes, items, open)?),
        VariantData::Struct(fields) => OwnedVariantData::Struct(add_fields(nodes, fields, open)?),
    };
    Ok(OwnedVariant {
        index: v.index,
        name: v.name.to_string(),
        data,
    })
}

/// The node of the nearest open type that `matches`.
fn find_open(open: Option<&Open<'_>>, matches: impl Fn(&Open<'_>) -> bool) -> Option<u32> {
    let mut at = open;
    while let Some(o) = at {
        if matches(o) {
            return Some(o.node);
        }
        at = o.outer;
    }
    None
}

/// The same Rust-like text as [`Shape`]'s: `(i64, String)`,
/// `Point { x: i64 }`, `enum Op { Add(i64), Stop }`, a recursive type by
/// its name where it comes back to itself.
impl fmt::Display for OwnedShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_node(f, 0, 0)
    }
}

impl OwnedShape {
    /// Writes node `at` as text ([`Display`](fmt::Display)); `depth` bounds
    /// the recursion for tables that were never checked.
    pub fn write_node(&self, f: &mut fmt::Formatter<'_>, at: u32, depth: usize) -> fmt::Result {
        if depth > MAX_SHAPE_NODES {
            return f.write_str("…");
        }
        let d = depth + 1;
        let simple = match self.node(at) {
            ShapeNode::Bool => "bool",
            ShapeNode::I8 => "i8",
            ShapeNode::I16 => "i16",
            ShapeNode::I32 => "i32",
            ShapeNode::I64 => "i64",
            ShapeNode::I128 => "i128",
            ShapeNode::U8 => "u8",
            ShapeNode::U16 => "u16",
            ShapeNode::U32 => "u32",
            ShapeNode::U64 => "u64",
            ShapeNode::U128 => "u128",
            ShapeNode::F32 => "f32",
            ShapeNode::F64 => "f64",
            ShapeNode::Char => "char",
            ShapeNode::String => "String",
            ShapeNode::Bytes => "bytes",
            ShapeNode::Unit => "()",
            _ => "",
        };
        if !simple.is_empty() {
            return f.write_str(simple);
        }
        match self.node(at) {
            ShapeNode::Option(t) => {
                f.write_str("Option<")?;
                self.write_node(f, *t, d)?;
                f.write_str(">")
            }
            ShapeNode::Seq(t) => {
                f.write_str("[")?;
                self.write_node(f, *t, d)?;
                f.write_str("]")
            }
            ShapeNode::Map { key, value } => {
                f.write_str("Map<")?;
                self.write_node(f, *key, d)?;
                f.write_str(", ")?;
                self.write_node(f, *value, d)?;
                f.write_str(">")
            }
            ShapeNode::Tuple(items) => self.write_list(f, "(", items, ")", d),
            ShapeNode::Array { len, item } => {
                f.write_str("[")?;
                self.write_node(f, *item, d)?;
                write!(f, "; {len}]")
            }
            ShapeNode::UnitStruct(name) => f.write_str(name),
            ShapeNode::NewtypeStruct { name, inner } => {
                write!(f, "{name}(")?;
                self.write_node(f, *inner, d)?;
                f.write_str(")")
            }
            ShapeNode::TupleStruct { name, fields } => {
                f.write_str(name)?;
                self.write_list(f, "(", fields, ")", d)
            }
            ShapeNode::Struct { name, fields } => {
                f.write_str(name)?;
                self.write_fields(f, fields, d)
            }
            ShapeNode::Enum { name, variants } => {
                write!(f, "enum {name} {{")?;
                for (i, v) in variants.iter().enumerate() {
                    f.write_str(if i == 0 { " " } else { ", " })?;
                    f.write_str(&v.name)?;
                    match &v.data {
                        OwnedVariantData::Unit => {}
                        OwnedVariantData::Newtype(t) => {
                            f.write_str("(")?;
                            self.write_node(f, *t, d)?;
                            f.write_str(")")?;
                        }
                        OwnedVariantData::Tuple(items) => self.write_list(f, "(", items, ")", d)?,
                        OwnedVariantData::Struct(fields) => self.write_fields(f, fields, d)?,
                    }
                }
                f.write_str(if variants.is_empty() { "}" } else { " }" })
            }
            ShapeNode::Opaque { name, params } => {
                f.write_str(name)?;
                if params.is_empty() {
                    Ok(())
                } else {
                    self.write_list(f, "<", params, ">", d)
                }
            }
            ShapeNode::Back(target) => f.write_str(self.type_name(*target).unwrap_or("?")),
            _ => Ok(()),
        }
    }

    fn write_list(
        &self,
        f: &mut fmt::Formatter<'_>,
        open_with: &str,
        items: &[u32],
        close: &str,
        depth: usize,
    ) -> fmt::Result {
        f.write_str(open_with)?;
        for (i, t) in items.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            self.write_node(f, *t, depth)?;
        }
        if open_with == "(" && items.len() == 1 {
            f.write_str(",")?;
        }
        f.write_str(close)
    }

    fn write_fields(
        &self,
        f: &mut fmt::Formatter<'_>,
        fields: &[(String, u32)],
        depth: usize,
    ) -> fmt::Result {
        if fields.is_empty() {
            return f.write_str(" {}");
        }
        f.write_str(" { ")?;
        for (i, (name, t)) in fields.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{name}: ")?;
            self.write_node(f, *t, depth)?;
        }
        f.write_str(" }")
    }

    /// The text of node `at` alone (as [`Display`](fmt::Display) writes
    /// the root).
    pub fn node_text(&self, at: u32) -> String {
        struct Node<'a>(&'a OwnedShape, u32);
        impl fmt::Display for Node<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.write_node(f, self.1, 0)
            }
        }
        Node(self, at).to_string()
    }
}

/// The description of a registration with `signature` under `function`
/// (`None` for a registration without declared shapes, or one too large
/// to describe).
pub(crate) fn describe(function: &str, signature: &crate::Signature) -> Option<Description> {
    let schema = signature.schema?;
    Some(Description {
        function: function.to_string(),
        signature: signature.id(),
        args: OwnedShape::of(schema.args).ok()?,
        result: OwnedShape::of(schema.result).ok()?,
        args_type: signature.args.to_string(),
        result_type: signature.result.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Schema;

    #[derive(Schema)]
    #[allow(dead_code)]
    struct Tree {
        label: String,
        children: Vec<Tree>,
    }

    #[derive(Schema)]
    #[allow(dead_code)]
    enum Op {
        Add(i64),
        Move { x: f32, y: f32 },
        Pair(u8, u8),
        Stop,
    }

    /// The text of a shape as data is the shape's own text, for every kind
    /// of node, and the table passes its check.
    #[test]
    fn owned_shapes_read_as_their_shapes() {
        let shapes: [&Shape; 8] = [
            <(i64, String)>::SHAPE,
            <Vec<Option<f32>>>::SHAPE,
            <[u8; 4]>::SHAPE,
            <std::collections::HashMap<String, Vec<u64>>>::SHAPE,
            <Result<usize, String>>::SHAPE,
            Tree::SHAPE,
            Op::SHAPE,
            <(Op, (bool,), ())>::SHAPE,
        ];
        for shape in shapes {
            let owned = OwnedShape::of(shape).unwrap();
            owned.check().unwrap();
            assert_eq!(owned.to_string(), shape.to_string());
        }
        let tree = OwnedShape::of(Tree::SHAPE).unwrap();
        assert!(tree.nodes().contains(&ShapeNode::Back(0)), "{tree:?}");
    }

    /// A table from a peer is refused unless it is a tree of nodes after
    /// their parents, with back references to enclosing named nodes only.
    #[test]
    fn malformed_tables_are_refused() {
        let bad = [
            vec![],
            vec![ShapeNode::Seq(0)],
            vec![ShapeNode::Seq(5)],
            vec![ShapeNode::Tuple(vec![1, 1]), ShapeNode::I8],
            vec![ShapeNode::Back(0)],
            vec![ShapeNode::Seq(1), ShapeNode::Back(0)],
            vec![ShapeNode::I8, ShapeNode::I8],
        ];
        for nodes in bad {
            assert!(
                OwnedShape::from_nodes(nodes.clone()).is_err(),
                "{nodes:?} passed"
            );
        }
        let too_many = vec![ShapeNode::Unit; MAX_SHAPE_NODES + 1];
        assert_eq!(OwnedShape::from_nodes(too_many), Err(ShapeError::TooLarge));
        let ok = vec![
            ShapeNode::Struct {
                name: "T".into(),
                fields: vec![("next".into(), 1)],
            },
            ShapeNode::Option(2),
            ShapeNode::Back(0),
        ];
        assert_eq!(
            OwnedShape::from_nodes(ok).unwrap().to_string(),
            "T { next: Option<T> }"
        );
    }
}
