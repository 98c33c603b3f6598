//! Reads from a stream that fail when no byte arrives within the stall
//! timeout.

use std::future::Future as _;

use tokio::io::{AsyncRead, AsyncReadExt};

use crate::{RecvBuffer, TransportError};

/// Tensor bytes arriving on a stream (inline, or the `shm` ring) are read
/// in steps of this size; each step's memory is made resident
/// ([`RecvBuffer::prepare`]) just before its bytes are read, so memory is
/// committed in step with the bytes that arrive.
const RECV_STEP: usize = 4 << 20;

/// Why a read of frame bytes stopped.
pub(super) enum ReadFail {
    Io(std::io::Error),
    /// No byte came within the stall timeout; `got` bytes of the buffer are in.
    Stalled {
        got: usize,
    },
}

/// Fills `buf` from `r`, each read bounded by `stall` (progress resets it).
pub(super) async fn read_with_stall<R: AsyncRead + Unpin + ?Sized>(
    r: &mut R,
    buf: &mut [u8],
    stall: std::time::Duration,
) -> Result<(), ReadFail> {
    let mut got = 0;
    while got < buf.len() {
        match tokio::time::timeout(stall, r.read(&mut buf[got..])).await {
            Ok(Ok(0)) => {
                return Err(ReadFail::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            Ok(Ok(n)) => got += n,
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Ok(Err(e)) => return Err(ReadFail::Io(e)),
            Err(_) => return Err(ReadFail::Stalled { got }),
        }
    }
    Ok(())
}

/// A reader whose every read fails with `TimedOut` when no byte comes
/// within the stall timeout (for pipelines that read with `read_exact`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) struct StallReader<'a, R> {
    inner: &'a mut R,
    stall: std::time::Duration,
    sleep: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl<'a, R> StallReader<'a, R> {
    pub(super) fn new(inner: &'a mut R, stall: std::time::Duration) -> Self {
        StallReader {
            inner,
            stall,
            sleep: None,
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for StallReader<'_, R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = &mut *self;
        match std::pin::Pin::new(&mut *this.inner).poll_read(cx, buf) {
            std::task::Poll::Ready(r) => {
                this.sleep = None;
                std::task::Poll::Ready(r)
            }
            std::task::Poll::Pending => {
                let stall = this.stall;
                let sleep = this
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
                match sleep.as_mut().poll(cx) {
                    std::task::Poll::Ready(()) => std::task::Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no byte arrived for {stall:?}"),
                    ))),
                    std::task::Poll::Pending => std::task::Poll::Pending,
                }
            }
        }
    }
}

/// Fills a tensor's destination from a stream in [`RECV_STEP`] steps,
/// making each step's memory resident only as its bytes are about to
/// arrive. `what` describes the tensor in a stall's error; `channel` names
/// the channel in errors of a channel's own stream (`None`: the
/// connection's stream).
pub(super) async fn receive_in_steps<R: AsyncRead + Unpin + ?Sized>(
    r: &mut R,
    dest: &mut dyn RecvBuffer,
    stall: std::time::Duration,
    peer: &str,
    what: &(dyn std::fmt::Display + Sync),
    channel: Option<&'static str>,
) -> Result<(), TransportError> {
    let len = dest.as_mut_bytes().len();
    let mut at = 0;
    while at < len {
        let end = (at + RECV_STEP).min(len);
        dest.prepare(end);
        match read_with_stall(r, &mut dest.as_mut_bytes()[at..end], stall).await {
            Ok(()) => at = end,
            Err(ReadFail::Stalled { got }) => {
                return Err(TransportError::Stalled {
                    peer: peer.to_owned(),
                    waiting_for: what.to_string(),
                    got: (at + got) as u64,
                    len: len as u64,
                    after: stall,
                })
            }
            Err(ReadFail::Io(e)) => {
                if let Some(r) = crate::auth::RecordError::of(&e) {
                    if !matches!(r, crate::auth::RecordError::Truncated { .. }) {
                        return Err(TransportError::Integrity {
                            peer: peer.to_owned(),
                            source: r.clone(),
                        });
                    }
                }
                return Err(match channel {
                    Some(channel) => TransportError::Channel {
                        channel,
                        peer: peer.to_owned(),
                        reason: e.to_string(),
                    },
                    None if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        TransportError::Closed {
                            peer: peer.to_owned(),
                        }
                    }
                    None => TransportError::Io {
                        peer: peer.to_owned(),
                        source: e,
                    },
                });
            }
        }
    }
    Ok(())
}
