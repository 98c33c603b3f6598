//! Session-bound records: how the bytes of an authenticated stream travel
//! after the handshake, so that a relay or anyone on the path can neither
//! inject, drop, reorder, replay nor alter them unnoticed.
//!
//! Each direction of a stream is cut into records:
//!
//! | bytes | what |
//! |---|---|
//! | 4 | the data's length `n` (big-endian, at most [`MAX_RECORD`]) |
//! | `n` | the data (in [`Protection::Encrypt`], its ciphertext) |
//! | 32 or 16 | the tag |
//!
//! With [`Protection::Mac`] the tag is keyed BLAKE3 over
//! `seq ‖ n ‖ data`; with [`Protection::Encrypt`] the data is sealed with
//! AES-256-GCM under the nonce `seq` with `n` as associated data, and the
//! tag is GCM's. `seq` counts the records of the
//! direction from 0 and never crosses the wire: a dropped, replayed or
//! reordered record fails its tag like an altered one. Each direction has
//! its own key ([`super::SessionKey`] derives both from the handshake's
//! nonces), so a record cannot be reflected back to its sender either.
//!
//! [`Sealer`] and [`Opener`] are the pure core (bytes in, bytes out);
//! [`RecordReader`] and [`RecordWriter`] wrap a byte stream with them.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Most data bytes one record carries.
pub const MAX_RECORD: usize = 256 << 10;
/// Bytes of a record's length prefix.
pub const RECORD_HEADER_LEN: usize = 4;

/// What the records of an authenticated stream guarantee.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protection {
    /// Integrity: every record carries a MAC (keyed BLAKE3), so nothing
    /// can be injected, dropped, reordered, replayed or altered; the bytes
    /// themselves travel in the clear.
    #[default]
    Mac,
    /// Integrity and confidentiality: every record is sealed with
    /// AES-256-GCM.
    Encrypt,
}

impl Protection {
    /// The environment variable that chooses the protection of a group
    /// that has a secret: `mac` (the default) or `encrypt`.
    pub const ENV: &'static str = "FERRY_AUTH";

    /// The protection `FERRY_AUTH` names: unset or empty is
    /// [`Protection::Mac`]; anything but `mac` or `encrypt` is an error.
    pub fn from_env() -> Result<Protection, String> {
        match std::env::var(Self::ENV) {
            Err(_) => Ok(Protection::Mac),
            Ok(v) => v.parse(),
        }
    }

    /// Bytes of a record's tag.
    pub fn tag_len(self) -> usize {
        match self {
            Protection::Mac => blake3::OUT_LEN,
            Protection::Encrypt => AES_256_GCM.tag_len(),
        }
    }

    /// The name in labels, logs and `FERRY_AUTH`.
    pub fn name(self) -> &'static str {
        match self {
            Protection::Mac => "mac",
            Protection::Encrypt => "encrypt",
        }
    }
}

impl std::str::FromStr for Protection {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "" | "mac" => Ok(Protection::Mac),
            "encrypt" => Ok(Protection::Encrypt),
            other => Err(format!(
                "{}={other:?} is neither `mac` nor `encrypt`",
                Protection::ENV
            )),
        }
    }
}

/// Why a record was refused: the stream is no longer the one the
/// handshake authenticated, and is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The record's tag does not match: it was altered, injected,
    /// replayed, reordered, or one before it was dropped.
    #[error("record {seq} failed its integrity check (altered, injected, replayed, reordered, or one before it was dropped)")]
    Forged {
        /// The record's place in its direction, counted from 0.
        seq: u64,
    },
    /// The length prefix announces more than [`MAX_RECORD`] bytes.
    #[error("record {seq} announces {len} bytes, more than the {MAX_RECORD} a record may carry")]
    TooLarge {
        /// The record's place in its direction.
        seq: u64,
        /// The length it announced.
        len: u64,
    },
    /// The bytes of a tensor that crossed outside the records (the `ucx`
    /// channel) do not match the MAC its sealed frame carried.
    #[error("the bytes of {channel} transfer {seq} failed their integrity check")]
    Tensor {
        /// The channel that carried them.
        channel: &'static str,
        /// The transfer's sequence number on that channel.
        seq: u64,
    },
    /// The stream ended inside a record.
    #[error("the stream ended inside record {seq}")]
    Truncated {
        /// The record's place in its direction.
        seq: u64,
    },
}

