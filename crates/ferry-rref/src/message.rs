//! The RRef service's messages (one service kind; the payload starts with
//! an [`RRefMessage`], and a `remote` call's encoded arguments follow it).

use serde::{Deserialize, Serialize};

use crate::protocol::{Envelope, ForkData, ForkId, RRefId};

/// The message kind of the RRef service.
pub const RREF_SERVICE: ferry_wire::MessageKind = ferry_wire::kinds::RREF;

#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum RRefMessage {
    /// A protocol control message; the reply acknowledges it.
    Control(Envelope),
    /// Create the value of `rref_id` here by running `function` on the
    /// arguments that follow; reply once it has run.
    Remote {
        rref_id: RRefId,
        /// The creator's user; `None` when the creator is the owner.
        fork_id: Option<ForkId>,
        function: String,
        signature: ferry_rpc::SignatureId,
        /// The creator's signature as text, for the error of a refused
        /// call: as declared shapes if it is typed, else as type names
        /// ([`Signature::shown`](ferry_rpc::Signature::shown)`(true)`).
        caller: String,
        /// The same as type names (`shown(false)`), for a refusal that
        /// compared type names (the registration is not typed).
        caller_names: String,
    },
    /// Reply with the value of `rref_id` once it exists.
    ToHere {
        rref_id: RRefId,
        type_name: String,
        timeout_ms: u64,
    },
}

/// The owner's answer to [`RRefMessage::Remote`].
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum RemoteReply {
    /// The function ran (its outcome, value or error, is kept as the value).
    Ran,
    /// The function was refused before its arguments were decoded (no such
    /// function, a wrong signature): the forks in them never arrived.
    Refused,
}

/// The owner's answer to [`RRefMessage::ToHere`]; with `Value`, the
/// encoded value follows it in the payload.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum ToHereReply {
    Value,
    /// Not owned here (deleted, or its creating call never arrived in time).
    Unknown,
    /// The value was not made within the request's timeout.
    NotYet,
    /// The function creating the value failed with this text.
    Failed(crate::slot::FailureText),
    /// The value is of this other type.
    WrongType(String),
}

/// How an RRef travels inside a payload.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct RRefWire {
    pub(crate) fork: ForkData,
    pub(crate) type_name: String,
}
