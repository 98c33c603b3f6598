//! The peer's bytes as the set-up reads them (sans-IO): authentication
//! messages first (with a secret), then records checked with the
//! direction's [`Opener`] (with a secret) or bytes as they came, and from
//! their data the handshake frames. Nothing is taken past the frame asked
//! for: what follows stays here for the connection's reader.

use std::time::{Duration, Instant};

use ferry_wire::{
    handshake_limits, Frame, FrameHeader, Handshake, Limits, MessageKind, HEADER_LEN,
};

use crate::auth::message::HEADER_LEN as AUTH_HEADER_LEN;
use crate::auth::records::{Opener, RECORD_HEADER_LEN};
use crate::auth::{AuthMessage, DecodeError};
use crate::TransportError;

/// Why no handshake frame came out of the bytes.
pub(super) enum FrameFail {
    /// The stream ended between frames, before one was in.
    ClosedBefore,
    /// The error to fail the set-up with.
    Error(TransportError),
}

/// The bytes read from the peer and not yet used.
pub(super) struct Inbound {
    /// Bytes as read: authentication messages, records, or (without a
    /// secret) frames.
    raw: Vec<u8>,
    /// Data of records already checked, not yet used (with an opener).
    plain: Vec<u8>,
    opener: Option<Opener>,
    /// The peer closed its side.
    eof: bool,
    /// When the last byte arrived.
    last_byte: Option<Instant>,
    limits: Limits,
    /// Names the peer in errors.
    peer: String,
}

impl Inbound {
    pub(super) fn new(peer: String) -> Self {
        Inbound {
            raw: Vec::new(),
            plain: Vec::new(),
            opener: None,
            eof: false,
            last_byte: None,
            limits: handshake_limits(),
            peer,
        }
    }

    /// Takes bytes read from the peer.
    pub(super) fn push(&mut self, now: Instant, bytes: &[u8]) {
        if !bytes.is_empty() {
            self.raw.extend_from_slice(bytes);
            self.last_byte = Some(now);
        }
    }

    /// The peer closed its side: nothing more comes.
    pub(super) fn close(&mut self) {
        self.eof = true;
    }

    /// Whether the peer closed its side.
    pub(super) fn closed(&self) -> bool {
        self.eof
    }

    /// From here on the bytes are records opened with `opener`.
    pub(super) fn seal(&mut self, opener: Opener) {
        self.opener = Some(opener);
    }

    /// The next authentication message: `Ok(None)` while more bytes are
    /// needed. Like the handshake's stream shell, it looks at nothing
    /// before a whole message header is in.
    pub(super) fn auth_message(&mut self) -> Result<Option<AuthMessage>, DecodeError> {
        if self.raw.len() < AUTH_HEADER_LEN {
            return Ok(None);
        }
        match AuthMessage::decode(&self.raw)? {
            Some((message, used)) => {
                self.raw.drain(..used);
                Ok(Some(message))
            }
            None => Ok(None),
        }
    }

    /// The frame bytes so far: the checked data with an opener, else the
    /// bytes as read.
    fn frames(&self) -> &[u8] {
        match self.opener {
            Some(_) => &self.plain,
            None => &self.raw,
        }
    }

    /// Whether part of a frame (or of a record) is in.
    pub(super) fn partial(&self) -> bool {
        !self.raw.is_empty() || !self.plain.is_empty()
    }

    /// When a frame that started arriving has stalled for `stall`, if one
    /// has.
    pub(super) fn stall_deadline(&self, stall: Duration) -> Option<Instant> {
        if !self.partial() || self.eof {
            return None;
        }
        self.last_byte.map(|t| t + stall)
    }

    /// The error for a frame that stopped arriving.
    pub(super) fn stalled(&self) -> TransportError {
        let stall = self.limits.frame_stall_timeout;
        let have = self.frames();
        let header = have
            .get(..HEADER_LEN)
            .and_then(|h| <&[u8; HEADER_LEN]>::try_from(h).ok())
            .and_then(|h| FrameHeader::decode(h, &self.limits).ok());
        let (waiting_for, got, len) = match header {
            Some(h) => (
                format!("the {}-byte payload of a {} frame", h.payload_len, h.kind),
                (have.len() - HEADER_LEN).min(h.body_len()) as u64,
                h.body_len() as u64,
            ),
            None => (
                "the frame header".to_owned(),
                have.len().min(HEADER_LEN) as u64,
                HEADER_LEN as u64,
            ),
        };
        TransportError::Stalled {
            peer: self.peer.clone(),
            waiting_for,
            got,
            len,
            after: stall,
        }
    }

