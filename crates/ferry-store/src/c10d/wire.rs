//! c10d `TCPStore`'s bytes, sans-IO: pure functions from queries and
//! replies to bytes and back.
//!
//! The protocol has no frames: a query is its type (one byte), then its
//! fields; a reply is its fields only, and which fields depends on the
//! query it answers ([`ReplyKind`]). Decoders therefore work on a growing
//! buffer: `Ok(None)` means "not whole yet, read more", `Ok(Some((value,
//! used)))` gives the value and how many bytes it took.
//!
//! | field | bytes |
//! |---|---|
//! | query type, check and wait replies | `u8` |
//! | string (key), bytes (value) | length as `u64`, then the bytes |
//! | key count | `u64` |
//! | counter, key count reply, deleted count | `i64` |
//! | magic, ping nonce | `u32` |
//!
//! Integers are little-endian (PyTorch writes them in host order; every
//! platform it runs on is little-endian).
//!
//! | query type | fields | reply |
//! |---|---|---|
//! | 0 `VALIDATE` | magic ([`VALIDATION_MAGIC`]) | – |
//! | 1 `SET` | key, value | – |
//! | 2 `COMPARE_SET` | key, expected, desired | value |
//! | 3 `GET` | key | value |
//! | 4 `ADD` | key, delta | counter |
//! | 5 `CHECK` | count, keys | `0` ready, `1` not ready |
//! | 6 `WAIT` | count, keys | `0` (stop waiting), once every key exists |
//! | 7 `GETNUMKEYS` | – | count |
//! | 8 `DELETE_KEY` | key | number deleted |
//! | 9 `APPEND` | key, value | – |
//! | 10 `MULTI_GET` | count, keys | one value per key |
//! | 11 `MULTI_SET` | count, (key, value) pairs | – |
//! | 12 `CANCEL_WAIT` | – | `1` (wait canceled) |
//! | 13 `PING` | nonce | the nonce |
//! | 14 `QUEUE_PUSH` | key, value | – |
//! | 15 `QUEUE_POP` | key | (not decoded here) |
//! | 16 `QUEUE_LEN` | key | count |
//! | 17 `LIST_KEYS` | – | count, keys |
//!
//! A connection's first query must be `VALIDATE` with the magic number;
//! the libuv server (PyTorch's default) ignores a connection until then.
//!
//! # Limits
//!
//! A length over [`MAX_FIELD_BYTES`], a key count over [`MAX_KEYS`], a
//! whole query over [`MAX_QUERY_BYTES`], an unknown query type, a key that
//! is not UTF-8 and a reply byte other than 0 or 1 each give their own
//! [`C10dFormatError`] before anything is allocated for them. No input
//! panics.
//!
//! ```
//! use ferry_store::c10d::wire::{self, Query};
//!
//! let query = Query::Add { key: "/joined".into(), delta: 1 };
//! let bytes = wire::encode_query(&query)?;
//! assert_eq!(bytes[0], 4); // ADD
//! assert_eq!(wire::decode_query(&bytes[..3])?, None); // not whole yet
//! assert_eq!(wire::decode_query(&bytes)?, Some((query, bytes.len())));
//! # Ok::<(), ferry_store::c10d::C10dFormatError>(())
//! ```

/// The number a client sends in its first query, `VALIDATE`.
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// The prefix PyTorch's `TCPStore` client puts before every key a user
/// gives it (`store.set("a", …)` sends `"/a"`). Ferry's
/// [`C10dStore`](super::C10dStore) adds it too, so both see the same keys.
pub const KEY_PREFIX: &str = "/";

/// The longest string or value a query or reply may carry: 64 MiB.
pub const MAX_FIELD_BYTES: usize = crate::MAX_MESSAGE_BYTES;

/// The most bytes one whole query may take.
pub const MAX_QUERY_BYTES: usize = crate::MAX_MESSAGE_BYTES;

/// The most keys one query (or `LIST_KEYS` reply) may name.
pub const MAX_KEYS: u64 = 1 << 20;

