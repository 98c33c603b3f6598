//! Boxed types shared by the crate's modules.

use std::future::Future;
use std::pin::Pin;

/// A boxed, sendable future (what services and layers return).
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;
