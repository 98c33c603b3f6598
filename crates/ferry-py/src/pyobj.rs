//! How a live Python object ([`PyObj::Live`]) goes on the wire: pickled
//! when it is encoded, with the GIL taken without blocking a runtime.

use serde::{Serialize, Serializer};

use crate::wire::{PyObj, PyObjWire};

impl Serialize for PyObj {
    /// A live object is pickled here, with the GIL taken; on a thread of a
    /// multi-threaded tokio runtime (the owner answering `to_here`) inside
    /// `block_in_place`, so that the runtime's other tasks move to other
    /// threads while this one waits for the GIL.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            PyObj::Wire { pickled, raised } => PyObjWire {
                raised: *raised,
                pickled,
            }
            .serialize(s),
            PyObj::Live { object, raised } => {
                let pickled = crate::gil::blocking(|| crate::pickle::dumps_object(object))
                    .map_err(serde::ser::Error::custom)?;
                PyObjWire {
                    raised: *raised,
                    pickled: &pickled,
                }
                .serialize(s)
            }
        }
    }
}
