//! The store server's quota: bounds per key, per client connection and in
//! total, and the ledger that enforces them.
//!
//! Every stored key is charged to the connection that last wrote it
//! (`set`, `add`, a `compare_set` that stored): its size is the key's
//! length plus the value's. A key written by another connection moves to
//! that connection's account; a deleted key leaves every account. Keys
//! stay after their connection closes (other ranks still read them), and
//! so do their charges against the totals.

use std::collections::HashMap;
use std::time::Duration;

/// The bounds a [`TcpStoreServer`](crate::TcpStoreServer) enforces; see
/// [`StoreLimits::default`] for the defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreLimits {
    /// Longest key, in bytes.
    pub max_key_bytes: usize,
    /// Largest value, in bytes.
    pub max_value_bytes: usize,
    /// Most keys one connection may hold (last written by it).
    pub max_keys_per_connection: usize,
    /// Most bytes (keys and values) one connection may hold.
    pub max_bytes_per_connection: u64,
    /// Most blocking requests (`get`, `wait`) one connection may have
    /// waiting on the server at once.
    pub max_waits_per_connection: usize,
    /// Most keys in the whole store.
    pub max_total_keys: usize,
    /// Most bytes (keys and values) in the whole store.
    pub max_total_bytes: u64,
    /// A connection that has not completed a request this long after it
    /// was accepted is closed (it holds a file descriptor for nothing).
    pub first_request_timeout: Duration,
}

impl Default for StoreLimits {
    /// 4 KiB keys, 16 MiB values; per connection 65,536 keys, 256 MiB and
    /// 4,096 waiting requests; 1,048,576 keys and 1 GiB in total; 30 s to
    /// complete a first request.
    fn default() -> Self {
        StoreLimits {
            max_key_bytes: 4 << 10,
            max_value_bytes: 16 << 20,
            max_keys_per_connection: 1 << 16,
            max_bytes_per_connection: 256 << 20,
            max_waits_per_connection: 4096,
            max_total_keys: 1 << 20,
            max_total_bytes: 1 << 30,
            first_request_timeout: Duration::from_secs(30),
        }
    }
}

/// Which bound of [`StoreLimits`] a request would exceed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuotaBound {
    /// [`StoreLimits::max_key_bytes`].
    KeyBytes,
    /// [`StoreLimits::max_value_bytes`].
    ValueBytes,
    /// [`StoreLimits::max_keys_per_connection`].
    ConnectionKeys,
    /// [`StoreLimits::max_bytes_per_connection`].
    ConnectionBytes,
    /// [`StoreLimits::max_waits_per_connection`].
    ConnectionWaits,
    /// [`StoreLimits::max_total_keys`].
    TotalKeys,
    /// [`StoreLimits::max_total_bytes`].
    TotalBytes,
}

impl std::fmt::Display for QuotaBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            QuotaBound::KeyBytes => "key size (max_key_bytes)",
            QuotaBound::ValueBytes => "value size (max_value_bytes)",
            QuotaBound::ConnectionKeys => "keys per connection (max_keys_per_connection)",
            QuotaBound::ConnectionBytes => "bytes per connection (max_bytes_per_connection)",
            QuotaBound::ConnectionWaits => {
                "waiting requests per connection (max_waits_per_connection)"
            }
            QuotaBound::TotalKeys => "keys in the store (max_total_keys)",
            QuotaBound::TotalBytes => "bytes in the store (max_total_bytes)",
        })
    }
}

/// A request refused by the quota: the bound, its limit and what the
/// request would have brought it to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub bound: QuotaBound,
    pub limit: u64,
    pub requested: u64,
}

/// Identifies a client connection of the server.
pub(crate) type ConnId = u64;

#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    keys: u64,
    bytes: u64,
}

/// Who holds each key and how much every account holds.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    keys: HashMap<String, (ConnId, u64)>,
    connections: HashMap<ConnId, Usage>,
    total: Usage,
}

fn check(bound: QuotaBound, limit: u64, requested: u64) -> Result<(), Refusal> {
    if requested > limit {
        Err(Refusal {
            bound,
            limit,
            requested,
        })
    } else {
        Ok(())
    }
}

