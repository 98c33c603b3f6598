//! Passing fds over a Unix stream socket (`SCM_RIGHTS`).

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use tokio::io::Interest;
use tokio::net::UnixStream;

/// The most fds one message may carry (Linux's `SCM_MAX_FD`).
pub const MAX_FDS_PER_MESSAGE: usize = 253;

fn control_space(fds: usize) -> usize {
    if fds == 0 {
        0
    } else {
        rustix::cmsg_space!(ScmRights(fds))
    }
}

/// Sends `bytes` with `fds` attached, over a connected Unix stream socket.
///
/// `bytes` must not be empty (a stream socket carries fds only alongside
/// data). The fds travel with the first chunk the kernel accepts; the rest
/// of `bytes` follows with plain sends, so the whole buffer is sent when
/// this returns. The receiver gets duplicates; `fds` stay open here.
///
/// A stream socket has no message boundaries: frame `bytes` so the receiver
/// knows how much to read (see [`recv_fds`]).
pub async fn send_fds(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if bytes.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "send_fds needs at least one byte of data to carry the fds",
        ));
    }
    if fds.len() > MAX_FDS_PER_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "cannot send {} fds in one message (at most {MAX_FDS_PER_MESSAGE})",
                fds.len()
            ),
        ));
    }
    let mut space = vec![MaybeUninit::<u8>::uninit(); control_space(fds.len())];
    let mut sent = stream
        .async_io(Interest::WRITABLE, || {
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
                return Err(io::Error::other("fd control buffer too small"));
            }
            Ok(rustix::net::sendmsg(
                stream,
                &[IoSlice::new(bytes)],
                &mut control,
                SendFlags::NOSIGNAL,
            )?)
        })
        .await?;
    while sent < bytes.len() {
        let n = stream
            .async_io(Interest::WRITABLE, || {
                Ok(rustix::net::send(
                    stream,
                    &bytes[sent..],
                    SendFlags::NOSIGNAL,
                )?)
            })
            .await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        sent += n;
    }
    Ok(())
}

/// Receives bytes into `buf` and up to `max_fds` fds from a connected Unix
/// stream socket; returns how many bytes were read (0 at end of stream) and
/// the fds (close-on-exec), which came with those bytes.
///
/// One call is one `recvmsg`: it may return fewer bytes than the sender
/// sent (read the rest with plain reads), and bytes sent before the fds may
/// come with them, so frame the data. If the sender attached more than
/// `max_fds` fds, the call fails with `InvalidData` and closes those it got
/// (the kernel drops the rest); the bytes read are lost with it, so treat
/// that as fatal for the connection.
pub async fn recv_fds(
    stream: &UnixStream,
    buf: &mut [u8],
    max_fds: usize,
) -> io::Result<(usize, Vec<OwnedFd>)> {
    if buf.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "recv_fds needs room for at least one byte",
        ));
    }
    if max_fds > MAX_FDS_PER_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("max_fds {max_fds} exceeds {MAX_FDS_PER_MESSAGE}"),
        ));
    }
    let mut space = vec![MaybeUninit::<u8>::uninit(); control_space(max_fds)];
    stream
        .async_io(Interest::READABLE, || {
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let msg = rustix::net::recvmsg(
                stream,
                &mut [IoSliceMut::new(&mut *buf)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            )?;
            let mut fds = Vec::new();
            for message in control.drain() {
                if let RecvAncillaryMessage::ScmRights(received) = message {
                    fds.extend(received);
                }
            }
            if msg.flags.contains(ReturnFlags::CTRUNC) || fds.len() > max_fds {
                let got = fds.len();
                drop(fds);
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "the peer sent more fds than the {max_fds} expected \
                         (control data truncated, {got} received and closed)"
                    ),
                ));
            }
            Ok((msg.bytes, fds))
        })
        .await
}
