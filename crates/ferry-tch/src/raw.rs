//! [`AsRaw`]: a libtorch tensor in the payload layout of a
//! `ferry_transport::RawTensor`.

use std::sync::Arc;

use ferry_transport::RawTensor;
use ferry_wire::payload;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::alloc::{take_landed, Received};
use crate::outgoing::Outgoing;
use crate::tensor::from_raw;

/// A libtorch tensor written as a `ferry_transport::RawTensor` is: its
/// entry in the message's tensor table alone, with no autograd metadata
/// beside it (a [`Tensor`](crate::Tensor) writes some). A peer's
/// `RawTensor` receives what it sends, and it receives what a peer's
/// `RawTensor` sends, so code holding libtorch tensors (a binding to
/// Python) calls functions declared with `RawTensor`s, and serves them.
///
/// Its bytes leave from the tensor's own storage, views as views, and a
/// received one is the libtorch tensor the bytes landed in (a worker with
/// [`TchAllocator`](crate::TchAllocator)), both without a copy; it takes
/// part in no distributed autograd (no send or recv function is
/// recorded). Its [`Schema`](ferry_rpc::Schema) is `RawTensor`'s, so a
/// signature with one matches one with a `RawTensor` at the same place.
///
/// ```
/// use ferry_rpc::Schema;
///
/// assert_eq!(
///     ferry_tch::AsRaw::SHAPE.to_string(),
///     ferry_transport::RawTensor::SHAPE.to_string()
/// );
/// ```
pub struct AsRaw(pub tch::Tensor);

impl std::fmt::Debug for AsRaw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsRaw")
            .field("kind", &self.0.f_kind().ok())
            .field("size", &self.0.size())
            .finish()
    }
}

impl Serialize for AsRaw {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let outgoing = Outgoing::new(&self.0)
            .map_err(|e| payload::custom_ser_error::<S::Error>(e.to_string()))?;
        payload::serialize_tensor(Arc::new(outgoing), s)
    }
}

impl<'de> Deserialize<'de> for AsRaw {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let incoming = payload::deserialize_tensor(d)?;
        let desc = incoming.descriptor;
        let storage = match incoming.storage.downcast::<RawTensor>() {
            Ok(raw) => {
                return match take_landed(*raw) {
                    // `TchAllocator` received it: the libtorch tensor the
                    // bytes landed in.
                    Ok(t) => Ok(AsRaw(t)),
                    // Another allocator received it: one copy into libtorch.
                    Err(raw) => from_raw(&raw).map(AsRaw).map_err(payload::custom_error),
                };
            }
            Err(other) => other,
        };
        match storage.downcast::<Received>() {
            Ok(t) => Ok(AsRaw(t.0)),
            Err(_) => Err(payload::custom_error(format!(
                "received a {} tensor of shape {:?} into storage that is neither a libtorch \
                 tensor nor a RawTensor",
                desc.dtype, desc.shape
            ))),
        }
    }
}

impl ferry_rpc::Schema for AsRaw {
    const SHAPE: &'static ferry_rpc::schema::Shape = <RawTensor as ferry_rpc::Schema>::SHAPE;
}
