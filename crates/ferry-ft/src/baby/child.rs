//! The child's side: the loop that runs in the `ferry-ft-baby` program (or
//! in a re-executed binary that calls [`run_child_if_requested`]), reading
//! commands from the socket its parent passed down and running Ferry's
//! in-process [`ProcessGroup`] on buffers mapped from shared memory.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::Duration;

use tokio::net::UnixStream;
use tracing::{debug, info, info_span, warn, Instrument};

#[cfg(feature = "nccl")]
use super::nccl::{NcclBackend, NcclFailure};
use super::protocol::{Backend, Command, FailureKind, FrameDecoder, Reply};
use super::shm::Mapping;
use super::{CHILD_FD_ENV, PARENT_PID_ENV};
use crate::collective::{CollectiveError, ProcessGroup, ProcessGroupOptions};

/// Runs the child loop and exits the process if this process was started
/// as a Baby child (its environment holds the command socket), and
/// returns at once otherwise. Call it first thing in `main` when the group
/// uses [`ChildProgram::CurrentExe`](super::ChildProgram::CurrentExe).
///
/// ```no_run
/// // The first line of `main`:
/// ferry_ft::baby::run_child_if_requested();
/// // ... the training program ...
/// ```
pub fn run_child_if_requested() {
    if std::env::var_os(CHILD_FD_ENV).is_some() {
        std::process::exit(child_main());
    }
}

/// The child program's whole life: checks that its parent is alive, serves
/// commands until the parent closes the socket or says to shut down, and
/// returns the exit code (0: asked to stop or the parent went away, 1: a
/// setup failure, printed on stderr). What `ferry-ft-baby` runs.
pub fn child_main() -> i32 {
    let fd: i32 = match std::env::var(CHILD_FD_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(fd) => fd,
        None => {
            eprintln!(
                "ferry-ft-baby: {CHILD_FD_ENV} does not name the command socket; \
                 this program is started by ferry_ft::baby::BabyProcessGroup"
            );
            return 1;
        }
    };
    let parent: Option<i32> = std::env::var(PARENT_PID_ENV)
        .ok()
        .and_then(|v| v.parse().ok());
    // The parent may have died between fork and the death signal being
    // armed (the launcher checks too, before exec): then we are an orphan.
    let ppid = rustix::process::getppid().map(|pid| pid.as_raw_nonzero().get());
    if parent.is_some() && ppid != parent {
        eprintln!("ferry-ft-baby: parent {parent:?} is gone (parent is now {ppid:?}); exiting");
        return 0;
    }
    // SAFETY: the parent passed this fd down for us alone (it cleared
    // close-on-exec on it only in this child); nothing else in this
    // process owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY (of the environment): no other thread runs yet.
    std::env::remove_var(CHILD_FD_ENV);
    std::env::remove_var(PARENT_PID_ENV);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("ferry-ft-baby: cannot start a runtime: {error}");
            return 1;
        }
    };
    let std_stream = std::os::unix::net::UnixStream::from(owned);
    if let Err(error) = std_stream.set_nonblocking(true) {
        eprintln!("ferry-ft-baby: command socket: {error}");
        return 1;
    }
    runtime.block_on(async move {
        let stream = match UnixStream::from_std(std_stream) {
            Ok(stream) => stream,
            Err(error) => {
                eprintln!("ferry-ft-baby: command socket: {error}");
                return 1;
            }
        };
        match serve(stream).await {
            Ok(()) => 0,
            Err(error) => {
                eprintln!("ferry-ft-baby {}: {error}", std::process::id());
                1
            }
        }
    })
}

