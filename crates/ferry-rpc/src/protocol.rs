//! What the agent puts in frame payloads: the call header in front of a
//! request's arguments, and the failure record of an error reply.

use serde::{Deserialize, Serialize};

/// Opaque data an interceptor attaches to an outgoing call and reads on the
/// callee (distributed autograd carries its context and message ids here).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extension {
    /// Who the data is for; each upper layer picks its own id.
    pub id: u16,
    /// The data.
    pub data: Vec<u8>,
}

/// Sent in front of the arguments of every request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct CallHeader {
    /// Registered function name.
    pub(crate) function: String,
    /// The caller's [`Signature::id`](crate::Signature::id).
    pub(crate) signature: crate::SignatureId,
    /// Interceptor data.
    pub(crate) extensions: Vec<Extension>,
}

/// Sent in front of the service's own bytes in every service message.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct ServiceHeader {
    /// Interceptor data.
    pub(crate) extensions: Vec<Extension>,
}

/// Why a call failed on the callee.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum FailureKind {
    /// No such function registered.
    UnknownFunction,
    /// The caller's signature differs from the registration.
    WrongType,
    /// The arguments did not decode as the registered type.
    BadArguments,
    /// The function returned an error or panicked.
    Failed,
    /// The request itself was malformed.
    BadRequest,
}

/// Payload of an error reply.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Failure {
    pub(crate) kind: FailureKind,
    /// The error's text as raised, at most
    /// [`MAX_ERROR_TEXT_BYTES`](crate::MAX_ERROR_TEXT_BYTES).
    pub(crate) message: String,
    /// For `WrongType`: the callee's registered signature.
    pub(crate) expected: String,
    /// How many bytes of the raised text the callee left out after `message`.
    pub(crate) omitted: u64,
    /// For `WrongType`: whether the callee compared the signatures by their
    /// shapes (both typed), so that `expected` is written as shapes.
    pub(crate) by_schema: bool,
}

impl Failure {
    /// A failure with `message`, cut to
    /// [`MAX_ERROR_TEXT_BYTES`](crate::MAX_ERROR_TEXT_BYTES).
    pub(crate) fn new(kind: FailureKind, mut message: String) -> Self {
        let omitted = crate::error::bound_text(&mut message, crate::MAX_ERROR_TEXT_BYTES);
        Self {
            kind,
            message,
            expected: String::new(),
            omitted,
            by_schema: false,
        }
    }

    /// The refusal of a call whose signature differs from the
    /// registration's, `expected` (written as shapes when `by_schema`).
    pub(crate) fn wrong_type(mut expected: String, by_schema: bool) -> Self {
        crate::error::bound_text(&mut expected, crate::MAX_ERROR_TEXT_BYTES);
        Self {
            expected,
            by_schema,
            ..Self::new(FailureKind::WrongType, String::new())
        }
    }

    pub(crate) fn failed(message: String) -> Self {
        Self::new(FailureKind::Failed, message)
    }
}
