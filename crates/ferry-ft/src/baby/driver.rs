//! The driver: one tokio task per child that owns the process and its
//! command socket, sends the handle's requests, matches the child's
//! answers to them, and watches for the child's death, a hang (no answer
//! within the limit) or a broken protocol, killing and reaping the child
//! before it fails what is outstanding.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::{debug, info_span, warn, Instrument, Span};

use super::child::write_all;
use super::launch::{launch, Launched};
use super::protocol::{Command, FrameDecoder, Reply};
use super::shared::{BabyFailure, BabyOptions, Incarnation, Outcome, Request};
use super::shm::{Released, SharedBuffer};
use super::BabyError;

/// Starts a child and waits for its `Ready`; then its driver runs.
pub(super) async fn start(
    options: &BabyOptions,
    released: Released,
) -> Result<Incarnation, BabyError> {
    let replica_id = options.replica_id.clone();
    let Launched {
        child,
        stream,
        pid,
        program,
    } = launch(&options.child, &replica_id).await?;
    let span = info_span!("baby_child", replica_id = %replica_id, pid);
    debug!(parent: &span, program = %program.display(), "Baby child started");
    let mut driver = Driver {
        replica_id,
        pid,
        child,
        stream,
        decoder: FrameDecoder::default(),
        chunk: vec![0; 4096],
        pending: VecDeque::new(),
        mapped: HashSet::new(),
        released,
        next_op: 1,
        head_since: Instant::now(),
        limit: options.timeout + options.watchdog_margin,
        exit_grace: options.exit_grace,
        failure: Arc::new(Mutex::new(None)),
        span: span.clone(),
    };
    let init = Command::Init {
        replica_id: options.replica_id.clone(),
        bind: options.bind.clone(),
        timeout_ms: options.timeout.as_millis() as u64,
        connect_timeout_ms: options.connect_timeout.as_millis() as u64,
        backend: options.backend,
    };
    let limit = options.connect_timeout + options.watchdog_margin;
    if let Err(error) = driver.hello(init, limit).await {
        driver.kill().await;
        return Err(error);
    }
    let (requests, inbox) = mpsc::unbounded_channel();
    let failure = Arc::clone(&driver.failure);
    let handle = tokio::spawn(driver.run(inbox).instrument(span));
    Ok(Incarnation {
        pid,
        requests,
        failure,
        driver: handle,
    })
}

/// An operation sent to the child and not answered yet.
struct Pending {
    op: u64,
    during: &'static str,
    reply: oneshot::Sender<Outcome>,
    buffer: Option<SharedBuffer>,
}

/// Owns one child process and its socket.
struct Driver {
    replica_id: String,
    pid: u32,
    child: tokio::process::Child,
    stream: UnixStream,
    decoder: FrameDecoder,
    chunk: Vec<u8>,
    /// Sent and unanswered, in the order the child runs them.
    pending: VecDeque<Pending>,
    /// Buffers this child has mapped.
    mapped: HashSet<u64>,
    released: Released,
    next_op: u64,
    /// Since when the oldest pending operation has been the child's
    /// current one.
    head_since: Instant,
    /// The longest one operation may take before the child counts as hung.
    limit: Duration,
    exit_grace: Duration,
    failure: Arc<Mutex<Option<BabyError>>>,
    span: Span,
}

/// What ended a driver's wait.
enum Event {
    Exited(String),
    Read(std::io::Result<usize>),
    Overdue,
    Request(Option<Request>),
}

