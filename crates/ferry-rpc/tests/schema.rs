//! `#[derive(Schema)]`: the shapes it derives follow serde's data model
//! and its attributes, and what changes the payload's layout changes the
//! hash; recursive types (directly, mutually, generic) have finite shapes.
#![allow(clippy::unwrap_used, dead_code)]

use std::collections::{BTreeMap, HashMap};

use ferry_rpc::schema::{hash, Field, Schema, Shape};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Schema)]
struct Point {
    x: i64,
    y: i64,
}

/// The same fields in another order: another payload layout.
#[derive(Serialize, Deserialize, Schema)]
#[serde(rename = "Point")]
struct SwappedPoint {
    y: i64,
    x: i64,
}

#[derive(Serialize, Deserialize, Schema)]
#[serde(rename_all = "camelCase")]
struct Options {
    learning_rate: f32,
    #[serde(rename = "steps")]
    max_steps: u32,
    #[serde(skip)]
    cache: Vec<u8>,
    #[serde(default)]
    tag: Option<String>,
}

#[derive(Serialize, Deserialize, Schema)]
#[serde(rename_all = "snake_case")]
enum Command {
    Start,
    MoveTo(Point),
    Pair(u8, u8),
    #[serde(skip)]
    Internal,
    SetOptions {
        verbose: bool,
    },
}

#[derive(Serialize, Deserialize, Schema)]
struct Wrapper<T> {
    inner: T,
    count: usize,
}

#[derive(Serialize, Deserialize, Schema)]
#[serde(transparent)]
struct Meters(f64);

#[derive(Serialize, Deserialize, Schema)]
struct Id(u64);

#[derive(Serialize, Deserialize, Schema)]
struct Pair(u8, String);

#[derive(Serialize, Deserialize, Schema)]
struct Marker;

mod as_seconds {
    pub(crate) fn serialize<S: serde::Serializer>(
        d: &std::time::Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_secs())
    }
    pub(crate) fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<std::time::Duration, D::Error> {
        let secs = <u64 as serde::Deserialize>::deserialize(d)?;
        Ok(std::time::Duration::from_secs(secs))
    }
}

#[derive(Serialize, Deserialize, Schema)]
struct Deadline {
    #[serde(with = "as_seconds")]
    #[schema(as = u64)]
    after: std::time::Duration,
}

#[test]
fn structs_show_their_fields_in_order() {
    assert_eq!(Point::SHAPE.to_string(), "Point { x: i64, y: i64 }");
    assert_eq!(SwappedPoint::SHAPE.to_string(), "Point { y: i64, x: i64 }");
    assert_ne!(hash(Point::SHAPE), hash(SwappedPoint::SHAPE));
    // Same layout, different declaration (a tuple is not a Point).
    assert_ne!(hash(Point::SHAPE), hash(<(i64, i64)>::SHAPE));
}

#[test]
fn serde_renames_and_skips_are_followed() {
    assert_eq!(
        Options::SHAPE.to_string(),
        "Options { learningRate: f32, steps: u32, tag: Option<String> }"
    );
    assert_eq!(
        Command::SHAPE.to_string(),
        "enum Command { start, move_to(Point { x: i64, y: i64 }), pair(u8, u8), \
         set_options { verbose: bool } }"
    );
    // The skipped variant keeps its index: the one after it is written as 4.
    let Shape::Enum { variants, .. } = Command::SHAPE.resolve() else {
        panic!("not an enum")
    };
    assert_eq!(
        variants.iter().map(|v| v.index).collect::<Vec<_>>(),
        [0, 1, 2, 4]
    );
}

#[test]
fn generics_transparent_newtypes_and_overrides() {
    assert_eq!(
        <Wrapper<String>>::SHAPE.to_string(),
        "Wrapper { inner: String, count: u64 }"
    );
    assert_ne!(hash(<Wrapper<String>>::SHAPE), hash(<Wrapper<i64>>::SHAPE));
    assert_eq!(Meters::SHAPE, <f64>::SHAPE);
    assert_eq!(Id::SHAPE.to_string(), "Id(u64)");
    assert_eq!(Pair::SHAPE.to_string(), "Pair(u8, String)");
    assert_eq!(Marker::SHAPE.to_string(), "Marker");
    assert_eq!(Deadline::SHAPE.to_string(), "Deadline { after: u64 }");
}

