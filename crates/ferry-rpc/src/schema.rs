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
//! Recursive types have finite shapes: where a type comes back inside
//! itself (directly, or through other types), its shape refers back to
//! it by name ([`Shape::Declared`], [`Shape::Recursive`]).
//!
//! ```
//! use ferry_rpc::schema::{self, Schema};
//!
//! #[derive(serde::Serialize, serde::Deserialize, Schema)]
//! enum Expr {
//!     Num(i64),
//!     Neg(Box<Expr>),
//!     Call { name: String, args: Vec<Expr> },
//! }
//!
//! assert_eq!(
//!     Expr::SHAPE.to_string(),
//!     "enum Expr { Num(i64), Neg(Expr), Call { name: String, args: [Expr] } }"
//! );
//! const H: u64 = schema::hash(Expr::SHAPE);
//! # assert_eq!(H, schema::hash(Expr::SHAPE));
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
///
/// Two shapes are equal (`==`) when they describe the same payload
/// layout: when their [`hash`]es' encodings are equal, which looks through
/// [`Shape::Declared`] and treats a reference back to an enclosing type
/// ([`Shape::Recursive`], or a declaration met again inside itself) by
/// what it refers to.
#[derive(Debug, Clone, Copy)]
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
    /// A reference back to the nearest enclosing named type (struct or
    /// enum) called `name`, for recursive types (whose shape cannot
    /// contain itself): what `#[derive(Schema)]` writes where a generic
    /// type contains itself (`struct Tree<T> { children: Vec<Tree<T>> }`).
    Recursive(&'static str),
    /// The shape of a struct or enum declared without generic parameters,
    /// held in a static: what `#[derive(Schema)]` gives such a type, so
    /// that it may contain itself, directly or through other types
    /// (`struct Tree { children: Vec<Tree> }`, `enum A { B(Box<B>) }` with
    /// `enum B { A(Option<Box<A>>) }`). It stands for the shape it holds
    /// (its hash, text and comparisons are that shape's, [`resolve`]
    /// reaches it), except where the same declaration is met again inside
    /// itself: there it is a reference back, as [`Shape::Recursive`] is,
    /// and the shape ends. So a recursive type has a finite shape, the
    /// same for the same declaration in any build.
    ///
    /// [`resolve`]: Shape::resolve
    Declared(Declaration),
}

/// A named type's shape held in a static, under an identity of the type's
/// declaration ([`Shape::Declared`]).
///
/// A shape is built of constants, and a constant cannot contain itself:
/// the shape of `struct Tree { children: Vec<Tree> }` would need
/// `Tree::SHAPE` to evaluate it (rustc's E0391). A static can, and the
/// derive keeps such a type's shape in one; a declaration refers to it,
/// with an identity (the type's module path and name) by which a hash or
/// a text of the shape finds where it comes back to a type it is inside.
///
/// ```
/// use ferry_rpc::schema::{self, Schema};
///
/// #[derive(serde::Serialize, serde::Deserialize, Schema)]
/// struct Tree {
///     label: String,
///     children: Vec<Tree>,
/// }
///
/// assert_eq!(Tree::SHAPE.to_string(), "Tree { label: String, children: [Tree] }");
/// const H: u64 = schema::hash(Tree::SHAPE); // still computed by the compiler
/// assert_eq!(H, schema::hash(Tree::SHAPE));
/// ```
#[derive(Clone, Copy)]
pub struct Declaration {
    id: &'static str,
    /// A raw pointer, not a reference: the compiler checks a constant's
    /// value by following its references, into statics too, and the
    /// static's value names this constant when the type is recursive (a
    /// cycle again). It does not follow raw pointers.
    shape: *const Shape,
}

// SAFETY: `shape` comes from a `&'static Shape` (`Declaration::new`):
// immutable data that lives as long as the program, shared and sent as
// safely as that reference.
unsafe impl Send for Declaration {}
// SAFETY: as for `Send`.
unsafe impl Sync for Declaration {}

