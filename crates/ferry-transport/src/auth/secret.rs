//! The group's shared secret and the keys derived from it.

use std::fmt;
use std::sync::Arc;

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
}

/// Key material for one handshake: the group's secret, or a session key
/// derived from an earlier handshake. Its `Debug` never shows the bytes,
/// and it has no `==`: keys are only ever compared through HMAC
/// verification, in constant time.
#[derive(Clone)]
pub struct Key(Arc<[u8]>);

impl Key {
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
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
        Ok(Secret(Key(bytes.into())))
    }

    /// The secret in `FERRY_AUTH_SECRET`, `None` when it is unset or
    /// empty; an error when it is too short.
    pub fn from_env() -> Result<Option<Secret>, SecretError> {
        match std::env::var_os(SECRET_ENV) {
            Some(v) if !v.is_empty() => {
                use std::os::unix::ffi::OsStrExt;
                Secret::new(v.as_bytes().to_vec()).map(Some)
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

/// The key both ends of one authenticated connection share after the
/// handshake, for the connections set up on its behalf. No `==`, as for
/// [`Secret`].
#[derive(Clone)]
pub struct SessionKey(pub(crate) [u8; 32]);

impl SessionKey {
    /// This session key as key material for a further handshake.
    pub fn key(&self) -> Key {
        Key(Arc::from(&self.0[..]))
    }
}

impl fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionKey(<redacted>)")
    }
}
