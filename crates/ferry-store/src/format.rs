//! The store's messages as bytes, sans-IO: pure functions from messages to
//! byte buffers and back, with the limits every decoder enforces. The TCP
//! server and client ([`TcpStoreServer`](crate::TcpStoreServer),
//! [`TcpStore`](crate::TcpStore)) only read frames off the socket and call
//! these.
//!
//! # Frames
//!
//! Every message is a frame: the body's length as a `u32` little-endian
//! (at most [`MAX_MESSAGE_BYTES`]), then the body. A request body is the
//! request id, then an opcode, then the opcode's fields; a response body is
//! the id of the request it answers, then its own opcode and fields.
//!
//! | field type | bytes |
//! |---|---|
//! | id, `u64`, `u32`, length, count, opcode | unsigned LEB128 varint (at most 10 bytes; 5 for `u32`) |
//! | `i64` | zigzag, then varint |
//! | bytes | length, then the bytes |
//! | string | length, then UTF-8 |
//! | list of strings | count, then each string |
//! | `Option<bytes>` | `0` (none) or `1` then the bytes |
//! | `bool` | `0` or `1` |
//! | duration | seconds (`u64`), then nanoseconds (`u32`, below 10⁹) |
//!
//! | request opcode | fields |
//! |---|---|
//! | 0 `Set` | key, value (bytes) |
//! | 1 `Get` | key, timeout (duration) |
//! | 2 `Wait` | keys, timeout |
//! | 3 `Add` | key, delta (`i64`) |
//! | 4 `CompareSet` | key, expected (`Option<bytes>`), desired (bytes) |
//! | 5 `Delete` | key |
//! | 6 `Check` | keys |
//!
//! | response opcode | fields |
//! |---|---|
//! | 0 `Done` | – |
//! | 1 `Value` | bytes |
//! | 2 `Counter` | `i64` |
//! | 3 `Bool` | `bool` |
//! | 4 `Failed` | failure opcode: 0 `Timeout` (keys, duration), 1 `NotACounter` (key), 2 `Overflow` (key, `i64`), 3 `Quota` (bound opcode 0–6 in [`QuotaBound`]'s order, key, limit `u64`, requested `u64`), 4 `Other` (string) |
//!
//! These are the bytes postcard gives the same messages as serde enums (the
//! store's format before it was written out here), so the two agree.
//!
//! # Limits
//!
//! A length prefix over [`MAX_MESSAGE_BYTES`] is refused before anything
//! is allocated ([`body_len`]); inside a body, a length or count larger
//! than the bytes left is refused before allocating; an unknown opcode, a
//! string that is not UTF-8, a bad tag, an overlong varint and trailing
//! bytes each give their own [`FormatError`] naming the field. No input
//! panics.
//!
//! ```
//! use std::time::Duration;
//! use ferry_store::format::{self, Request, RequestFrame};
//!
//! let frame = RequestFrame {
//!     id: 7,
//!     request: Request::Get { key: "worker/0".into(), timeout: Duration::from_secs(5) },
//! };
//! let bytes = format::encode_request(&frame)?;
//! let (body, used) = format::split_frame(&bytes)?.expect("a whole frame");
//! assert_eq!(used, bytes.len());
//! assert_eq!(format::decode_request(body)?, frame);
//! # Ok::<(), format::FormatError>(())
//! ```

use std::time::Duration;

use crate::{QuotaBound, StoreError};

/// The largest message (frame body) either side sends or accepts: 64 MiB.
/// A larger length prefix closes the connection before anything is
/// allocated; a larger message is refused before it is sent.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// The bytes of a frame's length prefix.
pub const LENGTH_PREFIX_BYTES: usize = 4;

/// A request and the id its response repeats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestFrame {
    /// Chosen by the client, unique among its requests in flight.
    pub id: u64,
    /// What is asked.
    pub request: Request,
}