impl Declaration {
    /// The declaration `id` (unique to the type: the derive writes its
    /// module path and name) of the type whose shape is `shape`.
    pub const fn new(id: &'static str, shape: &'static Shape) -> Self {
        Self { id, shape }
    }

    /// The identity of the declaration.
    pub const fn id(&self) -> &'static str {
        self.id
    }

    /// The shape it holds.
    pub const fn shape(&self) -> &'static Shape {
        // SAFETY: `shape` was a `&'static Shape` (`new`).
        unsafe { &*self.shape }
    }
}

/// The declaration's id and its shape as text (a recursive shape's text
/// ends where it comes back to itself, as the shape's does).
impl fmt::Debug for Declaration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Declaration")
            .field("id", &self.id)
            .field("shape", &format_args!("{}", Shape::Declared(*self)))
            .finish()
    }
}

impl Shape {
    /// The shape a [`Shape::Declared`] holds (a derived struct's
    /// [`Shape::Struct`], an enum's [`Shape::Enum`], ...); any other shape
    /// itself.
    ///
    /// ```
    /// use ferry_rpc::schema::{Schema, Shape};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize, Schema)]
    /// enum Op { Add(i64), Stop }
    ///
    /// let Shape::Enum { name, variants } = Op::SHAPE.resolve() else { unreachable!() };
    /// assert_eq!((*name, variants.len()), ("Op", 2));
    /// ```
    pub const fn resolve(&self) -> &Shape {
        match self {
            Shape::Declared(d) => d.shape(),
            other => other,
        }
    }

    /// The bytes [`hash`] hashes after its domain text: equal for two
    /// shapes exactly when they describe the same payload layout.
    fn encoding(&self) -> Vec<u8> {
        let mut out = Vec::new();
        encode_shape(&mut out, self, None);
        out
    }
}

impl PartialEq for Shape {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other) || self.encoding() == other.encoding()
    }
}

impl Eq for Shape {}

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
/// A [`Shape::Declared`] counts as the shape it holds; met again inside
/// itself, as a reference back to the type of that name (and how many
/// enclosing types of the same name are nearer), as [`Shape::Recursive`]
/// does: a recursive type's hash is finite and the same in every build.
///
/// ```
/// use ferry_rpc::schema::{hash, Schema};
///
/// const H: u64 = hash(<(i64, String)>::SHAPE); // computed by the compiler
/// assert_eq!(H, hash(<(i64, String)>::SHAPE));
/// assert_ne!(H, hash(<(String, i64)>::SHAPE));
/// ```
pub const fn hash(shape: &Shape) -> u64 {
    hash_shape(hash_str(FNV_OFFSET, DOMAIN), shape, None)
}

/// The hash of a function's signature: its argument and result shapes.
pub(crate) const fn hash_signature(args: &Shape, result: &Shape) -> u64 {
    let h = hash_str(FNV_OFFSET, DOMAIN);
    let h = hash_str(h, "fn");
    hash_shape(hash_shape(h, args, None), result, None)
}

/// A named type (struct or enum) whose shape is being hashed, encoded or
/// written, with those around it: where a reference back leads.
#[derive(Clone, Copy)]
struct Open<'a> {
    /// Its name (empty for a declaration of a shape without one).
    name: &'static str,
    /// Its [`Declaration`]'s id; empty for a shape not behind one.
    id: &'static str,
    outer: Option<&'a Open<'a>>,
}

const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// The name serde writes for a struct or enum; empty for other shapes.
const fn type_name(shape: &Shape) -> &'static str {
    match shape {
        Shape::UnitStruct(name)
        | Shape::NewtypeStruct { name, .. }
        | Shape::TupleStruct { name, .. }
        | Shape::Struct { name, .. }
        | Shape::Enum { name, .. } => name,
        _ => "",
    }
}

