//! Recovers the text of a custom serialization error, which postcard drops
//! (its `Error::custom` keeps no message): the value is serialized again
//! into a serializer that writes nothing and whose error keeps the text.

use std::fmt::Display;

use serde::ser::{self, Serialize};

/// The text of the custom error `value` raises when serialized, if any.
pub(crate) fn custom_message<T: Serialize + ?Sized>(value: &T) -> Option<String> {
    value.serialize(Catch).err().map(|Caught(m)| m)
}

/// A custom error's text.
#[derive(Debug)]
pub(crate) struct Caught(String);

impl Display for Caught {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Caught {}

impl ser::Error for Caught {
    fn custom<M: Display>(msg: M) -> Self {
        Caught(msg.to_string())
    }
}

/// Walks a value, writing nothing.
struct Catch;

type R = Result<(), Caught>;

/// Serializer methods for values that hold nothing to walk.
macro_rules! ignore_primitives {
    ($($method:ident($ty:ty),)*) => {$(
        fn $method(self, _: $ty) -> R {
            Ok(())
        }
    )*};
}

impl ser::Serializer for Catch {
    type Ok = ();
    type Error = Caught;
    type SerializeSeq = Catch;
    type SerializeTuple = Catch;
    type SerializeTupleStruct = Catch;
    type SerializeTupleVariant = Catch;
    type SerializeMap = Catch;
    type SerializeStruct = Catch;
    type SerializeStructVariant = Catch;

    ignore_primitives! {
        serialize_bool(bool),
        serialize_i8(i8),
        serialize_i16(i16),
        serialize_i32(i32),
        serialize_i64(i64),
        serialize_i128(i128),
        serialize_u8(u8),
        serialize_u16(u16),
        serialize_u32(u32),
        serialize_u64(u64),
        serialize_u128(u128),
        serialize_f32(f32),
        serialize_f64(f64),
        serialize_char(char),
        serialize_str(&str),
        serialize_bytes(&[u8]),
    }
    fn serialize_none(self) -> R {
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> R {
        value.serialize(Catch)
    }
    fn serialize_unit(self) -> R {
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> R {
        Ok(())
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, _: &'static str) -> R {
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, value: &T) -> R {
        value.serialize(Catch)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        value: &T,
    ) -> R {
        value.serialize(Catch)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Catch, Caught> {
        Ok(Catch)
    }
    fn serialize_tuple(self, _: usize) -> Result<Catch, Caught> {
        Ok(Catch)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Catch, Caught> {
        Ok(Catch)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Catch, Caught> {
        Ok(Catch)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Catch, Caught> {
        Ok(Catch)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Catch, Caught> {
        Ok(Catch)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Catch, Caught> {
        Ok(Catch)
    }
}

/// The compound serializers: each element or field is walked in turn.
macro_rules! walk_compound {
    ($($compound:ident::$method:ident($($name:ty),*);)*) => {$(
        impl ser::$compound for Catch {
            type Ok = ();
            type Error = Caught;
            fn $method<T: Serialize + ?Sized>(&mut self, $(_: $name,)* value: &T) -> R {
                value.serialize(Catch)
            }
            fn end(self) -> R {
                Ok(())
            }
        }
    )*};
}

walk_compound! {
    SerializeSeq::serialize_element();
    SerializeTuple::serialize_element();
    SerializeTupleStruct::serialize_field();
    SerializeTupleVariant::serialize_field();
    SerializeStruct::serialize_field(&'static str);
    SerializeStructVariant::serialize_field(&'static str);
}

impl ser::SerializeMap for Catch {
    type Ok = ();
    type Error = Caught;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> R {
        key.serialize(Catch)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> R {
        value.serialize(Catch)
    }
    fn end(self) -> R {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Refuses;
    impl Serialize for Refuses {
        fn serialize<S: ser::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
            Err(ser::Error::custom("this value refuses to be encoded"))
        }
    }

    #[test]
    fn a_custom_error_deep_inside_keeps_its_text() {
        let value = (1u8, vec![Some(("a", Refuses))]);
        assert_eq!(
            custom_message(&value).as_deref(),
            Some("this value refuses to be encoded")
        );
        assert_eq!(custom_message(&(1u8, "fine")), None);
    }
}