/// One operation of the [`Store`](crate::Store) trait, as a client sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// [`Store::set`](crate::Store::set).
    Set {
        /// The key.
        key: String,
        /// Its new value.
        value: Vec<u8>,
    },
    /// [`Store::get`](crate::Store::get), waiting on the server at most
    /// `timeout` for the key.
    Get {
        /// The key.
        key: String,
        /// How long the server waits for the key.
        timeout: Duration,
    },
    /// [`Store::wait`](crate::Store::wait).
    Wait {
        /// The keys waited for.
        keys: Vec<String>,
        /// How long the server waits for them.
        timeout: Duration,
    },
    /// [`Store::add`](crate::Store::add).
    Add {
        /// The counter.
        key: String,
        /// What to add.
        delta: i64,
    },
    /// [`Store::compare_set`](crate::Store::compare_set).
    CompareSet {
        /// The key.
        key: String,
        /// The value it must hold (`None`: absent).
        expected: Option<Vec<u8>>,
        /// The value to store.
        desired: Vec<u8>,
    },
    /// [`Store::delete`](crate::Store::delete).
    Delete {
        /// The key.
        key: String,
    },
    /// [`Store::check`](crate::Store::check).
    Check {
        /// The keys checked.
        keys: Vec<String>,
    },
}

/// A response and the id of the request it answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseFrame {
    /// The id of the request answered.
    pub id: u64,
    /// The answer.
    pub response: Response,
}

/// The server's answer to a [`Request`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// Done, nothing to return (`set`, `wait`).
    Done,
    /// A value (`get`, `compare_set`).
    Value(Vec<u8>),
    /// A counter's new value (`add`).
    Counter(i64),
    /// A yes or no (`delete`, `check`).
    Bool(bool),
    /// The request failed.
    Failed(Failure),
}

/// A [`StoreError`] as the server reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// [`StoreError::Timeout`].
    Timeout {
        /// The keys still missing.
        keys: Vec<String>,
        /// How long was waited.
        after: Duration,
    },
    /// [`StoreError::NotACounter`].
    NotACounter {
        /// The key.
        key: String,
    },
    /// [`StoreError::Overflow`].
    Overflow {
        /// The key.
        key: String,
        /// The delta that did not fit.
        delta: i64,
    },
    /// [`StoreError::Quota`].
    Quota {
        /// The bound that would be exceeded.
        bound: QuotaBound,
        /// The (first) key of the request.
        key: String,
        /// The bound's limit.
        limit: u64,
        /// What the request would have brought it to.
        requested: u64,
    },
    /// Any other error, as text.
    Other(String),
}

/// Why bytes are not a store message (or a message cannot be encoded).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// A message (frame body) over [`MAX_MESSAGE_BYTES`].
    #[error("a store message of {len} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// The message's length (from the length prefix, or as encoded).
        len: u64,
        /// The limit, [`MAX_MESSAGE_BYTES`].
        limit: usize,
    },
    /// The message ends inside a field.
    #[error("the store message ends inside its {field}: {needed} bytes needed, {available} left")]
    Truncated {
        /// The field being read.
        field: &'static str,
        /// The bytes it needs (a length or count read off the wire may be
        /// absurd).
        needed: u64,
        /// The bytes left in the message.
        available: usize,
    },
    /// An opcode no message of this kind has.
    #[error("unknown store {kind} opcode {opcode}")]
    UnknownOpcode {
        /// `request`, `response`, `failure` or `quota bound`.
        kind: &'static str,
        /// The opcode read.
        opcode: u64,
    },
    /// A varint longer than its type allows, or beyond its range.
    #[error("the {field} of a store message is a malformed varint (too long or out of range)")]
    BadVarint {
        /// The field being read.
        field: &'static str,
    },
    /// A string that is not UTF-8.
    #[error("the {field} of a store message is not UTF-8")]
    NotUtf8 {
        /// The field being read.
        field: &'static str,
    },
    /// A `bool` or `Option` tag other than 0 and 1.
    #[error("the {field} of a store message has tag {tag} (0 or 1 expected)")]
    BadTag {
        /// The field being read.
        field: &'static str,
        /// The byte read.
        tag: u8,
    },
    /// A duration with a billion nanoseconds or more.
    #[error("the {field} of a store message has {nanos} nanoseconds (at most 999999999)")]
    BadNanos {
        /// The field being read.
        field: &'static str,
        /// The nanoseconds read.
        nanos: u32,
    },
    /// Bytes after the end of a whole message.
    #[error("{count} bytes follow the end of the store message")]
    TrailingBytes {
        /// How many.
        count: usize,
    },
}