/// Where declaration `id` comes back to a type it is inside: that type's
/// name and how many enclosing types of the same name are nearer (0: the
/// nearest, what [`Shape::Recursive`] refers to). `None` when it is not
/// inside itself.
const fn back_reference(open: Option<&Open<'_>>, id: &str) -> Option<(&'static str, u64)> {
    let mut depth = 0;
    let mut at = open;
    let name = loop {
        let Some(o) = at else {
            return None;
        };
        if !o.id.is_empty() && str_eq(o.id, id) {
            break o.name;
        }
        depth += 1;
        at = o.outer;
    };
    let mut nearer = 0;
    let mut at = open;
    while depth > 0 {
        let Some(o) = at else {
            break;
        };
        if str_eq(o.name, name) {
            nearer += 1;
        }
        depth -= 1;
        at = o.outer;
    }
    Some((name, nearer))
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

const fn hash_shapes(mut h: u64, shapes: &[&Shape], open: Option<&Open<'_>>) -> u64 {
    h = hash_u64(h, shapes.len() as u64);
    let mut i = 0;
    while i < shapes.len() {
        h = hash_shape(h, shapes[i], open);
        i += 1;
    }
    h
}

const fn hash_fields(mut h: u64, fields: &[Field], open: Option<&Open<'_>>) -> u64 {
    h = hash_u64(h, fields.len() as u64);
    let mut i = 0;
    while i < fields.len() {
        h = hash_str(h, fields[i].name);
        h = hash_shape(h, fields[i].shape, open);
        i += 1;
    }
    h
}

/// A reference back: tag 29, the name, the number of nearer types of
/// that name.
const fn hash_back(h: u64, name: &str, nearer: u64) -> u64 {
    hash_u64(hash_str(hash_byte(h, 29), name), nearer)
}

const fn hash_shape(h: u64, shape: &Shape, open: Option<&Open<'_>>) -> u64 {
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
        Shape::Option(t) => hash_shape(hash_byte(h, 18), t, open),
        Shape::Seq(t) => hash_shape(hash_byte(h, 19), t, open),
        Shape::Map { key, value } => {
            hash_shape(hash_shape(hash_byte(h, 20), key, open), value, open)
        }
        Shape::Tuple(items) => hash_shapes(hash_byte(h, 21), items, open),
        Shape::Array { len, item } => {
            hash_shape(hash_u64(hash_byte(h, 22), *len as u64), item, open)
        }
        Shape::UnitStruct(_)
        | Shape::NewtypeStruct { .. }
        | Shape::TupleStruct { .. }
        | Shape::Struct { .. }
        | Shape::Enum { .. } => hash_named(h, shape, "", open),
        Shape::Opaque { name, params } => {
            hash_shapes(hash_str(hash_byte(h, 28), name), params, open)
        }
        Shape::Recursive(name) => hash_back(h, name, 0),
        Shape::Declared(d) => match back_reference(open, d.id) {
            Some((name, nearer)) => hash_back(h, name, nearer),
            None => hash_named(h, d.shape(), d.id, open),
        },
    }
}

/// Hashes `shape`, a named type's (or declaration `id`'s), with it open.
const fn hash_named(h: u64, shape: &Shape, id: &'static str, open: Option<&Open<'_>>) -> u64 {
    let here = Open {
        name: type_name(shape),
        id,
        outer: open,
    };
    let inside = Some(&here);
    match shape {
        Shape::UnitStruct(name) => hash_str(hash_byte(h, 23), name),
        Shape::NewtypeStruct { name, inner } => {
            hash_shape(hash_str(hash_byte(h, 24), name), inner, inside)
        }
        Shape::TupleStruct { name, fields } => {
            hash_shapes(hash_str(hash_byte(h, 25), name), fields, inside)
        }
        Shape::Struct { name, fields } => {
            hash_fields(hash_str(hash_byte(h, 26), name), fields, inside)
        }
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
                    VariantData::Newtype(t) => hash_shape(hash_byte(h, 2), t, inside),
                    VariantData::Tuple(items) => hash_shapes(hash_byte(h, 3), items, inside),
                    VariantData::Struct(fields) => hash_fields(hash_byte(h, 4), fields, inside),
                };
                i += 1;
            }
            h
        }
        // A declaration of a shape without a name: open under its id.
        other => hash_shape(h, other, inside),
    }
}

