//! The way out of a connection: a queue drained by the connection's writer
//! task, and a direct path past it.
//!
//! A sender that finds the queue empty and the writer idle writes its
//! message itself, on its own thread, which saves waking the writer task
//! (on another thread, often): on the `shm` transport that wake-up is a
//! good part of an empty call's round trip. If the transport cannot take
//! the whole frame at once, a task on the agent's runtime finishes it, so
//! a send never waits. Otherwise messages go through the queue and the
//! writer task writes what has gathered as one batch. Order is kept: a
//! direct write happens only while nothing queued is still unwritten,
//! under the lock the writer task holds while it writes.
//!
//! A message over the limits the peer stated in its handshake never
//! leaves: [`Outbox::send`] refuses it at once when the handshake is in,
//! and the writer task hands one queued before that to its `refused`
//! callback. Either way the connection and the other messages on it are
//! untouched (the peer would have closed the connection on reading it).
//!
//! Likewise a message with a tensor that no selected channel carries (say
//! two workers on different hosts that offer only the same-host channels)
//! is refused with the typed selection error, by [`Outbox::send`] or by
//! the writer task, instead of failing the connection's writer.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use ferry_transport::selection::{Selection, SelectionError};
use ferry_transport::{FrameWriter, OutgoingMessage, PeerWriter, TransportError};
use ferry_wire::{Device, Limits, WireError};
use tokio::runtime::Handle;
use tokio::sync::{mpsc, Mutex, Notify};

use crate::inline;

/// Most messages the writer task takes into one batch.
const MAX_BATCH: usize = 256;

/// The sending side of one connection; cheap to clone.
#[derive(Clone)]
pub(crate) struct Outbox {
    queue: mpsc::UnboundedSender<OutgoingMessage>,
    shared: Arc<SharedWriter>,
}

/// The writer task's side: the queue and the writer it drains into.
pub(crate) struct OutboxQueue {
    queue: mpsc::UnboundedReceiver<OutgoingMessage>,
    shared: Arc<SharedWriter>,
}

/// The connection's frame writer, shared by the writer task and direct
/// writers.
struct SharedWriter {
    /// `None` until the connection is established, and after a failed write.
    writer: Arc<Mutex<Option<FrameWriter<PeerWriter>>>>,
    /// The peer's limits, set when the connection is established (before
    /// `writer`).
    peer_limits: OnceLock<Limits>,
    /// The channels selected for the tensors this side sends, set with
    /// `peer_limits`.
    selection: OnceLock<Selection>,
    /// Messages queued and not yet written.
    queued: AtomicUsize,
    /// A write failed: the connection is broken.
    failed: AtomicBool,
    /// The error of a failed direct write finished by a task, for the
    /// writer task to report.
    error: parking_lot::Mutex<Option<TransportError>>,
    /// Wakes the writer task when `error` is set.
    broken: Notify,
    /// The agent's runtime, entered by direct writers (the transports
    /// register their wake-ups with its reactor).
    runtime: Handle,
}

/// Why [`Outbox::send`] did not send.
#[derive(Debug)]
pub(crate) enum SendError {
    /// The connection's writer is gone (closed or failed earlier).
    Closed,
    /// Writing the message failed; the connection is broken.
    Write(TransportError),
    /// The message is over the peer's limits (which one, by how much);
    /// nothing was written and the connection is intact.
    TooLarge(WireError),
    /// A tensor of the message has no channel to the peer (no channel both
    /// offer serves its device with equal descriptors); nothing was
    /// written and the connection is intact.
    NoChannel(SelectionError),
}

/// Why the writer task kept a queued message back (nothing of it was
/// written; the connection is intact).
#[derive(Debug)]
pub(crate) enum Refusal {
    /// Over the peer's limits.
    TooLarge(WireError),
    /// A tensor of it has no channel to the peer.
    NoChannel(SelectionError),
}

/// A new outbox and the queue its writer task drains.
pub(crate) fn outbox(runtime: Handle) -> (Outbox, OutboxQueue) {
    let (queue, rx) = mpsc::unbounded_channel();
    let shared = Arc::new(SharedWriter {
        writer: Arc::new(Mutex::new(None)),
        peer_limits: OnceLock::new(),
        selection: OnceLock::new(),
        queued: AtomicUsize::new(0),
        failed: AtomicBool::new(false),
        error: parking_lot::Mutex::new(None),
        broken: Notify::new(),
        runtime,
    });
    (
        Outbox {
            queue,
            shared: shared.clone(),
        },
        OutboxQueue { queue: rx, shared },
    )
}

