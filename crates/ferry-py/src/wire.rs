//! What Python values are on Ferry's wire: a pickle (protocol 5) with its
//! tensors and RRefs pulled out ([`Pickled`]), the two remote functions
//! every Python worker registers ([`CALL`], [`REMOTE`]) and the value an
//! RRef created from Python holds ([`PyObj`]).
//!
//! The pickle's bytes are a plain byte string in the payload. Every
//! `torch.Tensor` in the pickled object became a persistent id (its index
//! in [`Pickled::tensors`]), so its bytes travel out of band through the
//! tensor channels as a [`Tensor`], received into a fresh tensor's
//! storage; every RRef became an index into [`Pickled::rrefs`], which
//! travel as forks by the RRef protocol: RRefs to values of Python
//! functions as `RRef<PyObj>`s, RRefs to Rust values with the shape their
//! values are read by ([`RustRRefWire`]).

use std::sync::Arc;

use ferry::rpc::describe::OwnedShape;
use ferry::rpc::schema::{Schema, Shape};
use ferry::rref::DynRRef;
use ferry::tensor::Tensor;
use ferry::{Function, RRef};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A Python call or result: the pickle's bytes and what was pulled out of it.
#[derive(Default, Serialize, Deserialize, Schema)]
pub struct Pickled {
    /// The pickle (protocol 5), tensors and RRefs as persistent ids.
    pub bytes: PickleBytes,
    /// The tensors the pickle refers to, by index.
    pub tensors: Vec<Tensor>,
    /// The RRefs the pickle refers to, by index.
    pub rrefs: Vec<PickledRRef>,
}

/// An RRef inside a pickled call or result.
#[derive(Serialize, Deserialize, Schema)]
pub enum PickledRRef {
    /// To a value of a Python function (`remote`, `RRef(value)`).
    Python(RRef<PyObj>),
    /// To a value of a Rust function.
    Rust(RustRRefWire),
}

/// An RRef to a Rust value as it travels in a pickled call or result: the
/// RRef (forked to the receiver by the RRef protocol, as an RRef to the
/// value's Rust type), then the shape its value is read by (the value is
/// node `node` of `shape`), which the receiver checks.
pub struct RustRRefWire {
    /// The reference.
    pub rref: DynRRef,
    /// The shape of which a node is the value's.
    pub shape: Arc<OwnedShape>,
    /// The value's node.
    pub node: u32,
}

impl Serialize for RustRRefWire {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        (&self.rref, &*self.shape, self.node).serialize(s)
    }
}

impl<'de> Deserialize<'de> for RustRRefWire {
    /// Reads the RRef first: a shape refused afterwards drops it, as a
    /// user RRef is dropped, so the owner's accounting stays whole.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let (rref, shape, node): (DynRRef, OwnedShape, u32) = Deserialize::deserialize(d)?;
        let shape = checked_value_shape(shape, node).map_err(serde::de::Error::custom)?;
        Ok(RustRRefWire {
            rref,
            shape: Arc::new(shape),
            node,
        })
    }
}

/// `shape` if it is a well-formed shape ([`OwnedShape::check`]) with a
/// node `node`, else why not.
pub fn checked_value_shape(shape: OwnedShape, node: u32) -> Result<OwnedShape, String> {
    shape
        .check()
        .map_err(|e| format!("an RRef to a Rust value with a shape that cannot be used: {e}"))?;
    if node as usize >= shape.nodes().len() {
        return Err(format!(
            "an RRef to a Rust value at node {node} of a shape of {} nodes",
            shape.nodes().len()
        ));
    }
    Ok(shape)
}

impl Schema for RustRRefWire {
    const SHAPE: &'static Shape = &Shape::Opaque {
        name: "RustRRef",
        params: &[],
    };
}

/// A pickle's bytes, written as one byte string (not a sequence of `u8`s).
#[derive(Default, Debug, Clone, PartialEq, Eq)]
pub struct PickleBytes(pub Vec<u8>);

impl Serialize for PickleBytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for PickleBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = PickleBytes;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a pickle's bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<PickleBytes, E> {
                Ok(PickleBytes(v.to_vec()))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<PickleBytes, E> {
                Ok(PickleBytes(v))
            }
        }
        d.deserialize_byte_buf(Visit)
    }
}

impl Schema for PickleBytes {
    const SHAPE: &'static Shape = &Shape::Bytes;
}

/// The outcome of a Python call on its callee: its result, or the
/// exception it raised as PyTorch's `RemoteException` carries it (the
/// message with the callee's traceback, and the exception's type).
#[derive(Serialize, Deserialize, Schema)]
pub enum PyReply {
    /// The function returned: the pickled result.
    Value(Pickled),
    /// The function raised: the pickled `(message, exception type)`.
    Raised(Pickled),
}