impl RecordError {
    /// The I/O error a reader returns for it; [`RecordError::of`] finds it
    /// again.
    pub fn into_io(self) -> io::Error {
        let kind = match self {
            RecordError::Truncated { .. } => io::ErrorKind::UnexpectedEof,
            _ => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, self)
    }

    /// The record error inside an I/O error from a [`RecordReader`].
    pub fn of(e: &io::Error) -> Option<&RecordError> {
        e.get_ref().and_then(|inner| inner.downcast_ref())
    }
}

/// One direction's key and record count.
struct Direction {
    key: [u8; 32],
    /// The AEAD key ([`Protection::Encrypt`] only).
    aead: Option<LessSafeKey>,
    protection: Protection,
    seq: u64,
}

impl Direction {
    fn new(key: [u8; 32], protection: Protection) -> Direction {
        let aead = match protection {
            Protection::Mac => None,
            Protection::Encrypt => match UnboundKey::new(&AES_256_GCM, &key) {
                Ok(k) => Some(LessSafeKey::new(k)),
                Err(_) => unreachable!("AES-256-GCM takes a 32-byte key"),
            },
        };
        Direction {
            key,
            aead,
            protection,
            seq: 0,
        }
    }

    /// The record's nonce: its place in the direction, never used twice
    /// under one key.
    fn nonce(&self) -> Nonce {
        let mut n = [0u8; 12];
        n[4..].copy_from_slice(&self.seq.to_be_bytes());
        Nonce::assume_unique_for_key(n)
    }

    fn aead(&self) -> &LessSafeKey {
        match &self.aead {
            Some(k) => k,
            None => unreachable!("an Encrypt direction has its AEAD key"),
        }
    }

    fn mac(&self, len: [u8; 4], data: &[u8]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(&self.seq.to_be_bytes());
        h.update(&len);
        h.update(data);
        h.finalize()
    }
}

/// Seals the data of one direction into records (sans-IO).
pub struct Sealer(Direction);

impl Sealer {
    /// A sealer for the direction whose key is `key`.
    pub fn new(key: [u8; 32], protection: Protection) -> Sealer {
        Sealer(Direction::new(key, protection))
    }

    /// Appends one record holding `data` (at most [`MAX_RECORD`] bytes,
    /// gathered from the slices in order) to `out`.
    ///
    /// # Panics
    /// If the slices hold more than [`MAX_RECORD`] bytes (a caller's bug:
    /// [`RecordWriter`] never passes more).
    pub fn seal(&mut self, data: &[&[u8]], out: &mut Vec<u8>) {
        let n: usize = data.iter().map(|d| d.len()).sum();
        assert!(n <= MAX_RECORD, "a record of {n} bytes");
        let len = (n as u32).to_be_bytes();
        let start = out.len();
        out.extend_from_slice(&len);
        for d in data {
            out.extend_from_slice(d);
        }
        let body = start + RECORD_HEADER_LEN;
        let d = &self.0;
        match d.protection {
            Protection::Mac => {
                let tag = d.mac(len, &out[body..]);
                out.extend_from_slice(tag.as_bytes());
            }
            Protection::Encrypt => {
                let sealed = d.aead().seal_in_place_separate_tag(
                    d.nonce(),
                    Aad::from(len),
                    &mut out[body..],
                );
                match sealed {
                    Ok(tag) => out.extend_from_slice(tag.as_ref()),
                    // Only plaintexts over 64 GiB fail; records are bounded.
                    Err(_) => unreachable!("a record of {n} bytes is within GCM's limit"),
                }
            }
        }
        self.0.seq += 1;
    }
}

/// Opens the records of one direction (sans-IO).
pub struct Opener(Direction);

