//! Shapes declared in Python as text, the way Ferry writes shapes
//! (`"(Tensor, f32)"`, `"Point { x: i64, y: i64 }"`,
//! `"enum Op { Add(i64), Stop }"`), read into an [`OwnedShape`]; and an
//! [`OwnedShape`] made into the `'static` [`Shape`] a registration's
//! signature holds.
//!
//! Beside the text `Shape`'s `Display` writes, a few Rust spellings are
//! taken for the shapes serde gives them: `Vec<T>` for `[T]`, `HashMap<K,
//! V>` and `BTreeMap<K, V>` for `Map<K, V>`, `Box<T>` for `T`, `str` for
//! `String`, `usize`/`isize` for `u64`/`i64`. A bare name is `Tensor` or
//! `RawTensor` (tensors), an enclosing named type (a recursive reference)
//! or else a unit struct.

use ferry::rpc::describe::{
    OwnedShape, OwnedVariant, OwnedVariantData, ShapeNode, MAX_SHAPE_NODES,
};
use ferry::rpc::schema::{Field, Shape, Variant, VariantData};

/// How deep a declared shape may nest.
const MAX_NESTING: usize = 64;

/// The shape `text` declares, or why it declares none.
pub fn parse(text: &str) -> Result<OwnedShape, String> {
    let mut p = Parser {
        tokens: tokenize(text)?,
        at: 0,
        nodes: Vec::new(),
        open: Vec::new(),
    };
    p.shape(0)?;
    if let Some(t) = p.tokens.get(p.at) {
        return Err(format!("unexpected {t:?} after the shape"));
    }
    OwnedShape::from_nodes(p.nodes).map_err(|e| e.to_string())
}

fn tokenize(text: &str) -> Result<Vec<String>, String> {
    let mut tokens = Vec::new();
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c.is_whitespace() {
            continue;
        }
        if c.is_alphanumeric() || c == '_' {
            let mut end = i + c.len_utf8();
            while let Some((j, d)) = chars.peek().copied() {
                if d.is_alphanumeric() || d == '_' {
                    end = j + d.len_utf8();
                    chars.next();
                } else {
                    break;
                }
            }
            tokens.push(text[i..end].to_string());
        } else if "()[]{}<>,;:".contains(c) {
            tokens.push(c.to_string());
        } else {
            return Err(format!("unexpected {c:?} in a shape"));
        }
    }
    Ok(tokens)
}

struct Parser {
    tokens: Vec<String>,
    at: usize,
    nodes: Vec<ShapeNode>,
    /// The named types being read, innermost last: (name, node).
    open: Vec<(String, u32)>,
}

impl Parser {
    fn peek(&self) -> Option<&str> {
        self.tokens.get(self.at).map(String::as_str)
    }

    /// What comes next, for an error: the token, or the text's end.
    fn found(&self) -> String {
        match self.peek() {
            Some(t) => format!("{t:?}"),
            None => "the end (the shape ends too early)".into(),
        }
    }

    fn next(&mut self) -> Result<String, String> {
        let t = self
            .tokens
            .get(self.at)
            .cloned()
            .ok_or("the shape ends too early")?;
        self.at += 1;
        Ok(t)
    }

    fn expect(&mut self, token: &str) -> Result<(), String> {
        let t = self.next()?;
        if t == token {
            Ok(())
        } else {
            Err(format!("expected {token:?}, found {t:?}"))
        }
    }

