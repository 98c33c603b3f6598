//! [`Tensor`]: a `tch::Tensor` that travels inside Ferry payloads.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use ferry_transport::RawTensor;
use ferry_wire::payload;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::alloc::{take_landed, Received};
use crate::dtype::kind_of;
use crate::grad::{self, GradMeta};
use crate::outgoing::Outgoing;
use crate::tree;

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
        let outgoing = Outgoing::new(&self.0)
            .map_err(|e| payload::custom_ser_error::<S::Error>(e.to_string()))?;
        let meta = if self.0.requires_grad() {
            grad::current().and_then(|r| r.record_send(&self.0))
        } else {
            None
        };
        Wire {
            tensor: Arc::new(outgoing),
            meta,
        }
        .serialize(s)
    }
}

/// The serialised form: the table entry, then the autograd metadata.
struct Wire {
    tensor: Arc<Outgoing>,
    meta: Option<GradMeta>,
}

impl Serialize for Wire {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        struct Entry(Arc<Outgoing>);
        impl Serialize for Entry {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                payload::serialize_tensor(self.0.clone(), s)
            }
        }
        let mut t = s.serialize_tuple(2)?;
        t.serialize_element(&Entry(self.tensor.clone()))?;
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
        struct Entry(tch::Tensor);
        impl<'de> Deserialize<'de> for Entry {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let incoming = payload::deserialize_tensor(d)?;
                let desc = incoming.descriptor;
                let storage = match incoming.storage.downcast::<RawTensor>() {
                    Ok(raw) => {
                        return match take_landed(*raw) {
                            // `TchAllocator` received it: the libtorch tensor
                            // the bytes landed in.
                            Ok(t) => Ok(Entry(t)),
                            // Another allocator received it: one copy into
                            // libtorch.
                            Err(raw) => from_raw(&raw).map(Entry).map_err(payload::custom_error),
                        };
                    }
                    Err(other) => other,
                };
                match storage.downcast::<Received>() {
                    Ok(t) => Ok(Entry(t.0)),
                    Err(_) => Err(payload::custom_error(format!(
                        "received a {} tensor of shape {:?} into storage that is neither \
                         a libtorch tensor nor a RawTensor",
                        desc.dtype, desc.shape
                    ))),
                }
            }
        }
        let (Entry(tensor), meta): (Entry, Option<GradMeta>) = Deserialize::deserialize(d)?;
        let tensor = match (meta, grad::for_receive()) {
            (Some(meta), Some(recorder)) => recorder
                .record_recv(tensor, meta)
                .map_err(payload::custom_error)?,
            _ => tensor,
        };
        Ok(Tensor(tensor))
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