impl Opener {
    /// An opener for the direction whose key is `key`.
    pub fn new(key: [u8; 32], protection: Protection) -> Opener {
        Opener(Direction::new(key, protection))
    }

    /// The next record's place in its direction.
    pub fn seq(&self) -> u64 {
        self.0.seq
    }

    /// The whole length (header, data, tag) of the record that `header`
    /// starts, or why it is refused.
    pub fn record_len(&self, header: [u8; RECORD_HEADER_LEN]) -> Result<usize, RecordError> {
        let n = u32::from_be_bytes(header) as usize;
        if n > MAX_RECORD {
            return Err(RecordError::TooLarge {
                seq: self.0.seq,
                len: n as u64,
            });
        }
        Ok(RECORD_HEADER_LEN + n + self.0.protection.tag_len())
    }

    /// Checks (and in [`Protection::Encrypt`], decrypts in place) one
    /// whole record, returning the range of its data within `record`.
    pub fn open(&mut self, record: &mut [u8]) -> Result<std::ops::Range<usize>, RecordError> {
        let seq = self.0.seq;
        let forged = RecordError::Forged { seq };
        let header: [u8; RECORD_HEADER_LEN] = record
            .get(..RECORD_HEADER_LEN)
            .and_then(|h| h.try_into().ok())
            .ok_or(RecordError::Truncated { seq })?;
        let total = self.record_len(header)?;
        if record.len() != total {
            return Err(RecordError::Truncated { seq });
        }
        let end = total - self.0.protection.tag_len();
        let d = &self.0;
        match d.protection {
            Protection::Mac => {
                let (body, tag) = record[RECORD_HEADER_LEN..].split_at_mut(end - RECORD_HEADER_LEN);
                let mut theirs = [0u8; blake3::OUT_LEN];
                theirs.copy_from_slice(tag);
                // `blake3::Hash`'s `==` runs in constant time.
                if d.mac(header, body) != blake3::Hash::from(theirs) {
                    return Err(forged);
                }
            }
            Protection::Encrypt => {
                // Ciphertext and tag, opened in place (ring checks the tag
                // in constant time).
                d.aead()
                    .open_in_place(
                        d.nonce(),
                        Aad::from(header),
                        &mut record[RECORD_HEADER_LEN..],
                    )
                    .map_err(|_| forged)?;
            }
        }
        self.0.seq += 1;
        Ok(RECORD_HEADER_LEN..end)
    }
}

/// Bytes of a record reader's buffer before a larger record arrives.
const FIRST_BUFFER: usize = 16 << 10;

/// Bytes of the largest record `opener` takes.
fn max_record_len(opener: &Opener) -> usize {
    RECORD_HEADER_LEN + MAX_RECORD + opener.0.protection.tag_len()
}

/// Reads the records of a stream, handing on only data whose record
/// passed its check. Without an [`Opener`] it reads the stream as it is.
pub struct RecordReader<R> {
    inner: R,
    opener: Option<Opener>,
    /// Bytes read from `inner`: `buf[start..end]`, of which
    /// `buf[plain.start..plain.end]` is checked data not yet handed on.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    plain: std::ops::Range<usize>,
    failed: Option<RecordError>,
}

impl<R> RecordReader<R> {
    /// Reads `inner` through `opener` (`None`: as it is).
    pub fn new(inner: R, opener: Option<Opener>) -> Self {
        // Small records are read several at a time; the buffer grows when
        // a larger one comes (to at most two whole records), so a stream
        // that carries little (a lane's back channel) stays small.
        let cap = if opener.is_some() { FIRST_BUFFER } else { 0 };
        RecordReader {
            inner,
            opener,
            buf: vec![0; cap],
            start: 0,
            end: 0,
            plain: 0..0,
            failed: None,
        }
    }

