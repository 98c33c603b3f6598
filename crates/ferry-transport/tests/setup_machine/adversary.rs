//! Adversaries for the driver: one that tampers with chosen writes, and
//! one that cuts the honest byte streams into reads of any sizes.
#![allow(clippy::unwrap_used, dead_code)]

use ferry_transport::setup_machine::Role;

use super::driver::{Adversary, Piece};

/// What to do to one write.
#[derive(Debug, Clone)]
pub(crate) enum How {
    /// Flip the low bit of its byte `at`.
    Alter { at: usize },
    /// Deliver nothing of it.
    Drop,
    /// Deliver these bytes instead (a captured write of another session).
    Replace(Vec<u8>),
    /// Deliver its first `keep` bytes, then end the stream.
    Truncate { keep: usize },
    /// Deliver its first `keep` bytes, then nothing more from this side
    /// (the stream stays open).
    Stall { keep: usize },
    /// Deliver these bytes right after it, in the same read.
    Inject(Vec<u8>),
    /// Hold it and the next `count - 1` writes of its side, then deliver
    /// them in one read, in `order` (indices into the held writes; one
    /// left out is dropped).
    Hold { count: usize, order: Vec<usize> },
}

/// Tampers with side `from`'s `n`th write.
#[derive(Debug, Clone)]
pub(crate) struct Tamper {
    pub(crate) from: Role,
    pub(crate) n: usize,
    pub(crate) how: How,
}

/// Writes held for a [`How::Hold`]: how many to hold, the order to
/// deliver them in, and those held so far.
type Held = Option<(usize, Vec<usize>, Vec<Vec<u8>>)>;

/// Delivers each write as one read, except those it tampers with.
pub(crate) struct Attacker {
    tampers: Vec<Tamper>,
    /// Per side: writes held for a [`How::Hold`] and its order.
    held: [Held; 2],
    /// Per side: nothing more passes.
    silenced: [bool; 2],
}

fn index(role: Role) -> usize {
    match role {
        Role::Connect => 0,
        Role::Accept => 1,
    }
}

impl Attacker {
    pub(crate) fn new(tampers: Vec<Tamper>) -> Self {
        Attacker {
            tampers,
            held: [None, None],
            silenced: [false, false],
        }
    }

    /// Tampers with one write.
    pub(crate) fn one(from: Role, n: usize, how: How) -> Self {
        Self::new(vec![Tamper { from, n, how }])
    }
}

impl Adversary for Attacker {
    fn write(&mut self, from: Role, n: usize, mut bytes: Vec<u8>) -> Vec<Piece> {
        let i = index(from);
        if self.silenced[i] {
            return Vec::new();
        }
        if let Some((count, order, got)) = self.held[i].as_mut() {
            got.push(bytes);
            if got.len() < *count {
                return Vec::new();
            }
            let all: Vec<u8> = order.iter().flat_map(|&k| got[k].clone()).collect();
            self.held[i] = None;
            return vec![Piece::Bytes(all)];
        }
        let Some(t) = self.tampers.iter().find(|t| t.from == from && t.n == n) else {
            return vec![Piece::Bytes(bytes)];
        };
        match t.how.clone() {
            How::Alter { at } => {
                bytes[at] ^= 1;
                vec![Piece::Bytes(bytes)]
            }
            How::Drop => Vec::new(),
            How::Replace(other) => vec![Piece::Bytes(other)],
            How::Truncate { keep } => {
                self.silenced[i] = true;
                bytes.truncate(keep);
                vec![Piece::Bytes(bytes), Piece::Close]
            }
            How::Stall { keep } => {
                self.silenced[i] = true;
                bytes.truncate(keep);
                vec![Piece::Bytes(bytes)]
            }
            How::Inject(extra) => {
                bytes.extend_from_slice(&extra);
                vec![Piece::Bytes(bytes)]
            }
            How::Hold { count, order } => {
                self.held[i] = Some((count, order, vec![bytes]));
                Vec::new()
            }
        }
    }
}

/// Cuts each direction's byte stream into reads of the sizes given, in
/// turn: a write may arrive in many reads, or several writes in one.
/// What is left when nothing else moves arrives then.
pub(crate) struct Splitter {
    sizes: Vec<usize>,
    next: usize,
    pending: [Vec<u8>; 2],
}

impl Splitter {
    pub(crate) fn new(sizes: Vec<usize>) -> Self {
        assert!(sizes.iter().all(|&s| s > 0));
        Splitter {
            sizes,
            next: 0,
            pending: [Vec::new(), Vec::new()],
        }
    }

    fn cut(&mut self, i: usize, all: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        loop {
            let size = self.sizes[self.next % self.sizes.len()];
            let pending = &mut self.pending[i];
            if pending.is_empty() || (pending.len() < size && !all) {
                return out;
            }
            let take = size.min(pending.len());
            out.push(Piece::Bytes(pending.drain(..take).collect()));
            self.next += 1;
        }
    }
}

impl Adversary for Splitter {
    fn write(&mut self, from: Role, _: usize, bytes: Vec<u8>) -> Vec<Piece> {
        let i = index(from);
        self.pending[i].extend_from_slice(&bytes);
        self.cut(i, false)
    }

    fn flush(&mut self, from: Role) -> Vec<Piece> {
        self.cut(index(from), true)
    }
}

/// Plays the connecting side to the accepting one from a transcript of
/// another session: its first write when the real connector would write
/// its first, and one more after each of the acceptor's writes. The real
/// connector hears nothing and is heard by no one.
pub(crate) struct Replayer {
    transcript: std::collections::VecDeque<Vec<u8>>,
}

impl Replayer {
    pub(crate) fn new(transcript: Vec<Vec<u8>>) -> Self {
        Replayer {
            transcript: transcript.into(),
        }
    }

    fn next(&mut self) -> Vec<Piece> {
        self.transcript
            .pop_front()
            .map(Piece::Bytes)
            .into_iter()
            .collect()
    }
}

impl Adversary for Replayer {
    fn write(&mut self, from: Role, n: usize, _: Vec<u8>) -> Vec<Piece> {
        match (from, n) {
            (Role::Connect, 0) => self.next(),
            _ => Vec::new(),
        }
    }

    fn back(&mut self, from: Role, _: usize) -> Vec<Piece> {
        match from {
            Role::Accept => self.next(),
            Role::Connect => Vec::new(),
        }
    }
}
