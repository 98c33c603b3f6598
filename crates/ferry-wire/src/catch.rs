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

    fn serialize_bool(self, _: bool) -> R {
        Ok(())
    }
    fn serialize_i8(self, _: i8) -> R {
        Ok(())
    }
    fn serialize_i16(self, _: i16) -> R {
        Ok(())
    }
    fn serialize_i32(self, _: i32) -> R {
        Ok(())
    }
    fn serialize_i64(self, _: i64) -> R {
        Ok(())
    }
    fn serialize_i128(self, _: i128) -> R {
        Ok(())
    }
    fn serialize_u8(self, _: u8) -> R {
        Ok(())
    }
    fn serialize_u16(self, _: u16) -> R {
        Ok(())
    }
    fn serialize_u32(self, _: u32) -> R {
        Ok(())
    }
    fn serialize_u64(self, _: u64) -> R {
        Ok(())
    }
    fn serialize_u128(self, _: u128) -> R {
        Ok(())
    }
    fn serialize_f32(self, _: f32) -> R {
        Ok(())
    }
    fn serialize_f64(self, _: f64) -> R {
        Ok(())
    }
    fn serialize_char(self, _: char) -> R {
        Ok(())
    }
    fn serialize_str(self, _: &str) -> R {
        Ok(())
    }
    fn serialize_bytes(self, _: &[u8]) -> R {
        Ok(())
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

impl ser::SerializeSeq for Catch {
    type Ok = ();
    type Error = Caught;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> R {
        value.serialize(Catch)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeTuple for Catch {
    type Ok = ();
    type Error = Caught;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> R {
        value.serialize(Catch)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeTupleStruct for Catch {
    type Ok = ();
    type Error = Caught;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> R {
        value.serialize(Catch)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeTupleVariant for Catch {
    type Ok = ();
    type Error = Caught;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> R {
        value.serialize(Catch)
    }
    fn end(self) -> R {
        Ok(())
    }
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

impl ser::SerializeStruct for Catch {
    type Ok = ();
    type Error = Caught;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, _: &'static str, value: &T) -> R {
        value.serialize(Catch)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeStructVariant for Catch {
    type Ok = ();
    type Error = Caught;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, _: &'static str, value: &T) -> R {
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
