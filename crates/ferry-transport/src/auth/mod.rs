//! Mutual authentication of a connection before anything else is read
//! from it: HMAC-SHA256 challenge–response over fresh nonces in both
//! directions, keyed by a secret every member of the group shares.
//!
//! Every listener Ferry opens (the RPC port, the rendezvous store, the
//! shared-memory set-up socket, `mpt` lanes, ferry-ft's recovery server)
//! runs [`accept`] on a fresh connection before it reads a single frame;
//! the connecting side runs [`connect`]. The exchange (see [`message`]):
//!
//! 1. connecting side → `Hello { nonce_c }`
//! 2. accepting side → `Challenge { nonce_s, HMAC(k, "accept" ‖ nonce_c ‖ nonce_s) }`
//! 3. connecting side checks it, → `Proof { HMAC(k, "connect" ‖ nonce_s ‖ nonce_c) }`
//! 4. accepting side checks it, → `Accepted` (or `Refused`, then closes)
//!
//! Neither the secret nor anything replayable crosses the wire: each side
//! proves it knows the secret over the other side's fresh nonce, and the
//! two proofs carry different labels, so one side's proof cannot be
//! reflected back as the other's. The labels also name the
//! [`Protection`] each side asks for, so two sides that disagree on it
//! fail the handshake.
//!
//! Authentication proves who started a connection, not who sends its
//! bytes afterwards: a relay can pass the four messages through and then
//! speak for either side. So both ends derive, with HKDF-SHA256 over the
//! secret and both nonces, a [`SessionKey`]: one key per direction for
//! the [`records`] every byte after the handshake travels in (each with a
//! MAC over its place in the stream, or sealed with an AEAD), and a key
//! that authenticates the connections set up on behalf of this one
//! (shared-memory socket, `mpt` lanes), whose own records it keys in turn.
//! A relay or anyone on the path can then drop the connection, but not
//! inject, drop, reorder, replay or alter a byte of it unnoticed.
//!
//! The protocol logic is [`Handshake`], a pure state machine (messages
//! in, messages out); [`accept`] and [`connect`] are its thin I/O shell.
//!
//! ```
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use ferry_transport::auth::{self, Secret};
//! let secret = Secret::new(b"correct horse battery staple".to_vec())?;
//! let (mut a, mut b) = tokio::io::duplex(256);
//! let timeout = std::time::Duration::from_secs(5);
//! let (accepted, connected) = tokio::join!(
//!     auth::accept(&mut a, secret.key(), timeout),
//!     auth::connect(&mut b, secret.key(), timeout),
//! );
//! // Both ends now hold the same session key (compared only through
//! // HMAC verification, so it has no `==`).
//! let (_accepting_side, _connecting_side) = (accepted?, connected?);
//! # Ok(()) }
//! ```

/// The start of the reason of a
/// [`TransportError::Handshake`](crate::TransportError::Handshake) that
/// failed authentication.
pub const AUTH_FAILED: &str = "authentication failed";

/// Whether `error` is a connection refused because its peer failed the
/// authentication handshake (or this side did).
pub fn is_auth_failure(error: &crate::TransportError) -> bool {
    matches!(error, crate::TransportError::Handshake { reason, .. } if reason.starts_with(AUTH_FAILED))
}

mod handshake;
mod io;
pub mod message;
pub mod records;
mod secret;

pub use handshake::{AuthError, Handshake, Step};
pub use io::{accept, connect, AUTH_TIMEOUT};
pub use message::{AuthMessage, DecodeError};
pub use records::{Protection, RecordError, RecordReader, RecordWriter};
pub use secret::{Key, Role, Secret, SecretError, SessionKey, SECRET_ENV};
