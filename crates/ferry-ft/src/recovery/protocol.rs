//! The checkpoint protocol, sans-IO: message kinds, requests and replies,
//! the manifest and its validation, and the chunk plan both ends compute
//! alike.
//!
//! A fetch runs over `lanes` connections to the [`CheckpointServer`]:
//!
//! 1. On lane 0 the client sends [`Request::Manifest`] with the step it
//!    heals to. The server waits (up to the client's `wait_ms`, capped by its
//!    own limit) until a checkpoint is allowed, then answers
//!    [`Reply::Manifest`] (names, dtypes, shapes, byte lengths) if the step
//!    matches, or [`Reply::Refused`] with [`Refusal::StepMismatch`] if it
//!    serves another step ([`Refusal::NotServing`] if none came).
//! 2. Every lane sends [`Request::Stream`] (step, lane, lanes, chunk size).
//!    The server answers with the lane's chunks of the [`ChunkPlan`] back to
//!    back, one [`KIND_CHUNK`] message each: a [`ChunkHeader`] payload and
//!    the chunk as the one tensor of the message's tensor table (a 1-D view
//!    of the source tensor's storage, sent from its memory), then
//!    [`Reply::End`].
//!
//! The client allocates nothing per chunk: its receive hook hands the
//! transport the chunk's place in the destination tensor, checked against
//! the plan, so the bytes land where they belong.
//!
//! [`CheckpointServer`]: super::CheckpointServer

use ferry_wire::{DType, MessageKind};
use serde::{Deserialize, Serialize};

/// Requests, client to server.
pub(crate) const KIND_REQUEST: MessageKind = ferry_wire::kinds::FT_RECOVERY_REQUEST;
/// Replies (manifest, refusal, end of stream), server to client.
pub(crate) const KIND_REPLY: MessageKind = ferry_wire::kinds::FT_RECOVERY_REPLY;
/// One chunk of a tensor, server to client.
pub(crate) const KIND_CHUNK: MessageKind = ferry_wire::kinds::FT_RECOVERY_CHUNK;

/// Chunk sizes must be a multiple of this (the largest element size), so
/// every chunk boundary falls between elements.
pub(crate) const CHUNK_ALIGN: u64 = 16;
/// Smallest chunk size the server accepts.
pub(crate) const MIN_CHUNK_BYTES: u64 = 4 << 10;
/// Largest chunk size the server accepts.
pub(crate) const MAX_CHUNK_BYTES: u64 = 1 << 30;
/// Most lanes one fetch may use.
pub(crate) const MAX_LANES: u32 = 64;
/// Most tensors a manifest may list.
pub(crate) const MAX_TENSORS: usize = 1 << 20;
/// Most dimensions a manifest's tensor may have.
pub(crate) const MAX_DIMS: usize = 64;

/// Client to server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Request {
    /// The manifest of the checkpoint at `step`, waiting up to `wait_ms`
    /// for one to be allowed.
    Manifest {
        /// The step the client heals to.
        step: i64,
        /// How long the server may wait for a checkpoint to be allowed.
        wait_ms: u64,
    },
    /// Stream lane `lane` of `lanes` of the checkpoint at `step`.
    Stream {
        /// The step (checked again).
        step: i64,
        /// This lane.
        lane: u32,
        /// Lanes of the fetch.
        lanes: u32,
        /// Chunk size.
        chunk_bytes: u64,
    },
}

/// Server to client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Reply {
    /// What the checkpoint holds.
    Manifest(Manifest),
    /// The request was refused.
    Refused(Refusal),
    /// A lane's stream is complete: `chunks` chunks were sent.
    End {
        /// Chunks sent on the lane.
        chunks: u64,
    },
}

/// Why the server refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Refusal {
    /// The server serves the checkpoint of another step.
    StepMismatch {
        /// The step asked for.
        requested: i64,
        /// The step served.
        serving: i64,
    },
    /// No checkpoint was allowed within the wait.
    NotServing {
        /// The step asked for.
        requested: i64,
    },
    /// The request itself is invalid.
    BadRequest {
        /// Why.
        reason: String,
    },
}

