//! The handshake's messages on the wire: fixed-size, so a reader knows
//! from the 6-byte header (magic `FRYA`, version, kind) how many bytes
//! follow, and refuses anything else before reading further.
//!
//! | kind | name | body |
//! |---|---|---|
//! | 1 | `Hello` | the connecting side's nonce (32 bytes) |
//! | 2 | `Challenge` | the accepting side's nonce (32), its proof (32) |
//! | 3 | `Proof` | the connecting side's proof (32) |
//! | 4 | `Accepted` | none |
//! | 5 | `Refused` | none |

/// First bytes of every message.
pub const MAGIC: [u8; 4] = *b"FRYA";
/// The protocol version this build speaks.
pub const VERSION: u8 = 2;
/// Bytes of the header (magic, version, kind).
pub const HEADER_LEN: usize = 6;
/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of an HMAC-SHA256 tag.
pub const TAG_LEN: usize = 32;

/// One handshake message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthMessage {
    /// The connecting side's fresh nonce.
    Hello {
        /// Fresh random bytes.
        nonce: [u8; NONCE_LEN],
    },
    /// The accepting side's fresh nonce and its proof over both nonces.
    Challenge {
        /// Fresh random bytes.
        nonce: [u8; NONCE_LEN],
        /// `HMAC(k, "accept" ‖ nonce_c ‖ nonce_s)`.
        tag: [u8; TAG_LEN],
    },
    /// The connecting side's proof over both nonces.
    Proof {
        /// `HMAC(k, "connect" ‖ nonce_s ‖ nonce_c)`.
        tag: [u8; TAG_LEN],
    },
    /// The accepting side took the proof.
    Accepted,
    /// The accepting side refused the proof and closes the connection.
    Refused,
}

/// Why bytes are not a handshake message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The first four bytes are not `FRYA`: the peer speaks another
    /// protocol, or has no secret.
    #[error("not an authentication handshake (first bytes {0:02x?})")]
    BadMagic([u8; 4]),
    /// Another version of the handshake.
    #[error("authentication handshake version {0}, this build speaks {VERSION}")]
    BadVersion(u8),
    /// An unknown message kind.
    #[error("unknown authentication message kind {0}")]
    BadKind(u8),
}

impl AuthMessage {
    fn kind(&self) -> u8 {
        match self {
            AuthMessage::Hello { .. } => 1,
            AuthMessage::Challenge { .. } => 2,
            AuthMessage::Proof { .. } => 3,
            AuthMessage::Accepted => 4,
            AuthMessage::Refused => 5,
        }
    }

