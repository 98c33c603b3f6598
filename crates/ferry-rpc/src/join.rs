//! Graceful shutdown: decide, together with every other worker, that no
//! call is outstanding anywhere, then stop together.
//!
//! Each round, a worker waits until it has no call outstanding (none sent
//! and unanswered, none received and running), then publishes how many
//! requests it has sent (S) and finished serving (C) so far. The group is
//! done when two consecutive rounds show the same totals and S = C: the
//! counters only grow, so nothing was sent or served between the rounds,
//! and every request ever sent has been served (Mattern's four-counter
//! termination detection). A fire-and-forget chain is therefore never cut
//! short, whatever the order in which workers reach shutdown.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::agent::Inner;
use crate::store::StoreError;
use crate::RpcError;

/// One termination detection over the store keys under `phase/`.
pub(crate) async fn join(inner: Arc<Inner>, phase: &str) -> Result<(), RpcError> {
    let store = inner.store.clone();
    let n = inner.workers.len() as u32;
    let rank = inner.me.id;
    let mut previous: Option<(u64, u64)> = None;
    for round in 0u64.. {
        inner.wait_idle().await;
        let sent = inner.sent.load(Ordering::SeqCst);
        let finished = inner.finished.load(Ordering::SeqCst);
        let key = |r: u32| format!("{phase}/{round}/{r}");
        store
            .set(&key(rank), format!("{sent},{finished}").into_bytes())
            .await
            .map_err(|e| RpcError::Join(e.to_string()))?;
        let keys: Vec<String> = (0..n).map(key).collect();
        wait_all(&inner, &keys, round).await?;
        let mut total = (0u64, 0u64);
        for k in &keys {
            let v = store
                .get(k)
                .await
                .map_err(|e| RpcError::Join(e.to_string()))?;
            let (s, c) = parse_counts(&v)
                .ok_or_else(|| RpcError::Join(format!("corrupt shutdown record {k}")))?;
            total.0 += s;
            total.1 += c;
        }
        tracing::debug!(round, sent = total.0, finished = total.1, "shutdown round");
        if total.0 == total.1 && previous == Some(total) {
            break;
        }
        previous = Some(total);
    }
    // Rank 0 hosts the store: it stops last.
    let exit = |r: u32| format!("{phase}/exit/{r}");
    store
        .set(&exit(rank), Vec::new())
        .await
        .map_err(|e| RpcError::Join(e.to_string()))?;
    if rank == 0 {
        let keys: Vec<String> = (0..n).map(exit).collect();
        wait_all(&inner, &keys, u64::MAX).await?;
    }
    Ok(())
}

async fn wait_all(inner: &Inner, keys: &[String], round: u64) -> Result<(), RpcError> {
    match inner.store.wait(keys, inner.init_timeout).await {
        Ok(()) => Ok(()),
        Err(StoreError::Timeout { .. }) => {
            let mut missing = Vec::new();
            for (r, k) in keys.iter().enumerate() {
                if !inner
                    .store
                    .check(std::slice::from_ref(k))
                    .await
                    .unwrap_or(false)
                {
                    missing.push(inner.workers[r].name.clone());
                }
            }
            let stage = if round == u64::MAX {
                "the final shutdown barrier".to_string()
            } else {
                format!("shutdown round {round}")
            };
            Err(RpcError::Join(format!(
                "workers {missing:?} did not reach {stage} within {:?}",
                inner.init_timeout
            )))
        }
        Err(e) => Err(RpcError::Join(e.to_string())),
    }
}

fn parse_counts(v: &[u8]) -> Option<(u64, u64)> {
    let s = std::str::from_utf8(v).ok()?;
    let (a, b) = s.split_once(',')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}