// ---------------------------------------------------------------------------
// Frames
// ---------------------------------------------------------------------------

/// The body length a frame's length prefix announces, refused over
/// [`MAX_MESSAGE_BYTES`].
pub fn body_len(prefix: [u8; LENGTH_PREFIX_BYTES]) -> Result<usize, FormatError> {
    let len = u32::from_le_bytes(prefix);
    match usize::try_from(len) {
        Ok(len) if len <= MAX_MESSAGE_BYTES => Ok(len),
        _ => Err(FormatError::TooLarge {
            len: len.into(),
            limit: MAX_MESSAGE_BYTES,
        }),
    }
}

/// The first frame of `bytes`: its body and the bytes it takes (prefix
/// included), or `None` while it is incomplete. An oversized length
/// prefix is an error at once.
pub fn split_frame(bytes: &[u8]) -> Result<Option<(&[u8], usize)>, FormatError> {
    let Some((prefix, rest)) = bytes.split_first_chunk::<LENGTH_PREFIX_BYTES>() else {
        return Ok(None);
    };
    let len = body_len(*prefix)?;
    Ok(rest
        .get(..len)
        .map(|body| (body, LENGTH_PREFIX_BYTES + len)))
}

/// Encodes `frame` with its length prefix; refuses a message over
/// [`MAX_MESSAGE_BYTES`].
pub fn encode_request(frame: &RequestFrame) -> Result<Vec<u8>, FormatError> {
    let mut out = begin_frame();
    put_varint(&mut out, frame.id);
    match &frame.request {
        Request::Set { key, value } => {
            put_varint(&mut out, 0);
            put_bytes(&mut out, key.as_bytes());
            put_bytes(&mut out, value);
        }
        Request::Get { key, timeout } => {
            put_varint(&mut out, 1);
            put_bytes(&mut out, key.as_bytes());
            put_duration(&mut out, *timeout);
        }
        Request::Wait { keys, timeout } => {
            put_varint(&mut out, 2);
            put_strings(&mut out, keys);
            put_duration(&mut out, *timeout);
        }
        Request::Add { key, delta } => {
            put_varint(&mut out, 3);
            put_bytes(&mut out, key.as_bytes());
            put_i64(&mut out, *delta);
        }
        Request::CompareSet {
            key,
            expected,
            desired,
        } => {
            put_varint(&mut out, 4);
            put_bytes(&mut out, key.as_bytes());
            match expected {
                None => out.push(0),
                Some(v) => {
                    out.push(1);
                    put_bytes(&mut out, v);
                }
            }
            put_bytes(&mut out, desired);
        }
        Request::Delete { key } => {
            put_varint(&mut out, 5);
            put_bytes(&mut out, key.as_bytes());
        }
        Request::Check { keys } => {
            put_varint(&mut out, 6);
            put_strings(&mut out, keys);
        }
    }
    end_frame(out)
}

/// Decodes a request body (the frame without its length prefix).
pub fn decode_request(body: &[u8]) -> Result<RequestFrame, FormatError> {
    let mut r = Reader { rest: body };
    let id = r.varint("request id")?;
    let request = match r.varint("request opcode")? {
        0 => Request::Set {
            key: r.string("key")?,
            value: r.bytes("value")?,
        },
        1 => Request::Get {
            key: r.string("key")?,
            timeout: r.duration("timeout")?,
        },
        2 => Request::Wait {
            keys: r.strings("keys")?,
            timeout: r.duration("timeout")?,
        },
        3 => Request::Add {
            key: r.string("key")?,
            delta: r.i64("delta")?,
        },
        4 => Request::CompareSet {
            key: r.string("key")?,
            expected: r.option_bytes("expected value")?,
            desired: r.bytes("desired value")?,
        },
        5 => Request::Delete {
            key: r.string("key")?,
        },
        6 => Request::Check {
            keys: r.strings("keys")?,
        },
        opcode => {
            return Err(FormatError::UnknownOpcode {
                kind: "request",
                opcode,
            })
        }
    };
    r.finish()?;
    Ok(RequestFrame { id, request })
}