/// The query types, as their first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum QueryType {
    /// `VALIDATE`.
    Validate = 0,
    /// `SET`.
    Set = 1,
    /// `COMPARE_SET`.
    CompareSet = 2,
    /// `GET`.
    Get = 3,
    /// `ADD`.
    Add = 4,
    /// `CHECK`.
    Check = 5,
    /// `WAIT`.
    Wait = 6,
    /// `GETNUMKEYS`.
    NumKeys = 7,
    /// `DELETE_KEY`.
    DeleteKey = 8,
    /// `APPEND`.
    Append = 9,
    /// `MULTI_GET`.
    MultiGet = 10,
    /// `MULTI_SET`.
    MultiSet = 11,
    /// `CANCEL_WAIT`.
    CancelWait = 12,
    /// `PING`.
    Ping = 13,
    /// `QUEUE_PUSH`.
    QueuePush = 14,
    /// `QUEUE_POP`.
    QueuePop = 15,
    /// `QUEUE_LEN`.
    QueueLen = 16,
    /// `LIST_KEYS`.
    ListKeys = 17,
}

impl QueryType {
    /// The type whose byte is `b`.
    pub fn from_byte(b: u8) -> Option<QueryType> {
        use QueryType::*;
        Some(match b {
            0 => Validate,
            1 => Set,
            2 => CompareSet,
            3 => Get,
            4 => Add,
            5 => Check,
            6 => Wait,
            7 => NumKeys,
            8 => DeleteKey,
            9 => Append,
            10 => MultiGet,
            11 => MultiSet,
            12 => CancelWait,
            13 => Ping,
            14 => QueuePush,
            15 => QueuePop,
            16 => QueueLen,
            17 => ListKeys,
            _ => return None,
        })
    }
}

/// A query, as a client sends it. Keys are sent as given: the client adds
/// [`KEY_PREFIX`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Query {
    /// The first query of every connection.
    Validate {
        /// Must be [`VALIDATION_MAGIC`].
        magic: u32,
    },
    /// Store `value` under `key`.
    Set {
        /// The key.
        key: String,
        /// The value.
        value: Vec<u8>,
    },
    /// Store `desired` if `key` holds `expected` (empty: absent); the
    /// reply is the value held afterwards.
    CompareSet {
        /// The key.
        key: String,
        /// The value it must hold; empty also matches an absent key.
        expected: Vec<u8>,
        /// The value to store.
        desired: Vec<u8>,
    },
    /// The value of `key` (the client waits for it first).
    Get {
        /// The key.
        key: String,
    },
    /// Add `delta` to the decimal counter `key`.
    Add {
        /// The counter.
        key: String,
        /// What to add.
        delta: i64,
    },
    /// Whether every key exists.
    Check {
        /// The keys.
        keys: Vec<String>,
    },
    /// Answer once every key exists (or the wait is canceled).
    Wait {
        /// The keys.
        keys: Vec<String>,
    },
    /// How many keys the store holds.
    NumKeys,
    /// Remove `key`.
    DeleteKey {
        /// The key.
        key: String,
    },
    /// Append `value` to the value of `key` (absent: empty).
    Append {
        /// The key.
        key: String,
        /// The bytes appended.
        value: Vec<u8>,
    },
    /// The values of several keys.
    MultiGet {
        /// The keys.
        keys: Vec<String>,
    },
    /// Store several keys.
    MultiSet {
        /// `(key, value)` pairs.
        entries: Vec<(String, Vec<u8>)>,
    },
    /// Cancel this connection's pending `WAIT`.
    CancelWait,
    /// Echo `nonce`.
    Ping {
        /// Any number.
        nonce: u32,
    },
    /// Push `value` onto the queue `key`.
    QueuePush {
        /// The queue.
        key: String,
        /// The element.
        value: Vec<u8>,
    },
    /// Pop from the queue `key`.
    QueuePop {
        /// The queue.
        key: String,
    },
    /// The length of the queue `key`.
    QueueLen {
        /// The queue.
        key: String,
    },
    /// Every key in the store.
    ListKeys,
}

