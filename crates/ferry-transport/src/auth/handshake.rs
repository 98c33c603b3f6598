//! The handshake as a pure state machine: messages in, messages out.

use hkdf::Hkdf;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::message::{AuthMessage, DecodeError, NONCE_LEN, TAG_LEN};
use super::records::Protection;
use super::secret::{Key, Role, SessionKey};

type HmacSha256 = Hmac<Sha256>;

/// Label of the accepting side's proof (the protection's name follows).
const ACCEPT_LABEL: &str = "ferry-auth/v2 accept";
/// Label of the connecting side's proof (the protection's name follows).
const CONNECT_LABEL: &str = "ferry-auth/v2 connect";
/// HKDF info of the key shared for the connections set up on behalf of
/// this one.
const SESSION_INFO: &[u8] = b"ferry-auth/v2 session";
/// HKDF info of the records the connecting side sends.
const CONNECTOR_RECORDS_INFO: &str = "ferry-auth/v2 records connector->acceptor";
/// HKDF info of the records the accepting side sends.
const ACCEPTOR_RECORDS_INFO: &str = "ferry-auth/v2 records acceptor->connector";

/// A label with the protection's name after it, so that two sides that
/// disagree on the protection fail each other's proof.
fn labelled(label: &str, protection: Protection) -> Vec<u8> {
    format!("{label} {}", protection.name()).into_bytes()
}

/// The session's keys: HKDF-SHA256 (RFC 5869) with both nonces as salt
/// and the handshake's key as input, expanded once per use.
fn derive(key: &Key, role: Role, nonce_c: &[u8], nonce_s: &[u8]) -> SessionKey {
    let mut salt = [0u8; 2 * NONCE_LEN];
    salt[..NONCE_LEN].copy_from_slice(nonce_c);
    salt[NONCE_LEN..].copy_from_slice(nonce_s);
    let hk = Hkdf::<Sha256>::new(Some(&salt), key.bytes());
    let protection = key.protection();
    let expand = |info: &[u8]| {
        let mut out = [0u8; 32];
        match hk.expand(info, &mut out) {
            Ok(()) => out,
            Err(_) => unreachable!("HKDF-SHA256 expands to 32 bytes"),
        }
    };
    let shared = expand(SESSION_INFO);
    let from_connector = expand(&labelled(CONNECTOR_RECORDS_INFO, protection));
    let from_acceptor = expand(&labelled(ACCEPTOR_RECORDS_INFO, protection));
    let (send, recv) = match role {
        Role::Connect => (from_connector, from_acceptor),
        Role::Accept => (from_acceptor, from_connector),
    };
    SessionKey {
        shared,
        send,
        recv,
        protection,
        role,
    }
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The peer's bytes are not a handshake message (another protocol, or
    /// a peer with no secret).
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// A valid message, at the wrong moment.
    #[error("unexpected {got} while {expecting}")]
    Unexpected {
        /// What the handshake waited for.
        expecting: &'static str,
        /// What came.
        got: &'static str,
    },
    /// The peer's proof does not match: it holds another secret, asks for
    /// another protection (`FERRY_AUTH`), or replays a proof made for
    /// another nonce.
    #[error("the peer's proof does not match (another secret, another FERRY_AUTH protection, or a replayed handshake)")]
    BadProof,
    /// The accepting side refused this side's proof.
    #[error("the peer refused this side's proof (another secret?)")]
    Refused,
    /// The handshake did not finish in time.
    #[error("the authentication handshake did not finish within {0:?}")]
    Timeout(std::time::Duration),
    /// A socket operation failed, or the peer closed the connection.
    #[error("i/o error during the authentication handshake: {0}")]
    Io(#[from] std::io::Error),
}

/// What to do after a message.
#[derive(Debug)]
pub struct Step {
    /// A message to send now (before closing, if the handshake failed).
    pub send: Option<AuthMessage>,
    /// `Some(Ok(key))`: authenticated, frames may follow. `Some(Err(_))`:
    /// failed, close the connection. `None`: wait for the next message.
    pub outcome: Option<Result<SessionKey, AuthError>>,
}

#[derive(Debug)]
enum State {
    AwaitHello,
    AwaitChallenge,
    AwaitProof { peer_nonce: [u8; NONCE_LEN] },
    AwaitAccepted { session: SessionKey },
    Finished,
}

impl State {
    fn expecting(&self) -> &'static str {
        match self {
            State::AwaitHello => "awaiting a hello",
            State::AwaitChallenge => "awaiting a challenge",
            State::AwaitProof { .. } => "awaiting a proof",
            State::AwaitAccepted { .. } => "awaiting the verdict",
            State::Finished => "finished",
        }
    }
}

