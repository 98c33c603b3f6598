//! The group's shared secret and the keys derived from it.

use std::fmt;
use std::sync::Arc;

use super::records::{Opener, Protection, RecordReader, RecordWriter, Sealer};

/// Which end of the connection this side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that accepted the connection (it answers the hello).
    Accept,
    /// The side that opened the connection (it says hello first).
    Connect,
}

/// The environment variable holding the group's shared secret.
pub const SECRET_ENV: &str = "FERRY_AUTH_SECRET";

/// Fewest bytes a secret may have.
const MIN_SECRET_LEN: usize = 16;

/// Why a secret was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// The secret is shorter than 16 bytes.
    #[error("an authentication secret needs at least {MIN_SECRET_LEN} bytes, got {0}")]
    TooShort(usize),
    /// `FERRY_AUTH` names no protection.
    #[error("{0}")]
    Protection(String),
}

/// Key material for one handshake: the group's secret, or a session key
/// derived from an earlier handshake. Its `Debug` never shows the bytes,
/// and it has no `==`: keys are only ever compared through HMAC
/// verification, in constant time.
#[derive(Clone)]
pub struct Key {
    bytes: Arc<[u8]>,
    protection: Protection,
}

impl Key {
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// What the records of a stream authenticated with this key guarantee.
    pub fn protection(&self) -> Protection {
        self.protection
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Key(<redacted>)")
    }
}

/// The secret every member of a group shares (`FERRY_AUTH_SECRET` or an
/// option). Its `Debug` never shows the bytes, and it has no `==` (a
/// byte-wise comparison would leak, through its timing, how much of a
/// guess is right).
#[derive(Clone)]
pub struct Secret(Key);

impl Secret {
    /// A secret from its bytes (at least 16).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Secret, SecretError> {
        let bytes: Vec<u8> = bytes.into();
        if bytes.len() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort(bytes.len()));
        }
        Ok(Secret(Key {
            bytes: bytes.into(),
            protection: Protection::Mac,
        }))
    }

    /// This secret with records protected as `protection` (both ends of
    /// a connection must agree: a mismatch fails the handshake).
    pub fn with_protection(mut self, protection: Protection) -> Secret {
        self.0.protection = protection;
        self
    }

    /// What the records of a connection authenticated with this secret
    /// guarantee.
    pub fn protection(&self) -> Protection {
        self.0.protection
    }

    /// The secret in `FERRY_AUTH_SECRET`, `None` when it is unset or
    /// empty, with the protection `FERRY_AUTH` names (`mac` by default,
    /// or `encrypt`); an error when the secret is too short or
    /// `FERRY_AUTH` names neither.
    pub fn from_env() -> Result<Option<Secret>, SecretError> {
        match std::env::var_os(SECRET_ENV) {
            Some(v) if !v.is_empty() => {
                use std::os::unix::ffi::OsStrExt;
                let protection = Protection::from_env().map_err(SecretError::Protection)?;
                Secret::new(v.as_bytes().to_vec()).map(|s| Some(s.with_protection(protection)))
            }
            _ => Ok(None),
        }
    }

    /// The key a handshake with this secret uses.
    pub fn key(&self) -> &Key {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// What one side holds after a handshake: the key both ends share for
/// the connections set up on behalf of this one, and the two directions'
/// record keys (see [`records`](super::records)), all derived from the
/// secret and both sides' fresh nonces. No `==`, as for [`Secret`].
#[derive(Clone)]
pub struct SessionKey {
    pub(crate) shared: [u8; 32],
    /// This side's sending direction.
    pub(crate) send: [u8; 32],
    /// This side's receiving direction.
    pub(crate) recv: [u8; 32],
    pub(crate) protection: Protection,
    pub(crate) role: Role,
}

impl SessionKey {
    /// This session key as key material for a further handshake (the
    /// shared-memory socket and `mpt` lanes of a connection), with the
    /// same protection.
    pub fn key(&self) -> Key {
        Key {
            bytes: Arc::from(&self.shared[..]),
            protection: self.protection,
        }
    }

    /// What the records sealed with this session guarantee.
    pub fn protection(&self) -> Protection {
        self.protection
    }

    /// Which end of the handshake this side was.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The keys of the MACs of tensor bytes that cross outside the
    /// records (the `ucx` channel): (this side's sending, its receiving).
    pub(crate) fn tensor_keys(&self) -> ([u8; 32], [u8; 32]) {
        const CONTEXT: &str = "ferry-auth/v2 out-of-band tensor bytes";
        (
            blake3::derive_key(CONTEXT, &self.send),
            blake3::derive_key(CONTEXT, &self.recv),
        )
    }

    /// Seals what this side sends.
    pub fn sealer(&self) -> Sealer {
        Sealer::new(self.send, self.protection)
    }

    /// Opens what this side receives.
    pub fn opener(&self) -> Opener {
        Opener::new(self.recv, self.protection)
    }

    /// The reading half of the authenticated stream, its records checked.
    pub fn reader<R>(&self, r: R) -> RecordReader<R> {
        RecordReader::new(r, Some(self.opener()))
    }

    /// The writing half of the authenticated stream, its records sealed.
    pub fn writer<W>(&self, w: W) -> RecordWriter<W> {
        RecordWriter::new(w, Some(self.sealer()))
    }
}

impl fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionKey(<redacted>)")
    }
}