impl Query {
    /// Its type.
    pub fn query_type(&self) -> QueryType {
        match self {
            Query::Validate { .. } => QueryType::Validate,
            Query::Set { .. } => QueryType::Set,
            Query::CompareSet { .. } => QueryType::CompareSet,
            Query::Get { .. } => QueryType::Get,
            Query::Add { .. } => QueryType::Add,
            Query::Check { .. } => QueryType::Check,
            Query::Wait { .. } => QueryType::Wait,
            Query::NumKeys => QueryType::NumKeys,
            Query::DeleteKey { .. } => QueryType::DeleteKey,
            Query::Append { .. } => QueryType::Append,
            Query::MultiGet { .. } => QueryType::MultiGet,
            Query::MultiSet { .. } => QueryType::MultiSet,
            Query::CancelWait => QueryType::CancelWait,
            Query::Ping { .. } => QueryType::Ping,
            Query::QueuePush { .. } => QueryType::QueuePush,
            Query::QueuePop { .. } => QueryType::QueuePop,
            Query::QueueLen { .. } => QueryType::QueueLen,
            Query::ListKeys => QueryType::ListKeys,
        }
    }

    /// The shape of the reply the server sends to it, if any (the reply
    /// to `WAIT` may come much later).
    pub fn reply_kind(&self) -> Option<ReplyKind> {
        Some(match self {
            Query::Validate { .. }
            | Query::Set { .. }
            | Query::Append { .. }
            | Query::MultiSet { .. }
            | Query::QueuePush { .. }
            | Query::QueuePop { .. } => return None,
            Query::CompareSet { .. } | Query::Get { .. } => ReplyKind::Value,
            Query::Add { .. }
            | Query::NumKeys
            | Query::DeleteKey { .. }
            | Query::QueueLen { .. } => ReplyKind::Int,
            Query::Check { .. } => ReplyKind::Check,
            Query::Wait { .. } | Query::CancelWait => ReplyKind::Wait,
            Query::MultiGet { keys } => ReplyKind::Values { count: keys.len() },
            Query::Ping { .. } => ReplyKind::Nonce,
            Query::ListKeys => ReplyKind::Keys,
        })
    }
}

/// The answer to a `WAIT` or `CANCEL_WAIT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitReply {
    /// `0`: every key waited for exists.
    StopWaiting,
    /// `1`: the wait was canceled.
    WaitCanceled,
}

/// A reply, as the server sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// A value (`GET`, `COMPARE_SET`).
    Value(Vec<u8>),
    /// A number (`ADD`, `GETNUMKEYS`, `DELETE_KEY`, `QUEUE_LEN`).
    Int(i64),
    /// `CHECK`'s answer: `true` if every key exists.
    Check(bool),
    /// `WAIT`'s or `CANCEL_WAIT`'s answer.
    Wait(WaitReply),
    /// `MULTI_GET`'s values, one per key.
    Values(Vec<Vec<u8>>),
    /// `PING`'s nonce.
    Nonce(u32),
    /// `LIST_KEYS`'s keys.
    Keys(Vec<String>),
}

/// Which [`Reply`] a query expects (the bytes do not say).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyKind {
    /// [`Reply::Value`].
    Value,
    /// [`Reply::Int`].
    Int,
    /// [`Reply::Check`].
    Check,
    /// [`Reply::Wait`].
    Wait,
    /// [`Reply::Values`], `count` of them.
    Values {
        /// How many values.
        count: usize,
    },
    /// [`Reply::Nonce`].
    Nonce,
    /// [`Reply::Keys`].
    Keys,
}

