//! [`Tensor`]: a `tch::Tensor` that travels inside Ferry payloads.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use ferry_transport::RawTensor;
use ferry_wire::payload;
use ferry_wire::sparse::SparseCoo;
use ferry_wire::TensorDescriptor;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::alloc::{take_landed, Received};
use crate::dtype::kind_of;
use crate::grad::{self, GradMeta};
use crate::outgoing::Outgoing;
use crate::{sparse, tree};

/// A libtorch tensor that can sit anywhere in an RPC argument or result
/// (a field, a `Vec`, a map value, a tuple, nested). It derefs to
/// [`tch::Tensor`], and converts from and into one.
///
/// On the wire only its index into the message's tensor table and, under
/// distributed autograd, its [`GradMeta`] go into the payload; its bytes are
/// sent from its own storage and land in a tensor the receiver allocated.
pub struct Tensor(pub tch::Tensor);

impl Tensor {
    /// Wraps a libtorch tensor.
    pub fn new(tensor: tch::Tensor) -> Self {
        Tensor(tensor)
    }

    /// The libtorch tensor.
    pub fn into_inner(self) -> tch::Tensor {
        self.0
    }
}

impl Deref for Tensor {
    type Target = tch::Tensor;
    fn deref(&self) -> &tch::Tensor {
        &self.0
    }
}

impl DerefMut for Tensor {
    fn deref_mut(&mut self) -> &mut tch::Tensor {
        &mut self.0
    }
}

impl From<tch::Tensor> for Tensor {
    fn from(t: tch::Tensor) -> Self {
        Tensor(t)
    }
}

impl From<Tensor> for tch::Tensor {
    fn from(t: Tensor) -> Self {
        t.0
    }
}

impl Clone for Tensor {
    /// A shallow clone: the same tensor (storage and autograd history), as
    /// `tch::Tensor::shallow_clone`.
    fn clone(&self) -> Self {
        Tensor(self.0.shallow_clone())
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tensor")
            .field("kind", &self.0.f_kind().ok())
            .field("size", &self.0.size())
            .field("requires_grad", &self.0.requires_grad())
            .finish()
    }
}

impl Serialize for Tensor {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Inside `tree::flatten`: only the tensor's index in its list.
        if let Some(index) = tree::push_flattened(&self.0) {
            return s.serialize_u32(index);
        }
        let ser_error = |e: crate::TchError| payload::custom_ser_error::<S::Error>(e.to_string());
        let body = if self.0.defined() && self.0.is_sparse() {
            let (indices, values, layout) = sparse::parts(&self.0).map_err(ser_error)?;
            Body::SparseCoo {
                indices: Arc::new(Outgoing::new(&indices).map_err(ser_error)?),
                values: Arc::new(Outgoing::new(&values).map_err(ser_error)?),
                layout,
            }
        } else {
            Body::Strided(Arc::new(Outgoing::new(&self.0).map_err(ser_error)?))
        };
        let meta = if self.0.requires_grad() {
            grad::current().and_then(|r| r.record_send(&self.0))
        } else {
            None
        };
        Wire { body, meta }.serialize(s)
    }
}

/// What stands for a tensor's data in the payload: one entry of the
/// message's tensor table for a strided tensor; for a sparse COO tensor,
/// the entries of its indices and values and its layout. (The variants'
/// order is the wire's: [`BodyIn`] reads them in the same order.)
enum Body {
    Strided(Arc<Outgoing>),
    SparseCoo {
        indices: Arc<Outgoing>,
        values: Arc<Outgoing>,
        layout: SparseCoo,
    },
}

/// The serialised form: the body, then the autograd metadata.
struct Wire {
    body: Body,
    meta: Option<GradMeta>,
}

/// A table entry.
struct Entry<'a>(&'a Arc<Outgoing>);

impl Serialize for Entry<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        payload::serialize_tensor(self.0.clone(), s)
    }
}

impl Serialize for Body {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTupleVariant;
        match self {
            Body::Strided(t) => s.serialize_newtype_variant("Body", 0, "Strided", &Entry(t)),
            Body::SparseCoo {
                indices,
                values,
                layout,
            } => {
                let mut v = s.serialize_tuple_variant("Body", 1, "SparseCoo", 3)?;
                v.serialize_field(&Entry(indices))?;
                v.serialize_field(&Entry(values))?;
                v.serialize_field(layout)?;
                v.end()
            }
        }
    }
}

impl Serialize for Wire {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let mut t = s.serialize_tuple(2)?;
        t.serialize_element(&self.body)?;
        t.serialize_element(&self.meta)?;
        t.end()
    }
}

impl<'de> Deserialize<'de> for Tensor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Inside `tree::unflatten`: the tensor at the index.
        if tree::unflattening() {
            let index = u32::deserialize(d)?;
            return tree::take_unflattened(index)
                .map(Tensor)
                .map_err(serde::de::Error::custom);
        }
        let (body, meta): (BodyIn, Option<GradMeta>) = Deserialize::deserialize(d)?;
        let tensor = match body {
            BodyIn::Strided(EntryIn(tensor, _)) => tensor,
            BodyIn::SparseCoo(EntryIn(indices, i), EntryIn(values, v), layout) => {
                sparse::rebuild(&layout, (indices, &i), (values, &v))
                    .map_err(|e| payload::custom_error(e.to_string()))?
            }
        };
        let tensor = match (meta, grad::for_receive()) {
            (Some(meta), Some(recorder)) => recorder
                .record_recv(tensor, meta)
                .map_err(payload::custom_error)?,
            _ => tensor,
        };
        Ok(Tensor(tensor))
    }
}

/// [`Body`] as it arrives.
#[derive(Deserialize)]
enum BodyIn {
    Strided(EntryIn),
    SparseCoo(EntryIn, EntryIn, SparseCoo),
}

/// A received table entry: the libtorch tensor and the descriptor it
/// arrived with.
pub(crate) struct EntryIn(pub(crate) tch::Tensor, pub(crate) TensorDescriptor);

impl<'de> Deserialize<'de> for EntryIn {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let incoming = payload::deserialize_tensor(d)?;
        let desc = incoming.descriptor;
        let storage = match incoming.storage.downcast::<RawTensor>() {
            Ok(raw) => {
                return match take_landed(*raw) {
                    // `TchAllocator` received it: the libtorch tensor the
                    // bytes landed in.
                    Ok(t) => Ok(EntryIn(t, desc)),
                    // Another allocator received it: one copy into libtorch.
                    Err(raw) => from_raw(&raw)
                        .map(|t| EntryIn(t, desc.clone()))
                        .map_err(payload::custom_error),
                };
            }
            Err(other) => other,
        };
        match storage.downcast::<Received>() {
            Ok(t) => Ok(EntryIn(t.0, desc)),
            Err(_) => Err(payload::custom_error(format!(
                "received a {} tensor of shape {:?} into storage that is neither \
                 a libtorch tensor nor a RawTensor",
                desc.dtype, desc.shape
            ))),
        }
    }
}

/// Copies a [`RawTensor`] into a new libtorch tensor of the same view.
fn from_raw(raw: &RawTensor) -> Result<tch::Tensor, String> {
    let kind = kind_of(raw.dtype());
    let bytes = raw.to_contiguous_bytes();
    let t =
        tch::Tensor::f_empty(raw.shape(), (kind, tch::Device::Cpu)).map_err(|e| e.to_string())?;
    if !bytes.is_empty() {
        // SAFETY: `t` is a fresh contiguous tensor of exactly `bytes.len()`
        // bytes (same shape and element type).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), t.data_ptr() as *mut u8, bytes.len());
        }
    }
    Ok(t)
}