    fn eat(&mut self, token: &str) -> bool {
        if self.peek() == Some(token) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn ident(&mut self) -> Result<String, String> {
        let t = self.next()?;
        if t.chars()
            .next()
            .is_some_and(|c| c.is_alphabetic() || c == '_')
        {
            Ok(t)
        } else {
            Err(format!("expected a name, found {t:?}"))
        }
    }

    /// Reserves a node; the shape fills it in once its parts are read.
    fn reserve(&mut self) -> Result<u32, String> {
        if self.nodes.len() >= MAX_SHAPE_NODES {
            return Err(format!("a shape of more than {MAX_SHAPE_NODES} nodes"));
        }
        self.nodes.push(ShapeNode::Unit);
        Ok(self.nodes.len() as u32 - 1)
    }

    /// Reads one shape into a new node; returns its index.
    fn shape(&mut self, depth: usize) -> Result<u32, String> {
        if depth > MAX_NESTING {
            return Err(format!("a shape nested more than {MAX_NESTING} deep"));
        }
        let d = depth + 1;
        let at = self.reserve()?;
        let first = self.next()?;
        let node = match first.as_str() {
            "bool" => ShapeNode::Bool,
            "i8" => ShapeNode::I8,
            "i16" => ShapeNode::I16,
            "i32" => ShapeNode::I32,
            "i64" | "isize" => ShapeNode::I64,
            "i128" => ShapeNode::I128,
            "u8" => ShapeNode::U8,
            "u16" => ShapeNode::U16,
            "u32" => ShapeNode::U32,
            "u64" | "usize" => ShapeNode::U64,
            "u128" => ShapeNode::U128,
            "f32" => ShapeNode::F32,
            "f64" => ShapeNode::F64,
            "char" => ShapeNode::Char,
            "String" | "str" => ShapeNode::String,
            "bytes" => ShapeNode::Bytes,
            "(" => {
                let mut items = Vec::new();
                let mut trailing = false;
                while !self.eat(")") {
                    items.push(self.shape(d)?);
                    trailing = self.eat(",");
                    if !trailing && self.peek() != Some(")") {
                        return Err(format!("expected \",\" or \")\", found {}", self.found()));
                    }
                }
                match items.len() {
                    0 => ShapeNode::Unit,
                    1 if !trailing => {
                        // `(T)` is T itself: move it up into this node.
                        return self.unwrap_into(at, items[0]);
                    }
                    _ => ShapeNode::Tuple(items),
                }
            }
            "[" => {
                let item = self.shape(d)?;
                if self.eat(";") {
                    let len = self.next()?;
                    let len: u64 = len
                        .parse()
                        .map_err(|_| format!("an array length {len:?}"))?;
                    self.expect("]")?;
                    ShapeNode::Array { len, item }
                } else {
                    self.expect("]")?;
                    ShapeNode::Seq(item)
                }
            }
            "Option" => {
                self.expect("<")?;
                let t = self.shape(d)?;
                self.expect(">")?;
                ShapeNode::Option(t)
            }
            "Vec" | "VecDeque" | "HashSet" | "BTreeSet" => {
                self.expect("<")?;
                let t = self.shape(d)?;
                self.expect(">")?;
                ShapeNode::Seq(t)
            }
            "Map" | "HashMap" | "BTreeMap" => {
                self.expect("<")?;
                let key = self.shape(d)?;
                self.expect(",")?;
                let value = self.shape(d)?;
                self.expect(">")?;
                ShapeNode::Map { key, value }
            }
            "Box" | "Arc" | "Rc" => {
                self.expect("<")?;
                let t = self.shape(d)?;
                self.expect(">")?;
                return self.unwrap_into(at, t);
            }
            "enum" => {
                let name = self.ident()?;
                self.open.push((name.clone(), at));
                let variants = self.variants(d);
                self.open.pop();
                ShapeNode::Enum {
                    name,
                    variants: variants?,
                }
            }
            _ => {
                let name = first.clone();
                if !name
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_alphabetic() || c == '_')
                {
                    return Err(format!("expected a shape, found {name:?}"));
                }
                match self.peek() {
                    Some("<") => {
                        self.at += 1;
                        let mut params = Vec::new();
                        loop {
                            params.push(self.shape(d)?);
                            if self.eat(">") {
                                break;
                            }
                            self.expect(",")?;
                        }
                        ShapeNode::Opaque { name, params }
                    }
                    Some("(") => {
                        self.at += 1;
                        self.open.push((name.clone(), at));
                        let fields = self.list(d, ")");
                        self.open.pop();
                        let (fields, trailing) = fields?;
                        if fields.len() == 1 && !trailing {
                            ShapeNode::NewtypeStruct {
                                name,
                                inner: fields[0],
                            }
                        } else {
                            ShapeNode::TupleStruct { name, fields }
                        }
                    }
                    Some("{") => {
                        self.at += 1;
                        self.open.push((name.clone(), at));
                        let fields = self.fields(d);
                        self.open.pop();
                        ShapeNode::Struct {
                            name,
                            fields: fields?,
                        }
                    }
                    _ => {
                        if name == "Tensor" || name == "RawTensor" {
                            ShapeNode::Opaque {
                                name,
                                params: Vec::new(),
                            }
                        } else if let Some((_, target)) =
                            self.open.iter().rev().find(|(n, _)| *n == name)
                        {
                            ShapeNode::Back(*target)
                        } else {
                            ShapeNode::UnitStruct(name)
                        }
                    }
                }
            }
        };
        self.nodes[at as usize] = node;
        Ok(at)
    }