/// [`hash_shape`]'s input bytes (after the domain), at run time: what
/// shapes are compared by. Kept in step with it by the tests.
fn encode_shape(out: &mut Vec<u8>, shape: &Shape, open: Option<&Open<'_>>) {
    let tag = match shape {
        Shape::Bool => 1,
        Shape::I8 => 2,
        Shape::I16 => 3,
        Shape::I32 => 4,
        Shape::I64 => 5,
        Shape::I128 => 6,
        Shape::U8 => 7,
        Shape::U16 => 8,
        Shape::U32 => 9,
        Shape::U64 => 10,
        Shape::U128 => 11,
        Shape::F32 => 12,
        Shape::F64 => 13,
        Shape::Char => 14,
        Shape::String => 15,
        Shape::Bytes => 16,
        Shape::Unit => 17,
        _ => 0,
    };
    if tag != 0 {
        out.push(tag);
        return;
    }
    match shape {
        Shape::Option(t) => {
            out.push(18);
            encode_shape(out, t, open);
        }
        Shape::Seq(t) => {
            out.push(19);
            encode_shape(out, t, open);
        }
        Shape::Map { key, value } => {
            out.push(20);
            encode_shape(out, key, open);
            encode_shape(out, value, open);
        }
        Shape::Tuple(items) => {
            out.push(21);
            encode_shapes(out, items, open);
        }
        Shape::Array { len, item } => {
            out.push(22);
            out.extend_from_slice(&(*len as u64).to_le_bytes());
            encode_shape(out, item, open);
        }
        Shape::Opaque { name, params } => {
            out.push(28);
            encode_str(out, name);
            encode_shapes(out, params, open);
        }
        Shape::Recursive(name) => encode_back(out, name, 0),
        Shape::Declared(d) => match back_reference(open, d.id) {
            Some((name, nearer)) => encode_back(out, name, nearer),
            None => encode_named(out, d.shape(), d.id, open),
        },
        _ => encode_named(out, shape, "", open),
    }
}

fn encode_named(out: &mut Vec<u8>, shape: &Shape, id: &'static str, open: Option<&Open<'_>>) {
    let here = Open {
        name: type_name(shape),
        id,
        outer: open,
    };
    let inside = Some(&here);
    match shape {
        Shape::UnitStruct(name) => {
            out.push(23);
            encode_str(out, name);
        }
        Shape::NewtypeStruct { name, inner } => {
            out.push(24);
            encode_str(out, name);
            encode_shape(out, inner, inside);
        }
        Shape::TupleStruct { name, fields } => {
            out.push(25);
            encode_str(out, name);
            encode_shapes(out, fields, inside);
        }
        Shape::Struct { name, fields } => {
            out.push(26);
            encode_str(out, name);
            encode_fields(out, fields, inside);
        }
        Shape::Enum { name, variants } => {
            out.push(27);
            encode_str(out, name);
            out.extend_from_slice(&(variants.len() as u64).to_le_bytes());
            for v in *variants {
                out.extend_from_slice(&u64::from(v.index).to_le_bytes());
                encode_str(out, v.name);
                match &v.data {
                    VariantData::Unit => out.push(1),
                    VariantData::Newtype(t) => {
                        out.push(2);
                        encode_shape(out, t, inside);
                    }
                    VariantData::Tuple(items) => {
                        out.push(3);
                        encode_shapes(out, items, inside);
                    }
                    VariantData::Struct(fields) => {
                        out.push(4);
                        encode_fields(out, fields, inside);
                    }
                }
            }
        }
        other => encode_shape(out, other, inside),
    }
}

