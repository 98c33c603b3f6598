//! The command protocol between a [`BabyProcessGroup`](super::BabyProcessGroup)
//! and its child, sans-IO: frames in, frames out, no sockets.
//!
//! A frame is a little-endian `u32` body length, then the body: a one-byte
//! tag and the fields in order (integers little-endian, strings as a `u32`
//! byte length and UTF-8, lists as a `u32` count and the items). The memfd
//! of a [`Command::MapBuffer`] travels beside its frame as `SCM_RIGHTS`
//! ancillary data, not in it; buffers themselves never cross the socket.
//!
//! [`FrameDecoder`] takes bytes as they arrive, in any chunking, and yields
//! whole frames; a frame longer than [`MAX_FRAME`] or one that does not
//! decode is an error that ends the connection.

use std::fmt;

/// The largest frame body accepted (1 MiB): commands are small, so a
/// bigger length means a corrupt stream.
pub const MAX_FRAME: usize = 1 << 20;

/// How an allreduce combines contributions, on the wire.
pub use crate::collective::ReduceOp;

/// Parent to child.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// First command: who the child works for. Answered by
    /// [`Reply::Ready`].
    Init {
        /// The replica group's id (the child's process group uses it).
        replica_id: String,
        /// Where the child's process group listens (`host:port`).
        bind: String,
        /// The collective's timeout (rendezvous, one allreduce), ms.
        timeout_ms: u64,
        /// The connect timeout (peers, store), ms.
        connect_timeout_ms: u64,
        /// Which collective backend the child runs.
        backend: Backend,
    },
    /// Configure the child's process group for a quorum. Answered by
    /// [`Reply::Done`] or [`Reply::Failed`] with `op`.
    Configure {
        /// The operation's id.
        op: u64,
        /// The quorum primary's store, `host:port`.
        store_address: String,
        /// The quorum id.
        quorum_id: i64,
        /// The members, in replica-rank order.
        replica_ids: Vec<String>,
        /// This replica group's rank.
        replica_rank: u64,
    },
    /// Map buffer `buffer` of `len` `f32` values from the memfd sent with
    /// this frame. No reply; a failure fails the next operation on it.
    MapBuffer {
        /// The buffer's id.
        buffer: u64,
        /// Its length in `f32` values.
        len: u64,
    },
    /// Unmap buffer `buffer`. No reply.
    UnmapBuffer {
        /// The buffer's id.
        buffer: u64,
    },
    /// Allreduce buffer `buffer` in place. Answered by [`Reply::Done`] or
    /// [`Reply::Failed`] with `op`.
    Allreduce {
        /// The operation's id.
        op: u64,
        /// The buffer's id (mapped earlier).
        buffer: u64,
        /// Sum or mean.
        reduce: ReduceOp,
    },
    /// Exit now. No reply.
    Shutdown,
}

/// The collective backend a child runs, chosen by the parent in
/// [`Command::Init`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Backend {
    /// Ferry's own CPU allreduce
    /// ([`ProcessGroup`](crate::collective::ProcessGroup)): bit-identical
    /// across members.
    #[default]
    Ferry,
    /// NCCL on CUDA device `device` of the child (ferry-ft's `nccl`
    /// feature; a child built without it, or on a host without CUDA or
    /// NCCL, fails its `Init`). Shared host buffers are copied to the
    /// device, reduced there and copied back.
    Nccl {
        /// The CUDA device ordinal.
        device: u32,
    },
}

/// Child to parent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The answer to [`Command::Init`]: the child is up.
    Ready {
        /// The child's process id.
        pid: u32,
        /// Where its process group listens.
        listen: String,
    },
    /// Operation `op` succeeded.
    Done {
        /// The operation's id.
        op: u64,
    },
    /// Operation `op` failed (`op` 0: a command without reply failed, or
    /// the child cannot go on).
    Failed {
        /// The operation's id.
        op: u64,
        /// What kind of failure.
        kind: FailureKind,
        /// The child's description.
        message: String,
    },
}

/// The kind of failure a child reports, after
/// [`CollectiveError`](crate::collective::CollectiveError)'s variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// A peer replica group died, closed its connection or stalled.
    PeerLost,
    /// The operation (rendezvous, allreduce) ran past its timeout.
    Timeout,
    /// The store could not be reached, failed, or keys never appeared.
    Store,
    /// A peer could not be connected to.
    Connect,
    /// A peer sent something off protocol.
    Protocol,
    /// The quorum cannot be used.
    InvalidQuorum,
    /// A buffer is unknown or cannot be mapped.
    Buffer,
    /// Anything else (binding, a broken group).
    Other,
}