impl Outbox {
    /// Checks a message's payload and tensors against the peer's limits,
    /// once the connection is established (before, everything passes:
    /// the writer task checks it then).
    pub(crate) fn check(
        &self,
        payload: &[u8],
        tensors: &[Arc<dyn ferry_wire::OutgoingTensor>],
    ) -> Result<(), WireError> {
        match self.shared.peer_limits.get() {
            Some(limits) => {
                let descriptors: Vec<_> = tensors.iter().map(|t| t.descriptor()).collect();
                limits.check_outgoing(payload.len(), &descriptors)
            }
            None => Ok(()),
        }
    }

    /// Whether messages can no longer leave through it.
    pub(crate) fn is_closed(&self) -> bool {
        self.queue.is_closed() || self.shared.failed.load(Ordering::SeqCst)
    }

    /// Sends `message`: written directly when the writer is idle and
    /// nothing is queued, else queued for the writer task. Never waits: a
    /// direct write the transport cannot take at once is finished by a
    /// task on the agent's runtime, which keeps the writer until then.
    /// A message over the peer's limits is refused (`TooLarge`) once the
    /// connection is established; before, the writer task checks it.
    pub(crate) fn send(&self, message: OutgoingMessage) -> Result<(), SendError> {
        if self.shared.failed.load(Ordering::SeqCst) {
            return Err(SendError::Closed);
        }
        let checked = match self.shared.peer_limits.get() {
            Some(limits) => {
                message.check(limits).map_err(SendError::TooLarge)?;
                self.shared.routable(&message)?;
                true
            }
            None => false,
        };
        let message = match self.try_write(message, checked) {
            Ok(written) => return written,
            Err(message) => message,
        };
        self.shared.queued.fetch_add(1, Ordering::SeqCst);
        self.queue.send(message).map_err(|_| {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            SendError::Closed
        })
    }

    /// The direct write, or the message back when it has to be queued.
    fn try_write(
        &self,
        message: OutgoingMessage,
        checked: bool,
    ) -> Result<Result<(), SendError>, OutgoingMessage> {
        if self.shared.queued.load(Ordering::SeqCst) != 0 {
            return Err(message);
        }
        let Ok(mut guard) = self.shared.writer.clone().try_lock_owned() else {
            return Err(message);
        };
        // Under the lock the writer task is not writing; with nothing
        // queued, nothing sent earlier is still unwritten.
        if guard.is_none() || self.shared.queued.load(Ordering::SeqCst) != 0 {
            return Err(message);
        }
        // The connection was established since `send` looked.
        if let (false, Some(limits)) = (checked, self.shared.peer_limits.get()) {
            if let Err(e) = message.check(limits) {
                return Ok(Err(SendError::TooLarge(e)));
            }
            if let Err(e) = self.shared.routable(&message) {
                return Ok(Err(e));
            }
        }
        let shared = self.shared.clone();
        let write = Box::pin(async move {
            let Some(writer) = guard.as_mut() else {
                return;
            };
            if let Err(e) = writer.write(&message).await {
                *guard = None;
                shared.fail(e);
            }
        });
        // A frame the transport cannot take at once may be partly out: the
        // task that finishes it keeps the writer until it is done.
        if !inline::run_or_spawn(&self.shared.runtime, write) {
            return Ok(Ok(()));
        }
        Ok(match self.shared.take_error() {
            Some(e) => Err(SendError::Write(e)),
            None => Ok(()),
        })
    }
}

impl SharedWriter {
    /// Whether every tensor of `message` has a selected channel to the
    /// peer (always, before the connection is established).
    fn routable(&self, message: &OutgoingMessage) -> Result<(), SendError> {
        let Some(selection) = self.selection.get() else {
            return Ok(());
        };
        for t in &message.tensors {
            // The receiver allocates every destination on its CPU.
            selection
                .channel_for(t.descriptor().device, Device::Cpu)
                .map_err(SendError::NoChannel)?;
        }
        Ok(())
    }

    /// Records a failed write: the connection is broken. The writer task
    /// reports it (`drain` returns it) unless a direct sender takes it.
    fn fail(&self, error: TransportError) {
        *self.error.lock() = Some(error);
        self.failed.store(true, Ordering::SeqCst);
        self.broken.notify_one();
    }

    fn take_error(&self) -> Option<TransportError> {
        self.error.lock().take()
    }
}

impl OutboxQueue {
    /// Installs the established connection's writer (and the peer's limits
    /// it knows from the handshake).
    pub(crate) async fn install(&self, writer: FrameWriter<PeerWriter>) {
        let _ = self.shared.selection.set(writer.selection().clone());
        if let Some(limits) = writer.peer_limits() {
            let _ = self.shared.peer_limits.set(limits);
        }
        *self.shared.writer.lock().await = Some(writer);
    }