    /// Makes node `at` the shape just read at `inner` (for `(T)` and
    /// `Box<T>`), dropping the reserved node; `inner` is the last shape
    /// read, so its nodes are the table's end.
    fn unwrap_into(&mut self, at: u32, inner: u32) -> Result<u32, String> {
        debug_assert_eq!(inner, at + 1);
        self.nodes.remove(at as usize);
        // Every index after `at` moves down by one.
        for node in &mut self.nodes[at as usize..] {
            shift(node, at);
        }
        for (_, n) in &mut self.open {
            if *n > at {
                *n -= 1;
            }
        }
        Ok(at)
    }

    /// Shapes separated by commas up to `close`; whether a comma ended
    /// the list.
    fn list(&mut self, depth: usize, close: &str) -> Result<(Vec<u32>, bool), String> {
        let mut items = Vec::new();
        let mut trailing = false;
        while !self.eat(close) {
            items.push(self.shape(depth)?);
            trailing = self.eat(",");
            if !trailing && self.peek() != Some(close) {
                return Err(format!(
                    "expected \",\" or {close:?}, found {}",
                    self.found()
                ));
            }
        }
        Ok((items, trailing))
    }

    /// `name: shape, ...}` (the `{` read).
    fn fields(&mut self, depth: usize) -> Result<Vec<(String, u32)>, String> {
        let mut fields = Vec::new();
        while !self.eat("}") {
            let name = self.ident()?;
            self.expect(":")?;
            fields.push((name, self.shape(depth)?));
            if !self.eat(",") && self.peek() != Some("}") {
                return Err(format!("expected \",\" or \"}}\", found {}", self.found()));
            }
        }
        Ok(fields)
    }

    /// `{ Variant, Variant(T), Variant { a: T }, ... }`.
    fn variants(&mut self, depth: usize) -> Result<Vec<OwnedVariant>, String> {
        self.expect("{")?;
        let mut variants = Vec::new();
        while !self.eat("}") {
            let name = self.ident()?;
            let data = if self.eat("(") {
                let (items, trailing) = self.list(depth, ")")?;
                if items.len() == 1 && !trailing {
                    OwnedVariantData::Newtype(items[0])
                } else {
                    OwnedVariantData::Tuple(items)
                }
            } else if self.eat("{") {
                OwnedVariantData::Struct(self.fields(depth)?)
            } else {
                OwnedVariantData::Unit
            };
            variants.push(OwnedVariant {
                index: variants.len() as u32,
                name,
                data,
            });
            if !self.eat(",") && self.peek() != Some("}") {
                return Err(format!("expected \",\" or \"}}\", found {}", self.found()));
            }
        }
        Ok(variants)
    }
}

/// Moves every index in `node` above `removed` down by one.
fn shift(node: &mut ShapeNode, removed: u32) {
    let fix = |i: &mut u32| {
        if *i > removed {
            *i -= 1;
        }
    };
    match node {
        ShapeNode::Option(t) | ShapeNode::Seq(t) | ShapeNode::Back(t) => fix(t),
        ShapeNode::Map { key, value } => {
            fix(key);
            fix(value);
        }
        ShapeNode::Array { item, .. } => fix(item),
        ShapeNode::NewtypeStruct { inner, .. } => fix(inner),
        ShapeNode::Tuple(items)
        | ShapeNode::TupleStruct { fields: items, .. }
        | ShapeNode::Opaque { params: items, .. } => items.iter_mut().for_each(fix),
        ShapeNode::Struct { fields, .. } => fields.iter_mut().for_each(|(_, t)| fix(t)),
        ShapeNode::Enum { variants, .. } => {
            for v in variants {
                match &mut v.data {
                    OwnedVariantData::Unit => {}
                    OwnedVariantData::Newtype(t) => fix(t),
                    OwnedVariantData::Tuple(items) => items.iter_mut().for_each(fix),
                    OwnedVariantData::Struct(fields) => fields.iter_mut().for_each(|(_, t)| fix(t)),
                }
            }
        }
        _ => {}
    }
}

