//! The parent's side: [`BabyProcessGroup`] (the handle the training loop
//! holds) and [`BabyWork`], the future of one operation. The child itself
//! is owned by a driver task (`driver.rs`).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, info_span, warn, Instrument};

use super::driver::start;
use super::shared::{BabyFailure, BabyOptions, Incarnation, Outcome, Request};
use super::shm::{Released, SharedBuffer};
use super::BabyError;
use crate::collective::{quorum_rank, ReduceOp};
use crate::manager::QuorumResult;

/// The future of one [`allreduce_buffer`](BabyProcessGroup::allreduce_buffer):
/// it owns nothing of the group, so the group can be reconfigured while it
/// is outstanding (which fails it). Resolves to the buffer, reduced, or to
/// the failure with the buffer.
#[must_use = "the allreduce's result says whether the step may be committed"]
pub struct BabyWork {
    state: WorkState,
}

enum WorkState {
    Ready(Option<Result<SharedBuffer, BabyFailure>>),
    Waiting {
        reply: oneshot::Receiver<Outcome>,
        replica_id: String,
        pid: u32,
    },
}

impl fmt::Debug for BabyWork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.state {
            WorkState::Ready(_) => f.write_str("BabyWork(ready)"),
            WorkState::Waiting { pid, .. } => write!(f, "BabyWork(child {pid})"),
        }
    }
}

impl Future for BabyWork {
    type Output = Result<SharedBuffer, BabyFailure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match &mut this.state {
            WorkState::Ready(result) => Poll::Ready(result.take().unwrap_or_else(|| {
                Err(BabyFailure {
                    error: BabyError::NotConfigured,
                    buffer: None,
                })
            })),
            WorkState::Waiting {
                reply,
                replica_id,
                pid,
            } => match Pin::new(reply).poll(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Ok(Ok(buffer))) => match buffer {
                    Some(buffer) => Poll::Ready(Ok(buffer)),
                    None => Poll::Ready(Err(BabyFailure {
                        error: BabyError::ChildProtocol {
                            replica_id: replica_id.clone(),
                            pid: *pid,
                            reason: "an allreduce came back without its buffer".to_owned(),
                        },
                        buffer: None,
                    })),
                },
                Poll::Ready(Ok(Err(failure))) => Poll::Ready(Err(failure)),
                Poll::Ready(Err(_)) => Poll::Ready(Err(BabyFailure {
                    error: BabyError::Aborted {
                        replica_id: replica_id.clone(),
                        pid: *pid,
                        during: "allreduce".to_owned(),
                        reason: "the child's driver is gone (runtime shut down)".to_owned(),
                    },
                    buffer: None,
                })),
            },
        }
    }
}

/// The quorum a group is configured for.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Configured {
    quorum_id: i64,
    replica_ids: Vec<String>,
    rank: u64,
}

/// A process group across the replica groups of the current quorum whose
/// collectives run in a child process (torchft's `ProcessGroupBaby`): a
/// collective that hangs or crashes takes the child down, never the
/// training process.
///
/// The interface is [`ProcessGroup`](crate::collective::ProcessGroup)'s:
/// [`configure`](Self::configure) after every quorum,
/// [`allreduce`](Self::allreduce) / [`allreduce_mean`](Self::allreduce_mean)
/// on a slice; the results are bit-identical, since the child runs that
/// very group. Without a copy: [`buffer`](Self::buffer) gives a
/// [`SharedBuffer`] in shared memory, and
/// [`allreduce_buffer`](Self::allreduce_buffer) reduces it in place in the
/// child and returns a [`BabyWork`] future that does not borrow the group.
///
/// Every new quorum starts a fresh child (the old one is asked to exit, or
/// killed if busy, which fails its outstanding operations with
/// [`BabyError::Aborted`]). A child that dies, does not answer within the
/// timeout plus [`watchdog_margin`](BabyOptions::watchdog_margin), or
/// reports an error fails every outstanding operation with a typed
/// [`BabyError`] and is killed with SIGKILL; the group is then broken until
/// the next quorum. The child exits by itself if this process dies
/// (`PR_SET_PDEATHSIG`).
pub struct BabyProcessGroup {
    options: BabyOptions,
    released: Released,
    child: Option<Incarnation>,
    configured: Option<Configured>,
    /// A buffer kept for [`allreduce`](Self::allreduce)'s copies.
    spare: Option<SharedBuffer>,
}

