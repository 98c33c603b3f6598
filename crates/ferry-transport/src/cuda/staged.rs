//! The `cuda_staged` channel's chunk pipeline: device memory → pinned host
//! staging slots → any byte stream (a CPU channel) → pinned host staging
//! slots → device memory, in chunks, so the device copies of some chunks
//! overlap the stream transfer of others.
//!
//! The pipeline is generic over a [`CopyEngine`], which owns the device
//! buffer and the staging slots and runs the copies: the CUDA engine (the
//! `cuda` feature's `driver::CudaCopyEngine`) issues them on a stream and
//! records an event per copy; [`HostCopyEngine`] is a real engine over host
//! memory (it performs each copy when it is waited for, so a pipeline that
//! reads a slot before waiting sees stale bytes, and one that reuses a busy
//! slot gets [`StagedError::SlotBusy`]). The scheduling below is therefore
//! tested without a GPU.
//!
//! Scheduling (with `S` slots and chunks `0..n`):
//! - sending: copies of chunks `0..S` to the host start at once; for each
//!   chunk in order, wait for its copy, write its slot to the stream, then
//!   start the copy of chunk `i + S` into the freed slot;
//! - receiving: for each chunk in order, wait for the copy that last used
//!   its slot (chunk `i - S`), read the chunk from the stream into the slot,
//!   and start its copy to the device; at the end, wait for all copies.
//!
//! A pipeline dropped half-way (cancelled, or failed) waits for the copies
//! it started before it lets go of the engine, so no copy into or out of a
//! slot outlives the pipeline.

use std::collections::VecDeque;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Default chunk size of the `cuda_staged` channel.
pub const DEFAULT_CHUNK_BYTES: usize = 4 << 20;
/// Default number of staging slots (chunks in flight per direction).
pub const DEFAULT_SLOTS: usize = 3;

/// Why a staged transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum StagedError {
    /// The byte stream between the two ends failed.
    #[error("the stream failed after {done} of {len} bytes: {source}")]
    Stream {
        /// Bytes fully moved before the failure.
        done: u64,
        /// Bytes of the whole transfer.
        len: u64,
        /// The stream's error.
        #[source]
        source: std::io::Error,
    },
    /// A device copy failed (the engine's words).
    #[error("device copy failed: {0}")]
    Copy(String),
    /// A copy was asked for outside the device buffer.
    #[error(
        "a copy of {len} bytes at offset {offset} is outside the {capacity}-byte device buffer"
    )]
    OutOfRange {
        /// Offset asked for.
        offset: usize,
        /// Length asked for.
        len: usize,
        /// Size of the device buffer.
        capacity: usize,
    },
    /// A copy was started into a staging slot whose previous copy is still
    /// in flight (a scheduling error).
    #[error("staging slot {0} is still in use by a copy in flight")]
    SlotBusy(usize),
    /// The options are unusable.
    #[error("invalid staged-transfer options: {0}")]
    Options(String),
}

/// The chunking of a staged transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedOptions {
    /// Bytes per chunk (the size of each staging slot).
    pub chunk_bytes: usize,
    /// Staging slots: chunks whose device copy may be in flight at once.
    pub slots: usize,
}

impl Default for StagedOptions {
    fn default() -> Self {
        StagedOptions {
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            slots: DEFAULT_SLOTS,
        }
    }
}

impl StagedOptions {
    /// Checks that chunks and slots are not zero.
    pub fn validate(&self) -> Result<(), StagedError> {
        if self.chunk_bytes == 0 {
            return Err(StagedError::Options("chunk_bytes must be positive".into()));
        }
        if self.slots == 0 {
            return Err(StagedError::Options("slots must be positive".into()));
        }
        Ok(())
    }

    /// The (offset, length) of each chunk of a `len`-byte transfer: full
    /// chunks, then a partial last one; none for an empty transfer.
    pub fn chunks(&self, len: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let step = self.chunk_bytes.max(1);
        (0..len)
            .step_by(step)
            .map(move |offset| (offset, step.min(len - offset)))
    }
}