    /// The writer task: writes queued messages in batches (and the
    /// connection's pending releases when `releases` fires) until every
    /// [`Outbox`] is dropped, then shuts the write side down. Returns the
    /// first write error. A queued message over the peer's limits goes to
    /// `refused` instead, which may give a message to send in its place;
    /// so does one with a tensor no selected channel carries.
    pub(crate) async fn drain(
        mut self,
        releases: ferry_transport::ReleaseSignal,
        refused: impl Fn(OutgoingMessage, Refusal) -> Option<OutgoingMessage>,
    ) -> Result<(), TransportError> {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        loop {
            let first = tokio::select! {
                biased;
                m = self.queue.recv() => match m {
                    Some(m) => Some(m),
                    None => break,
                },
                // The reader copied tensors out of band: tell the peer.
                () = releases.wait() => None,
                () = self.shared.broken.notified() => match self.shared.take_error() {
                    Some(e) => return Err(e),
                    None => continue,
                },
            };
            let limits = self.shared.peer_limits.get();
            let shared = &self.shared;
            let mut admit = |m: OutgoingMessage| match limits.map(|l| m.check(l)) {
                Some(Err(e)) => batch.extend(refused(m, Refusal::TooLarge(e))),
                _ => match shared.routable(&m) {
                    Err(SendError::NoChannel(e)) => {
                        batch.extend(refused(m, Refusal::NoChannel(e)));
                    }
                    _ => batch.push(m),
                },
            };
            let mut taken = 0;
            if let Some(m) = first {
                admit(m);
                taken += 1;
            }
            while taken < MAX_BATCH {
                match self.queue.try_recv() {
                    Ok(m) => {
                        admit(m);
                        taken += 1;
                    }
                    Err(_) => break,
                }
            }
            let written = taken;
            let mut guard = self.shared.writer.lock().await;
            let Some(writer) = guard.as_mut() else {
                // A direct write failed.
                return self.shared.take_error().map_or(Ok(()), Err);
            };
            if let Err(e) = writer.write_batch(&batch).await {
                self.shared.failed.store(true, Ordering::SeqCst);
                *guard = None;
                return Err(e);
            }
            drop(guard);
            self.shared.queued.fetch_sub(written, Ordering::SeqCst);
            batch.clear();
        }
        if let Some(writer) = self.shared.writer.lock().await.as_mut() {
            let _ = writer.shutdown().await;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ferry_transport::{Endpoint, PeerConnection};
    use ferry_wire::{Flags, MessageKind};
    use tokio::net::TcpListener;

    use super::*;

    fn message(id: u64, len: usize) -> OutgoingMessage {
        OutgoingMessage {
            kind: MessageKind::REQUEST,
            flags: Flags::NONE,
            request_id: id,
            payload: vec![id as u8; len],
            tensors: Vec::new(),
        }
    }

    /// Sends from a thread outside the runtime never wait, even for frames
    /// far larger than the transport can take while nobody reads, and the
    /// peer receives every message in the order sent, direct and queued
    /// ones mixed.
    #[test]
    fn sends_never_wait_and_keep_their_order() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (client, server) = rt.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let accept = tokio::spawn(async move {
                let (stream, _) = listener.accept().await.unwrap();
                PeerConnection::accept(stream, &Endpoint::new("server", 0))
                    .await
                    .unwrap()
            });
            let client = PeerConnection::connect(addr, &Endpoint::new("client", 1))
                .await
                .unwrap();
            (client, accept.await.unwrap())
        });
        let (outbox, queue) = outbox(rt.handle().clone());
        let releases = client.writer.release_signal();
        rt.block_on(queue.install(client.writer));
        let drained = rt.spawn(queue.drain(releases, |_, _| None));

        // Large frames (more than any ring or socket buffer holds) between
        // small ones; nothing reads until every send has returned.
        let lens: Vec<usize> = (0..40)
            .map(|i| if i % 10 == 0 { 24 << 20 } else { 100 + i })
            .collect();
        let (done, sent) = std::sync::mpsc::channel();
        let sender = {
            let lens = lens.clone();
            std::thread::spawn(move || {
                for (id, &len) in lens.iter().enumerate() {
                    outbox.send(message(id as u64, len)).unwrap();
                }
                done.send(()).unwrap();
                outbox
            })
        };
        sent.recv_timeout(Duration::from_secs(60))
            .expect("a send waited for the peer to read");
        drop(sender.join().unwrap());

        let mut reader = server.reader;
        rt.block_on(async {
            for (id, &len) in lens.iter().enumerate() {
                let msg = reader.read().await.unwrap().expect("a message");
                assert_eq!(msg.header.request_id, id as u64, "order");
                assert_eq!(msg.payload.len(), len, "length of message {id}");
                assert!(msg.payload.iter().all(|&b| b == id as u8));
            }
        });
        rt.block_on(drained).unwrap().unwrap();
    }
}
