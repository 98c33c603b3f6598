//! [`Schema`] for the standard library's types, with the shapes serde's
//! own impls write.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet, LinkedList, VecDeque};
use std::marker::PhantomData;
use std::rc::Rc;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use crate::schema::{Field, Schema, Shape, Variant, VariantData};

macro_rules! primitive {
    ($($t:ty => $shape:ident),* $(,)?) => {
        $(impl Schema for $t {
            const SHAPE: &'static Shape = &Shape::$shape;
        })*
    };
}

primitive! {
    bool => Bool,
    i8 => I8, i16 => I16, i32 => I32, i64 => I64, i128 => I128, isize => I64,
    u8 => U8, u16 => U16, u32 => U32, u64 => U64, u128 => U128, usize => U64,
    f32 => F32, f64 => F64, char => Char,
    String => String, str => String, () => Unit,
}

// serde writes an atomic as the integer (or bool) it holds.
primitive! {
    std::sync::atomic::AtomicBool => Bool,
    std::sync::atomic::AtomicI8 => I8, std::sync::atomic::AtomicI16 => I16,
    std::sync::atomic::AtomicI32 => I32, std::sync::atomic::AtomicI64 => I64,
    std::sync::atomic::AtomicIsize => I64,
    std::sync::atomic::AtomicU8 => U8, std::sync::atomic::AtomicU16 => U16,
    std::sync::atomic::AtomicU32 => U32, std::sync::atomic::AtomicU64 => U64,
    std::sync::atomic::AtomicUsize => U64,
}

/// Types serde writes exactly as the type they hold.
macro_rules! transparent {
    ($($t:ident),*) => {
        $(impl<T: Schema + ?Sized> Schema for $t<T> {
            const SHAPE: &'static Shape = T::SHAPE;
        })*
    };
}
transparent!(Box, Rc, Arc);
// serde writes a lock as the value inside (locking it), so state behind an
// RRef (`Mutex<Vec<f32>>`, `RwLock<Model>`) has the shape of its value.
transparent!(Mutex, RwLock, RefCell);

impl<T: Schema + ?Sized> Schema for &T {
    const SHAPE: &'static Shape = T::SHAPE;
}

impl<T: Schema + ?Sized> Schema for &mut T {
    const SHAPE: &'static Shape = T::SHAPE;
}

impl<T: Schema + ToOwned + ?Sized> Schema for Cow<'_, T> {
    const SHAPE: &'static Shape = T::SHAPE;
}

impl<T: Schema> Schema for Option<T> {
    const SHAPE: &'static Shape = &Shape::Option(T::SHAPE);
}

macro_rules! seq {
    ($($t:ident),*) => {
        $(impl<T: Schema> Schema for $t<T> {
            const SHAPE: &'static Shape = &Shape::Seq(T::SHAPE);
        })*
    };
}
seq!(Vec, VecDeque, LinkedList, BinaryHeap, BTreeSet);

impl<T: Schema, S> Schema for HashSet<T, S> {
    const SHAPE: &'static Shape = &Shape::Seq(T::SHAPE);
}

impl<T: Schema> Schema for [T] {
    const SHAPE: &'static Shape = &Shape::Seq(T::SHAPE);
}

impl<T: Schema, const N: usize> Schema for [T; N] {
    const SHAPE: &'static Shape = &Shape::Array {
        len: N,
        item: T::SHAPE,
    };
}

impl<K: Schema, V: Schema, S> Schema for HashMap<K, V, S> {
    const SHAPE: &'static Shape = &Shape::Map {
        key: K::SHAPE,
        value: V::SHAPE,
    };
}

impl<K: Schema, V: Schema> Schema for BTreeMap<K, V> {
    const SHAPE: &'static Shape = &Shape::Map {
        key: K::SHAPE,
        value: V::SHAPE,
    };
}

macro_rules! tuple {
    ($($name:ident)+) => {
        impl<$($name: Schema),+> Schema for ($($name,)+) {
            const SHAPE: &'static Shape = &Shape::Tuple(&[$($name::SHAPE),+]);
        }
    };
}
tuple!(A);
tuple!(A B);
tuple!(A B C);
tuple!(A B C D);
tuple!(A B C D E);
tuple!(A B C D E F);
tuple!(A B C D E F G);
tuple!(A B C D E F G H);
tuple!(A B C D E F G H I);
tuple!(A B C D E F G H I J);
tuple!(A B C D E F G H I J K);
tuple!(A B C D E F G H I J K L);

impl<T: Schema, E: Schema> Schema for Result<T, E> {
    const SHAPE: &'static Shape = &Shape::Enum {
        name: "Result",
        variants: &[
            Variant {
                index: 0,
                name: "Ok",
                data: VariantData::Newtype(T::SHAPE),
            },
            Variant {
                index: 1,
                name: "Err",
                data: VariantData::Newtype(E::SHAPE),
            },
        ],
    };
}

impl<T: ?Sized> Schema for PhantomData<T> {
    const SHAPE: &'static Shape = &Shape::UnitStruct("PhantomData");
}

impl Schema for Duration {
    const SHAPE: &'static Shape = &Shape::Struct {
        name: "Duration",
        fields: &[
            Field {
                name: "secs",
                shape: &Shape::U64,
            },
            Field {
                name: "nanos",
                shape: &Shape::U32,
            },
        ],
    };
}

impl Schema for SystemTime {
    const SHAPE: &'static Shape = &Shape::Struct {
        name: "SystemTime",
        fields: &[
            Field {
                name: "secs_since_epoch",
                shape: &Shape::U64,
            },
            Field {
                name: "nanos_since_epoch",
                shape: &Shape::U32,
            },
        ],
    };
}

/// A tensor in a payload: an entry of the message's out-of-band tensor
/// table (`ferry_tch::Tensor` writes autograd metadata beside its entry,
/// so it has a shape of its own).
impl Schema for ferry_transport::RawTensor {
    const SHAPE: &'static Shape = &Shape::Opaque {
        name: "RawTensor",
        params: &[],
    };
}
