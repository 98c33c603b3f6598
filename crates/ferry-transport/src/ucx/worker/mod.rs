//! One connection's UCP worker and endpoint, its requests and their
//! progress.
//!
//! Every operation posts a request with a completion callback whose user
//! data is the request's [`Completion`](request::Completion). A [`Pending`]
//! request owns what UCX reads or writes (`keep`): when it is dropped
//! before UCX completed it, it is cancelled and moved, buffer and all, into
//! the worker's in-flight list, which is swept after each progress call;
//! memory UCX may still write is never freed. Fire-and-forget sends
//! (tensors, frame chunks) go to the same list.
//!
//! A task waiting for a receive first spins on `ucp_worker_progress` for at
//! most the configured spin time since UCX last reported progress (ten
//! times that while the link moves bulk data: [`Shared::spin_budget`]),
//! then sleeps on the worker's event fd itself (tokio `AsyncFd`, plus a
//! backstop timer): it progresses, arms the worker and waits for the fd,
//! and again each time it wakes, until its request completes. While it
//! sleeps its waker is also kept in the completion, so a request that
//! another task's progress call completes wakes it too; once awake it takes
//! the waker back out, so that its own progress call does not wake it
//! again. The event that ends the sleep thus wakes the waiting task
//! directly, with no other task in between: a handoff through a second
//! task would cost a wake-up and a thread switch per message.
//! The connection's progress task works only while a send UCX has not
//! finished is in flight: it spins on progress while UCX keeps moving the
//! send (as a waiting receive spins), then arms the worker and sleeps on
//! the fd; each time it wakes it progresses the worker and sweeps the
//! finished sends. Otherwise it sleeps, with no timer, until such a send
//! exists. While nothing sleeps the worker stays unarmed: an armed worker
//! makes the peer signal it for the next message (a system call there, a
//! wake-up here), which a task spinning for that message does not need.
//!
//! The files: this one creates the worker and holds the link's handles;
//! `connect` makes the endpoint (from the peer's address, or through a
//! listener); `shared` is the state the handles share (the lock, progress,
//! the spin and the in-flight list); `request` is what a UCX request
//! reports and owns; `link` posts sends and receives; `pending` is a posted
//! receive and how its task waits; `drive` is the progress task.

mod connect;
mod drive;
mod link;
mod pending;
mod request;
mod shared;
#[cfg(test)]
pub(crate) mod tests;

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use shared::{Shared, State};

use super::{context, exit, status_text, sys};
use crate::TransportError;

pub(crate) use pending::Pending;

/// How long the progress task sleeps on the event fd at most (a backstop
/// for events the fd does not signal).
const BACKSTOP: Duration = Duration::from_millis(5);
/// Progress calls per lock while draining.
const DRAIN: usize = 64;
/// Times a sleeping receive progresses and re-arms the worker while UCX
/// reports events pending (`UCS_ERR_BUSY`) before it yields to tokio.
const ARM_TRIES: usize = 4;
/// Progress calls per round of a spinning wait before the CPU is yielded.
/// A progress call (with the link's lock) costs far more than an `shm`
/// ring check (hundreds of nanoseconds over UCX's tcp), so a round as
/// long as the rings' ([`SPIN_ITERATIONS`](crate::spin::SPIN_ITERATIONS),
/// 64) would hold the core for many microseconds while, on a host with
/// fewer cores than busy threads, the thread that must answer may be
/// waiting for it. Shorter rounds yield more often and cost a `sched_yield`
/// each.
const PROGRESS_CALLS_PER_ROUND: u32 = 16;
/// A send or receive at least this long marks its link as streaming
/// ([`Shared::spin_budget`]): its bytes take hundreds of microseconds to
/// move at the few GB/s of a host's copies, several times the spin.
const STREAMING_BYTES: usize = 1 << 20;
/// How long after its last such send or receive was posted a link counts
/// as streaming.
const STREAMING_FOR: Duration = Duration::from_millis(2);
/// How many times the configured spin a wait on a streaming link spins
/// for. Over TCP a transfer's bytes arrive as the socket drains, and on a
/// small host the gaps between them (the other side's thread descheduled
/// for a moment) often outlast the configured spin: the wait then sleeps on
/// the event fd and pays a wake-up, again and again within one transfer.
/// Spinning longer keeps the waiting side on its core through those gaps;
/// over shared memory the bytes come as one copy, so it changes nothing
/// there. The cost is bounded: only
/// links moving bulk data spin longer, and only while bytes keep moving or
/// for the longer budget after they stop.
const STREAMING_SPIN_FACTOR: u32 = 10;
/// Tag of the probe each side sends once its endpoint exists (see
/// [`UcxLink::probe`]): in the frames' half of the tag space, above any
/// chunk sequence number a connection reaches.
const PROBE_TAG: u64 = super::FRAME_TAG | (1 << 62);

/// A link to the peer's UCX worker: cloned by the connection's reader,
/// writer and channels; the last handle stops the progress task, which
/// then releases the worker.
pub(crate) struct UcxLink {
    shared: Arc<Shared>,
    _handle: Arc<StopOnDrop>,
}

impl Clone for UcxLink {
    fn clone(&self) -> Self {
        UcxLink {
            shared: self.shared.clone(),
            _handle: self._handle.clone(),
        }
    }
}

struct StopOnDrop(Arc<Shared>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stop.notify_one();
    }
}

/// A worker whose endpoint is not connected yet: its address goes in the
/// handshake.
pub(crate) struct UcxWorker {
    shared: Arc<Shared>,
    address: Vec<u8>,
    /// Whether UCX's transports may include one with peer failure
    /// detection (see [`UcxWorker::connect`]).
    peer_mode: bool,
}

