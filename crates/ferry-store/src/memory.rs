//! The store's state: a map plus per-key waiters, no I/O.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::{Store, StoreError, StoreFuture, DEFAULT_STORE_TIMEOUT};

/// An in-process store: the state a [`TcpStoreServer`](crate::TcpStoreServer)
/// serves, and a [`Store`] on its own for a single process.
///
/// A waiter parks on the first key it still misses; storing that key
/// (set, add, compare-and-set) wakes exactly the waiters parked on it.
/// Nothing polls. As in c10d, a key a waiter has once seen present counts
/// as present for that wait even if it is deleted afterwards.
#[derive(Debug)]
pub struct MemoryStore {
    state: Mutex<State>,
    timeout: Duration,
}

#[derive(Debug, Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
    /// One `Notify` per key somebody waits for; taken out and fired when
    /// the key is stored.
    waiters: HashMap<String, Arc<Notify>>,
}

impl State {
    /// Stores `value` and takes the waiters of `key`, to be woken once
    /// the lock is released.
    fn store(&mut self, key: &str, value: Vec<u8>) -> Option<Arc<Notify>> {
        self.map.insert(key.to_owned(), value);
        self.waiters.remove(key)
    }
}

fn wake(waiters: Option<Arc<Notify>>) {
    if let Some(n) = waiters {
        n.notify_waiters();
    }
}

impl Default for MemoryStore {
    /// An empty store whose [`Store::get`] waits at most
    /// [`DEFAULT_STORE_TIMEOUT`](crate::DEFAULT_STORE_TIMEOUT).
    fn default() -> Self {
        Self::new(DEFAULT_STORE_TIMEOUT)
    }
}

impl MemoryStore {
    /// An empty store whose [`Store::get`] waits at most `default_timeout`.
    pub fn new(default_timeout: Duration) -> Self {
        MemoryStore {
            state: Mutex::new(State::default()),
            timeout: default_timeout,
        }
    }

    /// How long [`Store::get`] waits for a missing key.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Number of keys stored.
    pub fn len(&self) -> usize {
        self.state.lock().map.len()
    }

    /// Whether no key is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stores `value` under `key` and wakes its waiters.
    pub(crate) fn insert(&self, key: &str, value: Vec<u8>) {
        let waiters = self.state.lock().store(key, value);
        wake(waiters);
    }

    /// Adds `delta` to the decimal counter `key` (absent: 0), returns the
    /// new value and wakes the waiters of `key`.
    pub(crate) fn increment(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let (value, waiters) = {
            let mut state = self.state.lock();
            let current = match state.map.get(key) {
                None => 0,
                Some(v) => parse_counter(v).ok_or_else(|| StoreError::NotACounter {
                    key: key.to_owned(),
                })?,
            };
            let value = current
                .checked_add(delta)
                .ok_or_else(|| StoreError::Overflow {
                    key: key.to_owned(),
                    delta,
                })?;
            (value, state.store(key, value.to_string().into_bytes()))
        };
        wake(waiters);
        Ok(value)
    }

    /// Compare-and-set with the semantics of [`Store::compare_set`]; wakes
    /// the waiters of `key` when it stores.
    pub(crate) fn swap_if(&self, key: &str, expected: Option<&[u8]>, desired: Vec<u8>) -> Vec<u8> {
        let waiters = {
            let mut state = self.state.lock();
            match (state.map.get(key), expected) {
                (None, None) => {}
                (Some(c), Some(e)) if c.as_slice() == e => {}
                (Some(c), _) => return c.clone(),
                (None, Some(e)) => return e.to_vec(),
            }
            state.store(key, desired.clone())
        };
        wake(waiters);
        desired
    }

    /// Compare-and-set as c10d's server does it: an empty `expected`
    /// matches an absent key (and a key holding an empty value); returns
    /// the value held afterwards and whether this call stored it. Wakes the
    /// waiters of `key` when it stores.
    pub(crate) fn swap_if_c10d(
        &self,
        key: &str,
        expected: &[u8],
        desired: Vec<u8>,
    ) -> (Vec<u8>, bool) {
        let waiters = {
            let mut state = self.state.lock();
            match state.map.get(key) {
                None if expected.is_empty() => {}
                None => return (expected.to_vec(), false),
                Some(c) if c.as_slice() == expected => {}
                Some(c) => return (c.clone(), false),
            }
            state.store(key, desired.clone())
        };
        wake(waiters);
        (desired, true)
    }