/// Runs a pickled `(function, args, kwargs)` on the callee and replies
/// with its outcome (`rpc_sync`, `rpc_async`).
pub const CALL: Function<Pickled, PyReply> = Function::new("ferry.py.call");

/// Runs a pickled `(function, args, kwargs)` on the callee and keeps its
/// outcome there as an RRef's value (`remote`).
pub const REMOTE: Function<Pickled, PyObj> = Function::new("ferry.py.remote");

/// The value of an RRef created from Python.
///
/// On its owner it is the Python object itself ([`PyObj::Live`]), so
/// `local_value()` and methods run through the proxies see one object and
/// its changes. Where it arrives by `to_here` it is still pickled
/// ([`PyObj::Wire`]): it is unpickled once the caller holds the GIL.
pub enum PyObj {
    /// The object, on its owner.
    Live {
        /// The object (the function's result, or the exception it raised
        /// as `(message, exception type)`).
        object: pyo3::Py<pyo3::PyAny>,
        /// Whether the function raised.
        raised: bool,
    },
    /// The object as it arrived, not yet unpickled.
    Wire {
        /// The pickled object.
        pickled: Pickled,
        /// Whether the function raised.
        raised: bool,
    },
}

/// How a [`PyObj`] travels: whether its function raised, and the pickle.
#[derive(Serialize, Deserialize)]
pub struct PyObjWire<P> {
    /// Whether the function raised.
    pub raised: bool,
    /// The pickled object.
    pub pickled: P,
}

impl<'de> Deserialize<'de> for PyObj {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let wire = PyObjWire::<Pickled>::deserialize(d)?;
        Ok(PyObj::Wire {
            pickled: wire.pickled,
            raised: wire.raised,
        })
    }
}

impl Schema for PyObj {
    const SHAPE: &'static Shape = &Shape::Opaque {
        name: "PyObj",
        params: &[],
    };
}

/// The handle of an RRef to a value a Rust function made (`ferry.rpc.RRef`
/// wraps it): the reference, and the shape its value is read by. Its
/// methods are in `interop`.
#[pyo3::pyclass(name = "RustRRefHandle", module = "ferry._ferry.interop", frozen)]
pub struct RustRRef {
    /// The reference, held by the RRef protocol.
    pub rref: DynRRef,
    /// The shape of which a node is the value's.
    pub shape: Arc<OwnedShape>,
    /// The value's node.
    pub node: u32,
}

/// The Python handle of an RRef created from Python (`ferry.rpc.RRef`
/// wraps it); its methods are in `rpc::rref`.
#[pyo3::pyclass(name = "RRefHandle", module = "ferry._ferry.rpc", frozen)]
pub struct PyRRef {
    /// The reference, held by the RRef protocol.
    pub rref: RRef<PyObj>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry::rpc::describe::ShapeNode;
    use ferry::wire::payload;
    use proptest::prelude::*;

    /// The shape of an RRef to a Rust value is used only once checked,
    /// with its node in range.
    #[test]
    fn a_value_shape_is_checked_with_its_node() {
        let shape = OwnedShape::of(<(ferry::RawTensor, Vec<Option<String>>)>::SHAPE).unwrap();
        let n = shape.nodes().len() as u32;
        for node in 0..n {
            assert!(checked_value_shape(shape.clone(), node).is_ok());
        }
        let e = checked_value_shape(shape, n).unwrap_err();
        assert!(e.contains(&format!("at node {n}")), "{e}");
        // A table that breaks the rules (a child before its parent), made
        // the way a peer's bytes would make it.
        let bad = vec![ShapeNode::Option(0)];
        let bytes = payload::encode(&(bad, 0u32)).unwrap().payload;
        let (shape, node): (OwnedShape, u32) = payload::decode(&bytes, Vec::new()).unwrap();
        let e = checked_value_shape(shape, node).unwrap_err();
        assert!(e.contains("cannot be used"), "{e}");
    }

    proptest! {
        /// Any bytes give a checked shape with its node, or an error:
        /// never a panic.
        #[test]
        fn any_bytes_give_a_checked_shape_or_an_error(
            bytes in prop::collection::vec(any::<u8>(), 0..256),
        ) {
            if let Ok((shape, node)) = payload::decode::<(OwnedShape, u32)>(&bytes, Vec::new()) {
                if let Ok(shape) = checked_value_shape(shape, node) {
                    prop_assert!((node as usize) < shape.nodes().len());
                    let _ = shape.node_text(node);
                }
            }
        }
    }
}