impl FailureKind {
    const ALL: [FailureKind; 8] = [
        FailureKind::PeerLost,
        FailureKind::Timeout,
        FailureKind::Store,
        FailureKind::Connect,
        FailureKind::Protocol,
        FailureKind::InvalidQuorum,
        FailureKind::Buffer,
        FailureKind::Other,
    ];

    fn code(self) -> u8 {
        Self::ALL.iter().position(|&k| k == self).unwrap_or(7) as u8
    }

    fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code)).copied()
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            FailureKind::PeerLost => "peer lost",
            FailureKind::Timeout => "timeout",
            FailureKind::Store => "store",
            FailureKind::Connect => "connect",
            FailureKind::Protocol => "protocol",
            FailureKind::InvalidQuorum => "invalid quorum",
            FailureKind::Buffer => "buffer",
            FailureKind::Other => "other",
        };
        f.write_str(name)
    }
}

/// Why bytes do not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The frame announces a body over [`MAX_FRAME`].
    #[error("frame of {0} bytes exceeds the {MAX_FRAME} byte limit")]
    TooLong(usize),
    /// The body ended inside a field.
    #[error("frame ends inside {0}")]
    Truncated(&'static str),
    /// Bytes left after the last field.
    #[error("{0} bytes after the last field")]
    Trailing(usize),
    /// An unknown tag or enum code.
    #[error("unknown {what} {code}")]
    Unknown {
        /// Which field.
        what: &'static str,
        /// The value.
        code: u8,
    },
    /// A string that is not UTF-8.
    #[error("a string field is not UTF-8")]
    Utf8,
}

const CMD_INIT: u8 = 1;
const CMD_CONFIGURE: u8 = 2;
const CMD_MAP: u8 = 3;
const CMD_UNMAP: u8 = 4;
const CMD_ALLREDUCE: u8 = 5;
const CMD_SHUTDOWN: u8 = 6;
const REPLY_READY: u8 = 1;
const REPLY_DONE: u8 = 2;
const REPLY_FAILED: u8 = 3;

struct Out(Vec<u8>);

impl Out {
    fn new(tag: u8) -> Self {
        // The length prefix is patched in by `finish`.
        Out(vec![0, 0, 0, 0, tag])
    }
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn finish(mut self) -> Vec<u8> {
        let body = (self.0.len() - 4) as u32;
        self.0[..4].copy_from_slice(&body.to_le_bytes());
        self.0
    }
}

struct In<'a>(&'a [u8]);

impl<'a> In<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError::Truncated(what));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        let mut b = [0; 4];
        b.copy_from_slice(self.take(4, what)?);
        Ok(u32::from_le_bytes(b))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        let mut b = [0; 8];
        b.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(b))
    }
    fn i64(&mut self, what: &'static str) -> Result<i64, DecodeError> {
        Ok(self.u64(what)? as i64)
    }
    fn str(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let len = self.u32(what)? as usize;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| DecodeError::Utf8)
    }
    fn end(self) -> Result<(), DecodeError> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(DecodeError::Trailing(n)),
        }
    }
}

fn encode_backend(out: &mut Out, backend: Backend) {
    match backend {
        Backend::Ferry => out.u8(0),
        Backend::Nccl { device } => {
            out.u8(1);
            out.u32(device);
        }
    }
}

fn decode_backend(input: &mut In<'_>) -> Result<Backend, DecodeError> {
    match input.u8("backend")? {
        0 => Ok(Backend::Ferry),
        1 => Ok(Backend::Nccl {
            device: input.u32("device")?,
        }),
        code => Err(DecodeError::Unknown {
            what: "backend",
            code,
        }),
    }
}

fn reduce_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Mean => 1,
    }
}

fn reduce_from(code: u8) -> Result<ReduceOp, DecodeError> {
    match code {
        0 => Ok(ReduceOp::Sum),
        1 => Ok(ReduceOp::Mean),
        code => Err(DecodeError::Unknown {
            what: "reduce op",
            code,
        }),
    }
}

