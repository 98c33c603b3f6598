//! Message watches: hooks for a layer that puts state of its own into a
//! message while the message is encoded or decoded (the RRef layer forks a
//! reference for every RRef an argument or a result carries).
//!
//! - **Encoding.** The agent encodes every call's arguments and every
//!   result inside [`encoding_message`]. Code serializing inside it may
//!   [`watch_message`]: the agent tells each watch how the message ended
//!   ([`Delivery`]), so a fork the receiver never decoded can be undone.
//!   [`is_encoding_message`] says whether a message is being encoded at
//!   all (an RRef refuses to be serialized anywhere else).
//! - **Decoding.** A function's arguments decode inside the agent's
//!   argument decoding; code deserializing there may register a wait with
//!   [`before_run`] that must finish before the function runs (the RRef
//!   layer waits until every user RRef in the arguments is confirmed by
//!   its owner).
//!
//! Nothing is allocated for a message that registers nothing.
//!
//! ```
//! use ferry_rpc::watch::{self, Delivery, MessageWatch};
//! use std::sync::atomic::{AtomicBool, Ordering};
//! use std::sync::Arc;
//!
//! struct Undo(Arc<AtomicBool>);
//! impl MessageWatch for Undo {
//!     fn settled(self: Box<Self>, delivery: Delivery) {
//!         self.0.store(delivery == Delivery::NotDecoded, Ordering::SeqCst);
//!     }
//! }
//! let undone = Arc::new(AtomicBool::new(false));
//! assert!(!watch::is_encoding_message());
//! let ((), watches) = watch::encoding_message(|| {
//!     assert!(watch::is_encoding_message());
//!     assert!(watch::watch_message(Box::new(Undo(undone.clone()))).is_ok());
//! });
//! watches.settle(Delivery::NotDecoded);
//! assert!(undone.load(Ordering::SeqCst));
//! ```

use std::cell::RefCell;

use crate::boxed::BoxFuture;

/// How a watched message ended, as far as its receiver's code goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// The receiver decoded the message: the function ran (and may have
    /// failed), or the result reached the caller.
    Decoded,
    /// The receiver never decoded the message: it failed to encode, was
    /// never sent, or the receiver refused it before reading its arguments
    /// (no such function, a wrong signature, a malformed request).
    NotDecoded,
    /// Not known: the call timed out or lost its connection, or its
    /// arguments failed partway through decoding.
    Unknown,
}

/// Told once how the message it was attached to ended.
pub trait MessageWatch: Send + 'static {
    /// The message ended this way.
    fn settled(self: Box<Self>, delivery: Delivery);
}

/// The watches one message's encoding attached.
#[derive(Default)]
pub struct Watches(Vec<Box<dyn MessageWatch>>);

impl Watches {
    /// Whether nothing watches the message (the common case).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Tells every watch how the message ended.
    pub fn settle(self, delivery: Delivery) {
        for w in self.0 {
            w.settled(delivery);
        }
    }
}

impl std::fmt::Debug for Watches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Watches").field(&self.0.len()).finish()
    }
}

type Waits = Vec<BoxFuture<Result<(), String>>>;

thread_local! {
    /// The watches of the message being encoded on this thread, if any.
    static ENCODING: RefCell<Option<Vec<Box<dyn MessageWatch>>>> = const { RefCell::new(None) };
    /// The waits of the arguments being decoded on this thread, if any.
    static DECODING: RefCell<Option<Waits>> = const { RefCell::new(None) };
}

/// Runs `encode` as the encoding of one message; returns its outcome and
/// the watches attached meanwhile (the caller settles them). Nests: an
/// inner message's watches stay with it. If `encode` panics, the watches
/// attached so far are settled as [`Delivery::NotDecoded`].
pub fn encoding_message<R>(encode: impl FnOnce() -> R) -> (R, Watches) {
    struct Restore(Option<Option<Vec<Box<dyn MessageWatch>>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(previous) = self.0.take() {
                // Unwinding out of `encode`: nothing was sent.
                let left = ENCODING.with(|e| std::mem::replace(&mut *e.borrow_mut(), previous));
                Watches(left.unwrap_or_default()).settle(Delivery::NotDecoded);
            }
        }
    }
    let previous = ENCODING.with(|e| e.borrow_mut().replace(Vec::new()));
    let mut restore = Restore(Some(previous));
    let r = encode();
    let previous = restore.0.take().unwrap_or_default();
    let watches = ENCODING.with(|e| std::mem::replace(&mut *e.borrow_mut(), previous));
    (r, Watches(watches.unwrap_or_default()))
}