/// Why bytes are not a c10d query or reply, or why a peer broke the
/// protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum C10dFormatError {
    /// A first byte that is no query type.
    #[error("unknown c10d store query type {0}")]
    UnknownQuery(u8),
    /// A string or value longer than [`MAX_FIELD_BYTES`].
    #[error("the {field} of a c10d store message is {len} bytes long, over the limit of {limit}")]
    TooLarge {
        /// The field.
        field: &'static str,
        /// Its length as sent.
        len: u64,
        /// The limit.
        limit: usize,
    },
    /// A query over [`MAX_QUERY_BYTES`] in all.
    #[error("a c10d store query of more than {limit} bytes")]
    QueryTooLarge {
        /// The limit.
        limit: usize,
    },
    /// More keys than [`MAX_KEYS`].
    #[error("a c10d store message names {count} keys, over the limit of {limit}")]
    TooManyKeys {
        /// The count as sent.
        count: u64,
        /// The limit.
        limit: u64,
    },
    /// A key that is not UTF-8.
    #[error("the {field} of a c10d store message is not UTF-8")]
    NotUtf8 {
        /// The field.
        field: &'static str,
    },
    /// A reply byte other than the two the reply may hold.
    #[error("the c10d store's {field} reply is byte {byte} (0 or 1 expected)")]
    BadReplyByte {
        /// `check` or `wait`.
        field: &'static str,
        /// The byte.
        byte: u8,
    },
    /// A client whose first query is not `VALIDATE`.
    #[error("a c10d store client sent {0:?} before VALIDATE")]
    NotValidated(QueryType),
    /// A `VALIDATE` with the wrong number.
    #[error("a c10d store client validated with magic {0:#010x}, not {VALIDATION_MAGIC:#010x}")]
    BadMagic(u32),
}

// ---------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------

type Decoded<T> = Result<Option<T>, C10dFormatError>;

/// A position in a buffer that may end early.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// `?` for "not whole yet".
macro_rules! need {
    ($e:expr) => {
        match $e? {
            Some(v) => v,
            None => return Ok(None),
        }
    };
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Decoded<&'a [u8]> {
        let end = self.pos.saturating_add(n);
        if end > MAX_QUERY_BYTES.saturating_add(16) {
            return Err(C10dFormatError::QueryTooLarge {
                limit: MAX_QUERY_BYTES,
            });
        }
        match self.buf.get(self.pos..end) {
            Some(s) => {
                self.pos = end;
                Ok(Some(s))
            }
            None => Ok(None),
        }
    }

    fn array<const N: usize>(&mut self) -> Decoded<[u8; N]> {
        let s = need!(self.take(N));
        let mut a = [0; N];
        a.copy_from_slice(s);
        Ok(Some(a))
    }

    fn u8(&mut self) -> Decoded<u8> {
        Ok(Some(need!(self.array::<1>())[0]))
    }

    fn u32(&mut self) -> Decoded<u32> {
        Ok(Some(u32::from_le_bytes(need!(self.array()))))
    }

    fn u64(&mut self) -> Decoded<u64> {
        Ok(Some(u64::from_le_bytes(need!(self.array()))))
    }

    fn i64(&mut self) -> Decoded<i64> {
        Ok(Some(i64::from_le_bytes(need!(self.array()))))
    }

    fn bytes(&mut self, field: &'static str) -> Decoded<Vec<u8>> {
        let len = need!(self.u64());
        if len > MAX_FIELD_BYTES as u64 {
            return Err(C10dFormatError::TooLarge {
                field,
                len,
                limit: MAX_FIELD_BYTES,
            });
        }
        Ok(Some(need!(self.take(len as usize)).to_vec()))
    }

    fn string(&mut self, field: &'static str) -> Decoded<String> {
        let bytes = need!(self.bytes(field));
        String::from_utf8(bytes)
            .map(Some)
            .map_err(|_| C10dFormatError::NotUtf8 { field })
    }

    fn count(&mut self) -> Decoded<usize> {
        let count = need!(self.u64());
        if count > MAX_KEYS {
            return Err(C10dFormatError::TooManyKeys {
                count,
                limit: MAX_KEYS,
            });
        }
        Ok(Some(count as usize))
    }

    fn keys(&mut self) -> Decoded<Vec<String>> {
        let count = need!(self.count());
        let mut keys = Vec::with_capacity(count.min(1024));
        for _ in 0..count {
            keys.push(need!(self.string("key")));
        }
        Ok(Some(keys))
    }
}