/// Writes all of `bytes` to `stream`.
pub(crate) async fn write_all(stream: &UnixStream, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        stream.writable().await?;
        match stream.try_write(bytes) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

fn failure_kind(error: &CollectiveError) -> FailureKind {
    match error {
        CollectiveError::PeerLost { .. } => FailureKind::PeerLost,
        CollectiveError::Timeout { .. } => FailureKind::Timeout,
        CollectiveError::Store { .. }
        | CollectiveError::StoreAddress { .. }
        | CollectiveError::StoreTimeout { .. } => FailureKind::Store,
        CollectiveError::Connect { .. } => FailureKind::Connect,
        CollectiveError::Protocol { .. } => FailureKind::Protocol,
        CollectiveError::InvalidQuorum { .. } => FailureKind::InvalidQuorum,
        _ => FailureKind::Other,
    }
}

/// The child's state between commands.
struct Child {
    /// The Ferry backend's process group (after an `Init` that chose it).
    pg: Option<ProcessGroup>,
    /// The NCCL backend (after an `Init` that chose it).
    #[cfg(feature = "nccl")]
    nccl: Option<NcclBackend>,
    buffers: HashMap<u64, Mapping>,
    /// Buffers whose mapping failed, and why.
    unmappable: HashMap<u64, String>,
}

/// Serves commands until the parent closes the socket or says to stop.
async fn serve(stream: UnixStream) -> Result<(), String> {
    let mut decoder = FrameDecoder::default();
    let mut fds: VecDeque<OwnedFd> = VecDeque::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let mut child = Child {
        pg: None,
        #[cfg(feature = "nccl")]
        nccl: None,
        buffers: HashMap::new(),
        unmappable: HashMap::new(),
    };
    let mut span = info_span!("baby_child", pid = std::process::id());
    loop {
        let body = loop {
            if let Some(body) = decoder
                .next_frame()
                .map_err(|error| format!("command stream: {error}"))?
            {
                break body;
            }
            let (n, received) = ferry_transport::shm::recv_fds(&stream, &mut chunk, 8)
                .await
                .map_err(|error| format!("command socket: {error}"))?;
            if n == 0 {
                debug!(parent: &span, "the parent closed the command socket");
                return Ok(());
            }
            fds.extend(received);
            decoder.push(&chunk[..n]);
        };
        let command = Command::decode(&body).map_err(|error| format!("bad command: {error}"))?;
        let reply = match command {
            Command::Init {
                replica_id,
                bind: _,
                timeout_ms,
                connect_timeout_ms,
                backend: Backend::Nccl { device },
            } => {
                span = info_span!("baby_child", replica_id = %replica_id, pid = std::process::id());
                let timeouts = (
                    Duration::from_millis(timeout_ms),
                    Duration::from_millis(connect_timeout_ms),
                );
                Some(open_nccl(&mut child, device, timeouts, &span))
            }
            Command::Init {
                replica_id,
                bind,
                timeout_ms,
                connect_timeout_ms,
                backend: Backend::Ferry,
            } => {
                span = info_span!("baby_child", replica_id = %replica_id, pid = std::process::id());
                let options = ProcessGroupOptions::new(replica_id)
                    .with_timeout(Duration::from_millis(timeout_ms))
                    .with_connect_timeout(Duration::from_millis(connect_timeout_ms));
                let pg = ProcessGroup::bind(bind.as_str(), options)
                    .instrument(span.clone())
                    .await
                    .map_err(|error| format!("cannot bind the process group: {error}"))?;
                let listen = pg.local_addr().to_string();
                child.pg = Some(pg);
                info!(parent: &span, %listen, "Baby child ready");
                Some(Reply::Ready {
                    pid: std::process::id(),
                    listen,
                })
            }
            Command::Configure {
                op,
                store_address,
                quorum_id,
                replica_ids,
                replica_rank,
            } => Some(match child.pg.as_mut() {
                None => {
                    let quorum = (store_address.as_str(), quorum_id, replica_ids.as_slice());
                    configure_nccl(&mut child, op, quorum, replica_rank, &span).await
                }
                Some(pg) => match pg
                    .configure_with(&store_address, quorum_id, &replica_ids, replica_rank)
                    .instrument(span.clone())
                    .await
                {
                    Ok(()) => Reply::Done { op },
                    Err(error) => failed(&span, op, &error),
                },
            }),
            Command::MapBuffer { buffer, len } => {
                let mapped = match (fds.pop_front(), usize::try_from(len)) {
                    (None, _) => Err("no fd came with the command".to_owned()),
                    (Some(_), Err(_)) => Err(format!("length {len} does not fit in memory")),
                    (Some(fd), Ok(len)) => Mapping::open(fd, len).map_err(|e| e.to_string()),
                };
                match mapped {
                    Ok(mapping) => {
                        child.buffers.insert(buffer, mapping);
                    }
                    Err(reason) => {
                        warn!(parent: &span, buffer, "cannot map the buffer: {reason}");
                        child.unmappable.insert(buffer, reason);
                    }
                }
                None
            }
            Command::UnmapBuffer { buffer } => {
                child.buffers.remove(&buffer);
                child.unmappable.remove(&buffer);
                None
            }
            Command::Allreduce { op, buffer, reduce } => Some(match child.has_backend() {
                false => not_initialised(op),
                true => match child.buffers.get(&buffer) {
                    None => Reply::Failed {
                        op,
                        kind: FailureKind::Buffer,
                        message: child.unmappable.get(&buffer).map_or_else(
                            || format!("buffer {buffer} was never mapped"),
                            |reason| format!("buffer {buffer} could not be mapped: {reason}"),
                        ),
                    },
                    Some(mapping) => {
                        // SAFETY: the parent gave up its access to this
                        // buffer when it sent the allreduce (it holds the
                        // buffer by value until our reply), and this loop
                        // runs one command at a time.
                        let data = unsafe { mapping.slice_mut() };
                        match child.pg.as_mut() {
                            Some(pg) => {
                                match pg.allreduce(data, reduce).instrument(span.clone()).await {
                                    Ok(()) => Reply::Done { op },
                                    Err(error) => failed(&span, op, &error),
                                }
                            }
                            #[cfg(feature = "nccl")]
                            None => allreduce_nccl(&mut child.nccl, op, data, reduce, &span),
                            #[cfg(not(feature = "nccl"))]
                            None => not_initialised(op),
                        }
                    }
                },
            }),
            Command::Shutdown => {
                debug!(parent: &span, "asked to shut down");
                return Ok(());
            }
        };
        if let Some(reply) = reply {
            write_all(&stream, &reply.encode())
                .await
                .map_err(|error| format!("cannot answer the parent: {error}"))?;
        }
    }
}

impl Child {
    /// Whether an `Init` set up a backend.
    fn has_backend(&self) -> bool {
        #[cfg(feature = "nccl")]
        if self.nccl.is_some() {
            return true;
        }
        self.pg.is_some()
    }
}

/// `Init` with the NCCL backend on CUDA device `device`: `Ready`, or why
/// not (then the parent kills this child).
#[cfg(feature = "nccl")]
fn open_nccl(
    child: &mut Child,
    device: u32,
    (timeout, connect_timeout): (Duration, Duration),
    span: &tracing::Span,
) -> Reply {
    match NcclBackend::open(device, timeout, connect_timeout) {
        Ok(nccl) => {
            child.nccl = Some(nccl);
            let listen = format!("nccl:cuda:{device}");
            info!(parent: span, %listen, "Baby child ready");
            Reply::Ready {
                pid: std::process::id(),
                listen,
            }
        }
        Err(message) => Reply::Failed {
            op: 0,
            kind: FailureKind::Other,
            message: format!("the NCCL backend is unavailable: {message}"),
        },
    }
}

#[cfg(not(feature = "nccl"))]
fn open_nccl(
    _child: &mut Child,
    device: u32,
    _timeouts: (Duration, Duration),
    _span: &tracing::Span,
) -> Reply {
    Reply::Failed {
        op: 0,
        kind: FailureKind::Other,
        message: format!(
            "the NCCL backend (CUDA device {device}) needs ferry-ft's `nccl` feature, \
             which this child program was built without"
        ),
    }
}

/// `Configure` on the NCCL backend; `quorum` is the store's address, the
/// quorum id and the world size.
#[cfg(feature = "nccl")]
async fn configure_nccl(
    child: &mut Child,
    op: u64,
    (store_address, quorum_id, replica_ids): (&str, i64, &[String]),
    replica_rank: u64,
    span: &tracing::Span,
) -> Reply {
    let world_size = replica_ids.len();
    let Some(nccl) = child.nccl.as_mut() else {
        return not_initialised(op);
    };
    let Some(rank) = usize::try_from(replica_rank)
        .ok()
        .filter(|&rank| rank < world_size)
    else {
        return Reply::Failed {
            op,
            kind: FailureKind::InvalidQuorum,
            message: format!("replica rank {replica_rank} outside a quorum of {world_size}"),
        };
    };
    match nccl
        .configure(store_address, quorum_id, replica_ids, rank)
        .instrument(span.clone())
        .await
    {
        Ok(()) => Reply::Done { op },
        Err(failure) => nccl_failed(span, op, failure),
    }
}

#[cfg(not(feature = "nccl"))]
async fn configure_nccl(
    _child: &mut Child,
    op: u64,
    _quorum: (&str, i64, &[String]),
    _replica_rank: u64,
    _span: &tracing::Span,
) -> Reply {
    not_initialised(op)
}

/// `Allreduce` on the NCCL backend.
#[cfg(feature = "nccl")]
fn allreduce_nccl(
    nccl: &mut Option<NcclBackend>,
    op: u64,
    data: &mut [f32],
    reduce: crate::collective::ReduceOp,
    span: &tracing::Span,
) -> Reply {
    match nccl.as_mut().map(|nccl| nccl.allreduce(data, reduce)) {
        None => not_initialised(op),
        Some(Ok(())) => Reply::Done { op },
        Some(Err(failure)) => nccl_failed(span, op, failure),
    }
}

#[cfg(feature = "nccl")]
fn nccl_failed(span: &tracing::Span, op: u64, failure: NcclFailure) -> Reply {
    warn!(parent: span, op, "NCCL operation failed: {}", failure.message);
    Reply::Failed {
        op,
        kind: failure.kind,
        message: failure.message,
    }
}

fn not_initialised(op: u64) -> Reply {
    Reply::Failed {
        op,
        kind: FailureKind::Other,
        message: "the child got no Init command".to_owned(),
    }
}

fn failed(span: &tracing::Span, op: u64, error: &CollectiveError) -> Reply {
    warn!(parent: span, op, "operation failed: {error}");
    Reply::Failed {
        op,
        kind: failure_kind(error),
        message: error.to_string(),
    }
}