impl Ledger {
    /// Whether `conn` may store `value_len` bytes under `key`.
    pub(crate) fn admit(
        &self,
        limits: &StoreLimits,
        conn: ConnId,
        key: &str,
        value_len: usize,
    ) -> Result<(), Refusal> {
        check(
            QuotaBound::KeyBytes,
            limits.max_key_bytes as u64,
            key.len() as u64,
        )?;
        check(
            QuotaBound::ValueBytes,
            limits.max_value_bytes as u64,
            value_len as u64,
        )?;
        let size = (key.len() + value_len) as u64;
        let old = self.keys.get(key).copied();
        let mine = self.connections.get(&conn).copied().unwrap_or_default();
        let (mine_keys, mine_bytes) = match old {
            Some((owner, old_size)) if owner == conn => (mine.keys, mine.bytes - old_size + size),
            _ => (mine.keys + 1, mine.bytes + size),
        };
        let (total_keys, total_bytes) = match old {
            Some((_, old_size)) => (self.total.keys, self.total.bytes - old_size + size),
            None => (self.total.keys + 1, self.total.bytes + size),
        };
        check(
            QuotaBound::ConnectionKeys,
            limits.max_keys_per_connection as u64,
            mine_keys,
        )?;
        check(
            QuotaBound::ConnectionBytes,
            limits.max_bytes_per_connection,
            mine_bytes,
        )?;
        check(
            QuotaBound::TotalKeys,
            limits.max_total_keys as u64,
            total_keys,
        )?;
        check(QuotaBound::TotalBytes, limits.max_total_bytes, total_bytes)
    }

    /// Records that `conn` stored `value_len` bytes under `key`.
    pub(crate) fn stored(&mut self, conn: ConnId, key: &str, value_len: usize) {
        self.deleted(key);
        let size = (key.len() + value_len) as u64;
        self.keys.insert(key.to_owned(), (conn, size));
        let mine = self.connections.entry(conn).or_default();
        mine.keys += 1;
        mine.bytes += size;
        self.total.keys += 1;
        self.total.bytes += size;
    }

    /// Records that `key` is gone.
    pub(crate) fn deleted(&mut self, key: &str) {
        let Some((owner, size)) = self.keys.remove(key) else {
            return;
        };
        if let Some(usage) = self.connections.get_mut(&owner) {
            usage.keys -= 1;
            usage.bytes -= size;
            if usage.keys == 0 {
                self.connections.remove(&owner);
            }
        }
        self.total.keys -= 1;
        self.total.bytes -= size;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> StoreLimits {
        StoreLimits {
            max_key_bytes: 8,
            max_value_bytes: 100,
            max_keys_per_connection: 2,
            max_bytes_per_connection: 150,
            max_waits_per_connection: 1,
            max_total_keys: 3,
            max_total_bytes: 205,
            first_request_timeout: Duration::from_secs(1),
        }
    }

    fn bound(r: Result<(), Refusal>) -> Option<QuotaBound> {
        r.err().map(|r| r.bound)
    }

    #[test]
    fn each_bound_refuses_and_overwrites_and_deletes_give_back() {
        let l = small();
        let mut ledger = Ledger::default();
        assert_eq!(
            bound(ledger.admit(&l, 1, "123456789", 0)),
            Some(QuotaBound::KeyBytes)
        );
        assert_eq!(
            bound(ledger.admit(&l, 1, "k", 101)),
            Some(QuotaBound::ValueBytes)
        );
        ledger.stored(1, "a", 99); // 100 bytes
        assert_eq!(
            bound(ledger.admit(&l, 1, "b", 60)),
            Some(QuotaBound::ConnectionBytes)
        );
        // Overwriting its own key charges only the difference.
        assert_eq!(bound(ledger.admit(&l, 1, "a", 100)), None);
        ledger.stored(1, "b", 9);
        assert_eq!(
            bound(ledger.admit(&l, 1, "c", 0)),
            Some(QuotaBound::ConnectionKeys)
        );
        ledger.stored(2, "c", 99);
        assert_eq!(
            bound(ledger.admit(&l, 3, "d", 0)),
            Some(QuotaBound::TotalKeys)
        );
        assert_eq!(
            bound(ledger.admit(&l, 3, "c", 100)),
            Some(QuotaBound::TotalBytes)
        );
        // Another connection takes over "a": it leaves connection 1's account.
        ledger.stored(3, "a", 0);
        assert_eq!(
            bound(ledger.admit(&l, 1, "e", 0)),
            Some(QuotaBound::TotalKeys)
        );
        ledger.deleted("c");
        assert_eq!(bound(ledger.admit(&l, 1, "e", 0)), None);
        ledger.deleted("never-stored");
    }
}