fn encode_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn encode_shapes(out: &mut Vec<u8>, shapes: &[&Shape], open: Option<&Open<'_>>) {
    out.extend_from_slice(&(shapes.len() as u64).to_le_bytes());
    for t in shapes {
        encode_shape(out, t, open);
    }
}

fn encode_fields(out: &mut Vec<u8>, fields: &[Field], open: Option<&Open<'_>>) {
    out.extend_from_slice(&(fields.len() as u64).to_le_bytes());
    for field in fields {
        encode_str(out, field.name);
        encode_shape(out, field.shape, open);
    }
}

fn encode_back(out: &mut Vec<u8>, name: &str, nearer: u64) {
    out.push(29);
    encode_str(out, name);
    out.extend_from_slice(&nearer.to_le_bytes());
}

/// Rust-like text: `(i64, String)`, `Option<[f32]>`, `Point { x: i64 }`,
/// `enum Op { Add(i64), Stop }`, `Tensor`, `RRef<i64>`; a recursive type
/// by its name where it comes back to itself: `Tree { children: [Tree] }`.
impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_shape(f, self, None)
    }
}

fn write_shape(f: &mut fmt::Formatter<'_>, shape: &Shape, open: Option<&Open<'_>>) -> fmt::Result {
    let simple = match shape {
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
    match shape {
        Shape::Option(t) => {
            f.write_str("Option<")?;
            write_shape(f, t, open)?;
            f.write_str(">")
        }
        Shape::Seq(t) => {
            f.write_str("[")?;
            write_shape(f, t, open)?;
            f.write_str("]")
        }
        Shape::Map { key, value } => {
            f.write_str("Map<")?;
            write_shape(f, key, open)?;
            f.write_str(", ")?;
            write_shape(f, value, open)?;
            f.write_str(">")
        }
        Shape::Tuple(items) => write_list(f, "(", items, ")", open),
        Shape::Array { len, item } => {
            f.write_str("[")?;
            write_shape(f, item, open)?;
            write!(f, "; {len}]")
        }
        Shape::Opaque { name, params } => {
            f.write_str(name)?;
            if params.is_empty() {
                Ok(())
            } else {
                write_list(f, "<", params, ">", open)
            }
        }
        Shape::Recursive(name) => f.write_str(name),
        Shape::Declared(d) => match back_reference(open, d.id) {
            Some(("", _)) => f.write_str(d.id),
            Some((name, _)) => f.write_str(name),
            None => write_named(f, d.shape(), d.id, open),
        },
        _ => write_named(f, shape, "", open),
    }
}

/// Writes `shape`, a named type's (or declaration `id`'s), with it open.
fn write_named(
    f: &mut fmt::Formatter<'_>,
    shape: &Shape,
    id: &'static str,
    open: Option<&Open<'_>>,
) -> fmt::Result {
    let here = Open {
        name: type_name(shape),
        id,
        outer: open,
    };
    let inside = Some(&here);
    match shape {
        Shape::UnitStruct(name) => f.write_str(name),
        Shape::NewtypeStruct { name, inner } => {
            write!(f, "{name}(")?;
            write_shape(f, inner, inside)?;
            f.write_str(")")
        }
        Shape::TupleStruct { name, fields } => {
            f.write_str(name)?;
            write_list(f, "(", fields, ")", inside)
        }
        Shape::Struct { name, fields } => {
            f.write_str(name)?;
            write_fields(f, fields, inside)
        }
        Shape::Enum { name, variants } => {
            write!(f, "enum {name} {{")?;
            for (i, v) in variants.iter().enumerate() {
                f.write_str(if i == 0 { " " } else { ", " })?;
                f.write_str(v.name)?;
                match &v.data {
                    VariantData::Unit => {}
                    VariantData::Newtype(t) => {
                        f.write_str("(")?;
                        write_shape(f, t, inside)?;
                        f.write_str(")")?;
                    }
                    VariantData::Tuple(items) => write_list(f, "(", items, ")", inside)?,
                    VariantData::Struct(fields) => write_fields(f, fields, inside)?,
                }
            }
            f.write_str(if variants.is_empty() { "}" } else { " }" })
        }
        other => write_shape(f, other, inside),
    }
}

fn write_list(
    f: &mut fmt::Formatter<'_>,
    open_with: &str,
    items: &[&Shape],
    close: &str,
    open: Option<&Open<'_>>,
) -> fmt::Result {
    f.write_str(open_with)?;
    for (i, t) in items.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write_shape(f, t, open)?;
    }
    if open_with == "(" && items.len() == 1 {
        // `(T,)` is a tuple; `(T)` would read as T.
        f.write_str(",")?;
    }
    f.write_str(close)
}