    /// Reads `inner` through `opener` (`None`: as it is), after the bytes
    /// already taken from it: `plain`, data of records already checked
    /// (with no opener: bytes as they came), handed on first, then
    /// `sealed`, the start of the records that follow, checked as if read
    /// from `inner`. The opener continues the direction where its sequence
    /// number stands (a connection's set-up read and checked the records
    /// before these: [`SetupMachine`](crate::setup_machine::SetupMachine)).
    pub fn with_buffered(inner: R, opener: Option<Opener>, plain: &[u8], sealed: &[u8]) -> Self {
        let mut reader = RecordReader::new(inner, opener);
        // Without an opener, sealed bytes are bytes like any other.
        let (plain, sealed): (Vec<u8>, &[u8]) = match reader.opener {
            Some(_) => (plain.to_vec(), sealed),
            None => ([plain, sealed].concat(), &[]),
        };
        let have = plain.len() + sealed.len();
        if reader.buf.len() < have {
            reader.buf.resize(have, 0);
        }
        reader.buf[..plain.len()].copy_from_slice(&plain);
        reader.buf[plain.len()..have].copy_from_slice(sealed);
        reader.plain = 0..plain.len();
        reader.start = plain.len();
        reader.end = have;
        reader
    }

    /// The stream underneath.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// The stream underneath.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// Whether records are checked (the stream was authenticated).
    pub fn is_sealed(&self) -> bool {
        self.opener.is_some()
    }

    /// Bytes read from the stream and not yet handed on (checked or not).
    pub fn buffered(&self) -> usize {
        self.end - self.start + (self.plain.end - self.plain.start)
    }

    /// The stream underneath; what was buffered is dropped.
    pub fn into_inner(self) -> R {
        self.inner
    }

    /// The stream underneath and the opener, its count going on, to read
    /// the rest of the direction from another stream; what was buffered
    /// is dropped (check [`buffered`](Self::buffered) first).
    pub fn into_parts(self) -> (R, Option<Opener>) {
        (self.inner, self.opener)
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for RecordReader<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.opener.is_none() && !this.plain.is_empty() {
            // Bytes taken before this reader (see `with_buffered`).
            let n = this.plain.len().min(out.remaining());
            out.put_slice(&this.buf[this.plain.start..this.plain.start + n]);
            this.plain.start += n;
            return Poll::Ready(Ok(()));
        }
        let Some(opener) = this.opener.as_mut() else {
            return Pin::new(&mut this.inner).poll_read(cx, out);
        };
        if let Some(e) = &this.failed {
            return Poll::Ready(Err(e.clone().into_io()));
        }
        loop {
            if !this.plain.is_empty() {
                let n = this.plain.len().min(out.remaining());
                out.put_slice(&this.buf[this.plain.start..this.plain.start + n]);
                this.plain.start += n;
                return Poll::Ready(Ok(()));
            }
            // A whole record in the buffer: open it.
            let have = this.end - this.start;
            // Bytes from `start` the record under way needs (its header
            // until that is in).
            let mut want = RECORD_HEADER_LEN;
            if have >= RECORD_HEADER_LEN {
                let mut header = [0u8; RECORD_HEADER_LEN];
                header.copy_from_slice(&this.buf[this.start..this.start + RECORD_HEADER_LEN]);
                let total = match opener.record_len(header) {
                    Ok(t) => t,
                    Err(e) => {
                        this.failed = Some(e.clone());
                        return Poll::Ready(Err(e.into_io()));
                    }
                };
                want = total;
                if have >= total {
                    let record = &mut this.buf[this.start..this.start + total];
                    match opener.open(record) {
                        Ok(r) => {
                            this.plain = this.start + r.start..this.start + r.end;
                            this.start += total;
                            continue;
                        }
                        Err(e) => {
                            this.failed = Some(e.clone());
                            return Poll::Ready(Err(e.into_io()));
                        }
                    }
                }
            }
            // Need more bytes (nothing checked is waiting): make room for
            // the whole record at the end, then read. The buffer grows
            // only as far as the records that arrive need.
            if this.start == this.end {
                this.start = 0;
                this.end = 0;
            } else if this.start + want > this.buf.len() {
                this.buf.copy_within(this.start..this.end, 0);
                this.end -= this.start;
                this.start = 0;
            }
            if want > this.buf.len() {
                let grown = want.next_power_of_two().min(2 * max_record_len(opener));
                this.buf.resize(grown.max(want), 0);
            }
            let seq = opener.seq();
            let mut rb = ReadBuf::new(&mut this.buf[this.end..]);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            if n == 0 {
                if this.end == this.start {
                    // A clean end between records.
                    return Poll::Ready(Ok(()));
                }
                let e = RecordError::Truncated { seq };
                this.failed = Some(e.clone());
                return Poll::Ready(Err(e.into_io()));
            }
            this.end += n;
        }
    }
}