/// What the derive says matches what serde writes: decoding a value with
/// a shape of equal hash works, and the shapes differ where it would not.
#[test]
fn equal_hashes_mean_compatible_payloads() {
    #[derive(Serialize, Deserialize, Schema, Debug, PartialEq)]
    #[serde(rename = "Point")]
    struct OtherPoint {
        x: i64,
        y: i64,
    }
    assert_eq!(hash(Point::SHAPE), hash(OtherPoint::SHAPE));
    let bytes = postcard::to_allocvec(&Point { x: 1, y: -2 }).unwrap();
    let back: OtherPoint = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(back, OtherPoint { x: 1, y: -2 });
}

/// Contains itself through a `Vec`.
#[derive(Serialize, Deserialize, Schema, Debug, PartialEq)]
struct Tree {
    label: String,
    children: Vec<Tree>,
}

/// The same declaration elsewhere (another build's module): the same shape.
mod elsewhere {
    use super::*;

    #[derive(Serialize, Deserialize, Schema, Debug, PartialEq)]
    pub(crate) struct Tree {
        pub(crate) label: String,
        pub(crate) children: Vec<Self>,
    }
}

/// Another recursive type under the same name: a field more.
mod other {
    use super::*;

    #[derive(Serialize, Deserialize, Schema)]
    pub(crate) struct Tree {
        pub(crate) label: String,
        pub(crate) children: Vec<Tree>,
        pub(crate) weight: f32,
    }
}

/// Mutually recursive through `Box` and `Option`.
#[derive(Serialize, Deserialize, Schema)]
enum A {
    B(Box<B>),
    Leaf,
}

#[derive(Serialize, Deserialize, Schema)]
enum B {
    A(Option<Box<A>>),
}

/// Recursive through maps, as keys' neighbours and as values.
#[derive(Serialize, Deserialize, Schema)]
struct Json {
    object: BTreeMap<String, Json>,
    by_id: HashMap<u64, Vec<Json>>,
}

/// A generic type containing itself.
#[derive(Serialize, Deserialize, Schema, Debug, PartialEq)]
#[serde(rename = "Tree")]
struct GenericTree<T> {
    label: T,
    children: Vec<GenericTree<T>>,
}

/// A list: its tail, and a type holding lists of lists.
#[derive(Serialize, Deserialize, Schema)]
struct List<T> {
    head: T,
    tail: Option<Box<Self>>,
}

#[derive(Serialize, Deserialize, Schema)]
struct Nested {
    lists: List<List<i64>>,
    inner: Option<Box<Nested>>,
}

#[test]
fn recursive_types_have_finite_shapes() {
    assert_eq!(
        Tree::SHAPE.to_string(),
        "Tree { label: String, children: [Tree] }"
    );
    assert_eq!(
        A::SHAPE.to_string(),
        "enum A { B(enum B { A(Option<A>) }), Leaf }"
    );
    assert_eq!(
        B::SHAPE.to_string(),
        "enum B { A(Option<enum A { B(B), Leaf }>) }"
    );
    assert_eq!(
        Json::SHAPE.to_string(),
        "Json { object: Map<String, Json>, by_id: Map<u64, [Json]> }"
    );
    assert_eq!(
        <GenericTree<String>>::SHAPE.to_string(),
        "Tree { label: String, children: [Tree] }"
    );
    // Each list is its own: the inner list's tail is the inner list.
    assert_eq!(
        Nested::SHAPE.to_string(),
        "Nested { lists: List { head: List { head: i64, tail: Option<List> }, \
         tail: Option<List> }, inner: Option<Nested> }"
    );
    let Shape::Struct { name, fields } = Tree::SHAPE.resolve() else {
        panic!("not a struct: {:?}", Tree::SHAPE)
    };
    assert_eq!((*name, fields.len()), ("Tree", 2));
    // Debug ends where the type comes back to itself, too.
    assert!(format!("{:?}", Tree::SHAPE).contains("children: [Tree]"));
}