/// `shape` as a `'static` [`Shape`], for the signature of a registration
/// that lives as long as the process (its memory is never freed, as a
/// Rust registration's shapes are constants). A reference back becomes
/// [`Shape::Recursive`], which refers to the nearest enclosing type of the
/// name: one to a farther type of the same name is refused.
pub fn leak(shape: &OwnedShape) -> Result<&'static Shape, String> {
    leak_node(shape, 0, &mut Vec::new())
}

fn text(s: &str) -> &'static str {
    Box::leak(s.to_string().into_boxed_str())
}

fn leak_node(
    shape: &OwnedShape,
    at: u32,
    open: &mut Vec<(String, u32)>,
) -> Result<&'static Shape, String> {
    let node = shape.node(at).clone();
    let named = shape.type_name(at).map(str::to_string);
    if let Some(name) = &named {
        open.push((name.clone(), at));
    }
    let result = leak_inner(shape, &node, open);
    if named.is_some() {
        open.pop();
    }
    Ok(Box::leak(Box::new(result?)))
}

fn leak_all(
    shape: &OwnedShape,
    items: &[u32],
    open: &mut Vec<(String, u32)>,
) -> Result<&'static [&'static Shape], String> {
    let v = items
        .iter()
        .map(|i| leak_node(shape, *i, open))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Box::leak(v.into_boxed_slice()))
}

