//! Frames off the socket (the bytes are [`format`](crate::format)'s
//! business), and a connection's sealed halves.

use std::io;
use std::pin::Pin;

use ferry_transport::auth::{self, RecordReader, RecordWriter};
use futures::stream::{Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::format::{self, FormatError, LENGTH_PREFIX_BYTES};

/// Why reading a frame failed.
#[derive(Debug)]
pub(super) enum FrameError {
    Io(io::Error),
    Format(FormatError),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Io(e) => write!(f, "{e}"),
            FrameError::Format(e) => write!(f, "{e}"),
        }
    }
}

/// A body decoder of [`format`](crate::format).
pub(super) type Decode<T> = fn(&[u8]) -> Result<T, FormatError>;

/// Reads one frame and decodes its body with `decode`; `Ok(None)` on a
/// clean end of stream between frames.
pub(super) async fn read_frame<R, T>(r: &mut R, decode: Decode<T>) -> Result<Option<T>, FrameError>
where
    R: AsyncRead + Unpin,
{
    let mut prefix = [0u8; LENGTH_PREFIX_BYTES];
    let n = r.read(&mut prefix).await.map_err(FrameError::Io)?;
    if n == 0 {
        return Ok(None);
    }
    r.read_exact(&mut prefix[n..])
        .await
        .map_err(FrameError::Io)?;
    let len = format::body_len(prefix).map_err(FrameError::Format)?;
    // Grow with what actually arrives rather than trusting the prefix.
    let mut body = Vec::with_capacity(len.min(64 << 10));
    r.take(len as u64)
        .read_to_end(&mut body)
        .await
        .map_err(FrameError::Io)?;
    if body.len() != len {
        return Err(FrameError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("connection closed inside a {len}-byte message"),
        )));
    }
    decode(&body).map(Some).map_err(FrameError::Format)
}

/// The frames of `r`, as a stream (so reading survives a `select!`).
pub(super) fn frames<R, T>(
    r: R,
    decode: Decode<T>,
) -> Pin<Box<dyn Stream<Item = Result<T, FrameError>> + Send>>
where
    R: AsyncRead + Unpin + Send + 'static,
    T: Send + 'static,
{
    futures::stream::unfold(Some(r), move |r| async move {
        let mut r = r?;
        match read_frame(&mut r, decode).await {
            Ok(Some(msg)) => Some((Ok(msg), Some(r))),
            Ok(None) => None,
            Err(e) => Some((Err(e), None)),
        }
    })
    .boxed()
}

/// Writes the frames sent on `rx` until it closes or writing fails.
pub(super) async fn write_frames<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::UnboundedReceiver<Vec<u8>>,
) -> io::Result<()> {
    while let Some(frame) = rx.recv().await {
        w.write_all(&frame).await?;
        // Whatever else is queued goes in the same records; then out.
        while let Ok(frame) = rx.try_recv() {
            w.write_all(&frame).await?;
        }
        w.flush().await?;
    }
    Ok(())
}

/// A connection's halves: after the authentication handshake, read and
/// written in records sealed with its session ([`auth::records`]), so a
/// relay that passed the handshake through can neither speak for either
/// end nor alter, drop or reorder a byte; without a secret, as they are.
pub(super) fn halves(
    stream: TcpStream,
    session: Option<&auth::SessionKey>,
) -> (RecordReader<OwnedReadHalf>, RecordWriter<OwnedWriteHalf>) {
    let (rd, wr) = stream.into_split();
    match session {
        Some(s) => (s.reader(rd), s.writer(wr)),
        None => (RecordReader::new(rd, None), RecordWriter::new(wr, None)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Request, RequestFrame};
    use crate::MAX_MESSAGE_BYTES;

    /// The socket shell reads whole frames and hands their bodies to
    /// `format` (whose own tests cover the bytes): a clean end between
    /// frames, an end inside one, and the limit on the length prefix.
    #[tokio::test]
    async fn the_shell_reads_frames_and_stops_at_the_limits() {
        let frame = format::encode_request(&RequestFrame {
            id: 7,
            request: Request::Check {
                keys: vec!["a".into()],
            },
        })
        .unwrap();
        let mut two = frame.clone();
        two.extend_from_slice(&frame);
        let mut r = &two[..];
        for _ in 0..2 {
            let back = read_frame(&mut r, format::decode_request).await.unwrap();
            assert_eq!(back.unwrap().id, 7);
        }
        assert!(read_frame(&mut r, format::decode_request)
            .await
            .unwrap()
            .is_none());

        let mut cut = &frame[..frame.len() - 1];
        assert!(matches!(
            read_frame(&mut cut, format::decode_request).await,
            Err(FrameError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof
        ));
        let huge = ((MAX_MESSAGE_BYTES + 1) as u32).to_le_bytes();
        let mut r = &huge[..];
        assert!(matches!(
            read_frame(&mut r, format::decode_request).await,
            Err(FrameError::Format(FormatError::TooLarge { .. }))
        ));
    }
}