/// The sealing half of a stream's state: the sealer and the sealed
/// bytes not yet written.
struct WriteState {
    sealer: Option<Sealer>,
    out: Vec<u8>,
    written: usize,
}

impl WriteState {
    fn new(sealer: Option<Sealer>) -> Self {
        WriteState {
            sealer,
            out: Vec::new(),
            written: 0,
        }
    }

    /// Writes out the sealed records waiting in `out`.
    fn poll_drain<W: AsyncWrite + Unpin>(
        &mut self,
        inner: &mut W,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        while self.written < self.out.len() {
            let n = ready!(Pin::new(&mut *inner).poll_write(cx, &self.out[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.out.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }

    fn poll_write_vectored<W: AsyncWrite + Unpin>(
        &mut self,
        inner: &mut W,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.sealer.is_none() {
            return Pin::new(inner).poll_write_vectored(cx, bufs);
        }
        ready!(self.poll_drain(inner, cx))?;
        // Gather up to one record's worth of the slices.
        let mut take: Vec<&[u8]> = Vec::with_capacity(bufs.len().min(64));
        let mut n = 0;
        for b in bufs {
            if n == MAX_RECORD {
                break;
            }
            let part = &b[..b.len().min(MAX_RECORD - n)];
            if !part.is_empty() {
                take.push(part);
                n += part.len();
            }
        }
        if n == 0 {
            return Poll::Ready(Ok(0));
        }
        if let Some(sealer) = self.sealer.as_mut() {
            sealer.seal(&take, &mut self.out);
        }
        // Start writing it; what the stream does not take now goes with
        // the next write or flush.
        if let Poll::Ready(Err(e)) = self.poll_drain(inner, cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush<W: AsyncWrite + Unpin>(
        &mut self,
        inner: &mut W,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(inner, cx))?;
        Pin::new(inner).poll_flush(cx)
    }

    fn poll_shutdown<W: AsyncWrite + Unpin>(
        &mut self,
        inner: &mut W,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(inner, cx))?;
        Pin::new(inner).poll_shutdown(cx)
    }
}

/// Writes data as records. Without a [`Sealer`] it writes the stream as
/// it is.
///
/// Data a write call accepted may wait in this writer until the next
/// write, flush or shutdown: callers flush when they are done (as with
/// any buffered writer).
pub struct RecordWriter<W> {
    inner: W,
    state: WriteState,
}

impl<W> RecordWriter<W> {
    /// Writes to `inner` through `sealer` (`None`: as it is).
    pub fn new(inner: W, sealer: Option<Sealer>) -> Self {
        RecordWriter {
            inner,
            state: WriteState::new(sealer),
        }
    }

    /// The stream underneath.
    pub fn get_ref(&self) -> &W {
        &self.inner
    }

    /// The stream underneath.
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }

    /// Whether records are sealed (the stream was authenticated).
    pub fn is_sealed(&self) -> bool {
        self.state.sealer.is_some()
    }

    /// The stream underneath. Call after a flush: sealed data not yet
    /// written is dropped.
    pub fn into_inner(self) -> W {
        self.inner
    }

    /// The stream underneath and the sealer, its count going on, to write
    /// the rest of the direction to another stream. Call after a flush.
    pub fn into_parts(self) -> (W, Option<Sealer>) {
        (self.inner, self.state.sealer)
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for RecordWriter<W> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.state.poll_write_vectored(&mut this.inner, cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.state.sealer.is_some() || self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.state.poll_flush(&mut this.inner, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.state.poll_shutdown(&mut this.inner, cx)
    }
}

#[cfg(test)]
mod tests;
