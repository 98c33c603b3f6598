//! Duplicate suppression for one sender's control messages.

use std::collections::BTreeSet;

/// The sequence numbers seen from one sender: everything up to `floor`,
/// plus the ones above it that arrived early. Once every message has
/// arrived (senders retry until acknowledged) `above` is empty again, so
/// the state stays one number per peer.
#[derive(Debug, Default, Clone)]
pub(crate) struct Dedup {
    floor: u64,
    above: BTreeSet<u64>,
}

impl Dedup {
    /// Records `seq`; true the first time it is seen.
    pub(crate) fn first_time(&mut self, seq: u64) -> bool {
        if seq <= self.floor || !self.above.insert(seq) {
            return false;
        }
        while self.above.remove(&(self.floor + 1)) {
            self.floor += 1;
        }
        true
    }

    /// Whether no message above the contiguous floor is outstanding.
    pub(crate) fn is_settled(&self) -> bool {
        self.above.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reordered_and_duplicated_sequence_numbers_are_seen_once() {
        let mut d = Dedup::default();
        assert!(d.first_time(2));
        assert!(!d.first_time(2));
        assert!(!d.is_settled());
        assert!(d.first_time(1));
        assert!(!d.first_time(1));
        assert!(d.is_settled());
        assert!(d.first_time(4));
        assert!(d.first_time(3));
        assert!(!d.first_time(4));
        assert!(d.is_settled());
    }
}
