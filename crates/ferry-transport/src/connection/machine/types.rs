//! What crosses between a [`SetupMachine`](super::SetupMachine) and the
//! shell that drives it: the actions the shell performs, the events that
//! answer them, and the machine's outputs and outcome.

use std::net::SocketAddr;

use ferry_wire::Handshake;

use super::super::{Agreement, UcxFallback, UcxUnusable};
use crate::auth::records::{Opener, Sealer};
use crate::auth::{Key, SessionKey};
use crate::TransportError;

/// What the machine asks its shell to do. Each action but
/// [`Action::AbandonUcxCheck`] is answered with one [`Event`].
#[derive(Debug)]
pub enum Action {
    /// Create this side's UCX worker and answer [`Event::UcxWorker`].
    /// With `listen` (the accepting side, whose peer can connect to a
    /// listener), also open a listener for the peer when the worker's
    /// transports can detect a peer's failure.
    CreateUcxWorker {
        /// Open a listener for the peer too.
        listen: bool,
    },
    /// Drop the listeners bound before, if any, bind the ones named, and
    /// answer [`Event::ListenersBound`] with the handshake properties that
    /// name them (the accepting side).
    BindListeners {
        /// The abstract Unix socket for shared memory.
        shm: bool,
        /// The TCP listener for `mpt` lanes.
        mpt: bool,
    },
    /// Connect this side's UCX worker to the peer's and exchange the
    /// probe; answer [`Event::UcxChecked`]. The accepting side may be told
    /// to abandon it ([`Action::AbandonUcxCheck`]).
    UcxCheck {
        /// The peer's handshake (its worker address or listener).
        peer: Box<Handshake>,
        /// Accept the peer's connection on this side's listener (the one
        /// [`UcxWorkerInfo::listener`] named) instead of connecting.
        accept: bool,
    },
    /// Stop the UCX check under way: the peer's failed first, and its
    /// result is no longer wanted.
    AbandonUcxCheck,
    /// Set up what the agreement needs after the handshake (shared
    /// memory, `mpt` lanes) as this side's role does; answer
    /// [`Event::SetupDone`].
    RunSetup {
        /// What both ends agreed on.
        agreement: Box<Agreement>,
        /// The key that authenticates the set-up's own connections.
        session: Option<Key>,
    },
}

/// What one side's UCX worker offers, for its handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxWorkerInfo {
    /// The worker's address, sent in the handshake.
    pub address: Vec<u8>,
    /// Whether its transports include a network one that detects a
    /// peer's failure (then the peer connects through a listener).
    pub may_detect_peer_failure: bool,
    /// The listener opened for the peer, if one was asked for and opened.
    pub listener: Option<SocketAddr>,
}

/// What the shell tells the machine: the result of an [`Action`].
#[derive(Debug)]
pub enum Event {
    /// Answers [`Action::CreateUcxWorker`]: the worker, or why there is
    /// none (the UCX offers are then withdrawn from this connection).
    UcxWorker(Result<UcxWorkerInfo, TransportError>),
    /// Answers [`Action::BindListeners`]: the properties naming them.
    ListenersBound(Result<Vec<(String, String)>, std::io::Error>),
    /// Answers [`Action::UcxCheck`]: this side's check result.
    UcxChecked(Result<(), UcxUnusable>),
    /// Answers [`Action::RunSetup`].
    SetupDone(Result<(), TransportError>),
}

/// What the machine produces, in order: the shell writes, performs or
/// returns each as it comes.
#[derive(Debug)]
pub enum Output {
    /// Bytes to write to the peer.
    Transmit(Vec<u8>),
    /// Something for the shell to do.
    Action(Action),
    /// The end: the connection's outcome, or why the set-up failed.
    /// Nothing comes after it.
    Done(Result<Box<Outcome>, TransportError>),
}

/// A set-up that succeeded: what the connection continues with.
pub struct Outcome {
    /// What both ends agreed on.
    pub agreement: Agreement,
    /// With a secret: the session the authentication derived (its key
    /// authenticates the set-up's own connections).
    pub session: Option<SessionKey>,
    /// With a secret: opens the peer's records from here on (its sequence
    /// number continues after the set-up's).
    pub opener: Option<Opener>,
    /// With a secret: seals this side's records from here on.
    pub sealer: Option<Sealer>,
    /// Data the peer sent after its last handshake frame, already read
    /// (and, with a secret, checked): the connection reads it first.
    pub plain: Vec<u8>,
    /// The start of a record after those, read but not yet whole.
    pub sealed: Vec<u8>,
    /// Why UCX was left out after the selection picked it, if it was.
    pub ucx_fallback: Option<UcxFallback>,
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outcome")
            .field("agreement", &self.agreement)
            .field("sealed", &self.opener.is_some())
            .field("plain", &self.plain.len())
            .field("partial record", &self.sealed.len())
            .field("ucx_fallback", &self.ucx_fallback)
            .finish_non_exhaustive()
    }
}