/// Whether this thread is encoding a message (inside [`encoding_message`]).
pub fn is_encoding_message() -> bool {
    ENCODING.with(|e| e.borrow().is_some())
}

/// Attaches `watch` to the message being encoded on this thread; gives it
/// back if no message is.
pub fn watch_message(watch: Box<dyn MessageWatch>) -> Result<(), Box<dyn MessageWatch>> {
    ENCODING.with(|e| match &mut *e.borrow_mut() {
        Some(list) => {
            list.push(watch);
            Ok(())
        }
        None => Err(watch),
    })
}

/// What must finish before a function whose arguments just decoded runs.
#[derive(Default)]
pub(crate) struct BeforeRun(Waits);

impl BeforeRun {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Waits for every registered wait; the first error wins.
    pub(crate) async fn wait(self) -> Result<(), String> {
        for w in self.0 {
            w.await?;
        }
        Ok(())
    }

    /// [`wait`](Self::wait) from a thread that may block (the blocking pool).
    pub(crate) fn block(self) -> Result<(), String> {
        match crate::Agent::current() {
            Some(agent) => agent.block_on(self.wait()),
            None => futures::executor::block_on(self.wait()),
        }
    }
}

/// Runs `decode` as the decoding of a function's arguments; returns its
/// outcome and the waits registered meanwhile.
pub(crate) fn decoding_arguments<R>(decode: impl FnOnce() -> R) -> (R, BeforeRun) {
    struct Restore(Option<Option<Waits>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(previous) = self.0.take() {
                DECODING.with(|d| *d.borrow_mut() = previous);
            }
        }
    }
    let previous = DECODING.with(|d| d.borrow_mut().replace(Vec::new()));
    let mut restore = Restore(Some(previous));
    let r = decode();
    let previous = restore.0.take().unwrap_or_default();
    let waits = DECODING.with(|d| std::mem::replace(&mut *d.borrow_mut(), previous));
    (r, BeforeRun(waits.unwrap_or_default()))
}

/// Registers `wait` to finish before the function whose arguments are
/// decoding on this thread runs; an `Err` fails the call with its text
/// instead. Returns `false` (and drops `wait`) when no arguments are
/// decoding here (a result or a service message is).
pub fn before_run(wait: BoxFuture<Result<(), String>>) -> bool {
    DECODING.with(|d| match &mut *d.borrow_mut() {
        Some(list) => {
            list.push(wait);
            true
        }
        None => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    struct Count(Arc<AtomicUsize>, Delivery);
    impl MessageWatch for Count {
        fn settled(self: Box<Self>, delivery: Delivery) {
            if delivery == self.1 {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    #[test]
    fn watches_outside_a_message_are_refused_and_nested_messages_keep_their_own() {
        let n = Arc::new(AtomicUsize::new(0));
        assert!(watch_message(Box::new(Count(n.clone(), Delivery::Decoded))).is_err());
        let (inner, outer) = encoding_message(|| {
            watch_message(Box::new(Count(n.clone(), Delivery::Decoded))).ok();
            let ((), inner) = encoding_message(|| {
                watch_message(Box::new(Count(n.clone(), Delivery::Decoded))).ok();
                watch_message(Box::new(Count(n.clone(), Delivery::Decoded))).ok();
            });
            assert!(is_encoding_message());
            inner
        });
        assert!(!is_encoding_message());
        assert_eq!((inner.0.len(), outer.0.len()), (2, 1));
        inner.settle(Delivery::Decoded);
        outer.settle(Delivery::Decoded);
        assert_eq!(n.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_panicking_encoding_settles_its_watches_as_not_decoded() {
        let n = Arc::new(AtomicUsize::new(0));
        let n2 = n.clone();
        let r = std::panic::catch_unwind(move || {
            encoding_message(|| {
                watch_message(Box::new(Count(n2, Delivery::NotDecoded))).ok();
                panic!("serializer panicked");
            })
        });
        assert!(r.is_err());
        assert!(!is_encoding_message());
        assert_eq!(n.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn waits_register_only_while_arguments_decode() {
        assert!(!before_run(Box::pin(async { Ok(()) })));
        let ((), waits) = decoding_arguments(|| {
            assert!(before_run(Box::pin(async { Ok(()) })));
            assert!(before_run(Box::pin(async {
                Err("not confirmed".to_string())
            })));
        });
        assert!(!waits.is_empty());
        assert_eq!(waits.block(), Err("not confirmed".to_string()));
        let ((), none) = decoding_arguments(|| {});
        assert!(none.is_empty());
    }
}