/// One tensor of a checkpoint, as listed in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TensorMeta {
    /// Its name.
    pub(crate) name: String,
    /// Element type.
    pub(crate) dtype: DType,
    /// Shape (contiguous, row-major).
    pub(crate) shape: Vec<i64>,
    /// Bytes of its elements.
    pub(crate) byte_len: u64,
}

/// The checkpoint's contents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Manifest {
    /// Its step.
    pub(crate) step: i64,
    /// Its tensors, in order.
    pub(crate) tensors: Vec<TensorMeta>,
}

/// The payload of a [`KIND_CHUNK`] message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ChunkHeader {
    /// The chunk's index in the plan.
    pub(crate) index: u64,
    /// Its tensor.
    pub(crate) tensor: u32,
    /// Its first byte in the tensor.
    pub(crate) offset: u64,
}

impl Manifest {
    /// Checks that the manifest is one the client can receive: the step it
    /// asked for, a bounded number of tensors, byte lengths that agree with
    /// dtype and shape, and at most `max_bytes` in all. Returns the total.
    pub(crate) fn validate(&self, step: i64, max_bytes: u64) -> Result<u64, String> {
        if self.step != step {
            return Err(format!(
                "manifest is for step {} but step {step} was asked for",
                self.step
            ));
        }
        if self.tensors.len() > MAX_TENSORS {
            return Err(format!(
                "manifest lists {} tensors, more than {MAX_TENSORS}",
                self.tensors.len()
            ));
        }
        let mut total: u64 = 0;
        for meta in &self.tensors {
            if meta.shape.len() > MAX_DIMS {
                return Err(format!(
                    "tensor {:?} has {} dimensions, more than {MAX_DIMS}",
                    meta.name,
                    meta.shape.len()
                ));
            }
            let mut numel: u64 = 1;
            for &dim in &meta.shape {
                let dim = u64::try_from(dim).map_err(|_| {
                    format!("tensor {:?} has a negative dimension {dim}", meta.name)
                })?;
                numel = numel
                    .checked_mul(dim)
                    .ok_or_else(|| format!("tensor {:?}: shape overflows", meta.name))?;
            }
            let expected = numel
                .checked_mul(meta.dtype.size() as u64)
                .ok_or_else(|| format!("tensor {:?}: size overflows", meta.name))?;
            if expected != meta.byte_len {
                return Err(format!(
                    "tensor {:?} ({} {:?}) announces {} bytes, its shape needs {expected}",
                    meta.name, meta.dtype, meta.shape, meta.byte_len
                ));
            }
            total = total
                .checked_add(meta.byte_len)
                .ok_or_else(|| "total size overflows".to_owned())?;
        }
        if total > max_bytes {
            return Err(format!(
                "checkpoint holds {total} bytes, more than the {max_bytes} allowed"
            ));
        }
        Ok(total)
    }
}

/// One chunk of the plan: a byte range of one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChunkSpec {
    /// Its index in the plan (chunks of tensor 0 first).
    pub(crate) index: u64,
    /// Its tensor.
    pub(crate) tensor: usize,
    /// Its first byte in the tensor.
    pub(crate) offset: u64,
    /// Its length in bytes (never zero).
    pub(crate) len: u64,
}

/// How a checkpoint is cut into chunks and the chunks dealt to lanes.
///
/// Every tensor is cut into `chunk_bytes` pieces (the last one shorter),
/// tensor after tensor; chunk `i` travels on lane `i mod lanes`, and each
/// lane carries its chunks in index order. Both ends compute the same plan
/// from the manifest.
#[derive(Debug, Clone)]
pub(crate) struct ChunkPlan {
    chunks: Vec<ChunkSpec>,
}

impl ChunkPlan {
    /// The plan for tensors of `byte_lens` bytes; `chunk_bytes > 0`.
    pub(crate) fn new(byte_lens: &[u64], chunk_bytes: u64) -> Self {
        let chunk_bytes = chunk_bytes.max(1);
        let mut chunks = Vec::new();
        let mut index = 0;
        for (tensor, &byte_len) in byte_lens.iter().enumerate() {
            let mut offset = 0;
            while offset < byte_len {
                let len = chunk_bytes.min(byte_len - offset);
                chunks.push(ChunkSpec {
                    index,
                    tensor,
                    offset,
                    len,
                });
                index += 1;
                offset += len;
            }
        }
        Self { chunks }
    }

