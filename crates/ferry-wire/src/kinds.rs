//! Every message kind Ferry's crates put on the wire, in one registry.
//!
//! A frame's kind says which layer reads it. The kinds are defined here,
//! not in the crates that use them, so that two layers can never pick the
//! same number: [`REGISTRY`] lists each with its name and owner, a unit
//! test checks the numbers are unique, and a tidy test (`cargo test -p
//! xtask`) checks that no other crate writes a `MessageKind(..)` literal.
//!
//! Ranges: below [`MessageKind::FIRST_SERVICE`] (`0x100`) the agent's own
//! kinds; `0x100..0x0f00` service layers that run on the agent's
//! connections (RRef, autograd); `0x0f00..` the fault-tolerance layer's
//! own connections (checkpoint recovery, replica-group collectives),
//! which never meet the agent's.

use crate::MessageKind;

/// The RRef service (`ferry-rref`): protocol control messages and `remote`.
pub const RREF: MessageKind = MessageKind(0x101);
/// The distributed autograd service (`ferry-autograd`): backward, clean-up.
pub const AUTOGRAD: MessageKind = MessageKind(0x102);
/// Checkpoint recovery requests, client to server (`ferry-ft`).
pub const FT_RECOVERY_REQUEST: MessageKind = MessageKind(0x0f00);
/// Checkpoint recovery replies: manifest, refusal, end of stream (`ferry-ft`).
pub const FT_RECOVERY_REPLY: MessageKind = MessageKind(0x0f01);
/// One chunk of a recovered tensor, server to client (`ferry-ft`).
pub const FT_RECOVERY_CHUNK: MessageKind = MessageKind(0x0f02);
/// First message on a replica-group peer connection (`ferry-ft`).
pub const FT_COLLECTIVE_HELLO: MessageKind = MessageKind(0x0f20);
/// The accepting side's answer to a hello (`ferry-ft`).
pub const FT_COLLECTIVE_HELLO_REPLY: MessageKind = MessageKind(0x0f21);
/// One segment of a replica-group allreduce (`ferry-ft`).
pub const FT_COLLECTIVE_DATA: MessageKind = MessageKind(0x0f22);

/// One registered kind: its number, its name in logs, the crate that reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KindInfo {
    /// The kind.
    pub kind: MessageKind,
    /// Its name, as [`MessageKind`]'s `Display` prints it.
    pub name: &'static str,
    /// The crate that defines its payload and reads it.
    pub owner: &'static str,
}

const fn info(kind: MessageKind, name: &'static str, owner: &'static str) -> KindInfo {
    KindInfo { kind, name, owner }
}

/// Every kind on the wire, in numeric order.
pub const REGISTRY: &[KindInfo] = &[
    info(MessageKind::HANDSHAKE, "handshake", "ferry-transport"),
    info(MessageKind::REQUEST, "request", "ferry-rpc"),
    info(MessageKind::RESPONSE, "response", "ferry-rpc"),
    info(MessageKind::ERROR, "error", "ferry-rpc"),
    info(MessageKind::RELEASE, "release", "ferry-transport"),
    info(RREF, "rref", "ferry-rref"),
    info(AUTOGRAD, "autograd", "ferry-autograd"),
    info(FT_RECOVERY_REQUEST, "ft-recovery-request", "ferry-ft"),
    info(FT_RECOVERY_REPLY, "ft-recovery-reply", "ferry-ft"),
    info(FT_RECOVERY_CHUNK, "ft-recovery-chunk", "ferry-ft"),
    info(FT_COLLECTIVE_HELLO, "ft-collective-hello", "ferry-ft"),
    info(
        FT_COLLECTIVE_HELLO_REPLY,
        "ft-collective-hello-reply",
        "ferry-ft",
    ),
    info(FT_COLLECTIVE_DATA, "ft-collective-data", "ferry-ft"),
];

/// The registry entry of `kind`, if it is a registered kind.
///
/// ```
/// use ferry_wire::kinds;
///
/// assert_eq!(kinds::lookup(kinds::RREF).map(|k| k.owner), Some("ferry-rref"));
/// assert_eq!(kinds::RREF.to_string(), "rref");
/// assert_eq!(ferry_wire::MessageKind(0x7777).to_string(), "kind 0x7777");
/// ```
pub fn lookup(kind: MessageKind) -> Option<&'static KindInfo> {
    REGISTRY.iter().find(|k| k.kind == kind)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn kinds_and_names_are_unique_and_in_order() {
        let kinds: HashSet<_> = REGISTRY.iter().map(|k| k.kind).collect();
        let names: HashSet<_> = REGISTRY.iter().map(|k| k.name).collect();
        assert_eq!(kinds.len(), REGISTRY.len(), "a kind is registered twice");
        assert_eq!(names.len(), REGISTRY.len(), "a name is registered twice");
        assert!(REGISTRY.windows(2).all(|w| w[0].kind < w[1].kind));
    }

    #[test]
    fn kinds_sit_in_their_ranges() {
        for k in REGISTRY {
            let service = k.kind.is_service();
            let agent_layer = matches!(k.owner, "ferry-transport" | "ferry-rpc");
            assert_eq!(service, !agent_layer, "{} is in the wrong range", k.name);
            if k.owner == "ferry-ft" {
                assert!(k.kind.0 >= 0x0f00, "{}: ft kinds start at 0x0f00", k.name);
            }
        }
    }
}
