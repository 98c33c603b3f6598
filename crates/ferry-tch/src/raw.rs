//! [`AsRaw`]: a libtorch tensor in the payload layout of a
//! `ferry_transport::RawTensor`.

use std::sync::Arc;

use ferry_transport::RawTensor;
use ferry_wire::payload;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::outgoing::Outgoing;
use crate::tensor::EntryIn;

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
    /// The libtorch tensor the bytes landed in (`TchAllocator`), or a copy
    /// of another allocator's `RawTensor`, as a [`Tensor`](crate::Tensor)'s
    /// entry is read.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        EntryIn::deserialize(d).map(|EntryIn(t, _)| AsRaw(t))
    }
}

impl ferry_rpc::Schema for AsRaw {
    const SHAPE: &'static ferry_rpc::schema::Shape = <RawTensor as ferry_rpc::Schema>::SHAPE;
}