fn write_fields(
    f: &mut fmt::Formatter<'_>,
    fields: &[Field],
    open: Option<&Open<'_>>,
) -> fmt::Result {
    if fields.is_empty() {
        return f.write_str(" {}");
    }
    f.write_str(" { ")?;
    for (i, field) in fields.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{}: ", field.name)?;
        write_shape(f, field.shape, open)?;
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

    /// Contains itself (the derive keeps its shape in a static).
    #[derive(Schema)]
    #[allow(dead_code)]
    struct Tree {
        children: Vec<Tree>,
    }

    #[derive(Schema)]
    #[allow(dead_code)]
    enum Ping {
        Pong(Box<Pong>),
    }

    #[derive(Schema)]
    #[allow(dead_code)]
    enum Pong {
        Ping(Option<Box<Ping>>),
        Stop,
    }

    #[derive(Schema)]
    #[allow(dead_code)]
    struct List<T> {
        head: T,
        tail: Option<Box<List<T>>>,
    }

    /// A recursive shape's hash is the encoding's FNV-1a too: a reference
    /// back is tag 29, the name, and how many types of that name are
    /// nearer; the comparisons (`==`) use the same encoding.
    #[test]
    fn recursive_shapes_follow_the_encoding() {
        let mut tree = text(DOMAIN);
        tree.push(26);
        tree.extend_from_slice(&text("Tree"));
        tree.extend_from_slice(&1u64.to_le_bytes());
        tree.extend_from_slice(&text("children"));
        tree.push(19);
        tree.push(29);
        tree.extend_from_slice(&text("Tree"));
        tree.extend_from_slice(&0u64.to_le_bytes());
        assert_eq!(hash(Tree::SHAPE), fnv(&tree));
        assert_eq!(Tree::SHAPE.encoding(), tree[text(DOMAIN).len()..]);

        let shapes: [&Shape; 9] = [
            <i64>::SHAPE,
            <(i64, String)>::SHAPE,
            <Result<Vec<u8>, [char; 3]>>::SHAPE,
            Tree::SHAPE,
            Ping::SHAPE,
            Pong::SHAPE,
            <List<i64>>::SHAPE,
            <List<List<Ping>>>::SHAPE,
            <std::collections::BTreeMap<String, Option<Tree>>>::SHAPE,
        ];
        for (i, shape) in shapes.iter().enumerate() {
            let mut bytes = text(DOMAIN);
            bytes.extend_from_slice(&shape.encoding());
            assert_eq!(hash(shape), fnv(&bytes), "{shape}");
            for (j, other) in shapes.iter().enumerate() {
                assert_eq!(shape == other, i == j, "{shape} == {other}");
            }
        }
        assert_eq!(
            Ping::SHAPE.to_string(),
            "enum Ping { Pong(enum Pong { Ping(Option<Ping>), Stop }) }"
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
