//! Bookkeeping of lowering ([`crate::lower::add_send_recv`]): which rank
//! has done which action, which blocked rank waits for which action, and
//! sets of ranks, all in flat tables (indexed by [`crate::pairs`]) so that
//! it runs in time proportional to the number of actions (no hashing of
//! actions). The unit-step simulator keeps its own per-pair table.

use std::collections::HashSet;

use crate::action::Action;

/// The sub-actions of a compound action, or the action itself.
#[inline]
pub(crate) fn leaves(action: &Action) -> &[Action] {
    if action.sub_actions().is_empty() {
        std::slice::from_ref(action)
    } else {
        action.sub_actions()
    }
}

/// Lowering's board: which rank has done which cell (the first in a flat
/// table, any other beside it) and which blocked ranks wait for which
/// cell, the two kept side by side per cell so that looking a cell up and
/// waking its waiters touch one cache line. The waiters of a cell are a list threaded through one vector.
pub(crate) struct Board {
    /// Per cell: 1 + the first rank that did it, and 1 + the index of the
    /// newest entry waiting for it (0: none, for both).
    cells: Vec<[u32; 2]>,
    /// Any other rank that did a cell (only in a malformed schedule).
    others: HashSet<(usize, usize)>,
    /// (waiting rank, the rank whose doing the cell wakes it, the rank's
    /// block count when it registered, next entry + 1).
    entries: Vec<(u32, u32, u32, u32)>,
    /// Per rank: how many times it blocked; entries of older blocks are stale.
    epoch: Vec<u32>,
    /// Per rank: whether it is blocked now.
    blocked: Vec<bool>,
}

impl Board {
    pub(crate) fn new(cells: usize, ranks: usize) -> Board {
        Board {
            cells: vec![[0; 2]; cells],
            others: HashSet::new(),
            entries: Vec::new(),
            epoch: vec![0; ranks],
            blocked: vec![false; ranks],
        }
    }

    /// Whether `rank` did `cell`.
    #[inline]
    pub(crate) fn has_cell(&self, rank: usize, cell: usize) -> bool {
        self.cells[cell][0] == rank as u32 + 1
            || (!self.others.is_empty() && self.others.contains(&(rank, cell)))
    }

    /// Marks `rank` blocked (a new block: earlier registrations go stale).
    pub(crate) fn block(&mut self, rank: usize) {
        self.epoch[rank] = self.epoch[rank].wrapping_add(1);
        self.blocked[rank] = true;
    }

    /// `rank` (blocked) waits until `producer` does `cell`.
    pub(crate) fn wait(&mut self, rank: usize, producer: usize, cell: Option<usize>) {
        let Some(cell) = cell else { return };
        self.entries.push((
            rank as u32,
            producer as u32,
            self.epoch[rank],
            self.cells[cell][1],
        ));
        self.cells[cell][1] = self.entries.len() as u32;
    }

    /// Records that `producer` did `cell`: every rank waiting for that is
    /// unblocked and passed to `wake`, in the order they registered
    /// (newest first).
    #[inline(always)]
    pub(crate) fn record(&mut self, producer: usize, cell: usize, mut wake: impl FnMut(usize)) {
        let tag = producer as u32 + 1;
        let slot = &mut self.cells[cell];
        if slot[0] == 0 {
            slot[0] = tag;
        } else if slot[0] != tag {
            self.others.insert((producer, cell));
        }
        let mut at = std::mem::take(&mut slot[1]);
        while at != 0 {
            let (rank, from, epoch, next) = self.entries[at as usize - 1];
            let (rank_i, live) = (rank as usize, self.epoch[rank as usize] == epoch);
            if live && self.blocked[rank_i] {
                if from as usize == producer {
                    self.blocked[rank_i] = false;
                    wake(rank_i);
                } else {
                    // Another rank's doing of the cell: keep waiting.
                    self.entries[at as usize - 1].3 = self.cells[cell][1];
                    self.cells[cell][1] = at;
                }
            }
            at = next;
        }
    }
}

/// A set of ranks, walked in increasing order while it changes.
pub(crate) struct RankSet {
    words: Vec<u64>,
}

impl RankSet {
    pub(crate) fn new(ranks: usize) -> RankSet {
        RankSet {
            words: vec![0; ranks.div_ceil(64)],
        }
    }

    #[inline]
    pub(crate) fn insert(&mut self, rank: usize) {
        self.words[rank / 64] |= 1 << (rank % 64);
    }

    /// Removes and returns the least rank at or above `from`.
    #[inline]
    pub(crate) fn take_from(&mut self, from: usize) -> Option<usize> {
        let mut w = from / 64;
        if w >= self.words.len() {
            return None;
        }
        let mut bits = self.words[w] & (!0u64 << (from % 64));
        loop {
            if bits != 0 {
                let rank = w * 64 + bits.trailing_zeros() as usize;
                self.words[w] &= !(1 << (rank % 64));
                return Some(rank);
            }
            w += 1;
            if w >= self.words.len() {
                return None;
            }
            bits = self.words[w];
        }
    }

    /// Moves every rank of `other` into this set.
    pub(crate) fn take_all(&mut self, other: &mut RankSet) {
        for (a, b) in self.words.iter_mut().zip(other.words.iter_mut()) {
            *a |= *b;
            *b = 0;
        }
    }
}