impl Command {
    /// The frame of this command, length prefix included.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Command::Init {
                replica_id,
                bind,
                timeout_ms,
                connect_timeout_ms,
                backend,
            } => {
                let mut out = Out::new(CMD_INIT);
                out.str(replica_id);
                out.str(bind);
                out.u64(*timeout_ms);
                out.u64(*connect_timeout_ms);
                encode_backend(&mut out, *backend);
                out.finish()
            }
            Command::Configure {
                op,
                store_address,
                quorum_id,
                replica_ids,
                replica_rank,
            } => {
                let mut out = Out::new(CMD_CONFIGURE);
                out.u64(*op);
                out.str(store_address);
                out.i64(*quorum_id);
                out.u32(replica_ids.len() as u32);
                for id in replica_ids {
                    out.str(id);
                }
                out.u64(*replica_rank);
                out.finish()
            }
            Command::MapBuffer { buffer, len } => {
                let mut out = Out::new(CMD_MAP);
                out.u64(*buffer);
                out.u64(*len);
                out.finish()
            }
            Command::UnmapBuffer { buffer } => {
                let mut out = Out::new(CMD_UNMAP);
                out.u64(*buffer);
                out.finish()
            }
            Command::Allreduce { op, buffer, reduce } => {
                let mut out = Out::new(CMD_ALLREDUCE);
                out.u64(*op);
                out.u64(*buffer);
                out.u8(reduce_code(*reduce));
                out.finish()
            }
            Command::Shutdown => Out::new(CMD_SHUTDOWN).finish(),
        }
    }

    /// Decodes one frame body (without its length prefix).
    pub fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        let mut input = In(body);
        let command = match input.u8("the tag")? {
            CMD_INIT => Command::Init {
                replica_id: input.str("replica_id")?,
                bind: input.str("bind")?,
                timeout_ms: input.u64("timeout_ms")?,
                connect_timeout_ms: input.u64("connect_timeout_ms")?,
                backend: decode_backend(&mut input)?,
            },
            CMD_CONFIGURE => {
                let op = input.u64("op")?;
                let store_address = input.str("store_address")?;
                let quorum_id = input.i64("quorum_id")?;
                let count = input.u32("replica_ids")? as usize;
                // Each id takes at least its 4-byte length: bound the
                // allocation by what the frame can hold.
                let mut replica_ids = Vec::with_capacity(count.min(input.0.len() / 4));
                for _ in 0..count {
                    replica_ids.push(input.str("replica_ids")?);
                }
                Command::Configure {
                    op,
                    store_address,
                    quorum_id,
                    replica_ids,
                    replica_rank: input.u64("replica_rank")?,
                }
            }
            CMD_MAP => Command::MapBuffer {
                buffer: input.u64("buffer")?,
                len: input.u64("len")?,
            },
            CMD_UNMAP => Command::UnmapBuffer {
                buffer: input.u64("buffer")?,
            },
            CMD_ALLREDUCE => Command::Allreduce {
                op: input.u64("op")?,
                buffer: input.u64("buffer")?,
                reduce: reduce_from(input.u8("reduce")?)?,
            },
            CMD_SHUTDOWN => Command::Shutdown,
            code => {
                return Err(DecodeError::Unknown {
                    what: "command tag",
                    code,
                })
            }
        };
        input.end()?;
        Ok(command)
    }
}

impl Reply {
    /// The frame of this reply, length prefix included.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Reply::Ready { pid, listen } => {
                let mut out = Out::new(REPLY_READY);
                out.u32(*pid);
                out.str(listen);
                out.finish()
            }
            Reply::Done { op } => {
                let mut out = Out::new(REPLY_DONE);
                out.u64(*op);
                out.finish()
            }
            Reply::Failed { op, kind, message } => {
                let mut out = Out::new(REPLY_FAILED);
                out.u64(*op);
                out.u8(kind.code());
                out.str(message);
                out.finish()
            }
        }
    }

    /// Decodes one frame body (without its length prefix).
    pub fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        let mut input = In(body);
        let reply = match input.u8("the tag")? {
            REPLY_READY => Reply::Ready {
                pid: input.u32("pid")?,
                listen: input.str("listen")?,
            },
            REPLY_DONE => Reply::Done {
                op: input.u64("op")?,
            },
            REPLY_FAILED => {
                let op = input.u64("op")?;
                let code = input.u8("kind")?;
                let kind = FailureKind::from_code(code).ok_or(DecodeError::Unknown {
                    what: "failure kind",
                    code,
                })?;
                Reply::Failed {
                    op,
                    kind,
                    message: input.str("message")?,
                }
            }
            code => {
                return Err(DecodeError::Unknown {
                    what: "reply tag",
                    code,
                })
            }
        };
        input.end()?;
        Ok(reply)
    }
}

/// Cuts a byte stream into frame bodies.
///
/// ```
/// use ferry_ft::baby::protocol::{Command, FrameDecoder};
///
/// let frame = Command::Shutdown.encode();
/// let mut decoder = FrameDecoder::default();
/// decoder.push(&frame[..2]);
/// assert_eq!(decoder.next_frame().unwrap(), None);
/// decoder.push(&frame[2..]);
/// let body = decoder.next_frame().unwrap().unwrap();
/// assert_eq!(Command::decode(&body).unwrap(), Command::Shutdown);
/// ```
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    start: usize,
}

