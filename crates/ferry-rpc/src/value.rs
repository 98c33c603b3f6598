//! A function's result kept as a typed value: encoded for a reply, or held
//! on the callee (an RRef's owner keeps the result of a `remote` call).

use std::any::{type_name, Any};
use std::sync::Arc;

use ferry_wire::payload::{self, Encoded};
use ferry_wire::WireError;
use serde::Serialize;

type EncodeFn = fn(&(dyn Any + Send + Sync)) -> Result<Encoded, WireError>;

/// A value of any serializable type, shared and type-erased.
///
/// ```
/// use ferry_rpc::Value;
///
/// let v = Value::new(vec![1u32, 2, 3]);
/// assert_eq!(v.type_name(), std::any::type_name::<Vec<u32>>());
/// assert_eq!(*v.downcast::<Vec<u32>>().unwrap(), vec![1, 2, 3]);
/// assert!(v.downcast::<String>().is_none());
/// assert!(!v.encode().unwrap().payload.is_empty());
/// ```
#[derive(Clone)]
pub struct Value {
    inner: Arc<dyn Any + Send + Sync>,
    encode: EncodeFn,
    type_name: &'static str,
}

impl Value {
    /// Wraps `value`.
    pub fn new<T: Serialize + Send + Sync + 'static>(value: T) -> Self {
        fn encode<T: Serialize + 'static>(
            v: &(dyn Any + Send + Sync),
        ) -> Result<Encoded, WireError> {
            match v.downcast_ref::<T>() {
                Some(v) => payload::encode(v),
                None => Err(WireError::Payload(format!(
                    "a value is not a {}",
                    type_name::<T>()
                ))),
            }
        }
        Self {
            inner: Arc::new(value),
            encode: encode::<T>,
            type_name: type_name::<T>(),
        }
    }

    /// Encodes the value as a payload (with its tensors out of band).
    pub fn encode(&self) -> Result<Encoded, WireError> {
        (self.encode)(&*self.inner)
    }

    /// The value as a `T`, if it is one.
    pub fn downcast<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        self.inner.clone().downcast::<T>().ok()
    }

    /// `std::any::type_name` of the value's type.
    pub fn type_name(&self) -> &'static str {
        self.type_name
    }
}

impl std::fmt::Debug for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Value")
            .field("type", &self.type_name)
            .finish()
    }
}