fn leak_fields(
    shape: &OwnedShape,
    fields: &[(String, u32)],
    open: &mut Vec<(String, u32)>,
) -> Result<&'static [Field], String> {
    let v = fields
        .iter()
        .map(|(name, t)| {
            Ok(Field {
                name: text(name),
                shape: leak_node(shape, *t, open)?,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Box::leak(v.into_boxed_slice()))
}

fn leak_inner(
    shape: &OwnedShape,
    node: &ShapeNode,
    open: &mut Vec<(String, u32)>,
) -> Result<Shape, String> {
    Ok(match node {
        ShapeNode::Bool => Shape::Bool,
        ShapeNode::I8 => Shape::I8,
        ShapeNode::I16 => Shape::I16,
        ShapeNode::I32 => Shape::I32,
        ShapeNode::I64 => Shape::I64,
        ShapeNode::I128 => Shape::I128,
        ShapeNode::U8 => Shape::U8,
        ShapeNode::U16 => Shape::U16,
        ShapeNode::U32 => Shape::U32,
        ShapeNode::U64 => Shape::U64,
        ShapeNode::U128 => Shape::U128,
        ShapeNode::F32 => Shape::F32,
        ShapeNode::F64 => Shape::F64,
        ShapeNode::Char => Shape::Char,
        ShapeNode::String => Shape::String,
        ShapeNode::Bytes => Shape::Bytes,
        ShapeNode::Unit => Shape::Unit,
        ShapeNode::Option(t) => Shape::Option(leak_node(shape, *t, open)?),
        ShapeNode::Seq(t) => Shape::Seq(leak_node(shape, *t, open)?),
        ShapeNode::Map { key, value } => Shape::Map {
            key: leak_node(shape, *key, open)?,
            value: leak_node(shape, *value, open)?,
        },
        ShapeNode::Tuple(items) => Shape::Tuple(leak_all(shape, items, open)?),
        ShapeNode::Array { len, item } => Shape::Array {
            len: usize::try_from(*len).map_err(|_| format!("an array of {len} items"))?,
            item: leak_node(shape, *item, open)?,
        },
        ShapeNode::UnitStruct(name) => Shape::UnitStruct(text(name)),
        ShapeNode::NewtypeStruct { name, inner } => Shape::NewtypeStruct {
            name: text(name),
            inner: leak_node(shape, *inner, open)?,
        },
        ShapeNode::TupleStruct { name, fields } => Shape::TupleStruct {
            name: text(name),
            fields: leak_all(shape, fields, open)?,
        },
        ShapeNode::Struct { name, fields } => Shape::Struct {
            name: text(name),
            fields: leak_fields(shape, fields, open)?,
        },
        ShapeNode::Enum { name, variants } => {
            let v = variants
                .iter()
                .map(|v| {
                    Ok(Variant {
                        index: v.index,
                        name: text(&v.name),
                        data: match &v.data {
                            OwnedVariantData::Unit => VariantData::Unit,
                            OwnedVariantData::Newtype(t) => {
                                VariantData::Newtype(leak_node(shape, *t, open)?)
                            }
                            OwnedVariantData::Tuple(items) => {
                                VariantData::Tuple(leak_all(shape, items, open)?)
                            }
                            OwnedVariantData::Struct(fields) => {
                                VariantData::Struct(leak_fields(shape, fields, open)?)
                            }
                        },
                    })
                })
                .collect::<Result<Vec<_>, String>>()?;
            Shape::Enum {
                name: text(name),
                variants: Box::leak(v.into_boxed_slice()),
            }
        }
        ShapeNode::Opaque { name, params } => Shape::Opaque {
            name: text(name),
            params: leak_all(shape, params, open)?,
        },
        ShapeNode::Back(target) => {
            let name = shape.type_name(*target).unwrap_or_default().to_string();
            match open.iter().rev().find(|(n, _)| *n == name) {
                Some((_, nearest)) if nearest == target => Shape::Recursive(text(&name)),
                _ => {
                    return Err(format!(
                        "a reference back to {name} past a nearer type of the same name"
                    ))
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry::rpc::schema::{self, Schema};

    #[derive(Schema)]
    #[allow(dead_code)]
    struct Point {
        x: i64,
        y: Option<f32>,
    }

    #[derive(Schema)]
    #[allow(dead_code)]
    enum Op {
        Add(i64),
        Move { x: f32, y: f32 },
        Pair(u8, u8),
        One(bool),
        Stop,
    }

    #[derive(Schema)]
    #[allow(dead_code)]
    struct Tree {
        label: String,
        children: Vec<Tree>,
    }

    #[derive(Schema)]
    #[allow(dead_code)]
    struct Meters(f64);

    /// The text a shape displays as reads back as that shape, and its
    /// `'static` form hashes as the Rust type's (so a Rust caller's typed
    /// call is accepted by a registration declared in text).
    #[test]
    fn declared_text_is_the_rust_types_shape() {
        let shapes: [&Shape; 9] = [
            <(i64, String)>::SHAPE,
            <(Vec<Option<f32>>, [u8; 4], ())>::SHAPE,
            <std::collections::HashMap<String, Vec<u64>>>::SHAPE,
            Point::SHAPE,
            Op::SHAPE,
            Tree::SHAPE,
            <(Meters, (bool,))>::SHAPE,
            <(ferry::tensor::Tensor, f32)>::SHAPE,
            <ferry::RRef<Point>>::SHAPE,
        ];
        for shape in shapes {
            let text = shape.to_string();
            let owned = parse(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(owned.to_string(), text);
            let leaked = leak(&owned).unwrap();
            assert_eq!(schema::hash(leaked), schema::hash(shape), "{text}");
        }
        // Rust spellings for the same shapes.
        assert_eq!(parse("Vec<Box<str>>").unwrap().to_string(), "[String]");
        assert_eq!(
            parse("HashMap<usize, (isize)>").unwrap().to_string(),
            "Map<u64, i64>"
        );
    }

    #[test]
    fn bad_text_is_refused_with_the_reason() {
        for (text, reason) in [
            ("(i64", "ends too early"),
            ("i64 i64", "after the shape"),
            ("Map<i64>", "expected \",\""),
            ("[u8; x]", "array length"),
            ("f32 $", "unexpected '$'"),
            ("", "ends too early"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(reason), "{text:?}: {e}");
        }
    }
}
