//! The Baby child's NCCL backend ([`Backend::Nccl`](super::Backend::Nccl),
//! feature `nccl`): a communicator per quorum on one CUDA device, through
//! `cudarc`'s NCCL bindings. The CUDA driver and NCCL are loaded at run
//! time (`dynamic-loading`), so building needs neither; a host without
//! them fails the child's `Init` with the reason.
//!
//! Rendezvous: rank 0 makes the NCCL unique id and publishes it in the
//! quorum's store under `ferry_ft/nccl/<quorum id>/<membership>/id` (the
//! membership hash of the in-process group's keys); the others wait for
//! it there. An allreduce copies the shared host buffer to
//! a device buffer kept for its length, reduces it there and copies it
//! back. Every NCCL call blocks the child's one thread: a hang is the
//! parent's watchdog's to end, which is why NCCL runs in the child.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp as NcclOp};
use ferry_store::{Store, TcpStore};

use super::protocol::FailureKind;
use crate::collective::{membership, ReduceOp};

/// Why NCCL cannot be used on this host: no driver, no NCCL library, no
/// device, or the driver failed to start.
pub fn nccl_availability() -> Result<usize, String> {
    // SAFETY: only tries to open the library by its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so.1) on this host".to_owned());
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err("no NCCL library (libnccl.so.2) on this host".to_owned());
    }
    cudarc::driver::result::init().map_err(|e| format!("the CUDA driver failed: {e}"))?;
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) => Err("no CUDA device".to_owned()),
        Err(e) => Err(format!("cannot count CUDA devices: {e}")),
    }
}

/// A failed NCCL step, as the child reports it.
pub(crate) struct NcclFailure {
    pub(crate) kind: FailureKind,
    pub(crate) message: String,
}

fn other(message: String) -> NcclFailure {
    NcclFailure {
        kind: FailureKind::Other,
        message,
    }
}

/// The child's NCCL state: the device's stream, the current quorum's
/// communicator and the device buffer of the last length reduced.
pub(crate) struct NcclBackend {
    stream: Arc<CudaStream>,
    comm: Option<Comm>,
    scratch: Option<CudaSlice<f32>>,
    timeout: Duration,
    connect_timeout: Duration,
}

impl NcclBackend {
    /// Opens CUDA device `device` (after checking that NCCL is there).
    pub(crate) fn open(
        device: u32,
        timeout: Duration,
        connect_timeout: Duration,
    ) -> Result<Self, String> {
        let count = nccl_availability()?;
        if device as usize >= count {
            return Err(format!("CUDA device {device} of {count}"));
        }
        let ctx =
            CudaContext::new(device as usize).map_err(|e| format!("CUDA device {device}: {e}"))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| format!("CUDA device {device}: a stream: {e}"))?;
        Ok(Self {
            stream,
            comm: None,
            scratch: None,
            timeout,
            connect_timeout,
        })
    }

    /// A communicator for `quorum_id`, rank `rank` of `replica_ids`, the
    /// unique id exchanged through the store at `store_address`.
    pub(crate) async fn configure(
        &mut self,
        store_address: &str,
        quorum_id: i64,
        replica_ids: &[String],
        rank: usize,
    ) -> Result<(), NcclFailure> {
        let world_size = replica_ids.len();
        // The old communicator is aborted (cudarc's Drop) first.
        self.comm = None;
        let store_failure = |message: String| NcclFailure {
            kind: FailureKind::Store,
            message,
        };
        let addr: SocketAddr = tokio::net::lookup_host(store_address)
            .await
            .ok()
            .and_then(|mut addrs| addrs.next())
            .ok_or_else(|| store_failure(format!("cannot resolve the store {store_address}")))?;
        let store = TcpStore::connect(addr, self.connect_timeout)
            .await
            .map_err(|e| store_failure(format!("store {store_address}: {e}")))?;
        let key = format!(
            "ferry_ft/nccl/{quorum_id}/{:016x}/id",
            membership(replica_ids)
        );
        let id = if rank == 0 {
            let id = Id::new().map_err(|e| other(format!("ncclGetUniqueId: {e:?}")))?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            store
                .set(&key, bytes)
                .await
                .map_err(|e| store_failure(format!("store {store_address}: {e}")))?;
            id
        } else {
            store
                .wait(std::slice::from_ref(&key), self.timeout)
                .await
                .map_err(|e| NcclFailure {
                    kind: FailureKind::Timeout,
                    message: format!("no NCCL id from rank 0 in the store: {e}"),
                })?;
            let bytes = store
                .get(&key)
                .await
                .map_err(|e| store_failure(format!("store {store_address}: {e}")))?;
            let mut internal = [0 as std::ffi::c_char; 128];
            if bytes.len() != internal.len() {
                return Err(NcclFailure {
                    kind: FailureKind::Protocol,
                    message: format!("rank 0 published a {}-byte NCCL id", bytes.len()),
                });
            }
            for (out, byte) in internal.iter_mut().zip(bytes) {
                *out = byte as std::ffi::c_char;
            }
            Id::uninit(internal)
        };
        let comm = Comm::from_rank(self.stream.clone(), rank, world_size, id)
            .map_err(|e| other(format!("ncclCommInitRank: {e:?}")))?;
        self.comm = Some(comm);
        Ok(())
    }

    /// Allreduces `data` in place on the device.
    pub(crate) fn allreduce(&mut self, data: &mut [f32], op: ReduceOp) -> Result<(), NcclFailure> {
        let comm = self
            .comm
            .as_ref()
            .ok_or_else(|| other("the NCCL group is not configured".to_owned()))?;
        let cuda = |what: &str, e: cudarc::driver::DriverError| other(format!("{what}: {e}"));
        if self.scratch.as_ref().map(CudaSlice::len) != Some(data.len()) {
            self.scratch = None;
            let fresh = self
                .stream
                .alloc_zeros::<f32>(data.len())
                .map_err(|e| cuda("allocating the device buffer", e))?;
            self.scratch = Some(fresh);
        }
        let Some(device) = self.scratch.as_mut() else {
            return Err(other("no device buffer".to_owned()));
        };
        self.stream
            .memcpy_htod(&*data, device)
            .map_err(|e| cuda("copying to the device", e))?;
        let op = match op {
            ReduceOp::Sum => NcclOp::Sum,
            ReduceOp::Mean => NcclOp::Avg,
        };
        comm.all_reduce_in_place(device, &op)
            .map_err(|e| other(format!("ncclAllReduce: {e:?}")))?;
        self.stream
            .memcpy_dtoh(device, data)
            .map_err(|e| cuda("copying from the device", e))?;
        self.stream
            .synchronize()
            .map_err(|e| cuda("synchronizing the stream", e))
    }
}