/// Decodes the query at the start of `buf`: `Ok(None)` if it is not whole
/// yet, else the query and the bytes it took.
pub fn decode_query(buf: &[u8]) -> Decoded<(Query, usize)> {
    let mut r = Reader { buf, pos: 0 };
    let byte = need!(r.u8());
    let ty = QueryType::from_byte(byte).ok_or(C10dFormatError::UnknownQuery(byte))?;
    let query = match ty {
        QueryType::Validate => Query::Validate {
            magic: need!(r.u32()),
        },
        QueryType::Set => Query::Set {
            key: need!(r.string("key")),
            value: need!(r.bytes("value")),
        },
        QueryType::CompareSet => Query::CompareSet {
            key: need!(r.string("key")),
            expected: need!(r.bytes("expected value")),
            desired: need!(r.bytes("desired value")),
        },
        QueryType::Get => Query::Get {
            key: need!(r.string("key")),
        },
        QueryType::Add => Query::Add {
            key: need!(r.string("key")),
            delta: need!(r.i64()),
        },
        QueryType::Check => Query::Check {
            keys: need!(r.keys()),
        },
        QueryType::Wait => Query::Wait {
            keys: need!(r.keys()),
        },
        QueryType::NumKeys => Query::NumKeys,
        QueryType::DeleteKey => Query::DeleteKey {
            key: need!(r.string("key")),
        },
        QueryType::Append => Query::Append {
            key: need!(r.string("key")),
            value: need!(r.bytes("value")),
        },
        QueryType::MultiGet => Query::MultiGet {
            keys: need!(r.keys()),
        },
        QueryType::MultiSet => {
            let count = need!(r.count());
            let mut entries = Vec::with_capacity(count.min(1024));
            for _ in 0..count {
                let key = need!(r.string("key"));
                let value = need!(r.bytes("value"));
                entries.push((key, value));
            }
            Query::MultiSet { entries }
        }
        QueryType::CancelWait => Query::CancelWait,
        QueryType::Ping => Query::Ping {
            nonce: need!(r.u32()),
        },
        QueryType::QueuePush => Query::QueuePush {
            key: need!(r.string("key")),
            value: need!(r.bytes("value")),
        },
        QueryType::QueuePop => Query::QueuePop {
            key: need!(r.string("key")),
        },
        QueryType::QueueLen => Query::QueueLen {
            key: need!(r.string("key")),
        },
        QueryType::ListKeys => Query::ListKeys,
    };
    Ok(Some((query, r.pos)))
}

// ---------------------------------------------------------------------------
// Streaming
// ---------------------------------------------------------------------------

/// One field of a query, as far as its length is concerned.
#[derive(Debug, Clone, Copy)]
enum Field {
    /// A fixed number of bytes (a `u32` or an `i64`).
    Fixed(usize),
    /// A length and that many bytes; the name is the error's.
    Blob(&'static str),
    /// A count and that many keys.
    Keys,
    /// A count and that many key–value pairs.
    Entries,
}

/// The fields that follow the type byte of a `ty` query (what
/// [`decode_query`] reads, in its order).
fn layout(ty: QueryType) -> &'static [Field] {
    use Field::*;
    match ty {
        QueryType::Validate | QueryType::Ping => &[Fixed(4)],
        QueryType::Set | QueryType::Append | QueryType::QueuePush => &[Blob("key"), Blob("value")],
        QueryType::CompareSet => &[Blob("key"), Blob("expected value"), Blob("desired value")],
        QueryType::Get | QueryType::DeleteKey | QueryType::QueuePop | QueryType::QueueLen => {
            &[Blob("key")]
        }
        QueryType::Add => &[Blob("key"), Fixed(8)],
        QueryType::Check | QueryType::Wait | QueryType::MultiGet => &[Keys],
        QueryType::MultiSet => &[Entries],
        QueryType::NumKeys | QueryType::CancelWait | QueryType::ListKeys => &[],
    }
}

