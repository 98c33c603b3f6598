//! What the agent keeps of each peer for graceful shutdown
//! ([`crate::join`]): its calls per peer ([`Tally`]) and what its
//! connections tell of each peer's liveness ([`Liveness`]).

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::termination::Counts;

/// This worker's calls per peer rank, for termination detection.
pub(crate) struct Tally {
    sent: Vec<AtomicU64>,
    lost: Vec<AtomicU64>,
    served: Vec<AtomicU64>,
}

impl Tally {
    /// All zero, for a group of `n`.
    pub(crate) fn new(n: usize) -> Tally {
        let zeros = || (0..n).map(|_| AtomicU64::new(0)).collect();
        Tally {
            sent: zeros(),
            lost: zeros(),
            served: zeros(),
        }
    }

    /// A call to `to` is about to be sent (counted while the call is
    /// outstanding, so no round reads it half-done).
    pub(crate) fn sending(&self, to: u32) {
        self.sent[to as usize].fetch_add(1, Ordering::SeqCst);
    }

    /// The send counted by [`sending`](Self::sending) failed: nothing
    /// reached `to`.
    pub(crate) fn not_sent(&self, to: u32) {
        self.sent[to as usize].fetch_sub(1, Ordering::SeqCst);
    }

    /// A call to `to` failed with its connection: `to` may or may not
    /// have served it.
    pub(crate) fn lost(&self, to: u32) {
        self.lost[to as usize].fetch_add(1, Ordering::SeqCst);
    }

    /// This worker finished serving a call from `from`.
    pub(crate) fn served(&self, from: u32) {
        self.served[from as usize].fetch_add(1, Ordering::SeqCst);
    }

    /// The counts now.
    pub(crate) fn snapshot(&self) -> Counts {
        let read = |v: &Vec<AtomicU64>| v.iter().map(|a| a.load(Ordering::SeqCst)).collect();
        Counts {
            sent: read(&self.sent),
            lost: read(&self.lost),
            served: read(&self.served),
        }
    }
}

/// What this worker knows of each peer's liveness from its connections:
/// whether a connection with it ended since the last one was made, and
/// whether a new one was refused. Shutdown uses it to tell a peer that is
/// gone (killed, or its agent stopped: nothing listens at its address any
/// more) from one that is only slow.
pub(crate) struct Liveness {
    /// Per peer rank: its state, and how many of its connections ended.
    peers: Mutex<Vec<(Peer, u64)>>,
    /// Woken at every change.
    pub(crate) changed: Notify,
}

/// One peer's liveness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Peer {
    /// No connection with it has ended since the last one was made.
    Up,
    /// A connection with it ended (the `n`th ending) and none was made
    /// since.
    Departed(u64),
    /// A connection to it was refused: nothing listens at its address.
    Refused,
}

impl Liveness {
    /// Every peer of a group of `n` up.
    pub(crate) fn new(n: usize) -> Liveness {
        Liveness {
            peers: Mutex::new(vec![(Peer::Up, 0); n]),
            changed: Notify::new(),
        }
    }

    fn update(&self, rank: u32, next: impl FnOnce(&mut (Peer, u64))) {
        if let Some(p) = self.peers.lock().get_mut(rank as usize) {
            next(p);
        }
        self.changed.notify_waiters();
    }

    /// A connection with `rank` was made.
    pub(crate) fn up(&self, rank: u32) {
        self.update(rank, |p| p.0 = Peer::Up);
    }

    /// A connection with `rank` ended (closed or failed).
    pub(crate) fn ended(&self, rank: u32) {
        self.update(rank, |p| {
            p.1 += 1;
            // An older connection ending says nothing new of a peer that
            // refused a newer one.
            if p.0 != Peer::Refused {
                p.0 = Peer::Departed(p.1);
            }
        });
    }

    /// A connection to `rank` was refused.
    pub(crate) fn refused(&self, rank: u32) {
        self.update(rank, |p| p.0 = Peer::Refused);
    }

    /// Every peer's state now.
    pub(crate) fn snapshot(&self) -> Vec<Peer> {
        self.peers.lock().iter().map(|p| p.0).collect()
    }
}
