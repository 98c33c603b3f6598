//! [`Agent::shutdown`]: the graceful shutdown, which runs the termination
//! rounds of [`crate::join`] twice around the layers' shutdown hooks.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tracing::Instrument;

use super::{Agent, Inner, JOINING, RUNNING};
use crate::boxed::BoxFuture;
use crate::join::join;
use crate::service::Service;
use crate::RpcError;

impl Agent {
    /// Graceful shutdown: waits until no worker of the group has calls
    /// outstanding (PyTorch's `join`), then all workers stop together.
    ///
    /// Stops all the same when it fails. With a worker that does not take
    /// part it fails with [`RpcError::Absent`] naming it: at once when the
    /// worker's connection closed and its address refuses a new one (a
    /// killed process: [`Absence::Gone`](crate::Absence::Gone)), else once
    /// the group has made no progress for
    /// [`shutdown_timeout`](crate::RpcOptions::shutdown_timeout)
    /// ([`Absence::Silent`](crate::Absence::Silent)); the worker that finds
    /// it tells the others through the store, so each survivor in shutdown
    /// ends with the same error ([`Absence::Reported`](crate::Absence::Reported)).
    /// Rank 0, which hosts the store, first waits up to one more
    /// `shutdown_timeout` until every other survivor has had that news.
    /// Calls that stay outstanding, a call that was never served, or a
    /// store that does not answer fail it with [`RpcError::Join`] after
    /// `shutdown_timeout` without progress. Layers' shutdown hooks are
    /// bounded by `shutdown_timeout` each.
    ///
    /// Call it from a thread, not from inside an async task on the agent's runtime.
    pub fn shutdown(&self) -> Result<(), RpcError> {
        let inner = &self.inner;
        if inner
            .state
            .compare_exchange(RUNNING, JOINING, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return Err(RpcError::NotInitialized);
        }
        let services: Vec<Arc<dyn Service>> = inner.services.values().cloned().collect();
        let result = inner.handle.block_on(
            async {
                join(inner.clone(), "join").await?;
                if services.is_empty() {
                    return Ok(());
                }
                // The group is idle: layers send what they still owe (the
                // RRef layer deletes its users), then the group waits until
                // that traffic has drained too, and layers release the rest.
                // Each hook is bounded too: shutdown ends within its bounds.
                let mut hooks = Ok(());
                for s in &services {
                    hooks = hooks.and(
                        inner
                            .bounded_hook(s.name(), "after_join", s.after_join())
                            .await,
                    );
                }
                let drained = join(inner.clone(), "drain").await;
                for s in &services {
                    hooks = hooks.and(
                        inner
                            .bounded_hook(s.name(), "before_stop", s.before_stop())
                            .await,
                    );
                }
                hooks.and(drained)
            }
            .instrument(inner.span.clone()),
        );
        self.stop();
        result
    }
}

impl Inner {
    /// Runs a layer's shutdown hook for at most `shutdown_timeout`.
    async fn bounded_hook(
        &self,
        layer: &str,
        hook: &str,
        run: BoxFuture<()>,
    ) -> Result<(), RpcError> {
        tokio::time::timeout(self.shutdown_timeout, run)
            .await
            .map_err(|_| {
                RpcError::Join(format!(
                    "the {layer:?} layer's {hook} did not finish within {:?}",
                    self.shutdown_timeout
                ))
            })
    }
}