#[test]
fn recursive_shapes_compare_by_structure() {
    // The same declaration, wherever it is: equal, one hash.
    assert_eq!(Tree::SHAPE, elsewhere::Tree::SHAPE);
    assert_eq!(hash(Tree::SHAPE), hash(elsewhere::Tree::SHAPE));
    // Generic or not, the same layout.
    assert_eq!(Tree::SHAPE, <GenericTree<String>>::SHAPE);
    assert_eq!(hash(Tree::SHAPE), hash(<GenericTree<String>>::SHAPE));
    // Other recursive types differ.
    assert_ne!(Tree::SHAPE, other::Tree::SHAPE);
    assert_ne!(hash(Tree::SHAPE), hash(other::Tree::SHAPE));
    assert_ne!(hash(Tree::SHAPE), hash(<GenericTree<u64>>::SHAPE));
    assert_ne!(hash(A::SHAPE), hash(B::SHAPE));
    assert_ne!(hash(<List<i64>>::SHAPE), hash(<List<List<i64>>>::SHAPE));
    assert_eq!(
        hash(<Vec<Tree>>::SHAPE),
        hash(<Vec<elsewhere::Tree>>::SHAPE)
    );
    // Written by hand with a reference back: the same shape.
    const BY_HAND: Shape = Shape::Struct {
        name: "Tree",
        fields: &[
            Field {
                name: "label",
                shape: &Shape::String,
            },
            Field {
                name: "children",
                shape: &Shape::Seq(&Shape::Recursive("Tree")),
            },
        ],
    };
    assert_eq!(*Tree::SHAPE, BY_HAND);
    assert_eq!(hash(Tree::SHAPE), hash(&BY_HAND));
    // Computed by the compiler.
    const H: u64 = hash(Tree::SHAPE);
    assert_eq!(H, hash(Tree::SHAPE));
}

/// Two types of one name, each holding the other: the one inside comes
/// back to the outer one.
mod twins {
    use super::*;

    #[derive(Serialize, Deserialize, Schema)]
    #[serde(rename = "Node")]
    pub(crate) struct Outer {
        pub(crate) a: Option<Box<Inner>>,
    }

    #[derive(Serialize, Deserialize, Schema)]
    #[serde(rename = "Node")]
    pub(crate) struct Inner {
        pub(crate) b: Option<Box<Outer>>,
    }
}

/// The same text, but the one inside comes back to itself.
mod loner {
    use super::*;

    #[derive(Serialize, Deserialize, Schema)]
    #[serde(rename = "Node")]
    pub(crate) struct Outer {
        pub(crate) a: Option<Box<Inner>>,
    }

    #[derive(Serialize, Deserialize, Schema)]
    #[serde(rename = "Node")]
    pub(crate) struct Inner {
        pub(crate) b: Option<Box<Inner>>,
    }
}

/// Where a reference back leads counts, not only the name it shows.
#[test]
fn references_back_to_types_of_one_name_are_told_apart() {
    let text = "Node { a: Option<Node { b: Option<Node> }> }";
    assert_eq!(twins::Outer::SHAPE.to_string(), text);
    assert_eq!(loner::Outer::SHAPE.to_string(), text);
    assert_ne!(twins::Outer::SHAPE, loner::Outer::SHAPE);
    assert_ne!(hash(twins::Outer::SHAPE), hash(loner::Outer::SHAPE));
}

/// A recursive value written by one declaration reads back through
/// another of equal hash.
#[test]
fn equal_recursive_hashes_mean_compatible_payloads() {
    let tree = Tree {
        label: "root".into(),
        children: vec![
            Tree {
                label: "a".into(),
                children: vec![],
            },
            Tree {
                label: "b".into(),
                children: vec![Tree {
                    label: "c".into(),
                    children: vec![],
                }],
            },
        ],
    };
    let bytes = postcard::to_allocvec(&tree).unwrap();
    let back: GenericTree<String> = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(back.children[1].children[0].label, "c");
    let again: elsewhere::Tree = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(postcard::to_allocvec(&again).unwrap(), bytes);
}
