//! `#[derive(Schema)]`: the shapes it derives follow serde's data model
//! and its attributes, and what changes the payload's layout changes the
//! hash.
#![allow(clippy::unwrap_used, dead_code)]

use ferry_rpc::schema::{hash, Schema, Shape};
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
    let Shape::Enum { variants, .. } = Command::SHAPE else {
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