/// Runs copies between one device buffer and a set of host staging slots.
pub trait CopyEngine {
    /// A copy in flight, to wait for.
    type Pending;
    /// Number of staging slots.
    fn slots(&self) -> usize;
    /// Bytes of each staging slot.
    fn slot_len(&self) -> usize;
    /// Starts copying `len` bytes at `offset` of the device buffer into the
    /// front of staging slot `slot`.
    fn start_to_host(
        &mut self,
        offset: usize,
        len: usize,
        slot: usize,
    ) -> Result<Self::Pending, StagedError>;
    /// Starts copying the first `len` bytes of staging slot `slot` to
    /// `offset` of the device buffer.
    fn start_to_device(
        &mut self,
        slot: usize,
        offset: usize,
        len: usize,
    ) -> Result<Self::Pending, StagedError>;
    /// Blocks until the copy is done.
    fn wait(&mut self, pending: Self::Pending) -> Result<(), StagedError>;
    /// The bytes of staging slot `slot` (valid only while no copy into or
    /// out of it is in flight).
    fn slot_mut(&mut self, slot: usize) -> &mut [u8];
}

/// Copies started and not yet waited for; waits for all of them when
/// dropped, so a cancelled pipeline leaves no copy running.
struct InFlight<'e, E: CopyEngine> {
    engine: &'e mut E,
    /// (slot, copy) in the order started.
    queue: VecDeque<(usize, E::Pending)>,
}

impl<E: CopyEngine> InFlight<'_, E> {
    /// Waits for the oldest copy; returns its slot.
    fn wait_oldest(&mut self) -> Result<Option<usize>, StagedError> {
        match self.queue.pop_front() {
            Some((slot, pending)) => {
                self.engine.wait(pending)?;
                Ok(Some(slot))
            }
            None => Ok(None),
        }
    }
}

impl<E: CopyEngine> Drop for InFlight<'_, E> {
    fn drop(&mut self) {
        while let Some((slot, pending)) = self.queue.pop_front() {
            if let Err(e) = self.engine.wait(pending) {
                tracing::warn!(slot, error = %e, "a staged copy failed while the transfer was abandoned");
            }
        }
    }
}

fn check_engine<E: CopyEngine>(engine: &E, options: &StagedOptions) -> Result<(), StagedError> {
    options.validate()?;
    if engine.slots() < options.slots || engine.slot_len() < options.chunk_bytes {
        return Err(StagedError::Options(format!(
            "the engine has {} slots of {} bytes, the transfer needs {} of {}",
            engine.slots(),
            engine.slot_len(),
            options.slots,
            options.chunk_bytes
        )));
    }
    Ok(())
}

/// Sends the first `len` bytes of the engine's device buffer to `out`,
/// staged through the engine's slots in `options.chunk_bytes` chunks.
pub async fn send<E, W>(
    engine: &mut E,
    len: usize,
    options: &StagedOptions,
    out: &mut W,
) -> Result<(), StagedError>
where
    E: CopyEngine,
    W: AsyncWrite + Unpin + ?Sized,
{
    check_engine(engine, options)?;
    let chunks: Vec<(usize, usize)> = options.chunks(len).collect();
    let mut flight = InFlight {
        engine,
        queue: VecDeque::with_capacity(options.slots),
    };
    let mut next = 0;
    while next < chunks.len() && next < options.slots {
        let (offset, n) = chunks[next];
        let pending = flight.engine.start_to_host(offset, n, next)?;
        flight.queue.push_back((next, pending));
        next += 1;
    }
    for &(offset, n) in &chunks {
        let Some(slot) = flight.wait_oldest()? else {
            break;
        };
        let bytes = &flight.engine.slot_mut(slot)[..n];
        out.write_all(bytes)
            .await
            .map_err(|source| StagedError::Stream {
                done: offset as u64,
                len: len as u64,
                source,
            })?;
        if let Some(&(offset, n)) = chunks.get(next) {
            let pending = flight.engine.start_to_host(offset, n, slot)?;
            flight.queue.push_back((slot, pending));
            next += 1;
        }
    }
    Ok(())
}

