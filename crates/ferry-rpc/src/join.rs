//! Graceful shutdown: decide, together with every other worker, that no
//! call is outstanding anywhere, then stop together.
//!
//! This is the I/O shell of [`crate::termination`]: it reads this
//! worker's per-peer counts ([`Tally`](crate::tally::Tally)) and performs
//! the machine's actions on the agent and the store. Every wait ends at the
//! machine's deadline, so shutdown fails instead of looping when the group
//! makes no progress for `shutdown_timeout`. Every wait also ends when a
//! peer is gone ([`Liveness`](crate::tally::Liveness): its connection ended
//! and a new one was refused) or when another worker writes the abort
//! record, so a killed worker ends every survivor's shutdown at once with
//! [`RpcError::Absent`] naming it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tracing::Instrument;

use crate::agent::Inner;
use crate::error::Absence;
use crate::store::StoreError;
use crate::tally::Peer;
use crate::termination::{Action, Counts, Failure, How, Input, Termination};
use crate::RpcError;

/// One termination detection over the store keys under `phase/`.
pub(crate) async fn join(inner: Arc<Inner>, phase: &str) -> Result<(), RpcError> {
    let names = inner.workers.iter().map(|w| w.name.clone()).collect();
    let mut machine = Termination::new(phase, inner.me.id, names, inner.shutdown_timeout);
    let (aborts, _watcher) = watch_aborts(&inner, machine.abort_key());
    let n = inner.workers.len() as u32;
    let mut shell = Shell {
        probed: vec![0; n as usize],
        over_keys: (0..n).map(|r| machine.over_key(r)).collect(),
        abort_key: machine.abort_key(),
        told: false,
        inner: &inner,
        aborts,
    };
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
                Action::SetOnce { key, value } => {
                    let set = inner.store.compare_set(&key, None, value);
                    if let Err(e) = bounded(&inner, set).await {
                        input = Some(Input::StoreFailed(e));
                        break;
                    }
                }
                Action::WaitIdle { deadline } => {
                    input = Some(shell.wait_idle(deadline).await);
                }
                Action::Collect {
                    keys,
                    ranks,
                    deadline,
                } => {
                    input = Some(shell.collect(&keys, &ranks, deadline).await);
                }
                Action::AwaitChange {
                    since,
                    wake,
                    deadline,
                } => {
                    input = Some(shell.await_change(&since, &wake, deadline).await);
                }
                Action::Done => return Ok(()),
                Action::Fail(failure) => return Err(shell.error(phase, failure)),
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

/// Watches the abort record at `key` for the length of one detection:
/// the receiver gets its first value (a task waits for it on the store,
/// stopped when the guard drops).
fn watch_aborts(
    inner: &Arc<Inner>,
    key: String,
) -> (watch::Receiver<Option<Vec<u8>>>, AbortOnDrop) {
    let (tx, rx) = watch::channel(None);
    let store = inner.store.clone();
    let timeout = inner.shutdown_timeout;
    let task = inner.handle.spawn(
        async move {
            let keys = [key];
            loop {
                let waited =
                    tokio::time::timeout(timeout + STORE_GRACE, store.wait(&keys, timeout));
                match waited.await {
                    Ok(Ok(())) => break,
                    Ok(Err(StoreError::Timeout { .. })) => continue,
                    // The store fails the detection's own operations too.
                    _ => return,
                }
            }
            if let Ok(Ok(record)) = tokio::time::timeout(timeout, store.get(&keys[0])).await {
                tx.send_replace(Some(record));
                // Kept open: the value is read once, the sender lives on.
                std::future::pending::<()>().await;
            }
        }
        .in_current_span(),
    );
    (rx, AbortOnDrop(task))
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The waits of one detection, each also ended by a gone peer or the
/// abort record.
struct Shell<'a> {
    inner: &'a Arc<Inner>,
    /// Per peer, the ending of its connection already answered with a
    /// reconnection.
    probed: Vec<u64>,
    /// Per peer, the key it writes when it gives up.
    over_keys: Vec<String>,
    /// The abort record's key.
    abort_key: String,
    /// Whether the machine was given the abort record.
    told: bool,
    /// The abort record, once it exists.
    aborts: watch::Receiver<Option<Vec<u8>>>,
}

impl Shell<'_> {
    /// What ends a wait before its own outcome, if anything: a peer among
    /// `ranks` that is gone ([`Input::Gone`]: its connection ended and a
    /// new one was refused) without having written its `over` key or, in
    /// a wait for keys, its key `keys[i]`; and then rather the abort
    /// record if there is one ([`Input::Aborted`]): a survivor that found
    /// the peer absent wrote it before it stopped. A peer whose connection
    /// ended and who wrote neither key is connected to again, once per
    /// ending: a live one answers, a gone one refuses. `settled[i]`: rank
    /// `ranks[i]` wrote one of those keys (it stays so), not checked again.
    async fn interrupt(
        &mut self,
        ranks: &[u32],
        keys: Option<&[String]>,
        settled: &mut [bool],
    ) -> Option<Input> {
        let inner = self.inner;
        let peers = inner.liveness.snapshot();
        let mut gone = Vec::new();
        for (i, &r) in ranks.iter().enumerate() {
            let peer = peers[r as usize];
            if settled[i] || r == inner.me.id || peer == Peer::Up {
                continue;
            }
            let mut written = vec![self.over_keys[r as usize].clone()];
            written.extend(keys.map(|k| k[i].clone()));
            for key in written {
                match bounded(inner, inner.store.check(std::slice::from_ref(&key))).await {
                    Ok(true) => settled[i] = true,
                    Ok(false) => {}
                    Err(e) => return Some(Input::StoreFailed(e)),
                }
            }
            match peer {
                _ if settled[i] => {}
                Peer::Refused => gone.push(r),
                Peer::Departed(ending) if self.probed[r as usize] != ending => {
                    self.probed[r as usize] = ending;
                    tracing::debug!(
                        peer = %inner.workers[r as usize].name,
                        "its connection ended: connecting again"
                    );
                    inner.probe(r);
                }
                _ => {}
            }
        }
        if gone.is_empty() {
            return None;
        }
        if !self.told {
            let abort = std::slice::from_ref(&self.abort_key);
            match bounded(inner, inner.store.check(abort)).await {
                Ok(true) => match bounded(inner, inner.store.get(&self.abort_key)).await {
                    Ok(record) => {
                        self.told = true;
                        return Some(Input::Aborted(record));
                    }
                    Err(e) => return Some(Input::StoreFailed(e)),
                },
                Ok(false) => {}
                Err(e) => return Some(Input::StoreFailed(e)),
            }
        }
        let names: Vec<&str> = gone
            .iter()
            .map(|&r| inner.workers[r as usize].name.as_str())
            .collect();
        tracing::info!(workers = ?names, "gone: their connection closed and a new one was refused");
        Some(Input::Gone(gone))
    }

    /// The abort record's value, once it is there (then never again).
    async fn aborted(aborts: &mut watch::Receiver<Option<Vec<u8>>>) -> Vec<u8> {
        loop {
            if aborts.changed().await.is_err() {
                // The watcher ended without a record: nothing will come.
                return std::future::pending().await;
            }
            if let Some(record) = aborts.borrow_and_update().clone() {
                return record;
            }
        }
    }

    /// The abort record from the watcher, unless the machine was told.
    async fn next_abort(&mut self) -> Input {
        if self.told {
            return std::future::pending().await;
        }
        let record = Self::aborted(&mut self.aborts).await;
        self.told = true;
        Input::Aborted(record)
    }

    /// Every peer's rank.
    fn all(&self) -> Vec<u32> {
        (0..self.inner.workers.len() as u32).collect()
    }

    /// Waits until this worker has no call outstanding, until `deadline`.
    async fn wait_idle(&mut self, deadline: Instant) -> Input {
        let inner = self.inner;
        let idle = tokio::time::timeout_at(deadline.into(), inner.wait_idle());
        tokio::pin!(idle);
        let ranks = self.all();
        let mut settled = vec![false; ranks.len()];
        loop {
            let changed = inner.liveness.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(input) = self.interrupt(&ranks, None, &mut settled).await {
                return input;
            }
            tokio::select! {
                idle = &mut idle => return match idle {
                    Ok(()) => Input::Idle(inner.tally.snapshot()),
                    Err(_) => Input::Busy { active: inner.active() },
                },
                () = changed => {}
                input = self.next_abort() => return input,
            }
        }
    }

    /// Waits for `keys` (`keys[i]` written by `ranks[i]`) until `deadline`
    /// and reads them.
    async fn collect(&mut self, keys: &[String], ranks: &[u32], deadline: Instant) -> Input {
        let inner = self.inner;
        let left = deadline.saturating_duration_since(Instant::now());
        let waited = tokio::time::timeout_at(
            (deadline + STORE_GRACE).into(),
            inner.store.wait(keys, left),
        );
        tokio::pin!(waited);
        let mut settled = vec![false; ranks.len()];
        let waited = loop {
            let changed = inner.liveness.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(input) = self.interrupt(ranks, Some(keys), &mut settled).await {
                return input;
            }
            tokio::select! {
                waited = &mut waited => break waited,
                () = changed => {}
                input = self.next_abort() => return input,
            }
        };
        let Ok(waited) = waited else {
            return Input::StoreFailed(format!("the store did not answer within {left:?}"));
        };
        match waited {
            Ok(()) => {}
            Err(StoreError::Timeout { keys: missing, .. }) => {
                return Input::Missing(
                    keys.iter()
                        .zip(ranks)
                        .filter(|(k, _)| missing.contains(k))
                        .map(|(_, &r)| r)
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
    async fn await_change(&mut self, since: &Counts, wake: &str, deadline: Instant) -> Input {
        let inner = self.inner;
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
        tokio::pin!(own);
        let left = deadline.saturating_duration_since(Instant::now());
        let woke = tokio::time::timeout_at(
            (deadline + STORE_GRACE).into(),
            inner.store.wait(&wake, left),
        );
        tokio::pin!(woke);
        let ranks = self.all();
        let mut settled = vec![false; ranks.len()];
        loop {
            let changed = inner.liveness.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(input) = self.interrupt(&ranks, None, &mut settled).await {
                return input;
            }
            tokio::select! {
                () = &mut own => return Input::Changed { own: true },
                woke = &mut woke => return match woke {
                    Ok(Ok(())) => Input::Changed { own: false },
                    Ok(Err(StoreError::Timeout { .. })) => Input::Quiet,
                    Ok(Err(e)) => Input::StoreFailed(e.to_string()),
                    Err(_) => Input::StoreFailed(format!("the store did not answer within {left:?}")),
                },
                () = changed => {}
                input = self.next_abort() => return input,
            }
        }
    }

    /// The error of `failure`, logged with the workers' names.
    fn error(&self, phase: &str, failure: Failure) -> RpcError {
        let name = |r: u32| self.inner.workers[r as usize].name.clone();
        let error = match failure {
            Failure::Absent { ranks, how } => RpcError::Absent {
                workers: ranks.into_iter().map(name).collect(),
                how: match how {
                    How::Gone => Absence::Gone,
                    How::Silent { after } => Absence::Silent { after },
                    How::Reported { by } => Absence::Reported { by: name(by) },
                },
            },
            Failure::Other(why) => RpcError::Join(why),
        };
        tracing::warn!(phase, error = %error, "graceful shutdown failed");
        error
    }
}

/// A store operation, bounded by `shutdown_timeout` whatever the store
/// does (a partitioned store must not hold shutdown up).
async fn bounded<T>(
    inner: &Inner,
    op: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, String> {
    match tokio::time::timeout(inner.shutdown_timeout, op).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "the store did not answer within {:?}",
            inner.shutdown_timeout
        )),
    }
}

/// How long after a deadline a store wait may still answer before the
/// shell gives up on the store itself.
const STORE_GRACE: Duration = Duration::from_secs(1);