    /// The next handshake frame's handshake: `Ok(None)` while more bytes
    /// are needed. Records are opened only as far as the frame needs.
    pub(super) fn handshake(&mut self) -> Result<Option<Handshake>, FrameFail> {
        loop {
            if let Some((handshake, used)) = self.whole_frame()? {
                match self.opener {
                    Some(_) => self.plain.drain(..used),
                    None => self.raw.drain(..used),
                };
                return Ok(Some(handshake));
            }
            if !self.open_record()? {
                break;
            }
        }
        if !self.eof {
            return Ok(None);
        }
        if self.partial() {
            // Inside a frame or a record: as a reader sees it.
            Err(FrameFail::Error(TransportError::Closed {
                peer: self.peer.clone(),
            }))
        } else {
            Err(FrameFail::ClosedBefore)
        }
    }

    /// A whole frame at the front of the frame bytes: its handshake and
    /// the bytes it took.
    fn whole_frame(&self) -> Result<Option<(Handshake, usize)>, FrameFail> {
        let have = self.frames();
        let Some(head) = have
            .get(..HEADER_LEN)
            .and_then(|h| <&[u8; HEADER_LEN]>::try_from(h).ok())
        else {
            return Ok(None);
        };
        // The header is checked as soon as it is in: one announcing more
        // than a handshake is refused before its body arrives.
        let header = FrameHeader::decode(head, &self.limits).map_err(|e| self.malformed(e))?;
        if have.len() < HEADER_LEN + header.body_len() {
            return Ok(None);
        }
        let (frame, used) = Frame::decode(have, &self.limits).map_err(|e| self.malformed(e))?;
        if frame.header.kind != MessageKind::HANDSHAKE {
            return Err(self.fail(format!(
                "expected a handshake, got a {} frame",
                frame.header.kind
            )));
        }
        let handshake = Handshake::decode(frame.payload).map_err(|e| self.fail(e.to_string()))?;
        Ok(Some((handshake, used)))
    }

    /// Opens the record at the front of the raw bytes into the checked
    /// data: `false` when there is no opener or the record is not whole.
    fn open_record(&mut self) -> Result<bool, FrameFail> {
        let Some(opener) = self.opener.as_mut() else {
            return Ok(false);
        };
        let Some(head) = self
            .raw
            .get(..RECORD_HEADER_LEN)
            .and_then(|h| <[u8; RECORD_HEADER_LEN]>::try_from(h).ok())
        else {
            return Ok(false);
        };
        let peer = &self.peer;
        let integrity = |source| {
            FrameFail::Error(TransportError::Integrity {
                peer: peer.clone(),
                source,
            })
        };
        let total = opener.record_len(head).map_err(integrity)?;
        let Some(record) = self.raw.get_mut(..total) else {
            return Ok(false);
        };
        let data = opener.open(record).map_err(integrity)?;
        self.plain.extend_from_slice(&record[data]);
        self.raw.drain(..total);
        Ok(true)
    }

    /// Opens every whole record still here (the connection's first
    /// records, which came with the last handshake frame): a forged one
    /// fails the set-up before anything of the connection runs.
    pub(super) fn open_whole_records(&mut self) -> Result<(), TransportError> {
        loop {
            match self.open_record() {
                Ok(true) => {}
                Ok(false) => return Ok(()),
                Err(FrameFail::Error(e)) => return Err(e),
                Err(FrameFail::ClosedBefore) => return Ok(()),
            }
        }
    }

    /// Bytes here, checked or not.
    pub(super) fn buffered(&self) -> usize {
        self.raw.len() + self.plain.len()
    }

    /// What is left when the set-up ends: the opener (its sequence number
    /// where the set-up left it), checked data, and the bytes of records
    /// not yet whole (with no opener, all bytes are in the first).
    pub(super) fn finish(self) -> (Option<Opener>, Vec<u8>, Vec<u8>) {
        match self.opener {
            Some(o) => (Some(o), self.plain, self.raw),
            None => (None, self.raw, Vec::new()),
        }
    }

    fn fail(&self, reason: String) -> FrameFail {
        FrameFail::Error(TransportError::Handshake {
            peer: self.peer.clone(),
            reason,
        })
    }

    fn malformed(&self, source: ferry_wire::WireError) -> FrameFail {
        FrameFail::Error(TransportError::Malformed {
            peer: self.peer.clone(),
            source,
        })
    }
}