/// How far the scan of the query at the front of the buffer has come:
/// everything before `pos` is known to belong to it and to be whole.
#[derive(Debug, Default)]
struct Scan {
    pos: usize,
    ty: Option<QueryType>,
    /// Fields of `layout(ty)` done.
    field: usize,
    /// In a list field: blobs still to come, and blobs done.
    list: Option<(u64, u64)>,
}

/// Whether `end` bytes are there, or an error if a query would need more
/// than a query may have.
fn within(buf: &[u8], end: usize) -> Result<bool, C10dFormatError> {
    if end > MAX_QUERY_BYTES.saturating_add(16) {
        return Err(C10dFormatError::QueryTooLarge {
            limit: MAX_QUERY_BYTES,
        });
    }
    Ok(buf.len() >= end)
}

fn le_u64(buf: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(a)
}

impl Scan {
    /// Steps over the blob at `pos` if it is whole.
    fn blob(&mut self, buf: &[u8], field: &'static str) -> Result<bool, C10dFormatError> {
        if !within(buf, self.pos.saturating_add(8))? {
            return Ok(false);
        }
        let len = le_u64(buf, self.pos);
        if len > MAX_FIELD_BYTES as u64 {
            return Err(C10dFormatError::TooLarge {
                field,
                len,
                limit: MAX_FIELD_BYTES,
            });
        }
        let end = self.pos + 8 + len as usize;
        if !within(buf, end)? {
            return Ok(false);
        }
        self.pos = end;
        Ok(true)
    }

    /// Resumes the scan over `buf` (the same bytes as before, and maybe
    /// more): the length of the query at its front once it is whole.
    fn resume(&mut self, buf: &[u8]) -> Decoded<usize> {
        let ty = match self.ty {
            Some(ty) => ty,
            None => {
                let Some(&byte) = buf.first() else {
                    return Ok(None);
                };
                let ty = QueryType::from_byte(byte).ok_or(C10dFormatError::UnknownQuery(byte))?;
                self.ty = Some(ty);
                self.pos = 1;
                ty
            }
        };
        let fields = layout(ty);
        while let Some(&field) = fields.get(self.field) {
            match field {
                Field::Fixed(n) => {
                    if !within(buf, self.pos + n)? {
                        return Ok(None);
                    }
                    self.pos += n;
                }
                Field::Blob(name) => {
                    if !self.blob(buf, name)? {
                        return Ok(None);
                    }
                }
                Field::Keys | Field::Entries => {
                    let (mut left, mut done) = match self.list {
                        Some(list) => list,
                        None => {
                            if !within(buf, self.pos + 8)? {
                                return Ok(None);
                            }
                            let count = le_u64(buf, self.pos);
                            if count > MAX_KEYS {
                                return Err(C10dFormatError::TooManyKeys {
                                    count,
                                    limit: MAX_KEYS,
                                });
                            }
                            self.pos += 8;
                            let per = if matches!(field, Field::Entries) {
                                2
                            } else {
                                1
                            };
                            (count * per, 0)
                        }
                    };
                    while left > 0 {
                        let name = if matches!(field, Field::Entries) && done % 2 == 1 {
                            "value"
                        } else {
                            "key"
                        };
                        if !self.blob(buf, name)? {
                            self.list = Some((left, done));
                            return Ok(None);
                        }
                        left -= 1;
                        done += 1;
                    }
                    self.list = None;
                }
            }
            self.field += 1;
        }
        Ok(Some(self.pos))
    }
}