    /// The message's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + NONCE_LEN + TAG_LEN);
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(self.kind());
        match self {
            AuthMessage::Hello { nonce } => out.extend_from_slice(nonce),
            AuthMessage::Challenge { nonce, tag } => {
                out.extend_from_slice(nonce);
                out.extend_from_slice(tag);
            }
            AuthMessage::Proof { tag } => out.extend_from_slice(tag),
            AuthMessage::Accepted | AuthMessage::Refused => {}
        }
        out
    }

    /// How many body bytes follow a valid `header`; an error as soon as
    /// the header shows the bytes are not a handshake message.
    pub fn body_len(header: &[u8; HEADER_LEN]) -> Result<usize, DecodeError> {
        let magic = [header[0], header[1], header[2], header[3]];
        if magic != MAGIC {
            return Err(DecodeError::BadMagic(magic));
        }
        if header[4] != VERSION {
            return Err(DecodeError::BadVersion(header[4]));
        }
        match header[5] {
            1 => Ok(NONCE_LEN),
            2 => Ok(NONCE_LEN + TAG_LEN),
            3 => Ok(TAG_LEN),
            4 | 5 => Ok(0),
            k => Err(DecodeError::BadKind(k)),
        }
    }

    /// Decodes one message from the start of `bytes`: `Ok(None)` while
    /// more bytes are needed, else the message and the bytes it used.
    /// Bad bytes are refused as early as the header shows them.
    pub fn decode(bytes: &[u8]) -> Result<Option<(AuthMessage, usize)>, DecodeError> {
        // Check what is there of the magic before waiting for the rest.
        let seen = bytes.len().min(MAGIC.len());
        if bytes[..seen] != MAGIC[..seen] {
            let mut magic = [0u8; 4];
            magic[..seen].copy_from_slice(&bytes[..seen]);
            return Err(DecodeError::BadMagic(magic));
        }
        let Some(header) = bytes.get(..HEADER_LEN) else {
            if let Some(&v) = bytes.get(4) {
                if v != VERSION {
                    return Err(DecodeError::BadVersion(v));
                }
            }
            return Ok(None);
        };
        let header: &[u8; HEADER_LEN] = header.try_into().map_err(|_| DecodeError::BadKind(0))?;
        let len = Self::body_len(header)?;
        let Some(body) = bytes.get(HEADER_LEN..HEADER_LEN + len) else {
            return Ok(None);
        };
        let take = |at: usize| -> [u8; 32] {
            let mut a = [0u8; 32];
            a.copy_from_slice(&body[at..at + 32]);
            a
        };
        let message = match header[5] {
            1 => AuthMessage::Hello { nonce: take(0) },
            2 => AuthMessage::Challenge {
                nonce: take(0),
                tag: take(NONCE_LEN),
            },
            3 => AuthMessage::Proof { tag: take(0) },
            4 => AuthMessage::Accepted,
            _ => AuthMessage::Refused,
        };
        Ok(Some((message, HEADER_LEN + len)))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Any message (also the handshake's property tests draw from it).
    pub(crate) fn any_message() -> impl Strategy<Value = AuthMessage> {
        prop_oneof![
            any::<[u8; 32]>().prop_map(|nonce| AuthMessage::Hello { nonce }),
            (any::<[u8; 32]>(), any::<[u8; 32]>())
                .prop_map(|(nonce, tag)| AuthMessage::Challenge { nonce, tag }),
            any::<[u8; 32]>().prop_map(|tag| AuthMessage::Proof { tag }),
            Just(AuthMessage::Accepted),
            Just(AuthMessage::Refused),
        ]
    }

    proptest! {
        #[test]
        fn every_message_round_trips_and_every_prefix_asks_for_more(
            m in any_message(),
            tail in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let bytes = m.encode();
            for cut in 0..bytes.len() {
                prop_assert_eq!(AuthMessage::decode(&bytes[..cut]), Ok(None));
            }
            let mut longer = bytes.clone();
            longer.extend_from_slice(&tail);
            prop_assert_eq!(AuthMessage::decode(&longer), Ok(Some((m, bytes.len()))));
        }

        #[test]
        fn any_bytes_decode_to_a_message_more_or_an_error(
            bytes in proptest::collection::vec(any::<u8>(), 0..100),
        ) {
            match AuthMessage::decode(&bytes) {
                Ok(Some((m, used))) => {
                    prop_assert!(used <= bytes.len());
                    prop_assert_eq!(&m.encode()[..], &bytes[..used]);
                }
                Ok(None) => prop_assert!(bytes.len() < HEADER_LEN + NONCE_LEN + TAG_LEN),
                Err(_) => {}
            }
        }

        #[test]
        fn bytes_with_a_wrong_first_byte_are_refused_at_once(b in any::<u8>()) {
            prop_assume!(b != MAGIC[0]);
            prop_assert!(matches!(AuthMessage::decode(&[b]), Err(DecodeError::BadMagic(_))));
        }
    }

    #[test]
    fn other_protocols_first_bytes_are_refused() {
        // A c10d TCPStore client's validation (query type 0 then a u32).
        assert!(matches!(
            AuthMessage::decode(&[0, 0x3c, 0x1d, 0xd4, 0x9b]),
            Err(DecodeError::BadMagic(_))
        ));
        let mut wrong_version = AuthMessage::Accepted.encode();
        wrong_version[4] = 9;
        assert_eq!(
            AuthMessage::decode(&wrong_version[..5]),
            Err(DecodeError::BadVersion(9))
        );
        let mut wrong_kind = AuthMessage::Accepted.encode();
        wrong_kind[5] = 0;
        assert_eq!(
            AuthMessage::decode(&wrong_kind),
            Err(DecodeError::BadKind(0))
        );
    }
}