/// Encodes `frame` with its length prefix; refuses a message over
/// [`MAX_MESSAGE_BYTES`].
pub fn encode_response(frame: &ResponseFrame) -> Result<Vec<u8>, FormatError> {
    let mut out = begin_frame();
    put_varint(&mut out, frame.id);
    match &frame.response {
        Response::Done => put_varint(&mut out, 0),
        Response::Value(v) => {
            put_varint(&mut out, 1);
            put_bytes(&mut out, v);
        }
        Response::Counter(n) => {
            put_varint(&mut out, 2);
            put_i64(&mut out, *n);
        }
        Response::Bool(b) => {
            put_varint(&mut out, 3);
            out.push(u8::from(*b));
        }
        Response::Failed(failure) => {
            put_varint(&mut out, 4);
            put_failure(&mut out, failure);
        }
    }
    end_frame(out)
}

/// Decodes a response body (the frame without its length prefix).
pub fn decode_response(body: &[u8]) -> Result<ResponseFrame, FormatError> {
    let mut r = Reader { rest: body };
    let id = r.varint("response id")?;
    let response = match r.varint("response opcode")? {
        0 => Response::Done,
        1 => Response::Value(r.bytes("value")?),
        2 => Response::Counter(r.i64("counter")?),
        3 => Response::Bool(r.bool("answer")?),
        4 => Response::Failed(r.failure()?),
        opcode => {
            return Err(FormatError::UnknownOpcode {
                kind: "response",
                opcode,
            })
        }
    };
    r.finish()?;
    Ok(ResponseFrame { id, response })
}

// ---------------------------------------------------------------------------
// Failures and store errors
// ---------------------------------------------------------------------------

const QUOTA_BOUNDS: [QuotaBound; 7] = [
    QuotaBound::KeyBytes,
    QuotaBound::ValueBytes,
    QuotaBound::ConnectionKeys,
    QuotaBound::ConnectionBytes,
    QuotaBound::ConnectionWaits,
    QuotaBound::TotalKeys,
    QuotaBound::TotalBytes,
];

fn quota_opcode(bound: QuotaBound) -> u64 {
    match bound {
        QuotaBound::KeyBytes => 0,
        QuotaBound::ValueBytes => 1,
        QuotaBound::ConnectionKeys => 2,
        QuotaBound::ConnectionBytes => 3,
        QuotaBound::ConnectionWaits => 4,
        QuotaBound::TotalKeys => 5,
        QuotaBound::TotalBytes => 6,
    }
}

fn put_failure(out: &mut Vec<u8>, failure: &Failure) {
    match failure {
        Failure::Timeout { keys, after } => {
            put_varint(out, 0);
            put_strings(out, keys);
            put_duration(out, *after);
        }
        Failure::NotACounter { key } => {
            put_varint(out, 1);
            put_bytes(out, key.as_bytes());
        }
        Failure::Overflow { key, delta } => {
            put_varint(out, 2);
            put_bytes(out, key.as_bytes());
            put_i64(out, *delta);
        }
        Failure::Quota {
            bound,
            key,
            limit,
            requested,
        } => {
            put_varint(out, 3);
            put_varint(out, quota_opcode(*bound));
            put_bytes(out, key.as_bytes());
            put_varint(out, *limit);
            put_varint(out, *requested);
        }
        Failure::Other(message) => {
            put_varint(out, 4);
            put_bytes(out, message.as_bytes());
        }
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Timeout { keys, after } => Failure::Timeout { keys, after },
            StoreError::NotACounter { key } => Failure::NotACounter { key },
            StoreError::Overflow { key, delta } => Failure::Overflow { key, delta },
            StoreError::Quota {
                bound,
                key,
                limit,
                requested,
            } => Failure::Quota {
                bound,
                key,
                limit,
                requested,
            },
            other => Failure::Other(other.to_string()),
        }
    }
}