/// Decodes a stream of queries as its bytes arrive, in pieces cut
/// anywhere: [`buffer`](Self::buffer) takes the bytes read,
/// [`next_query`](Self::next_query) gives each query once its last byte is
/// there. Incremental: each read resumes the scan where the last one
/// stopped (re-reading at most a length field), and a query's bytes are
/// decoded once, when whole.
///
/// ```
/// use ferry_store::c10d::wire::{encode_query, Query, QueryDecoder};
///
/// let bytes = encode_query(&Query::Get { key: "/k".into() })?;
/// let mut decoder = QueryDecoder::default();
/// decoder.buffer().extend_from_slice(&bytes[..5]);
/// assert_eq!(decoder.next_query()?, None);
/// decoder.buffer().extend_from_slice(&bytes[5..]);
/// assert_eq!(decoder.next_query()?, Some(Query::Get { key: "/k".into() }));
/// # Ok::<(), ferry_store::C10dFormatError>(())
/// ```
#[derive(Debug, Default)]
pub struct QueryDecoder {
    buf: Vec<u8>,
    /// Bytes at the front of `buf` already decoded.
    start: usize,
    scan: Scan,
}

impl QueryDecoder {
    /// The buffer to append bytes read from the stream to (bytes already
    /// decoded are dropped from its front first).
    pub fn buffer(&mut self) -> &mut Vec<u8> {
        if self.start > 0 {
            // Moves only the query not yet whole, once: the next call
            // that finds `start > 0` comes after that query was decoded.
            self.buf.drain(..self.start);
            self.start = 0;
        }
        &mut self.buf
    }

    /// The next query, once all its bytes are in; `Ok(None)` until then.
    /// After an error the stream cannot be resynchronised: close it.
    pub fn next_query(&mut self) -> Result<Option<Query>, C10dFormatError> {
        let pending = &self.buf[self.start..];
        if self.scan.resume(pending)?.is_none() {
            return Ok(None);
        }
        match decode_query(pending)? {
            Some((query, used)) => {
                self.start += used;
                self.scan = Scan::default();
                Ok(Some(query))
            }
            None => Ok(None),
        }
    }
}

/// Decodes a reply of `kind` at the start of `buf`: `Ok(None)` if it is
/// not whole yet, else the reply and the bytes it took.
pub fn decode_reply(kind: ReplyKind, buf: &[u8]) -> Decoded<(Reply, usize)> {
    let mut r = Reader { buf, pos: 0 };
    let reply = match kind {
        ReplyKind::Value => Reply::Value(need!(r.bytes("value"))),
        ReplyKind::Int => Reply::Int(need!(r.i64())),
        ReplyKind::Check => match need!(r.u8()) {
            0 => Reply::Check(true),
            1 => Reply::Check(false),
            byte => {
                return Err(C10dFormatError::BadReplyByte {
                    field: "check",
                    byte,
                })
            }
        },
        ReplyKind::Wait => match need!(r.u8()) {
            0 => Reply::Wait(WaitReply::StopWaiting),
            1 => Reply::Wait(WaitReply::WaitCanceled),
            byte => {
                return Err(C10dFormatError::BadReplyByte {
                    field: "wait",
                    byte,
                })
            }
        },
        ReplyKind::Values { count } => {
            let mut values = Vec::with_capacity(count.min(1024));
            for _ in 0..count {
                values.push(need!(r.bytes("value")));
            }
            Reply::Values(values)
        }
        ReplyKind::Nonce => Reply::Nonce(need!(r.u32())),
        ReplyKind::Keys => Reply::Keys(need!(r.keys())),
    };
    Ok(Some((reply, r.pos)))
}

// ---------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------

fn put_bytes(out: &mut Vec<u8>, field: &'static str, b: &[u8]) -> Result<(), C10dFormatError> {
    if b.len() > MAX_FIELD_BYTES {
        return Err(C10dFormatError::TooLarge {
            field,
            len: b.len() as u64,
            limit: MAX_FIELD_BYTES,
        });
    }
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
    Ok(())
}

fn put_count(out: &mut Vec<u8>, n: usize) -> Result<(), C10dFormatError> {
    if n as u64 > MAX_KEYS {
        return Err(C10dFormatError::TooManyKeys {
            count: n as u64,
            limit: MAX_KEYS,
        });
    }
    out.extend_from_slice(&(n as u64).to_le_bytes());
    Ok(())
}

