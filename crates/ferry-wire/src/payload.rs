//! Payload encoding: serde values with tensors pulled out into an
//! out-of-band tensor table.
//!
//! A value is serialised with [`encode`]. Wherever a tensor type appears
//! inside it (a field, a `Vec`, a `HashMap` value, an `Option`, a tuple, at
//! any depth) its `Serialize` impl calls [`serialize_tensor`], which appends
//! the tensor to the table and writes only its index into the payload. The
//! tensor bytes never enter the payload: the table keeps a handle on the
//! tensor, and the transport sends each tensor's bytes from its own memory.
//!
//! [`decode`] reverses it: the receiver has already put every tensor's bytes
//! into a destination it allocated, and the tensor type's `Deserialize` impl
//! calls [`deserialize_tensor`] to take its entry back out of the table by
//! index.
//!
//! The payload format is postcard (compact, non-self-describing); the layers
//! above check type signatures where they need wrong-type errors.

use std::any::Any;
use std::cell::RefCell;
use std::sync::Arc;

use serde::de::{DeserializeOwned, Error as _};
use serde::ser::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{TensorDescriptor, WireError};

/// The serde name under which a tensor's table index is written.
const TENSOR_TOKEN: &str = "$ferry::tensor";

/// A tensor that can be sent: its descriptor and the bytes that travel.
///
/// Implemented by the transport's raw tensor and by the libtorch layer.
/// The sender keeps the value alive until its channel reports the bytes sent.
pub trait OutgoingTensor: Send + Sync + 'static {
    /// The tensor's descriptor; `byte_len` equals `bytes().len()` for a
    /// host tensor.
    fn descriptor(&self) -> TensorDescriptor;
    /// The bytes that travel (host memory); empty for a device tensor.
    fn bytes(&self) -> &[u8];
    /// The device address of the bytes of a tensor on a CUDA device
    /// (`descriptor().device` is `cuda:N`): `byte_len` bytes there travel.
    /// `None` (the default) for a host tensor.
    fn device_ptr(&self) -> Option<u64> {
        None
    }
}

/// A received tensor: its descriptor and the destination its bytes were
/// written into, as allocated by the receiver's allocation hook.
pub struct IncomingTensor {
    /// The descriptor the sender sent.
    pub descriptor: TensorDescriptor,
    /// The destination, of whatever type the allocation hook produced.
    pub storage: Box<dyn Any + Send>,
}

impl std::fmt::Debug for IncomingTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncomingTensor")
            .field("descriptor", &self.descriptor)
            .finish_non_exhaustive()
    }
}

/// An encoded value: the serde payload and the tensors pulled out of it.
#[derive(Default)]
pub struct Encoded {
    /// The postcard payload, with tensors replaced by table indices.
    pub payload: Vec<u8>,
    /// The tensor table, in index order.
    pub tensors: Vec<Arc<dyn OutgoingTensor>>,
}

impl std::fmt::Debug for Encoded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoded")
            .field("payload_len", &self.payload.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl Encoded {
    /// Descriptors of the table's tensors, in index order.
    pub fn descriptors(&self) -> Vec<TensorDescriptor> {
        self.tensors.iter().map(|t| t.descriptor()).collect()
    }
}

thread_local! {
    /// postcard keeps no text for custom serde errors: the last one raised
    /// by this module is kept here so the returned error can name the cause.
    static LAST_CUSTOM: RefCell<Option<String>> = const { RefCell::new(None) };
    static ENCODING: RefCell<Vec<Vec<Arc<dyn OutgoingTensor>>>> = const { RefCell::new(Vec::new()) };
    static DECODING: RefCell<Vec<Vec<Option<IncomingTensor>>>> = const { RefCell::new(Vec::new()) };
}

/// Pops the innermost table when dropped, also when serde unwinds.
struct Scope<F: Fn()>(F);
impl<F: Fn()> Drop for Scope<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// Serialises `value`, pulling every tensor inside it into the tensor table.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Encoded, WireError> {
    let mut payload = Vec::with_capacity(64);
    let tensors = encode_into(value, &mut payload)?;
    Ok(Encoded { payload, tensors })
}

/// Like [`encode`], appending the payload to `out` (lets callers reuse buffers).
pub fn encode_into<T: Serialize + ?Sized>(
    value: &T,
    out: &mut Vec<u8>,
) -> Result<Vec<Arc<dyn OutgoingTensor>>, WireError> {
    LAST_CUSTOM.with(|c| c.borrow_mut().take());
    ENCODING.with(|s| s.borrow_mut().push(Vec::new()));
    let scope = Scope(|| {
        ENCODING.with(|s| {
            s.borrow_mut().pop();
        })
    });
    let taken = std::mem::take(out);
    let result = postcard::to_extend(value, taken);
    let tensors = ENCODING.with(|s| {
        s.borrow_mut()
            .last_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    });
    if matches!(result, Err(postcard::Error::SerdeSerCustom))
        && LAST_CUSTOM.with(|c| c.borrow().is_none())
    {
        // A type's own custom error: postcard dropped its text, so walk
        // the value again (still inside this table, whose tensors are
        // dropped) to catch it.
        if let Some(msg) = crate::catch::custom_message(value) {
            LAST_CUSTOM.with(|c| *c.borrow_mut() = Some(msg));
        }
    }
    drop(scope);
    match result {
        Ok(buf) => {
            *out = buf;
            Ok(tensors)
        }
        Err(e) => Err(payload_error(e)),
    }
}

