//! What every connection of a store server shares, whichever protocol
//! it speaks (Ferry's or c10d's), and the quota's checks on it.

use std::sync::Arc;

use ferry_transport::accept::RefusalWarnings;
use ferry_transport::auth::Secret;
use parking_lot::Mutex;
use tokio::sync::watch;

use crate::quota::{ConnId, Ledger, QuotaBound, Refusal, StoreLimits};
use crate::{MemoryStore, StoreError};

/// What every connection of a server shares.
#[derive(Debug)]
pub(crate) struct Served {
    pub(crate) state: Arc<MemoryStore>,
    pub(crate) limits: StoreLimits,
    pub(crate) ledger: Mutex<Ledger>,
    /// With a secret, every client proves it holds it before a byte of
    /// its requests is read.
    pub(crate) auth: Option<Secret>,
    /// The rate-limited warnings about clients refused for failing
    /// authentication (an outsider can open thousands a second).
    pub(crate) refusals: RefusalWarnings,
    /// The rate-limited warnings about clients closed for breaking the
    /// protocol (malformed or oversized input, either protocol).
    pub(crate) broken: RefusalWarnings,
}

impl Served {
    /// What the connections of a server serving `state` share.
    pub(crate) fn new(state: Arc<MemoryStore>, limits: StoreLimits, auth: Option<Secret>) -> Self {
        Served {
            state,
            limits,
            ledger: Mutex::new(Ledger::default()),
            auth,
            refusals: RefusalWarnings::new(
                "store server",
                "refused a store client that failed authentication",
            ),
            broken: RefusalWarnings::new(
                "store server",
                "closed a store client that broke the protocol",
            ),
        }
    }
}

/// The quota's checks, shared by both protocols' requests (Ferry's and
/// c10d's): one place that admits and charges a write, one counter charge,
/// one bound on waiting requests.
impl Served {
    /// Runs the write `store` to `key` for connection `conn` if the quota
    /// admits `bytes` there, under the ledger's lock (so concurrent
    /// writers cannot together exceed a bound). `store` returns its
    /// result and the bytes the key now holds if it stored (`None`:
    /// nothing stored, nothing charged).
    pub(crate) fn write<T>(
        &self,
        conn: ConnId,
        key: &str,
        bytes: usize,
        store: impl FnOnce() -> (T, Option<usize>),
    ) -> Result<T, Refusal> {
        let mut ledger = self.ledger.lock();
        ledger.admit(&self.limits, conn, key, bytes)?;
        let (out, stored) = store();
        if let Some(len) = stored {
            ledger.stored(conn, key, len);
        }
        Ok(out)
    }

    /// Adds `delta` to the counter at `key` for connection `conn`: admitted
    /// as the longest counter ([`COUNTER_BYTES`]), charged as the decimal
    /// text it now holds.
    pub(crate) fn add(
        &self,
        conn: ConnId,
        key: &str,
        delta: i64,
    ) -> Result<Result<i64, StoreError>, Refusal> {
        self.write(conn, key, COUNTER_BYTES, || {
            let added = self.state.increment(key, delta);
            let len = added.as_ref().ok().map(|n| n.to_string().len());
            (added, len)
        })
    }

    /// Deletes `key` (and its charge); whether it was there.
    pub(crate) fn delete(&self, key: &str) -> bool {
        let mut ledger = self.ledger.lock();
        ledger.deleted(key);
        self.state.remove(key)
    }

    /// Admits one more blocking request (`get`, `wait`) on a connection
    /// with `waiting` under way.
    pub(crate) fn admit_wait(&self, waiting: usize) -> Result<(), Refusal> {
        let limit = self.limits.max_waits_per_connection;
        if waiting >= limit {
            return Err(Refusal {
                bound: QuotaBound::ConnectionWaits,
                limit: limit as u64,
                requested: waiting as u64 + 1,
            });
        }
        Ok(())
    }
}

/// Completes once the server is closing (or gone).
pub(crate) async fn closing(closed: &mut watch::Receiver<bool>) {
    let _ = closed.wait_for(|c| *c).await;
}

/// The longest decimal text of an `i64` counter.
pub(crate) const COUNTER_BYTES: usize = 20;