    /// Appends `value` to the value of `key` (absent: empty) and wakes its
    /// waiters.
    pub(crate) fn append(&self, key: &str, value: &[u8]) {
        let waiters = {
            let mut state = self.state.lock();
            let mut now = state.map.get(key).cloned().unwrap_or_default();
            now.extend_from_slice(value);
            state.store(key, now)
        };
        wake(waiters);
    }

    /// The value of `key` now, if present.
    pub(crate) fn value(&self, key: &str) -> Option<Vec<u8>> {
        self.state.lock().map.get(key).cloned()
    }

    /// Every key, sorted.
    pub(crate) fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.state.lock().map.keys().cloned().collect();
        keys.sort();
        keys
    }

    /// Removes `key`; `true` if it existed.
    pub(crate) fn remove(&self, key: &str) -> bool {
        self.state.lock().map.remove(key).is_some()
    }

    /// Whether every key of `keys` is present.
    pub(crate) fn contains_all(&self, keys: &[String]) -> bool {
        let state = self.state.lock();
        keys.iter().all(|k| state.map.contains_key(k))
    }

    /// Waits until every key of `keys` is present, at most `timeout`.
    pub(crate) async fn wait_for(
        &self,
        keys: &[String],
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let mut seen = 0;
        let wait = async {
            while let Some(key) = keys.get(seen) {
                if self.value_of(key, false).await.is_some() {
                    seen += 1;
                }
            }
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(()) => Ok(()),
            Err(_) => Err(StoreError::Timeout {
                keys: self.missing(keys),
                after: timeout,
            }),
        }
    }

    /// The value of `key`, waiting until it is present, at most `timeout`.
    pub(crate) async fn get_within(
        &self,
        key: &str,
        timeout: Duration,
    ) -> Result<Vec<u8>, StoreError> {
        let wait = async {
            loop {
                if let Some(v) = self.value_of(key, true).await {
                    return v;
                }
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| StoreError::Timeout {
                keys: self.missing(std::slice::from_ref(&key.to_owned())),
                after: timeout,
            })
    }

    /// If `key` is present: `Some` (its value if `clone`, else empty).
    /// Otherwise waits until `key` is stored and returns `None`: the caller
    /// looks again (the key may have been deleted in between).
    async fn value_of(&self, key: &str, clone: bool) -> Option<Vec<u8>> {
        let parked = {
            let mut state = self.state.lock();
            if let Some(v) = state.map.get(key) {
                return Some(if clone { v.clone() } else { Vec::new() });
            }
            let notify = state.waiters.entry(key.to_owned()).or_default().clone();
            Parked {
                store: self,
                key,
                notify,
            }
        };
        // `notify_waiters` wakes every `Notified` created before it, polled
        // or not. A store of `key` since the look above took our `Notify`
        // out of the map (and fired it before `notified` existed), so look
        // again rather than wait; otherwise the next store fires it.
        let notified = parked.notify.notified();
        if self
            .state
            .lock()
            .waiters
            .get(key)
            .is_some_and(|n| Arc::ptr_eq(n, &parked.notify))
        {
            notified.await;
        }
        None
    }

    fn missing(&self, keys: &[String]) -> Vec<String> {
        let state = self.state.lock();
        keys.iter()
            .filter(|k| !state.map.contains_key(*k))
            .cloned()
            .collect()
    }
}

/// A waiter parked on `key`; on the way out (woken, timed out or
/// cancelled) it removes the key's `Notify` from the map when nobody else
/// waits on it.
struct Parked<'a> {
    store: &'a MemoryStore,
    key: &'a str,
    notify: Arc<Notify>,
}

impl Drop for Parked<'_> {
    fn drop(&mut self) {
        let mut state = self.store.state.lock();
        // Clones are made under the lock: two references (the map's and
        // ours) mean nobody else waits on it.
        if state
            .waiters
            .get(self.key)
            .is_some_and(|n| Arc::ptr_eq(n, &self.notify) && Arc::strong_count(n) == 2)
        {
            state.waiters.remove(self.key);
        }
    }
}