impl From<Failure> for StoreError {
    fn from(f: Failure) -> Self {
        match f {
            Failure::Timeout { keys, after } => StoreError::Timeout { keys, after },
            Failure::NotACounter { key } => StoreError::NotACounter { key },
            Failure::Overflow { key, delta } => StoreError::Overflow { key, delta },
            Failure::Quota {
                bound,
                key,
                limit,
                requested,
            } => StoreError::Quota {
                bound,
                key,
                limit,
                requested,
            },
            Failure::Other(message) => StoreError::Protocol(format!("store server: {message}")),
        }
    }
}

// ---------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------

/// A buffer with room for the length prefix.
fn begin_frame() -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&[0; LENGTH_PREFIX_BYTES]);
    out
}

/// Fills in the length prefix, refusing an oversized body.
fn end_frame(mut out: Vec<u8>) -> Result<Vec<u8>, FormatError> {
    let len = out.len() - LENGTH_PREFIX_BYTES;
    let prefix = u32::try_from(len)
        .ok()
        .filter(|_| len <= MAX_MESSAGE_BYTES)
        .ok_or(FormatError::TooLarge {
            len: len as u64,
            limit: MAX_MESSAGE_BYTES,
        })?;
    out[..LENGTH_PREFIX_BYTES].copy_from_slice(&prefix.to_le_bytes());
    Ok(out)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_i64(out: &mut Vec<u8>, v: i64) {
    put_varint(out, ((v << 1) ^ (v >> 63)) as u64);
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn put_strings(out: &mut Vec<u8>, strings: &[String]) {
    put_varint(out, strings.len() as u64);
    for s in strings {
        put_bytes(out, s.as_bytes());
    }
}

fn put_duration(out: &mut Vec<u8>, d: Duration) {
    put_varint(out, d.as_secs());
    put_varint(out, d.subsec_nanos().into());
}

// ---------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------

/// The unread rest of a message body.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, field: &'static str, n: u64) -> Result<&'a [u8], FormatError> {
        let truncated = FormatError::Truncated {
            field,
            needed: n,
            available: self.rest.len(),
        };
        let n = usize::try_from(n).map_err(|_| truncated.clone())?;
        if n > self.rest.len() {
            return Err(truncated);
        }
        let (taken, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(taken)
    }

    fn byte(&mut self, field: &'static str) -> Result<u8, FormatError> {
        Ok(self.take(field, 1)?[0])
    }

    /// An unsigned LEB128 varint of at most 10 bytes within `u64`.
    fn varint(&mut self, field: &'static str) -> Result<u64, FormatError> {
        let mut value = 0u64;
        for i in 0..10 {
            let b = self.byte(field)?;
            let bits = u64::from(b & 0x7f);
            // The tenth byte holds bit 63 only.
            if i == 9 && bits > 1 {
                return Err(FormatError::BadVarint { field });
            }
            value |= bits << (7 * i);
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(FormatError::BadVarint { field })
    }

    fn varint_u32(&mut self, field: &'static str) -> Result<u32, FormatError> {
        u32::try_from(self.varint(field)?).map_err(|_| FormatError::BadVarint { field })
    }

    fn i64(&mut self, field: &'static str) -> Result<i64, FormatError> {
        let z = self.varint(field)?;
        Ok(((z >> 1) as i64) ^ -((z & 1) as i64))
    }

    fn bool(&mut self, field: &'static str) -> Result<bool, FormatError> {
        match self.byte(field)? {
            0 => Ok(false),
            1 => Ok(true),
            tag => Err(FormatError::BadTag { field, tag }),
        }
    }

    /// Length-prefixed bytes, borrowed.
    fn slice(&mut self, field: &'static str) -> Result<&'a [u8], FormatError> {
        let len = self.varint(field)?;
        self.take(field, len)
    }

    fn bytes(&mut self, field: &'static str) -> Result<Vec<u8>, FormatError> {
        Ok(self.slice(field)?.to_vec())
    }

    fn string(&mut self, field: &'static str) -> Result<String, FormatError> {
        let bytes = self.slice(field)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| FormatError::NotUtf8 { field })
    }

    fn strings(&mut self, field: &'static str) -> Result<Vec<String>, FormatError> {
        let count = self.varint(field)?;
        // Every string takes at least its length byte: refuse an absurd
        // count before allocating for it.
        if count > self.rest.len() as u64 {
            return Err(FormatError::Truncated {
                field,
                needed: count,
                available: self.rest.len(),
            });
        }
        (0..count).map(|_| self.string(field)).collect()
    }

    fn option_bytes(&mut self, field: &'static str) -> Result<Option<Vec<u8>>, FormatError> {
        match self.byte(field)? {
            0 => Ok(None),
            1 => self.bytes(field).map(Some),
            tag => Err(FormatError::BadTag { field, tag }),
        }
    }

    fn duration(&mut self, field: &'static str) -> Result<Duration, FormatError> {
        let secs = self.varint(field)?;
        let nanos = self.varint_u32(field)?;
        if nanos >= 1_000_000_000 {
            return Err(FormatError::BadNanos { field, nanos });
        }
        Ok(Duration::new(secs, nanos))
    }

    fn failure(&mut self) -> Result<Failure, FormatError> {
        Ok(match self.varint("failure opcode")? {
            0 => Failure::Timeout {
                keys: self.strings("keys")?,
                after: self.duration("timeout")?,
            },
            1 => Failure::NotACounter {
                key: self.string("key")?,
            },
            2 => Failure::Overflow {
                key: self.string("key")?,
                delta: self.i64("delta")?,
            },
            3 => {
                let opcode = self.varint("quota bound")?;
                let bound = usize::try_from(opcode)
                    .ok()
                    .and_then(|i| QUOTA_BOUNDS.get(i))
                    .copied()
                    .ok_or(FormatError::UnknownOpcode {
                        kind: "quota bound",
                        opcode,
                    })?;
                Failure::Quota {
                    bound,
                    key: self.string("key")?,
                    limit: self.varint("limit")?,
                    requested: self.varint("requested amount")?,
                }
            }
            4 => Failure::Other(self.string("message")?),
            opcode => {
                return Err(FormatError::UnknownOpcode {
                    kind: "failure",
                    opcode,
                })
            }
        })
    }

    /// Refuses bytes left after a whole message.
    fn finish(self) -> Result<(), FormatError> {
        match self.rest.len() {
            0 => Ok(()),
            count => Err(FormatError::TrailingBytes { count }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quota_opcodes_follow_the_table() {
        for (i, bound) in QUOTA_BOUNDS.iter().enumerate() {
            assert_eq!(quota_opcode(*bound), i as u64);
        }
    }

    #[test]
    fn varints_at_the_edges() {
        for v in [0, 1, 127, 128, 16383, 16384, u64::from(u32::MAX), u64::MAX] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            let mut r = Reader { rest: &out };
            assert_eq!(r.varint("v").unwrap(), v);
            assert!(r.rest.is_empty());
        }
        // u64::MAX + 1 does not fit: the tenth byte may only hold bit 63.
        let over = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02];
        assert_eq!(
            Reader { rest: &over }.varint("v"),
            Err(FormatError::BadVarint { field: "v" })
        );
        let long = [0x80; 11];
        assert_eq!(
            Reader { rest: &long }.varint("v"),
            Err(FormatError::BadVarint { field: "v" })
        );
        for v in [0i64, -1, 1, i64::MIN, i64::MAX] {
            let mut out = Vec::new();
            put_i64(&mut out, v);
            assert_eq!(Reader { rest: &out }.i64("d").unwrap(), v);
        }
    }
}
