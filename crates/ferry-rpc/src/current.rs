//! The agent a thread is working for, while it runs a remote function or
//! decodes a reply: how types deserialized there (RRefs) find their worker.

use std::cell::RefCell;

use crate::Agent;

thread_local! {
    static CURRENT: RefCell<Option<Agent>> = const { RefCell::new(None) };
}

/// Runs `f` with `agent` as the current agent of this thread, restoring
/// the previous one afterwards (calls nest).
pub(crate) fn enter<R>(agent: &Agent, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Agent>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            CURRENT.with(|c| *c.borrow_mut() = previous);
        }
    }
    let previous = CURRENT.with(|c| c.borrow_mut().replace(agent.clone()));
    let _restore = Restore(previous);
    f()
}

/// The current agent of this thread, if any.
pub(crate) fn get() -> Option<Agent> {
    CURRENT.with(|c| c.borrow().clone())
}