/// Converts a postcard error, recovering the text of a custom error.
fn payload_error(e: postcard::Error) -> WireError {
    let custom = LAST_CUSTOM.with(|c| c.borrow_mut().take());
    match (e, custom) {
        (postcard::Error::SerdeSerCustom | postcard::Error::SerdeDeCustom, Some(msg)) => {
            WireError::Payload(msg)
        }
        (e, _) => WireError::Payload(e.to_string()),
    }
}

/// Records the text of a custom error before handing it to serde.
fn custom(msg: impl Into<String>) -> String {
    let msg = msg.into();
    LAST_CUSTOM.with(|c| *c.borrow_mut() = Some(msg.clone()));
    msg
}

/// Deserialises a `T` from `payload`, handing it the received tensors.
///
/// Trailing payload bytes, indices out of range and tensors taken twice are
/// errors. Tensors the value does not take are dropped.
pub fn decode<T: DeserializeOwned>(
    payload: &[u8],
    tensors: Vec<IncomingTensor>,
) -> Result<T, WireError> {
    DECODING.with(|s| s.borrow_mut().push(tensors.into_iter().map(Some).collect()));
    let _scope = Scope(|| {
        DECODING.with(|s| {
            s.borrow_mut().pop();
        })
    });
    LAST_CUSTOM.with(|c| c.borrow_mut().take());
    let (value, rest) = postcard::take_from_bytes::<T>(payload).map_err(payload_error)?;
    if !rest.is_empty() {
        return Err(WireError::Trailing {
            what: "payload",
            count: rest.len() as u64,
        });
    }
    Ok(value)
}

/// [`decode`] with a [`DeserializeSeed`](serde::de::DeserializeSeed)
/// driving it: for a value whose type is known at run time only (a
/// binding to another language decoding by a described shape). The same
/// rules: trailing bytes, indices out of range and tensors taken twice are
/// errors.
pub fn decode_seed<'de, S: serde::de::DeserializeSeed<'de>>(
    seed: S,
    payload: &'de [u8],
    tensors: Vec<IncomingTensor>,
) -> Result<S::Value, WireError> {
    DECODING.with(|s| s.borrow_mut().push(tensors.into_iter().map(Some).collect()));
    let _scope = Scope(|| {
        DECODING.with(|s| {
            s.borrow_mut().pop();
        })
    });
    LAST_CUSTOM.with(|c| c.borrow_mut().take());
    let mut de = postcard::Deserializer::from_bytes(payload);
    let value = seed.deserialize(&mut de).map_err(payload_error)?;
    let rest = de.finalize().map_err(payload_error)?;
    if !rest.is_empty() {
        return Err(WireError::Trailing {
            what: "payload",
            count: rest.len() as u64,
        });
    }
    Ok(value)
}

/// Called by a tensor type's `Serialize` impl: appends the tensor to the
/// active table and writes its index.
///
/// Outside [`encode`] there is no table, and this fails with a serde error.
pub fn serialize_tensor<S: Serializer>(
    tensor: Arc<dyn OutgoingTensor>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let index = ENCODING.with(|s| {
        let mut s = s.borrow_mut();
        let table = s.last_mut()?;
        table.push(tensor);
        Some(table.len() - 1)
    });
    match index.and_then(|i| u32::try_from(i).ok()) {
        Some(i) => serializer.serialize_newtype_struct(TENSOR_TOKEN, &i),
        None => Err(S::Error::custom(custom(
            "a tensor can only be serialized inside a Ferry payload (ferry_wire::payload::encode)",
        ))),
    }
}

/// Builds a custom serde error whose text survives postcard (which keeps
/// none): tensor types use it for their own conversion errors.
pub fn custom_error<E: serde::de::Error>(msg: impl Into<String>) -> E {
    E::custom(custom(msg))
}

/// [`custom_error`] for serialization: a type that refuses to be encoded
/// (an RRef whose creation failed) names the reason this way.
pub fn custom_ser_error<E: serde::ser::Error>(msg: impl Into<String>) -> E {
    E::custom(custom(msg))
}

/// Called by a tensor type's `Deserialize` impl: reads an index and takes
/// that tensor out of the active table.
pub fn deserialize_tensor<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<IncomingTensor, D::Error> {
    #[derive(Deserialize)]
    #[serde(rename = "$ferry::tensor")]
    struct Index(u32);
    let Index(index) = Index::deserialize(deserializer)?;
    DECODING.with(|s| {
        let mut s = s.borrow_mut();
        let table = s.last_mut().ok_or_else(|| {
            D::Error::custom(custom(
                "a tensor can only be deserialized inside a Ferry payload (ferry_wire::payload::decode)",
            ))
        })?;
        let len = table.len();
        let slot = table.get_mut(index as usize).ok_or_else(|| {
            D::Error::custom(custom(format!(
                "tensor index {index} out of range: the message carries {len} tensors"
            )))
        })?;
        slot.take()
            .ok_or_else(|| D::Error::custom(custom(format!("tensor index {index} used twice"))))
    })
}
