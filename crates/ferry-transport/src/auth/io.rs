//! The handshake's I/O shell over any byte stream.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::handshake::{AuthError, Handshake};
use super::message::{AuthMessage, HEADER_LEN, NONCE_LEN};
use super::secret::{Key, Role, SessionKey};

/// How long a listener gives a peer to finish the handshake.
pub const AUTH_TIMEOUT: Duration = Duration::from_secs(10);

/// Fresh random bytes from the operating system.
fn fresh_nonce() -> Result<[u8; NONCE_LEN], AuthError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut nonce)
        .map_err(|e| AuthError::Io(std::io::Error::other(format!("no random bytes: {e}"))))?;
    Ok(nonce)
}

/// Reads one message: the header first, refused before anything more is
/// read if it is not a handshake's, then exactly its body.
async fn read_message<S: AsyncRead + Unpin>(stream: &mut S) -> Result<AuthMessage, AuthError> {
    let mut buf = [0u8; HEADER_LEN + 64];
    stream.read_exact(&mut buf[..HEADER_LEN]).await?;
    let header: [u8; HEADER_LEN] = [buf[0], buf[1], buf[2], buf[3], buf[4], buf[5]];
    let body = AuthMessage::body_len(&header)?;
    stream
        .read_exact(&mut buf[HEADER_LEN..HEADER_LEN + body])
        .await?;
    match AuthMessage::decode(&buf[..HEADER_LEN + body])? {
        Some((m, _)) => Ok(m),
        None => Err(AuthError::Unexpected {
            expecting: "a whole message",
            got: "a short one",
        }),
    }
}

async fn run<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    role: Role,
    key: &Key,
) -> Result<SessionKey, AuthError> {
    let mut handshake = Handshake::new(role, key.clone(), fresh_nonce()?);
    if let Some(m) = handshake.start() {
        stream.write_all(&m.encode()).await?;
    }
    loop {
        let message = read_message(stream).await?;
        let step = handshake.receive(message);
        if let Some(m) = step.send {
            // A refusal is a courtesy: the connection closes either way.
            let sent = stream.write_all(&m.encode()).await;
            if step.outcome.is_none() || matches!(step.outcome, Some(Ok(_))) {
                sent?;
            }
        }
        if let Some(outcome) = step.outcome {
            stream.flush().await?;
            return outcome;
        }
    }
}

async fn bounded<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    role: Role,
    key: &Key,
    timeout: Duration,
) -> Result<SessionKey, AuthError> {
    tokio::time::timeout(timeout, run(stream, role, key))
        .await
        .map_err(|_| AuthError::Timeout(timeout))?
}

/// Authenticates the peer that connected on `stream` (and this side to
/// it), within `timeout`. Reads nothing past the handshake.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    key: &Key,
    timeout: Duration,
) -> Result<SessionKey, AuthError> {
    bounded(stream, Role::Accept, key, timeout).await
}

/// Authenticates this side to the peer it connected to on `stream` (and
/// the peer to it), within `timeout`.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    key: &Key,
    timeout: Duration,
) -> Result<SessionKey, AuthError> {
    bounded(stream, Role::Connect, key, timeout).await
}