impl FrameDecoder {
    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.start > 0 && self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole frame's body, if one has arrived.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, DecodeError> {
        let pending = &self.buf[self.start..];
        if pending.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes([pending[0], pending[1], pending[2], pending[3]]) as usize;
        if len > MAX_FRAME {
            return Err(DecodeError::TooLong(len));
        }
        if pending.len() < 4 + len {
            return Ok(None);
        }
        let body = pending[4..4 + len].to_vec();
        self.start += 4 + len;
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        }
        Ok(Some(body))
    }

    /// Bytes received but not yet returned as a frame.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_reduce() -> impl Strategy<Value = ReduceOp> {
        prop_oneof![Just(ReduceOp::Sum), Just(ReduceOp::Mean)]
    }

    fn any_command() -> impl Strategy<Value = Command> {
        prop_oneof![
            (".*", ".*", any::<u64>(), any::<u64>(), any::<Option<u32>>()).prop_map(
                |(r, b, t, c, device)| Command::Init {
                    replica_id: r,
                    bind: b,
                    timeout_ms: t,
                    connect_timeout_ms: c,
                    backend: device.map_or(Backend::Ferry, |device| Backend::Nccl { device }),
                }
            ),
            (
                any::<u64>(),
                ".*",
                any::<i64>(),
                proptest::collection::vec(".*", 0..5),
                any::<u64>()
            )
                .prop_map(|(op, s, q, ids, r)| Command::Configure {
                    op,
                    store_address: s,
                    quorum_id: q,
                    replica_ids: ids,
                    replica_rank: r,
                }),
            (any::<u64>(), any::<u64>())
                .prop_map(|(buffer, len)| Command::MapBuffer { buffer, len }),
            any::<u64>().prop_map(|buffer| Command::UnmapBuffer { buffer }),
            (any::<u64>(), any::<u64>(), any_reduce())
                .prop_map(|(op, buffer, reduce)| { Command::Allreduce { op, buffer, reduce } }),
            Just(Command::Shutdown),
        ]
    }

    fn any_reply() -> impl Strategy<Value = Reply> {
        prop_oneof![
            (any::<u32>(), ".*").prop_map(|(pid, listen)| Reply::Ready { pid, listen }),
            any::<u64>().prop_map(|op| Reply::Done { op }),
            (any::<u64>(), 0..8u8, ".*").prop_map(|(op, code, message)| Reply::Failed {
                op,
                kind: FailureKind::from_code(code).unwrap_or(FailureKind::Other),
                message,
            }),
        ]
    }

    /// Feeds `stream` to a decoder in chunks cut at `cuts` and collects
    /// the frames.
    fn frames(stream: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
        let mut decoder = FrameDecoder::default();
        let mut out = Vec::new();
        let mut at = 0;
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (stream.len() + 1)).collect();
        points.sort_unstable();
        points.push(stream.len());
        for point in points {
            decoder.push(&stream[at..point.max(at)]);
            at = point.max(at);
            while let Some(body) = decoder.next_frame().expect("valid frames") {
                out.push(body);
            }
        }
        assert_eq!(decoder.buffered(), 0);
        out
    }

    proptest! {
        #[test]
        fn commands_round_trip_in_any_chunking(
            commands in proptest::collection::vec(any_command(), 0..8),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let stream: Vec<u8> = commands.iter().flat_map(Command::encode).collect();
            let decoded: Vec<Command> = frames(&stream, &cuts)
                .iter()
                .map(|body| Command::decode(body).expect("decodes"))
                .collect();
            prop_assert_eq!(decoded, commands);
        }

        #[test]
        fn replies_round_trip_in_any_chunking(
            replies in proptest::collection::vec(any_reply(), 0..8),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let stream: Vec<u8> = replies.iter().flat_map(Reply::encode).collect();
            let decoded: Vec<Reply> = frames(&stream, &cuts)
                .iter()
                .map(|body| Reply::decode(body).expect("decodes"))
                .collect();
            prop_assert_eq!(decoded, replies);
        }

        #[test]
        fn garbage_never_panics(body in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Command::decode(&body);
            let _ = Reply::decode(&body);
        }

        #[test]
        fn a_truncated_or_extended_body_is_an_error(command in any_command(), extra in 1..4usize) {
            let frame = command.encode();
            let body = &frame[4..];
            for cut in 0..body.len() {
                prop_assert!(Command::decode(&body[..cut]).is_err());
            }
            let mut longer = body.to_vec();
            longer.extend(std::iter::repeat_n(0u8, extra));
            prop_assert_eq!(Command::decode(&longer), Err(DecodeError::Trailing(extra)));
        }
    }

    #[test]
    fn an_oversized_length_is_refused() {
        let mut decoder = FrameDecoder::default();
        decoder.push(&((MAX_FRAME as u32) + 1).to_le_bytes());
        assert_eq!(
            decoder.next_frame(),
            Err(DecodeError::TooLong(MAX_FRAME + 1))
        );
    }
}