impl Driver {
    /// Sends `Init` and waits for `Ready` within `limit`.
    async fn hello(&mut self, init: Command, limit: Duration) -> Result<(), BabyError> {
        let deadline = Instant::now() + limit;
        let during = "start-up";
        match tokio::time::timeout_at(deadline, write_all(&self.stream, &init.encode())).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Err(self.lost(during, &error.to_string()).await),
            Err(_) => return Err(self.hung(during, limit)),
        }
        loop {
            if let Some(reply) = self.next_reply().map_err(|reason| self.protocol(reason))? {
                return match reply {
                    Reply::Ready { pid, listen } => {
                        debug!(parent: &self.span, pid, %listen, "Baby child ready");
                        Ok(())
                    }
                    Reply::Failed { kind, message, .. } => Err(BabyError::ChildFailed {
                        replica_id: self.replica_id.clone(),
                        pid: self.pid,
                        during: during.to_owned(),
                        kind,
                        message,
                    }),
                    other => Err(self.protocol(format!("expected Ready, got {other:?}"))),
                };
            }
            let read = tokio::select! {
                status = self.child.wait() => {
                    let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
                    return Err(self.died(during, status));
                }
                read = read_some(&self.stream, &mut self.chunk) => read,
                () = tokio::time::sleep_until(deadline) => return Err(self.hung(during, limit)),
            };
            match read {
                Ok(0) => return Err(self.lost(during, "closed its socket").await),
                Ok(n) => self.decoder.push(&self.chunk[..n]),
                Err(error) => return Err(self.lost(during, &error.to_string()).await),
            }
        }
    }

    fn next_reply(&mut self) -> Result<Option<Reply>, String> {
        match self.decoder.next_frame() {
            Ok(None) => Ok(None),
            Ok(Some(body)) => Reply::decode(&body)
                .map(Some)
                .map_err(|e| format!("bad reply: {e}")),
            Err(error) => Err(format!("reply stream: {error}")),
        }
    }

    async fn run(mut self, mut inbox: mpsc::UnboundedReceiver<Request>) {
        loop {
            let deadline = self.pending.front().map(|_| self.head_since + self.limit);
            let event = tokio::select! {
                // Requests first: one sent before the child died is
                // submitted (and fails with the death) rather than refused.
                biased;
                request = inbox.recv() => Event::Request(request),
                status = self.child.wait() => Event::Exited(
                    status.map_or_else(|e| e.to_string(), |s| s.to_string())
                ),
                read = read_some(&self.stream, &mut self.chunk) => Event::Read(read),
                () = sleep_until(deadline) => Event::Overdue,
            };
            let fatal = match event {
                Event::Exited(status) => Some(self.died(self.current(), status)),
                Event::Read(Ok(0)) => Some(self.lost(self.current(), "closed its socket").await),
                Event::Read(Err(error)) => {
                    Some(self.lost(self.current(), &error.to_string()).await)
                }
                Event::Read(Ok(n)) => {
                    self.decoder.push(&self.chunk[..n]);
                    self.answers()
                }
                Event::Overdue => Some(self.hung(self.current(), self.limit)),
                Event::Request(None) => {
                    self.stop("the group was dropped").await;
                    return;
                }
                Event::Request(Some(Request::Stop { reason })) => {
                    self.stop(&reason).await;
                    inbox.close();
                    while let Ok(request) = inbox.try_recv() {
                        self.refuse(request, &reason);
                    }
                    return;
                }
                Event::Request(Some(request)) => self.submit(request).await.err(),
            };
            if let Some(error) = fatal {
                self.fail(error, &mut inbox).await;
                return;
            }
        }
    }

    /// What the child is doing, for errors.
    fn current(&self) -> &'static str {
        self.pending.front().map_or("idle", |p| p.during)
    }

    /// Handles the replies decoded so far; a fatal error if one is off
    /// protocol or reports a failure.
    fn answers(&mut self) -> Option<BabyError> {
        loop {
            let reply = match self.next_reply() {
                Ok(Some(reply)) => reply,
                Ok(None) => return None,
                Err(reason) => return Some(self.protocol(reason)),
            };
            let (op, failure) = match reply {
                Reply::Done { op } => (op, None),
                Reply::Failed { op, kind, message } => (op, Some((kind, message))),
                other => return Some(self.protocol(format!("unexpected {other:?}"))),
            };
            let Some(head) = self.pending.pop_front() else {
                return Some(self.protocol(format!("an answer for op {op}, none outstanding")));
            };
            if head.op != op {
                let error = self.protocol(format!("an answer for op {op}, expected {}", head.op));
                self.pending.push_front(head);
                return Some(error);
            }
            self.head_since = Instant::now();
            match failure {
                None => {
                    let _ = head.reply.send(Ok(head.buffer));
                }
                Some((kind, message)) => {
                    let error = BabyError::ChildFailed {
                        replica_id: self.replica_id.clone(),
                        pid: self.pid,
                        during: head.during.to_owned(),
                        kind,
                        message,
                    };
                    // Broken before anyone hears of it: a caller that
                    // checks the group after this error sees it broken.
                    self.record(&error);
                    let _ = head.reply.send(Err(BabyFailure {
                        error: error.clone(),
                        buffer: head.buffer,
                    }));
                    return Some(error);
                }
            }
        }
    }

    /// Sends a request's commands to the child.
    async fn submit(&mut self, request: Request) -> Result<(), BabyError> {
        let op = self.next_op;
        self.next_op += 1;
        let (during, frame, reply, buffer) = match request {
            Request::Configure {
                store_address,
                quorum_id,
                replica_ids,
                replica_rank,
                reply,
            } => {
                let frame = Command::Configure {
                    op,
                    store_address,
                    quorum_id,
                    replica_ids,
                    replica_rank,
                }
                .encode();
                ("configure", frame, reply, None)
            }
            Request::Allreduce {
                buffer,
                reduce,
                reply,
            } => {
                let frame = Command::Allreduce {
                    op,
                    buffer: buffer.id(),
                    reduce,
                }
                .encode();
                ("allreduce", frame, reply, Some(buffer))
            }
            Request::Stop { .. } => return Ok(()),
        };
        if self.pending.is_empty() {
            self.head_since = Instant::now();
        }
        self.pending.push_back(Pending {
            op,
            during,
            reply,
            buffer,
        });
        let deadline = self.head_since + self.limit;
        let result = tokio::time::timeout_at(deadline, self.send(frame)).await;
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(self.lost(during, &error.to_string()).await),
            Err(_) => Err(self.hung(during, self.limit)),
        }
    }

    /// Unmaps released buffers, maps the new one, then sends `frame`.
    async fn send(&mut self, frame: Vec<u8>) -> std::io::Result<()> {
        let released: Vec<u64> =
            std::mem::take(&mut *self.released.lock().unwrap_or_else(PoisonError::into_inner));
        for id in released {
            if self.mapped.remove(&id) {
                write_all(&self.stream, &Command::UnmapBuffer { buffer: id }.encode()).await?;
            }
        }
        if let Some(buffer) = self.pending.back().and_then(|p| p.buffer.as_ref()) {
            if !self.mapped.contains(&buffer.id()) {
                let mapping = Arc::clone(buffer.mapping());
                let map = Command::MapBuffer {
                    buffer: buffer.id(),
                    len: buffer.len() as u64,
                }
                .encode();
                let id = buffer.id();
                ferry_transport::shm::send_fds(&self.stream, &map, &[mapping.fd()]).await?;
                self.mapped.insert(id);
            }
        }
        write_all(&self.stream, &frame).await
    }

    fn refuse(&self, request: Request, reason: &str) {
        let (reply, buffer, during) = match request {
            Request::Configure { reply, .. } => (reply, None, "configure"),
            Request::Allreduce { reply, buffer, .. } => (reply, Some(buffer), "allreduce"),
            Request::Stop { .. } => return,
        };
        let _ = reply.send(Err(BabyFailure {
            error: BabyError::Aborted {
                replica_id: self.replica_id.clone(),
                pid: self.pid,
                during: during.to_owned(),
                reason: reason.to_owned(),
            },
            buffer,
        }));
    }

    /// A fatal error: the child is killed and reaped, every outstanding
    /// and queued operation fails.
    async fn fail(&mut self, error: BabyError, inbox: &mut mpsc::UnboundedReceiver<Request>) {
        warn!(parent: &self.span, "Baby child failed, killing it: {error}");
        self.record(&error);
        self.kill().await;
        let reason = format!("the child failed: {error}");
        let mut first = true;
        while let Some(pending) = self.pending.pop_front() {
            // The operation the child was on gets the error itself; those
            // queued behind it were abandoned because of it.
            let error = if first {
                error.clone()
            } else {
                BabyError::Aborted {
                    replica_id: self.replica_id.clone(),
                    pid: self.pid,
                    during: pending.during.to_owned(),
                    reason: reason.clone(),
                }
            };
            first = false;
            let _ = pending.reply.send(Err(BabyFailure {
                error,
                buffer: pending.buffer,
            }));
        }
        inbox.close();
        while let Ok(request) = inbox.try_recv() {
            self.refuse(request, &reason);
        }
    }

    fn record(&self, error: &BabyError) {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert_with(|| error.clone());
    }

    /// Stops the child: asked to exit when idle, killed otherwise or when
    /// it does not exit within the grace; outstanding operations fail with
    /// `reason`.
    async fn stop(&mut self, reason: &str) {
        let busy = !self.pending.is_empty();
        if busy {
            debug!(parent: &self.span, "stopping a busy Baby child: {reason}");
            self.record(&BabyError::Aborted {
                replica_id: self.replica_id.clone(),
                pid: self.pid,
                during: self.current().to_owned(),
                reason: reason.to_owned(),
            });
            self.kill().await;
        } else {
            let polite = async {
                write_all(&self.stream, &Command::Shutdown.encode()).await?;
                self.child.wait().await
            };
            match tokio::time::timeout(self.exit_grace, polite).await {
                Ok(Ok(status)) => debug!(parent: &self.span, %status, "Baby child exited"),
                _ => {
                    debug!(parent: &self.span, "Baby child did not exit in time, killing it");
                    self.kill().await;
                }
            }
        }
        while let Some(pending) = self.pending.pop_front() {
            let _ = pending.reply.send(Err(BabyFailure {
                error: BabyError::Aborted {
                    replica_id: self.replica_id.clone(),
                    pid: self.pid,
                    during: pending.during.to_owned(),
                    reason: reason.to_owned(),
                },
                buffer: pending.buffer,
            }));
        }
    }

    /// SIGKILL, then reap. A killed process ends unless it is stuck in
    /// the kernel; the wait is bounded so a parent never hangs on that.
    async fn kill(&mut self) {
        let _ = self.child.start_kill();
        match tokio::time::timeout(KILL_WAIT, self.child.wait()).await {
            Ok(Ok(status)) => debug!(parent: &self.span, %status, "Baby child reaped"),
            Ok(Err(error)) => warn!(parent: &self.span, "cannot reap the Baby child: {error}"),
            Err(_) => warn!(
                parent: &self.span,
                "Baby child still not gone {KILL_WAIT:?} after SIGKILL; \
                 tokio reaps it when it ends"
            ),
        }
    }

    fn died(&self, during: &str, status: String) -> BabyError {
        BabyError::ChildDied {
            replica_id: self.replica_id.clone(),
            pid: self.pid,
            during: during.to_owned(),
            status,
        }
    }

    /// The socket broke or closed: the child is dying or dead; its exit
    /// status (waited for at most the grace) says how.
    async fn lost(&mut self, during: &str, what: &str) -> BabyError {
        let status = match tokio::time::timeout(self.exit_grace, self.child.wait()).await {
            Ok(Ok(status)) => status.to_string(),
            _ => format!("command socket: {what}"),
        };
        self.died(during, status)
    }

    fn hung(&self, during: &str, waited: Duration) -> BabyError {
        BabyError::ChildHung {
            replica_id: self.replica_id.clone(),
            pid: self.pid,
            during: during.to_owned(),
            waited,
        }
    }

    fn protocol(&self, reason: String) -> BabyError {
        BabyError::ChildProtocol {
            replica_id: self.replica_id.clone(),
            pid: self.pid,
            reason,
        }
    }
}

/// How long a SIGKILLed child may take to be reaped before the driver
/// stops waiting.
const KILL_WAIT: Duration = Duration::from_secs(10);

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Reads what is available on `stream` into `buf` (cancel-safe).
async fn read_some(stream: &UnixStream, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        stream.readable().await?;
        match stream.try_read(buf) {
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => continue,
            result => return result,
        }
    }
}