    /// Chunks in the plan.
    pub(crate) fn len(&self) -> usize {
        self.chunks.len()
    }

    /// The chunks lane `lane` of `lanes` carries, in order.
    pub(crate) fn lane(&self, lane: u32, lanes: u32) -> impl Iterator<Item = ChunkSpec> + '_ {
        let lanes = u64::from(lanes.max(1));
        let lane = u64::from(lane);
        self.chunks
            .iter()
            .copied()
            .filter(move |chunk| chunk.index % lanes == lane)
    }
}

/// Checks a stream request's geometry; the reason if it is invalid.
pub(crate) fn check_stream_request(lane: u32, lanes: u32, chunk_bytes: u64) -> Result<(), String> {
    if lanes == 0 || lanes > MAX_LANES {
        return Err(format!("lanes must be 1 to {MAX_LANES}, got {lanes}"));
    }
    if lane >= lanes {
        return Err(format!("lane {lane} out of 0..{lanes}"));
    }
    if !(MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES).contains(&chunk_bytes) || chunk_bytes % CHUNK_ALIGN != 0
    {
        return Err(format!(
            "chunk size must be a multiple of {CHUNK_ALIGN} from {MIN_CHUNK_BYTES} to \
             {MAX_CHUNK_BYTES} bytes, got {chunk_bytes}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_every_byte_once_and_deal_lanes_round_robin() {
        let lens = [10u64, 0, 64, 65, 3];
        let plan = ChunkPlan::new(&lens, 32);
        // 10 -> 1; 0 -> 0; 64 -> 2; 65 -> 3; 3 -> 1.
        assert_eq!(plan.len(), 7);
        for (tensor, &len) in lens.iter().enumerate() {
            let mut next = 0;
            for chunk in plan.chunks.iter().filter(|c| c.tensor == tensor) {
                assert_eq!(chunk.offset, next);
                assert!(chunk.len > 0 && chunk.len <= 32);
                next += chunk.len;
            }
            assert_eq!(next, len);
        }
        let mut seen: Vec<u64> = (0..3)
            .flat_map(|lane| plan.lane(lane, 3).map(|c| c.index).collect::<Vec<_>>())
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..7).collect::<Vec<_>>());
        assert_eq!(
            plan.lane(1, 3).map(|c| c.index).collect::<Vec<_>>(),
            vec![1, 4]
        );
    }

    #[test]
    fn manifests_are_checked() {
        let meta = |shape: Vec<i64>, byte_len| TensorMeta {
            name: "w".into(),
            dtype: DType::F32,
            shape,
            byte_len,
        };
        let ok = Manifest {
            step: 3,
            tensors: vec![meta(vec![2, 3], 24), meta(vec![0], 0)],
        };
        assert_eq!(ok.validate(3, 1 << 20), Ok(24));
        assert!(ok.validate(4, 1 << 20).unwrap_err().contains("step 4"));
        assert!(ok.validate(3, 10).unwrap_err().contains("more than the 10"));
        let wrong = Manifest {
            step: 3,
            tensors: vec![meta(vec![2, 3], 25)],
        };
        assert!(wrong.validate(3, 1 << 20).unwrap_err().contains("25 bytes"));
        let negative = Manifest {
            step: 3,
            tensors: vec![meta(vec![-1], 0)],
        };
        assert!(negative.validate(3, 1 << 20).is_err());
        let overflow = Manifest {
            step: 3,
            tensors: vec![meta(vec![i64::MAX, i64::MAX], 0)],
        };
        assert!(overflow.validate(3, u64::MAX).is_err());
    }

    #[test]
    fn stream_requests_are_checked() {
        assert!(check_stream_request(0, 1, 1 << 20).is_ok());
        assert!(check_stream_request(1, 1, 1 << 20).is_err());
        assert!(check_stream_request(0, 0, 1 << 20).is_err());
        assert!(check_stream_request(0, 65, 1 << 20).is_err());
        assert!(check_stream_request(0, 2, 100).is_err());
        assert!(check_stream_request(0, 2, (1 << 20) + 8).is_err());
    }
}