/// Receives `len` bytes from `input` into the engine's device buffer,
/// staged through the engine's slots in `options.chunk_bytes` chunks.
pub async fn receive<E, R>(
    engine: &mut E,
    len: usize,
    options: &StagedOptions,
    input: &mut R,
) -> Result<(), StagedError>
where
    E: CopyEngine,
    R: AsyncRead + Unpin + ?Sized,
{
    check_engine(engine, options)?;
    let mut flight = InFlight {
        engine,
        queue: VecDeque::with_capacity(options.slots),
    };
    for (i, (offset, n)) in options.chunks(len).enumerate() {
        let slot = i % options.slots;
        if flight.queue.len() == options.slots {
            // The oldest copy is the one that used this slot.
            flight.wait_oldest()?;
        }
        let bytes = &mut flight.engine.slot_mut(slot)[..n];
        input
            .read_exact(bytes)
            .await
            .map_err(|source| StagedError::Stream {
                done: offset as u64,
                len: len as u64,
                source,
            })?;
        let pending = flight.engine.start_to_device(slot, offset, n)?;
        flight.queue.push_back((slot, pending));
    }
    while flight.wait_oldest()?.is_some() {}
    Ok(())
}

/// A copy engine over host memory: the "device" buffer is a `Vec<u8>`, and
/// each copy is a `memcpy` performed when it is waited for (as a device
/// copy completes some time after it is issued).
#[derive(Debug)]
pub struct HostCopyEngine {
    device: Vec<u8>,
    slots: Vec<Vec<u8>>,
    busy: Vec<bool>,
    ops: Vec<HostOp>,
    copies: u64,
}

/// One copy of the [`HostCopyEngine`], performed when waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostOp {
    to_device: bool,
    slot: usize,
    offset: usize,
    len: usize,
}

impl HostCopyEngine {
    /// An engine with `device` as its device buffer and `options.slots`
    /// slots of `options.chunk_bytes` bytes.
    pub fn new(device: Vec<u8>, options: &StagedOptions) -> Self {
        HostCopyEngine {
            device,
            slots: vec![vec![0; options.chunk_bytes]; options.slots],
            busy: vec![false; options.slots],
            ops: Vec::new(),
            copies: 0,
        }
    }

    /// The device buffer.
    pub fn device(&self) -> &[u8] {
        &self.device
    }

    /// Copies started and not yet waited for.
    pub fn in_flight(&self) -> usize {
        self.busy.iter().filter(|b| **b).count()
    }

    /// Copies completed so far.
    pub fn copies(&self) -> u64 {
        self.copies
    }

    fn start(&mut self, op: HostOp) -> Result<HostOp, StagedError> {
        let capacity = self.device.len();
        if op
            .offset
            .checked_add(op.len)
            .is_none_or(|end| end > capacity)
        {
            return Err(StagedError::OutOfRange {
                offset: op.offset,
                len: op.len,
                capacity,
            });
        }
        let Some(busy) = self.busy.get_mut(op.slot) else {
            return Err(StagedError::Copy(format!("no staging slot {}", op.slot)));
        };
        if *busy {
            return Err(StagedError::SlotBusy(op.slot));
        }
        if op.len > self.slots[op.slot].len() {
            return Err(StagedError::Copy(format!(
                "{} bytes do not fit staging slot {}",
                op.len, op.slot
            )));
        }
        *busy = true;
        self.ops.push(op);
        Ok(op)
    }
}

impl CopyEngine for HostCopyEngine {
    type Pending = HostOp;

    fn slots(&self) -> usize {
        self.slots.len()
    }

    fn slot_len(&self) -> usize {
        self.slots.first().map_or(0, Vec::len)
    }

    fn start_to_host(
        &mut self,
        offset: usize,
        len: usize,
        slot: usize,
    ) -> Result<HostOp, StagedError> {
        self.start(HostOp {
            to_device: false,
            slot,
            offset,
            len,
        })
    }

    fn start_to_device(
        &mut self,
        slot: usize,
        offset: usize,
        len: usize,
    ) -> Result<HostOp, StagedError> {
        self.start(HostOp {
            to_device: true,
            slot,
            offset,
            len,
        })
    }