/// A counter's value: decimal text of an `i64`, as c10d stores it.
fn parse_counter(v: &[u8]) -> Option<i64> {
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: Vec<u8>) -> StoreFuture<'_, ()> {
        self.insert(key, value);
        futures::future::ready(Ok(())).boxed()
    }

    fn get(&self, key: &str) -> StoreFuture<'_, Vec<u8>> {
        let key = key.to_owned();
        async move { self.get_within(&key, self.timeout).await }.boxed()
    }

    fn wait(&self, keys: &[String], timeout: Duration) -> StoreFuture<'_, ()> {
        let keys = keys.to_vec();
        async move { self.wait_for(&keys, timeout).await }.boxed()
    }

    fn add(&self, key: &str, delta: i64) -> StoreFuture<'_, i64> {
        futures::future::ready(self.increment(key, delta)).boxed()
    }

    fn compare_set(
        &self,
        key: &str,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    ) -> StoreFuture<'_, Vec<u8>> {
        futures::future::ready(Ok(self.swap_if(key, expected.as_deref(), desired))).boxed()
    }

    fn delete(&self, key: &str) -> StoreFuture<'_, bool> {
        futures::future::ready(Ok(self.remove(key))).boxed()
    }

    fn check(&self, keys: &[String]) -> StoreFuture<'_, bool> {
        futures::future::ready(Ok(self.contains_all(keys))).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> MemoryStore {
        MemoryStore::new(Duration::from_secs(30))
    }

    #[test]
    fn counters_are_decimal_text() {
        let s = store();
        assert_eq!(s.increment("c", 5).ok(), Some(5));
        assert_eq!(s.increment("c", -7).ok(), Some(-2));
        assert_eq!(
            s.state.lock().map.get("c").map(Vec::as_slice),
            Some(&b"-2"[..])
        );
        s.insert("x", b"nope".to_vec());
        assert!(matches!(s.increment("x", 1), Err(StoreError::NotACounter { key }) if key == "x"));
        s.insert("m", i64::MAX.to_string().into_bytes());
        assert!(matches!(
            s.increment("m", 1),
            Err(StoreError::Overflow { .. })
        ));
    }

    #[test]
    fn swap_if_follows_c10d() {
        let s = store();
        assert_eq!(s.swap_if("k", Some(b"a"), b"b".to_vec()), b"a");
        assert!(!s.contains_all(&["k".to_string()]));
        assert_eq!(s.swap_if("k", None, b"b".to_vec()), b"b");
        assert_eq!(s.swap_if("k", None, b"c".to_vec()), b"b");
        assert_eq!(s.swap_if("k", Some(b"x"), b"c".to_vec()), b"b");
        assert_eq!(s.swap_if("k", Some(b"b"), b"c".to_vec()), b"c");
        assert_eq!(
            s.state.lock().map.get("k").map(Vec::as_slice),
            Some(&b"c"[..])
        );
    }

    #[tokio::test]
    async fn waiters_wake_on_change_and_leave_nothing_behind() {
        let s = Arc::new(store());
        let keys = vec!["a".to_string(), "b".to_string()];
        let waiter = {
            let s = s.clone();
            let keys = keys.clone();
            tokio::spawn(async move { s.wait_for(&keys, Duration::from_secs(30)).await })
        };
        let getter = {
            let s = s.clone();
            tokio::spawn(async move { s.get_within("b", Duration::from_secs(30)).await })
        };
        tokio::task::yield_now().await;
        s.insert("a", vec![]);
        assert_eq!(s.increment("b", 1).ok(), Some(1));
        assert!(waiter.await.is_ok_and(|r| r.is_ok()));
        assert_eq!(getter.await.ok().and_then(Result::ok), Some(b"1".to_vec()));
        assert!(s.state.lock().waiters.is_empty());
    }

    #[tokio::test]
    async fn timeout_names_missing_keys_and_cleans_up() {
        let s = store();
        s.insert("a", vec![]);
        let keys = vec!["a".to_string(), "b".to_string()];
        match s.wait_for(&keys, Duration::from_millis(20)).await {
            Err(StoreError::Timeout { keys, after }) => {
                assert_eq!(keys, vec!["b".to_string()]);
                assert_eq!(after, Duration::from_millis(20));
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(s.state.lock().waiters.is_empty());
    }
}