fn name(m: &AuthMessage) -> &'static str {
    match m {
        AuthMessage::Hello { .. } => "hello",
        AuthMessage::Challenge { .. } => "challenge",
        AuthMessage::Proof { .. } => "proof",
        AuthMessage::Accepted => "accepted",
        AuthMessage::Refused => "refused",
    }
}

fn mac(key: &Key, label: &str, a: &[u8], b: &[u8]) -> HmacSha256 {
    let label = labelled(label, key.protection());
    // HMAC takes keys of any length: this cannot fail.
    let mut m = match HmacSha256::new_from_slice(key.bytes()) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC accepts keys of every length"),
    };
    m.update(&label);
    m.update(a);
    m.update(b);
    m
}

fn tag(key: &Key, label: &str, a: &[u8], b: &[u8]) -> [u8; TAG_LEN] {
    mac(key, label, a, b).finalize().into_bytes().into()
}

/// One side's handshake (see the [module](super) docs for the exchange).
#[derive(Debug)]
pub struct Handshake {
    role: Role,
    key: Key,
    nonce: [u8; NONCE_LEN],
    state: State,
}

impl Handshake {
    /// A handshake for `role` with key `key` and this side's fresh
    /// `nonce` (never used twice).
    pub fn new(role: Role, key: Key, nonce: [u8; NONCE_LEN]) -> Handshake {
        let state = match role {
            Role::Accept => State::AwaitHello,
            Role::Connect => State::AwaitChallenge,
        };
        Handshake {
            role,
            key,
            nonce,
            state,
        }
    }

    /// The message this side sends first: the connecting side's hello.
    pub fn start(&self) -> Option<AuthMessage> {
        match self.role {
            Role::Connect => Some(AuthMessage::Hello { nonce: self.nonce }),
            Role::Accept => None,
        }
    }

    /// Whether the handshake ended (authenticated or failed).
    pub fn is_finished(&self) -> bool {
        matches!(self.state, State::Finished)
    }

    fn fail(&mut self, send: Option<AuthMessage>, e: AuthError) -> Step {
        self.state = State::Finished;
        Step {
            send,
            outcome: Some(Err(e)),
        }
    }

    /// Takes the peer's next message.
    pub fn receive(&mut self, message: AuthMessage) -> Step {
        let state = std::mem::replace(&mut self.state, State::Finished);
        match (state, message) {
            (State::AwaitHello, AuthMessage::Hello { nonce: peer }) => {
                let t = tag(&self.key, ACCEPT_LABEL, &peer, &self.nonce);
                self.state = State::AwaitProof { peer_nonce: peer };
                Step {
                    send: Some(AuthMessage::Challenge {
                        nonce: self.nonce,
                        tag: t,
                    }),
                    outcome: None,
                }
            }
            (
                State::AwaitChallenge,
                AuthMessage::Challenge {
                    nonce: peer,
                    tag: t,
                },
            ) => {
                let expected = mac(&self.key, ACCEPT_LABEL, &self.nonce, &peer);
                if expected.verify_slice(&t).is_err() {
                    return self.fail(None, AuthError::BadProof);
                }
                let session = derive(&self.key, Role::Connect, &self.nonce, &peer);
                self.state = State::AwaitAccepted { session };
                Step {
                    send: Some(AuthMessage::Proof {
                        tag: tag(&self.key, CONNECT_LABEL, &peer, &self.nonce),
                    }),
                    outcome: None,
                }
            }
            (State::AwaitProof { peer_nonce }, AuthMessage::Proof { tag: t }) => {
                let expected = mac(&self.key, CONNECT_LABEL, &self.nonce, &peer_nonce);
                if expected.verify_slice(&t).is_err() {
                    return self.fail(Some(AuthMessage::Refused), AuthError::BadProof);
                }
                let session = derive(&self.key, Role::Accept, &peer_nonce, &self.nonce);
                Step {
                    send: Some(AuthMessage::Accepted),
                    outcome: Some(Ok(session)),
                }
            }
            (State::AwaitAccepted { session }, AuthMessage::Accepted) => Step {
                send: None,
                outcome: Some(Ok(session)),
            },
            (State::AwaitAccepted { .. }, AuthMessage::Refused) => {
                self.fail(None, AuthError::Refused)
            }
            (state, got) => {
                let e = AuthError::Unexpected {
                    expecting: state.expecting(),
                    got: name(&got),
                };
                let send = matches!(self.role, Role::Accept).then_some(AuthMessage::Refused);
                self.fail(send, e)
            }
        }
    }
}

#[cfg(test)]
mod tests;
