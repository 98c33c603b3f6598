//! Graceful shutdown: decide, together with every other worker, that no
//! call is outstanding anywhere, then stop together.
//!
//! This is the I/O shell of [`crate::termination`]: it keeps this
//! worker's per-peer counts ([`Tally`]) and performs the machine's
//! actions on the agent and the store. Every wait ends at the machine's
//! deadline, so shutdown fails with [`RpcError::Join`] instead of
//! looping when the group makes no progress for `init_timeout`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::agent::Inner;
use crate::store::StoreError;
use crate::termination::{Action, Counts, Input, Termination};
use crate::RpcError;

/// This worker's calls per peer rank, for termination detection.
pub(crate) struct Tally {
    sent: Vec<AtomicU64>,
    lost: Vec<AtomicU64>,
    served: Vec<AtomicU64>,
}

impl Tally {
    /// All zero, for a group of `n`.
    pub(crate) fn new(n: usize) -> Tally {
        let zeros = || (0..n).map(|_| AtomicU64::new(0)).collect();
        Tally {
            sent: zeros(),
            lost: zeros(),
            served: zeros(),
        }
    }

    /// A call to `to` is about to be sent (counted while the call is
    /// outstanding, so no round reads it half-done).
    pub(crate) fn sending(&self, to: u32) {
        self.sent[to as usize].fetch_add(1, Ordering::SeqCst);
    }

    /// The send counted by [`sending`](Self::sending) failed: nothing
    /// reached `to`.
    pub(crate) fn not_sent(&self, to: u32) {
        self.sent[to as usize].fetch_sub(1, Ordering::SeqCst);
    }

    /// A call to `to` failed with its connection: `to` may or may not
    /// have served it.
    pub(crate) fn lost(&self, to: u32) {
        self.lost[to as usize].fetch_add(1, Ordering::SeqCst);
    }

    /// This worker finished serving a call from `from`.
    pub(crate) fn served(&self, from: u32) {
        self.served[from as usize].fetch_add(1, Ordering::SeqCst);
    }

    /// The counts now.
    pub(crate) fn snapshot(&self) -> Counts {
        let read = |v: &Vec<AtomicU64>| v.iter().map(|a| a.load(Ordering::SeqCst)).collect();
        Counts {
            sent: read(&self.sent),
            lost: read(&self.lost),
            served: read(&self.served),
        }
    }
}

/// One termination detection over the store keys under `phase/`.
pub(crate) async fn join(inner: Arc<Inner>, phase: &str) -> Result<(), RpcError> {
    let names = inner.workers.iter().map(|w| w.name.clone()).collect();
    let mut machine = Termination::new(phase, inner.me.id, names, inner.init_timeout);
    let mut actions = machine.start(Instant::now());
    loop {
        let mut input = None;
        for action in actions {
            match action {
                Action::Delete(keys) => {
                    for k in keys {
                        // A key left behind costs little; failing shutdown for it more.
                        match bounded(&inner, inner.store.delete(&k)).await {
                            Ok(_) => {}
                            Err(e) => {
                                tracing::debug!(key = %k, error = %e, "cannot delete a shutdown key")
                            }
                        }
                    }
                }
                Action::Set { key, value } => {
                    if let Err(e) = bounded(&inner, inner.store.set(&key, value)).await {
                        input = Some(Input::StoreFailed(e));
                        break;
                    }
                }
                Action::WaitIdle { deadline } => {
                    let idle = tokio::time::timeout_at(deadline.into(), inner.wait_idle()).await;
                    input = Some(match idle {
                        Ok(()) => Input::Idle(inner.tally.snapshot()),
                        Err(_) => Input::Busy {
                            active: inner.active(),
                        },
                    });
                }
                Action::Collect { keys, deadline } => {
                    input = Some(collect(&inner, &keys, deadline).await);
                }
                Action::AwaitChange {
                    since,
                    wake,
                    deadline,
                } => {
                    input = Some(await_change(&inner, &since, &wake, deadline).await);
                }
                Action::Done => return Ok(()),
                Action::Fail(why) => return Err(RpcError::Join(why)),
            }
        }
        let Some(input) = input else {
            return Err(RpcError::Join("the shutdown protocol stalled".into()));
        };
        if let Input::Records(_) = &input {
            tracing::debug!(phase, round = machine.round(), "shutdown round read");
        }
        actions = machine.step(Instant::now(), input);
    }
}

/// A store operation, bounded by `init_timeout` whatever the store does
/// (a partitioned store must not hold shutdown up).
async fn bounded<T>(
    inner: &Inner,
    op: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, String> {
    match tokio::time::timeout(inner.init_timeout, op).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "the store did not answer within {:?}",
            inner.init_timeout
        )),
    }
}

/// How long after a deadline a store wait may still answer before the
/// shell gives up on the store itself.
const STORE_GRACE: Duration = Duration::from_secs(1);

/// Waits for `keys` until `deadline` and reads them.
async fn collect(inner: &Inner, keys: &[String], deadline: Instant) -> Input {
    let left = deadline.saturating_duration_since(Instant::now());
    let waited = tokio::time::timeout_at(
        (deadline + STORE_GRACE).into(),
        inner.store.wait(keys, left),
    );
    let Ok(waited) = waited.await else {
        return Input::StoreFailed(format!("the store did not answer within {left:?}"));
    };
    match waited {
        Ok(()) => {}
        Err(StoreError::Timeout { keys: missing, .. }) => {
            return Input::Missing(
                keys.iter()
                    .enumerate()
                    .filter(|(_, k)| missing.contains(k))
                    .map(|(r, _)| r as u32)
                    .collect(),
            )
        }
        Err(e) => return Input::StoreFailed(e.to_string()),
    }
    let mut records = Vec::with_capacity(keys.len());
    for k in keys {
        // The key exists: `get` answers at once (bounded all the same).
        match bounded(inner, inner.store.get(k)).await {
            Ok(v) => records.push(v),
            Err(e) => return Input::StoreFailed(e),
        }
    }
    Input::Records(records)
}

/// Waits until this worker's counts differ from `since` (it went busy
/// and idle again) or the `wake` key exists, until `deadline`.
async fn await_change(inner: &Inner, since: &Counts, wake: &str, deadline: Instant) -> Input {
    let wake = [wake.to_string()];
    let own = async {
        loop {
            let notified = inner.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if inner.tally.snapshot() != *since {
                return;
            }
            notified.await;
        }
    };
    let left = deadline.saturating_duration_since(Instant::now());
    let woke = tokio::time::timeout_at(
        (deadline + STORE_GRACE).into(),
        inner.store.wait(&wake, left),
    );
    tokio::select! {
        () = own => Input::Changed { own: true },
        woke = woke => match woke {
            Ok(Ok(())) => Input::Changed { own: false },
            Ok(Err(StoreError::Timeout { .. })) => Input::Quiet,
            Ok(Err(e)) => Input::StoreFailed(e.to_string()),
            Err(_) => Input::StoreFailed(format!("the store did not answer within {left:?}")),
        },
    }
}