impl fmt::Debug for BabyProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BabyProcessGroup")
            .field("replica_id", &self.options.replica_id)
            .field("child_pid", &self.child_pid())
            .field("quorum_id", &self.quorum_id())
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .finish_non_exhaustive()
    }
}

impl BabyProcessGroup {
    /// A group with no child yet: the first [`configure`](Self::configure)
    /// starts one.
    pub fn new(options: BabyOptions) -> Self {
        Self {
            options,
            released: Released::default(),
            child: None,
            configured: None,
            spare: None,
        }
    }

    /// The options.
    pub fn options(&self) -> &BabyOptions {
        &self.options
    }

    /// The current child's process id.
    pub fn child_pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.pid)
    }

    /// The quorum the group is configured for.
    pub fn quorum_id(&self) -> Option<i64> {
        self.configured.as_ref().map(|c| c.quorum_id)
    }

    /// This replica group's rank in the configured group.
    pub fn rank(&self) -> Option<u64> {
        self.configured.as_ref().map(|c| c.rank)
    }

    /// Members of the configured group.
    pub fn world_size(&self) -> Option<u64> {
        self.configured.as_ref().map(|c| c.replica_ids.len() as u64)
    }

    /// Whether the configured group's child failed (the step must not be
    /// committed; the next quorum rebuilds it).
    pub fn is_broken(&self) -> bool {
        self.failure().is_some()
    }

    /// The configured group's failure, if it failed.
    pub fn failure(&self) -> Option<BabyError> {
        self.configured.as_ref()?;
        match &self.child {
            Some(child) => child.failure(),
            None => Some(BabyError::NotConfigured),
        }
    }

    /// A zero-filled buffer of `len` `f32` values in shared memory, for
    /// [`allreduce_buffer`](Self::allreduce_buffer).
    pub fn buffer(&self, len: usize) -> Result<SharedBuffer, BabyError> {
        SharedBuffer::create(len, Arc::clone(&self.released)).map_err(|error| BabyError::Buffer {
            reason: error.to_string(),
        })
    }

    /// Configures the group for `quorum` (the manager's answer): a new
    /// quorum id or other members start a fresh child and rendezvous there;
    /// the same quorum again is a no-op, or fails with
    /// [`BabyError::Broken`] if its child failed.
    pub async fn configure(&mut self, quorum: &QuorumResult) -> Result<(), BabyError> {
        self.configure_with(
            &quorum.store_address,
            quorum.quorum_id,
            &quorum.replica_ids,
            quorum.replica_rank,
        )
        .await
    }

    /// [`configure`](Self::configure) from the parts of a quorum result.
    pub async fn configure_with(
        &mut self,
        store_address: &str,
        quorum_id: i64,
        replica_ids: &[String],
        replica_rank: u64,
    ) -> Result<(), BabyError> {
        let world_size = replica_ids.len();
        let me = &self.options.replica_id;
        let rank = quorum_rank(replica_ids, replica_rank, me, quorum_id)
            .map_err(|reason| BabyError::InvalidQuorum { reason })?;
        let wanted = Configured {
            quorum_id,
            replica_ids: replica_ids.to_vec(),
            rank: replica_rank,
        };
        if self.configured.as_ref() == Some(&wanted) {
            return match self.failure() {
                None => Ok(()),
                Some(error) => Err(BabyError::Broken {
                    quorum_id,
                    reason: error.to_string(),
                }),
            };
        }
        let span = info_span!(
            "baby_configure",
            replica_id = %me,
            quorum_id,
            rank,
            world_size
        );
        self.configured = None;
        if let Some(old) = self.child.take() {
            let pid = old.pid;
            old.stop(format!("the group is reconfigured for quorum {quorum_id}"))
                .instrument(span.clone())
                .await;
            span.in_scope(|| debug!(pid, "previous Baby child stopped"));
        }
        let child = start(&self.options, Arc::clone(&self.released))
            .instrument(span.clone())
            .await?;
        let (reply, outcome) = oneshot::channel();
        let sent = child.requests.send(Request::Configure {
            store_address: store_address.to_owned(),
            quorum_id,
            replica_ids: replica_ids.to_vec(),
            replica_rank,
            reply,
        });
        let pid = child.pid;
        self.child = Some(child);
        let result = match sent {
            Err(_) => Err(self.gone("configure", pid)),
            Ok(()) => match outcome.await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(failure)) => Err(failure.error),
                Err(_) => Err(self.gone("configure", pid)),
            },
        };
        match &result {
            Ok(()) => {
                span.in_scope(|| info!(pid, "Baby process group configured"));
                self.configured = Some(wanted);
            }
            Err(error) => {
                span.in_scope(|| warn!(pid, "Baby configure failed: {error}"));
                if let Some(child) = self.child.take() {
                    child.stop(format!("configure failed: {error}")).await;
                }
            }
        }
        result
    }

    /// The error for a driver that vanished: its recorded failure.
    fn gone(&self, during: &str, pid: u32) -> BabyError {
        self.child
            .as_ref()
            .and_then(Incarnation::failure)
            .unwrap_or_else(|| BabyError::Aborted {
                replica_id: self.options.replica_id.clone(),
                pid,
                during: during.to_owned(),
                reason: "the child's driver is gone".to_owned(),
            })
    }

    /// Starts reducing `buffer` across the group in the child, in place;
    /// the returned future gives the buffer back, reduced (every member's
    /// bits identical), or the failure (with the buffer once the child no
    /// longer holds it). Operations run in the child in the order they are
    /// started.
    pub fn allreduce_buffer(&self, buffer: SharedBuffer, reduce: ReduceOp) -> BabyWork {
        let ready = |error| BabyWork {
            state: WorkState::Ready(Some(Err(BabyFailure {
                error,
                buffer: None,
            }))),
        };
        let (Some(configured), Some(child)) = (&self.configured, &self.child) else {
            let mut work = ready(BabyError::NotConfigured);
            if let WorkState::Ready(Some(Err(failure))) = &mut work.state {
                failure.buffer = Some(buffer);
            }
            return work;
        };
        if let Some(error) = child.failure() {
            return BabyWork {
                state: WorkState::Ready(Some(Err(BabyFailure {
                    error: BabyError::Broken {
                        quorum_id: configured.quorum_id,
                        reason: error.to_string(),
                    },
                    buffer: Some(buffer),
                }))),
            };
        }
        let (reply, outcome) = oneshot::channel();
        match child.requests.send(Request::Allreduce {
            buffer,
            reduce,
            reply,
        }) {
            Ok(()) => BabyWork {
                state: WorkState::Waiting {
                    reply: outcome,
                    replica_id: self.options.replica_id.clone(),
                    pid: child.pid,
                },
            },
            Err(mpsc::error::SendError(request)) => {
                let buffer = match request {
                    Request::Allreduce { buffer, .. } => Some(buffer),
                    _ => None,
                };
                BabyWork {
                    state: WorkState::Ready(Some(Err(BabyFailure {
                        error: self.gone("allreduce", child.pid),
                        buffer,
                    }))),
                }
            }
        }
    }

    /// Reduces `data` across the group in place, like
    /// [`ProcessGroup::allreduce`](crate::collective::ProcessGroup::allreduce)
    /// and with the same bits. `data` is copied into a shared buffer kept
    /// for the purpose and back; [`allreduce_buffer`](Self::allreduce_buffer)
    /// avoids both copies.
    pub async fn allreduce(&mut self, data: &mut [f32], reduce: ReduceOp) -> Result<(), BabyError> {
        let mut buffer = match self.spare.take() {
            Some(buffer) if buffer.len() == data.len() => buffer,
            _ => self.buffer(data.len())?,
        };
        buffer.copy_from_slice(data);
        match self.allreduce_buffer(buffer, reduce).await {
            Ok(buffer) => {
                data.copy_from_slice(&buffer);
                self.spare = Some(buffer);
                Ok(())
            }
            Err(failure) => {
                self.spare = failure.buffer;
                Err(failure.error)
            }
        }
    }

    /// [`allreduce`](Self::allreduce) with [`ReduceOp::Mean`]: gradient
    /// averaging.
    pub async fn allreduce_mean(&mut self, data: &mut [f32]) -> Result<(), BabyError> {
        self.allreduce(data, ReduceOp::Mean).await
    }

    /// Stops the child (asked to exit, killed if it does not within
    /// [`exit_grace`](BabyOptions::exit_grace) or is busy) and waits until
    /// it is reaped. Dropping the group does the same in the background.
    pub async fn shutdown(mut self) {
        if let Some(child) = self.child.take() {
            child.stop("the group is shut down".to_owned()).await;
        }
    }
}
