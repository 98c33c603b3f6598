//! A function's result kept as a typed value: encoded for a reply, or held
//! on the callee (an RRef's owner keeps the result of a `remote` call).

use std::any::{type_name, Any};
use std::sync::{Arc, OnceLock};

use ferry_wire::payload::{self, Encoded};
use ferry_wire::WireError;
use parking_lot::Mutex;
use serde::Serialize;

/// A value of any serializable type, shared and type-erased.
///
/// The type need only be `Send`: until someone asks for it by reference,
/// the value sits behind a lock and each [`encode`](Self::encode) has it
/// to itself (a function's result on its way into a reply is never
/// shared). [`downcast`](Self::downcast), which hands out an `Arc<T>`
/// that other threads may read at the same time, asks for `T: Sync`.
///
/// ```
/// use ferry_rpc::Value;
///
/// let v = Value::new(vec![1u32, 2, 3]);
/// assert_eq!(v.type_name(), std::any::type_name::<Vec<u32>>());
/// assert_eq!(*v.downcast::<Vec<u32>>().unwrap(), vec![1, 2, 3]);
/// assert!(v.downcast::<String>().is_none());
/// assert!(!v.encode().unwrap().payload.is_empty());
///
/// // Neither `Sync` nor ever shared: still encodable, from any thread.
/// let cell = Value::new(std::cell::RefCell::new(7u8));
/// let encoded = std::thread::spawn(move || cell.encode()).join().unwrap();
/// assert!(encoded.is_ok());
/// ```
#[derive(Clone)]
pub struct Value {
    inner: Arc<dyn Held>,
    type_name: &'static str,
}

/// A value of one type behind the type erasure.
trait Held: Send + Sync {
    fn encode(&self) -> Result<Encoded, WireError>;
    fn as_any(&self) -> &dyn Any;
}

/// The value itself while nobody shares it, then the shared one.
struct Slot<T> {
    /// The value, until [`Value::downcast`] moves it into `shared`.
    owned: Mutex<Option<T>>,
    /// The value once shared (an `Arc<T>`, set under `owned`'s lock).
    shared: OnceLock<Arc<dyn Any + Send + Sync>>,
}

impl<T: Serialize + Send + 'static> Held for Slot<T> {
    fn encode(&self) -> Result<Encoded, WireError> {
        let owned = self.owned.lock();
        if let Some(value) = &*owned {
            return payload::encode(value);
        }
        drop(owned);
        match self.shared.get().and_then(|v| v.downcast_ref::<T>()) {
            Some(value) => payload::encode(value),
            None => Err(WireError::Payload(format!(
                "a {} value is missing",
                type_name::<T>()
            ))),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Value {
    /// Wraps `value`.
    pub fn new<T: Serialize + Send + 'static>(value: T) -> Self {
        Self {
            inner: Arc::new(Slot {
                owned: Mutex::new(Some(value)),
                shared: OnceLock::new(),
            }),
            type_name: type_name::<T>(),
        }
    }

    /// Encodes the value as a payload (with its tensors out of band).
    pub fn encode(&self) -> Result<Encoded, WireError> {
        self.inner.encode()
    }

    /// The value as a `T`, if it is one; every call gives the same `Arc`.
    pub fn downcast<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        let slot = self.inner.as_any().downcast_ref::<Slot<T>>()?;
        {
            let mut owned = slot.owned.lock();
            if let Some(value) = owned.take() {
                let shared: Arc<dyn Any + Send + Sync> = Arc::new(value);
                // Set under the lock: an encoder that finds `owned`
                // empty finds `shared` set.
                let _ = slot.shared.set(shared);
            }
        }
        slot.shared.get()?.clone().downcast::<T>().ok()
    }

    /// Runs `f` on the value as a `T`, if it is one, without sharing it:
    /// for types that are not `Sync` (`f` has the value to itself while
    /// it runs, and holds up encodings of it meanwhile).
    ///
    /// ```
    /// use ferry_rpc::Value;
    /// use std::cell::Cell;
    ///
    /// let v = Value::new(Cell::new(1u32));
    /// assert_eq!(v.with(|c: &Cell<u32>| c.replace(5)), Some(1));
    /// assert_eq!(v.with(|c: &Cell<u32>| c.get()), Some(5));
    /// assert_eq!(v.with(|s: &String| s.len()), None);
    /// ```
    pub fn with<T: Any + Send, R>(&self, f: impl FnOnce(&T) -> R) -> Option<R> {
        let slot = self.inner.as_any().downcast_ref::<Slot<T>>()?;
        let owned = slot.owned.lock();
        if let Some(value) = &*owned {
            return Some(f(value));
        }
        drop(owned);
        slot.shared.get()?.downcast_ref::<T>().map(f)
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

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    /// A value of a type that is `Send` but not `Sync`, encoded by several
    /// threads at once: each encoding has it to itself and all agree.
    #[test]
    fn a_value_that_is_not_sync_encodes_from_many_threads() {
        let v = Value::new(RefCell::new(vec![5u64; 1000]));
        let expected = v.encode().unwrap().payload;
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let v = v.clone();
                std::thread::spawn(move || {
                    (0..200)
                        .map(|_| v.encode().unwrap().payload)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for t in threads {
            for payload in t.join().unwrap() {
                assert_eq!(payload, expected);
            }
        }
    }

    /// Sharing moves the value out from behind the lock once: every
    /// downcast gives the same `Arc`, encoding goes on working, a wrong
    /// type gives `None` and changes nothing.
    #[test]
    fn downcasts_share_one_value_and_encoding_goes_on() {
        let v = Value::new(vec![1u32, 2, 3]);
        let before = v.encode().unwrap().payload;
        assert!(v.downcast::<String>().is_none());
        let a = v.downcast::<Vec<u32>>().unwrap();
        let b = v.clone().downcast::<Vec<u32>>().unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(v.encode().unwrap().payload, before);
        assert_eq!(v.with(|s: &Vec<u32>| s.len()), Some(3));
        assert_eq!(v.type_name(), type_name::<Vec<u32>>());
    }

    /// Encoders racing the first downcast always find the value.
    #[test]
    fn encoding_while_the_value_becomes_shared_finds_it() {
        for _ in 0..50 {
            let v = Value::new(vec![9u8; 64]);
            let expected = v.encode().unwrap().payload;
            let encoders: Vec<_> = (0..4)
                .map(|_| {
                    let (v, expected) = (v.clone(), expected.clone());
                    std::thread::spawn(move || {
                        (0..50).all(|_| v.encode().unwrap().payload == expected)
                    })
                })
                .collect();
            let shared = v.downcast::<Vec<u8>>().unwrap();
            assert_eq!(shared.len(), 64);
            for e in encoders {
                assert!(e.join().unwrap());
            }
            assert_eq!(v.encode().unwrap().payload, expected);
        }
    }
}
