//! Call scopes: per-call state an upper layer makes current on whatever
//! thread works for a call, the way `tracing` spans follow a future.
//!
//! An [`Interceptor`](crate::Interceptor) returns a [`CallScope`] from
//! `on_receive` (distributed autograd returns its context). The agent
//! enters it while the call's arguments decode, while the function runs
//! (around every poll of an async function) and while the result encodes;
//! a service's handler runs inside it too. Work started from inside a
//! scope (a function the RRef layer runs for a `remote` call) inherits it.

use std::any::Any;
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// Per-call state of an upper layer.
pub trait CallScope: Send + Sync + 'static {
    /// Makes the scope current on this thread; undone when the returned
    /// guard drops. Entries nest.
    fn enter(&self) -> Box<dyn Any>;
}

/// The scopes of one call.
#[derive(Clone, Default)]
pub(crate) struct Scopes(Option<Arc<Vec<Arc<dyn CallScope>>>>);

thread_local! {
    static CURRENT: RefCell<Scopes> = RefCell::new(Scopes::default());
}

impl Scopes {
    pub(crate) fn new(scopes: Vec<Arc<dyn CallScope>>) -> Self {
        // No scopes (the common case) costs no allocation.
        Scopes((!scopes.is_empty()).then(|| Arc::new(scopes)))
    }

    fn list(&self) -> &[Arc<dyn CallScope>] {
        self.0.as_deref().map_or(&[], Vec::as_slice)
    }

    /// The scopes entered on this thread.
    pub(crate) fn current() -> Scopes {
        CURRENT.with(|c| c.borrow().clone())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.list().is_empty()
    }

    /// Runs `f` inside these scopes.
    pub(crate) fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        if self.is_empty() {
            return f();
        }
        let previous = CURRENT.with(|c| std::mem::replace(&mut *c.borrow_mut(), self.clone()));
        struct Restore(Option<Scopes>, Vec<Box<dyn Any>>);
        impl Drop for Restore {
            fn drop(&mut self) {
                // Leave the scopes innermost first, then restore the list.
                while self.1.pop().is_some() {}
                if let Some(p) = self.0.take() {
                    CURRENT.with(|c| *c.borrow_mut() = p);
                }
            }
        }
        let guards = self.list().iter().map(|s| s.enter()).collect();
        let _restore = Restore(Some(previous), guards);
        f()
    }
}

/// A future polled inside a call's scopes.
pub(crate) struct Scoped<F> {
    pub(crate) scopes: Scopes,
    pub(crate) future: Pin<Box<F>>,
}

impl<F: Future> Future for Scoped<F> {
    type Output = F::Output;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        let future = this.future.as_mut();
        this.scopes.run(|| future.poll(cx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    thread_local! {
        static DEPTH: Cell<u32> = const { Cell::new(0) };
    }

    struct Counter;
    impl CallScope for Counter {
        fn enter(&self) -> Box<dyn Any> {
            struct Leave;
            impl Drop for Leave {
                fn drop(&mut self) {
                    DEPTH.with(|d| d.set(d.get() - 1));
                }
            }
            DEPTH.with(|d| d.set(d.get() + 1));
            Box::new(Leave)
        }
    }

    #[test]
    fn scopes_are_current_inside_and_restored_after() {
        let scopes = Scopes::new(vec![Arc::new(Counter), Arc::new(Counter)]);
        assert!(Scopes::current().is_empty());
        scopes.run(|| {
            assert_eq!(DEPTH.with(|d| d.get()), 2);
            assert_eq!(Scopes::current().list().len(), 2);
            // Nested entry of the captured scopes (work started from inside).
            Scopes::current().run(|| assert_eq!(DEPTH.with(|d| d.get()), 4));
            assert_eq!(DEPTH.with(|d| d.get()), 2);
        });
        assert_eq!(DEPTH.with(|d| d.get()), 0);
        assert!(Scopes::current().is_empty());
    }

    #[test]
    fn a_panic_inside_still_leaves_the_scopes() {
        let scopes = Scopes::new(vec![Arc::new(Counter)]);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            scopes.run(|| panic!("boom"));
        }));
        assert!(r.is_err());
        assert_eq!(DEPTH.with(|d| d.get()), 0);
        assert!(Scopes::current().is_empty());
    }
}
