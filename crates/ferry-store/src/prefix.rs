//! A namespace over another store.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;

use crate::{Store, StoreError, StoreFuture};

/// A view of another store in which every key `k` is stored as
/// `"{prefix}/{k}"`, like c10d's `PrefixStore`. Prefix stores nest.
///
/// Errors name the keys as the caller gave them (without the prefix).
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl PrefixStore {
    /// Namespaces `inner` under `prefix`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The prefix, without the `/` separator.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The store underneath.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{key}", self.prefix)
    }

    fn keys(&self, keys: &[String]) -> Vec<String> {
        keys.iter().map(|k| self.key(k)).collect()
    }

    /// Takes the prefix back off the keys an error names.
    fn unprefix(&self, e: StoreError) -> StoreError {
        let strip = |k: String| match k
            .strip_prefix(self.prefix.as_str())
            .and_then(|r| r.strip_prefix('/'))
        {
            Some(rest) => rest.to_owned(),
            None => k,
        };
        match e {
            StoreError::Timeout { keys, after } => StoreError::Timeout {
                keys: keys.into_iter().map(strip).collect(),
                after,
            },
            StoreError::NotACounter { key } => StoreError::NotACounter { key: strip(key) },
            StoreError::Overflow { key, delta } => StoreError::Overflow {
                key: strip(key),
                delta,
            },
            other => other,
        }
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: Vec<u8>) -> StoreFuture<'_, ()> {
        let key = self.key(key);
        async move {
            self.inner
                .set(&key, value)
                .await
                .map_err(|e| self.unprefix(e))
        }
        .boxed()
    }

    fn get(&self, key: &str) -> StoreFuture<'_, Vec<u8>> {
        let key = self.key(key);
        async move { self.inner.get(&key).await.map_err(|e| self.unprefix(e)) }.boxed()
    }

    fn wait(&self, keys: &[String], timeout: Duration) -> StoreFuture<'_, ()> {
        let keys = self.keys(keys);
        async move {
            self.inner
                .wait(&keys, timeout)
                .await
                .map_err(|e| self.unprefix(e))
        }
        .boxed()
    }

    fn add(&self, key: &str, delta: i64) -> StoreFuture<'_, i64> {
        let key = self.key(key);
        async move {
            self.inner
                .add(&key, delta)
                .await
                .map_err(|e| self.unprefix(e))
        }
        .boxed()
    }

    fn compare_set(
        &self,
        key: &str,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    ) -> StoreFuture<'_, Vec<u8>> {
        let key = self.key(key);
        async move {
            self.inner
                .compare_set(&key, expected, desired)
                .await
                .map_err(|e| self.unprefix(e))
        }
        .boxed()
    }

    fn delete(&self, key: &str) -> StoreFuture<'_, bool> {
        let key = self.key(key);
        async move { self.inner.delete(&key).await.map_err(|e| self.unprefix(e)) }.boxed()
    }

    fn check(&self, keys: &[String]) -> StoreFuture<'_, bool> {
        let keys = self.keys(keys);
        async move { self.inner.check(&keys).await.map_err(|e| self.unprefix(e)) }.boxed()
    }
}