fn put_keys(out: &mut Vec<u8>, keys: &[String]) -> Result<(), C10dFormatError> {
    put_count(out, keys.len())?;
    for k in keys {
        put_bytes(out, "key", k.as_bytes())?;
    }
    Ok(())
}

/// The bytes of `query`; refuses one that breaks the limits.
pub fn encode_query(query: &Query) -> Result<Vec<u8>, C10dFormatError> {
    let mut out = vec![query.query_type() as u8];
    let o = &mut out;
    match query {
        Query::Validate { magic } => o.extend_from_slice(&magic.to_le_bytes()),
        Query::Set { key, value }
        | Query::Append { key, value }
        | Query::QueuePush { key, value } => {
            put_bytes(o, "key", key.as_bytes())?;
            put_bytes(o, "value", value)?;
        }
        Query::CompareSet {
            key,
            expected,
            desired,
        } => {
            put_bytes(o, "key", key.as_bytes())?;
            put_bytes(o, "expected value", expected)?;
            put_bytes(o, "desired value", desired)?;
        }
        Query::Get { key }
        | Query::DeleteKey { key }
        | Query::QueuePop { key }
        | Query::QueueLen { key } => put_bytes(o, "key", key.as_bytes())?,
        Query::Add { key, delta } => {
            put_bytes(o, "key", key.as_bytes())?;
            o.extend_from_slice(&delta.to_le_bytes());
        }
        Query::Check { keys } | Query::Wait { keys } | Query::MultiGet { keys } => {
            put_keys(o, keys)?
        }
        Query::MultiSet { entries } => {
            put_count(o, entries.len())?;
            for (k, v) in entries {
                put_bytes(o, "key", k.as_bytes())?;
                put_bytes(o, "value", v)?;
            }
        }
        Query::NumKeys | Query::CancelWait | Query::ListKeys => {}
        Query::Ping { nonce } => o.extend_from_slice(&nonce.to_le_bytes()),
    }
    if out.len() > MAX_QUERY_BYTES {
        return Err(C10dFormatError::QueryTooLarge {
            limit: MAX_QUERY_BYTES,
        });
    }
    Ok(out)
}

/// The bytes of `reply`; refuses one that breaks the limits.
pub fn encode_reply(reply: &Reply) -> Result<Vec<u8>, C10dFormatError> {
    let mut out = Vec::new();
    let o = &mut out;
    match reply {
        Reply::Value(v) => put_bytes(o, "value", v)?,
        Reply::Int(n) => o.extend_from_slice(&n.to_le_bytes()),
        Reply::Check(ready) => o.push(if *ready { 0 } else { 1 }),
        Reply::Wait(WaitReply::StopWaiting) => o.push(0),
        Reply::Wait(WaitReply::WaitCanceled) => o.push(1),
        Reply::Values(values) => {
            for v in values {
                put_bytes(o, "value", v)?;
            }
        }
        Reply::Nonce(n) => o.extend_from_slice(&n.to_le_bytes()),
        Reply::Keys(keys) => put_keys(o, keys)?,
    }
    Ok(out)
}

/// The first bytes of every c10d connection (`VALIDATE` and the low three
/// bytes of its magic): enough to tell it from a Ferry store frame, whose
/// 4-byte length prefix would read as a length over
/// [`MAX_MESSAGE_BYTES`](crate::MAX_MESSAGE_BYTES).
pub const fn connection_preamble() -> [u8; 4] {
    let m = VALIDATION_MAGIC.to_le_bytes();
    [QueryType::Validate as u8, m[0], m[1], m[2]]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preamble_is_no_ferry_frame() {
        let prefix = connection_preamble();
        assert_eq!(prefix, [0x00, 0xCE, 0xF7, 0x85]);
        assert!(crate::format::body_len(prefix).is_err());
    }

    #[test]
    fn a_check_reply_byte_other_than_0_or_1_is_refused() {
        assert_eq!(
            decode_reply(ReplyKind::Check, &[2]),
            Err(C10dFormatError::BadReplyByte {
                field: "check",
                byte: 2
            })
        );
    }
}
