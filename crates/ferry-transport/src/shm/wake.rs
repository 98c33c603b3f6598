//! Eventfd wake-ups: one side signals, the other waits with tokio.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::task::{ready, Context, Poll};

use rustix::event::EventfdFlags;
use rustix::io::Errno;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// A new close-on-exec, non-blocking eventfd with a zero counter.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    Ok(rustix::event::eventfd(
        0,
        EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK,
    )?)
}

/// The signalling end of an eventfd.
#[derive(Debug)]
pub(crate) struct Signal {
    fd: OwnedFd,
}

impl Signal {
    pub(crate) fn new(fd: OwnedFd) -> Signal {
        Signal { fd }
    }

    /// Adds 1 to the counter, making the fd readable for the waiter.
    pub(crate) fn notify(&self) -> io::Result<()> {
        loop {
            match rustix::io::write(&self.fd, &1u64.to_ne_bytes()) {
                Ok(_) => return Ok(()),
                // The counter is saturated: the waiter is already signalled.
                Err(Errno::AGAIN) => return Ok(()),
                Err(Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// The waiting end of an eventfd. It is registered with the tokio reactor
/// on the first wait, so it can be made outside a runtime.
#[derive(Debug)]
pub(crate) enum Wait {
    /// Not registered yet (`None` only transiently, while registering).
    Unregistered(Option<OwnedFd>),
    /// Registered with the reactor.
    Registered(AsyncFd<OwnedFd>),
}

impl Wait {
    pub(crate) fn new(fd: OwnedFd) -> Wait {
        Wait::Unregistered(Some(fd))
    }

    fn registered(&mut self) -> io::Result<&AsyncFd<OwnedFd>> {
        if let Wait::Unregistered(fd) = self {
            if tokio::runtime::Handle::try_current().is_err() {
                return Err(io::Error::other(
                    "shm rings must be polled inside a tokio runtime",
                ));
            }
            let fd = fd
                .take()
                .ok_or_else(|| io::Error::other("eventfd registration failed earlier"))?;
            // SAFETY: the `AsyncFd` owns the `OwnedFd`, so the descriptor stays
            // open and names the same eventfd for the `AsyncFd`'s lifetime.
            let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
                .map_err(|e| e.into_parts().1)?;
            *self = Wait::Registered(fd);
        }
        match self {
            Wait::Registered(fd) => Ok(fd),
            Wait::Unregistered(_) => Err(io::Error::other("eventfd not registered")),
        }
    }

    /// Ready once the counter was non-zero; resets it to zero. Several
    /// signals may collapse into one wake-up, and a wake-up may be stale (a
    /// signal for a sleep that was already over): callers re-check their
    /// condition after every wake-up.
    pub(crate) fn poll_wait(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let fd = self.registered()?;
        loop {
            let mut guard = ready!(fd.poll_read_ready(cx))?;
            let mut buf = [0u8; 8];
            match rustix::io::read(fd.get_ref().as_fd(), &mut buf) {
                Ok(8) => return Poll::Ready(Ok(())),
                Ok(n) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("wake-up fd returned {n} bytes; it is not an eventfd"),
                    )))
                }
                Err(Errno::AGAIN) => guard.clear_ready(),
                Err(Errno::INTR) => continue,
                Err(e) => return Poll::Ready(Err(e.into())),
            }
        }
    }
}