    fn wait(&mut self, op: HostOp) -> Result<(), StagedError> {
        let Some(at) = self.ops.iter().position(|o| *o == op) else {
            return Err(StagedError::Copy(format!("{op:?} is not in flight")));
        };
        self.ops.remove(at);
        let (device, slot) = (
            &mut self.device[op.offset..op.offset + op.len],
            &mut self.slots[op.slot][..op.len],
        );
        if op.to_device {
            device.copy_from_slice(slot);
        } else {
            slot.copy_from_slice(device);
        }
        self.busy[op.slot] = false;
        self.copies += 1;
        Ok(())
    }

    fn slot_mut(&mut self, slot: usize) -> &mut [u8] {
        &mut self.slots[slot]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    /// Sends `data` through a pipe and receives it into a zeroed device
    /// buffer, both pipelines running at once.
    fn roundtrip(data: &[u8], options: StagedOptions, pipe: usize) -> Vec<u8> {
        run(async {
            let (mut a, mut b) = tokio::io::duplex(pipe);
            let mut tx = HostCopyEngine::new(data.to_vec(), &options);
            let mut rx = HostCopyEngine::new(vec![0; data.len()], &options);
            let (sent, received) = tokio::join!(
                send(&mut tx, data.len(), &options, &mut a),
                receive(&mut rx, data.len(), &options, &mut b)
            );
            sent.expect("send");
            received.expect("receive");
            assert_eq!(tx.in_flight(), 0);
            assert_eq!(rx.in_flight(), 0);
            let chunks = options.chunks(data.len()).count() as u64;
            assert_eq!(tx.copies(), chunks);
            assert_eq!(rx.copies(), chunks);
            rx.device().to_vec()
        })
    }

    #[test]
    fn chunks_cover_the_transfer_with_a_partial_last_one() {
        let o = StagedOptions {
            chunk_bytes: 4,
            slots: 2,
        };
        assert_eq!(o.chunks(10).collect::<Vec<_>>(), [(0, 4), (4, 4), (8, 2)]);
        assert_eq!(o.chunks(8).collect::<Vec<_>>(), [(0, 4), (4, 4)]);
        assert_eq!(o.chunks(0).count(), 0);
    }

    #[test]
    fn a_partial_last_chunk_and_more_chunks_than_slots_arrive_intact() {
        let data = pattern(10_007, 3);
        let o = StagedOptions {
            chunk_bytes: 1000,
            slots: 3,
        };
        assert_eq!(roundtrip(&data, o, 64), data);
        // One slot: no overlap at all, still correct.
        let o = StagedOptions {
            chunk_bytes: 333,
            slots: 1,
        };
        assert_eq!(roundtrip(&data, o, 7), data);
        // Empty transfer.
        assert_eq!(roundtrip(&[], o, 7), Vec::<u8>::new());
    }

    #[test]
    fn options_and_engine_mismatches_are_refused() {
        let zero = StagedOptions {
            chunk_bytes: 0,
            slots: 1,
        };
        assert!(matches!(zero.validate(), Err(StagedError::Options(_))));
        let small = StagedOptions {
            chunk_bytes: 8,
            slots: 1,
        };
        let mut engine = HostCopyEngine::new(vec![0; 64], &small);
        let big = StagedOptions {
            chunk_bytes: 16,
            slots: 2,
        };
        let err = run(send(&mut engine, 64, &big, &mut tokio::io::sink())).unwrap_err();
        assert!(err.to_string().contains("1 slots of 8 bytes"), "{err}");
    }

    #[test]
    fn the_host_engine_refuses_a_busy_slot_and_out_of_range_copies() {
        let o = StagedOptions {
            chunk_bytes: 8,
            slots: 2,
        };
        let mut e = HostCopyEngine::new(pattern(32, 0), &o);
        let first = e.start_to_host(0, 8, 0).expect("start");
        assert!(matches!(
            e.start_to_host(8, 8, 0),
            Err(StagedError::SlotBusy(0))
        ));
        // Not copied before the wait.
        assert_eq!(e.slot_mut(0), &[0u8; 8]);
        e.wait(first).expect("wait");
        assert_eq!(e.slot_mut(0), &pattern(32, 0)[..8]);
        assert!(matches!(
            e.start_to_device(1, 30, 8),
            Err(StagedError::OutOfRange {
                offset: 30,
                len: 8,
                capacity: 32
            })
        ));
    }

    #[test]
    fn a_device_buffer_shorter_than_the_transfer_fails_mid_stream() {
        let o = StagedOptions {
            chunk_bytes: 100,
            slots: 2,
        };
        run(async {
            let (mut a, mut b) = tokio::io::duplex(1 << 16);
            // The sender's buffer holds 450 bytes of a 1000-byte transfer.
            let mut tx = HostCopyEngine::new(pattern(450, 1), &o);
            let err = send(&mut tx, 1000, &o, &mut a).await.unwrap_err();
            assert!(
                matches!(
                    err,
                    StagedError::OutOfRange {
                        offset: 400,
                        len: 100,
                        capacity: 450
                    }
                ),
                "{err}"
            );
            assert_eq!(
                tx.in_flight(),
                0,
                "copies started before the failure were waited for"
            );
            drop(a);
            // Chunk 4's copy failed to start right after chunk 2 went out
            // (two slots): the receiver gets 300 bytes, then the end of the
            // stream.
            let mut rx = HostCopyEngine::new(vec![0; 1000], &o);
            let err = receive(&mut rx, 1000, &o, &mut b).await.unwrap_err();
            match err {
                StagedError::Stream { done, len, source } => {
                    assert_eq!((done, len), (300, 1000));
                    assert_eq!(source.kind(), std::io::ErrorKind::UnexpectedEof);
                }
                other => panic!("{other}"),
            }
            assert_eq!(rx.in_flight(), 0);
            assert_eq!(&rx.device()[..300], &pattern(450, 1)[..300]);
            assert!(rx.device()[300..].iter().all(|b| *b == 0));
        });
    }

    #[test]
    fn a_cancelled_receive_leaves_no_copy_in_flight_and_only_whole_chunks() {
        let o = StagedOptions {
            chunk_bytes: 64,
            slots: 3,
        };
        let data = pattern(1000, 9);
        run(async {
            let (mut a, mut b) = tokio::io::duplex(1 << 16);
            // Only 5 chunks and a half arrive; the sender's end stays open.
            a.write_all(&data[..5 * 64 + 32]).await.expect("write");
            let mut rx = HostCopyEngine::new(vec![0; 1000], &o);
            {
                let recv = receive(&mut rx, 1000, &o, &mut b);
                tokio::pin!(recv);
                // Poll until it waits for bytes that never come, then drop it.
                let pending = futures_poll_once(recv.as_mut()).await;
                assert!(pending, "the receive cannot finish");
            }
            assert_eq!(rx.in_flight(), 0);
            let got = rx.device();
            assert_eq!(&got[..5 * 64], &data[..5 * 64]);
            assert!(
                got[5 * 64..].iter().all(|b| *b == 0),
                "no partial chunk lands"
            );
        });
    }

    /// Polls `f` once (it makes all the progress it can on the bytes
    /// available); true when it is still pending.
    async fn futures_poll_once<F: std::future::Future + Unpin>(mut f: F) -> bool {
        std::future::poll_fn(|cx| {
            std::task::Poll::Ready(std::pin::Pin::new(&mut f).poll(cx).is_pending())
        })
        .await
    }

    #[test]
    fn a_failing_stream_names_the_bytes_done() {
        let o = StagedOptions {
            chunk_bytes: 10,
            slots: 2,
        };
        run(async {
            let (mut a, b) = tokio::io::duplex(16);
            drop(b);
            let mut tx = HostCopyEngine::new(pattern(100, 0), &o);
            let err = send(&mut tx, 100, &o, &mut a).await.unwrap_err();
            assert!(
                matches!(
                    err,
                    StagedError::Stream {
                        done: 0,
                        len: 100,
                        ..
                    }
                ),
                "{err}"
            );
            assert_eq!(tx.in_flight(), 0);
        });
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn any_length_chunking_and_pipe_size_roundtrip(
            len in 0usize..5000,
            chunk in 1usize..700,
            slots in 1usize..5,
            pipe in 1usize..600,
            seed in any::<u8>(),
        ) {
            let data = pattern(len, seed);
            let o = StagedOptions { chunk_bytes: chunk, slots };
            prop_assert_eq!(roundtrip(&data, o, pipe), data);
        }
    }
}