/// Whether a `UCX_TLS` list (`None`: UCX's default, every transport) names
/// a transport other than the shared-memory ones and `self`, which have no
/// peer failure detection in UCX 1.13.
fn may_detect_peer_failure(tls: Option<&str>) -> bool {
    tls.is_none_or(|list| {
        list.split(',').map(str::trim).any(|t| {
            let t = t.trim_start_matches('^');
            !(super::is_shared_memory(t) || t == "self" || t.is_empty())
        })
    })
}

/// A new worker's address and event fd, or what failed with UCX's status.
fn describe(
    api: &sys::Ucp,
    worker: sys::ucp_worker_h,
) -> Result<(Vec<u8>, RawFd), (&'static str, sys::ucs_status_t)> {
    let mut addr: *mut sys::ucp_address_t = std::ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: a live worker; out-parameters.
    let status = unsafe { api.ucp_worker_get_address(worker, &mut addr, &mut len) };
    if status != sys::UCS_OK {
        return Err(("reading the UCX worker's address failed", status));
    }
    // SAFETY: UCX returned `len` bytes at `addr`, released right after.
    let address = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
    // SAFETY: released once.
    unsafe { api.ucp_worker_release_address(worker, addr) };
    let mut efd: RawFd = -1;
    // SAFETY: a live worker created with wakeup events; out-parameter.
    let status = unsafe { api.ucp_worker_get_efd(worker, &mut efd) };
    if status != sys::UCS_OK {
        return Err(("the UCX worker has no event fd", status));
    }
    Ok((address, efd))
}

impl UcxWorker {
    /// Creates a worker on the context for `tls`.
    pub(crate) fn new(tls: Option<&str>, spin: Duration) -> Result<Self, TransportError> {
        Self::with_backstop(tls, spin, BACKSTOP)
    }

    /// [`new`](Self::new) with another backstop: the tests use one so
    /// long that only the event fd can end a sleep.
    fn with_backstop(
        tls: Option<&str>,
        spin: Duration,
        backstop: Duration,
    ) -> Result<Self, TransportError> {
        let api = super::api()?;
        // Held until the worker is registered (see `exit`).
        let mut registry = exit::registry();
        if registry.exiting {
            return Err(TransportError::Unavailable {
                what: "UCX",
                reason: "the process is exiting".into(),
            });
        }
        let ctx = context(tls)?;
        let unavailable = |what: &str, status| TransportError::Unavailable {
            what: "UCX",
            reason: format!("{what}: {}", status_text(api, status)),
        };
        // SAFETY: zeroed is a valid parameter block.
        let mut params: sys::ucp_worker_params_t = unsafe { std::mem::zeroed() };
        params.field_mask =
            (sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE | sys::UCP_WORKER_PARAM_FIELD_EVENTS) as u64;
        params.thread_mode = sys::UCS_THREAD_MODE_SERIALIZED;
        params.events = sys::UCP_WAKEUP_TAG_SEND
            | sys::UCP_WAKEUP_TAG_RECV
            | sys::UCP_WAKEUP_TX
            | sys::UCP_WAKEUP_RX;
        let mut worker: sys::ucp_worker_h = std::ptr::null_mut();
        // SAFETY: a live context; out-parameter.
        let status = unsafe { api.ucp_worker_create(ctx.handle, &params, &mut worker) };
        if status != sys::UCS_OK {
            return Err(unavailable("creating a UCX worker failed", status));
        }
        // What UCX says of the new worker; on failure the worker is
        // destroyed here (no `Shared` owns it yet).
        let described = describe(api, worker).inspect_err(|_| {
            // SAFETY: created above, used by nothing else.
            unsafe { api.ucp_worker_destroy(worker) };
        });
        let (address, efd) = match described {
            Ok(d) => d,
            Err((what, status)) => return Err(unavailable(what, status)),
        };
        // SAFETY: the worker owns the fd and keeps it open until it is
        // destroyed, which `Shared::drop` does only after dropping this.
        let fd =
            match unsafe { AsyncFd::register_with_interest(efd, tokio::io::Interest::READABLE) } {
                Ok(fd) => fd,
                Err(e) => {
                    // SAFETY: as above.
                    unsafe { api.ucp_worker_destroy(worker) };
                    return Err(TransportError::Unavailable {
                        what: "UCX",
                        reason: format!("cannot watch the UCX worker's event fd: {e}"),
                    });
                }
            };
        let shared = Arc::new(Shared {
            api,
            state: Mutex::new(State {
                worker,
                ep: std::ptr::null_mut(),
                listener: std::ptr::null_mut(),
                inflight: Vec::new(),
                waiters: Vec::new(),
                room: None,
            }),
            failed: Mutex::new(None),
            has_failed: AtomicBool::new(false),
            requests: Mutex::new(Vec::new()),
            senders: AtomicUsize::new(0),
            stop: Notify::new(),
            wanted: Notify::new(),
            efd: Some(fd),
            spin,
            streamed_at: AtomicU64::new(0),
            created: Instant::now(),
            backstop,
            peer: OnceLock::new(),
            _context: ctx,
        });
        let weak: Weak<Shared> = Arc::downgrade(&shared);
        registry.push(weak);
        drop(registry);
        let peer_mode = may_detect_peer_failure(super::effective_tls(tls).as_deref());
        Ok(UcxWorker {
            shared,
            address,
            peer_mode,
        })
    }

    /// Whether UCX's transports may include one with peer failure
    /// detection (a network one): where they do, the endpoint asks for
    /// peer-failure handling, and the accepting side listens
    /// ([`listen`](Self::listen)).
    pub(crate) fn may_detect_peer_failure(&self) -> bool {
        self.peer_mode
    }

    /// The worker's address, for the peer.
    pub(crate) fn address(&self) -> &[u8] {
        &self.address
    }
}
