//! `ferry._ferry.rpc`, the compiled half of `ferry.rpc`: starting and
//! stopping the worker, the calls (`call`), RRef handles (`rref`), the
//! functions every Python worker serves (`serve`) and the completion of
//! Python futures (`complete`).
//!
//! Python's side (`python/ferry/rpc/`) holds the public API and the
//! pickling; this side moves what it pickled and never holds the GIL
//! while it waits.

pub mod call;
pub mod complete;
pub mod rref;
pub mod serve;

use std::collections::HashMap;
use std::time::Duration;

use ferry::RpcOptions;
use pyo3::prelude::*;

use crate::error::Error;
use crate::wire::PyRRef;

/// Starts this process's worker `name`, as `ferry::init_rpc` does, serving
/// Python calls. `rank`, `world_size`, `master_addr` and `master_port`
/// override `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`; every
/// other setting (torchrun's variables, `FERRY_*`) comes from the
/// environment as `RpcOptions::from_env` reads it. `rpc_timeout` is the
/// default timeout of calls in seconds (0: none). Blocks, with the GIL
/// released, until the whole group has met.
/// Keeps freed large blocks in the process for the next received tensor
/// ([`crate::malloc::retain_freed_memory`]); whether it was applied.
#[pyfunction]
fn retain_freed_memory() -> bool {
    crate::malloc::retain_freed_memory()
}

#[pyfunction]
#[pyo3(signature = (name, rank=None, world_size=None, master_addr=None, master_port=None, rpc_timeout=None))]
fn init(
    py: Python<'_>,
    name: String,
    rank: Option<u32>,
    world_size: Option<u32>,
    master_addr: Option<String>,
    master_port: Option<u16>,
    rpc_timeout: Option<f64>,
) -> Result<(), Error> {
    let mut given = HashMap::new();
    if let Some(r) = rank {
        given.insert("RANK", r.to_string());
    }
    if let Some(w) = world_size {
        given.insert("WORLD_SIZE", w.to_string());
    }
    if let Some(a) = master_addr {
        given.insert("MASTER_ADDR", a);
    }
    if let Some(p) = master_port {
        given.insert("MASTER_PORT", p.to_string());
    }
    let lookup = |k: &str| given.get(k).cloned().or_else(|| std::env::var(k).ok());
    let mut functions = serve::functions();
    crate::interop::add_registered(&mut functions);
    crate::interop::forget_descriptions();
    let mut options = RpcOptions::from_vars(name, lookup)?.functions(functions);
    if let Some(seconds) = rpc_timeout {
        let timeout = call::timeout_of(seconds)?.unwrap_or(ferry::rpc::DEFAULT_RPC_TIMEOUT);
        options = options.rpc_timeout(timeout);
    }
    py.detach(|| ferry::init_rpc(options))?;
    Ok(())
}

/// Stops this process's worker: gracefully (every worker waits until no
/// worker of the group has calls outstanding, serving meanwhile), or at
/// once. The GIL is released while it waits.
#[pyfunction]
#[pyo3(signature = (graceful=true))]
fn shutdown(py: Python<'_>, graceful: bool) -> Result<(), Error> {
    py.detach(|| {
        if graceful {
            ferry::shutdown()
        } else {
            ferry::shutdown_now()
        }
    })?;
    Ok(())
}

/// `(name, rank)` of the worker `to` names (a name or a rank), or of this
/// worker.
#[pyfunction]
#[pyo3(signature = (to=None))]
fn get_worker_info(to: Option<&Bound<'_, PyAny>>) -> Result<(String, u32), Error> {
    let to = to.map(call::worker_ref).transpose()?;
    let info = ferry::get_worker_info(to)?;
    Ok((info.name, info.id))
}

/// The link to worker `to` once it is up: `(transport, outgoing,
/// incoming)`, the transport carrying the frames and the channels of the
/// tensors this worker sends to and receives from it, one name per
/// (source, target) device pair; `None` before the link is up.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn link_info(to: &Bound<'_, PyAny>) -> Result<Option<(String, Vec<String>, Vec<String>)>, Error> {
    let to = call::worker_ref(to)?;
    let agent = ferry::rpc::agent()?;
    let names = |choices: Vec<ferry::wire::ChannelChoice>| -> Vec<String> {
        choices.into_iter().map(|c| c.channel).collect()
    };
    Ok(agent.link_info(to)?.map(|link| {
        (
            link.transport.to_string(),
            names(link.outgoing),
            names(link.incoming),
        )
    }))
}

/// `(name, rank)` of every worker of the group, by rank.
#[pyfunction]
fn workers() -> Result<Vec<(String, u32)>, Error> {
    let agent = ferry::rpc::agent()?;
    Ok(agent
        .workers()
        .iter()
        .map(|w| (w.name.clone(), w.id))
        .collect())
}

/// The default timeout of calls, in seconds (0: none).
#[pyfunction]
fn get_rpc_timeout() -> Result<f64, Error> {
    Ok(ferry::get_rpc_timeout()?.as_secs_f64())
}

/// Sets the default timeout of the calls started from now on, in seconds
/// (0: none).
#[pyfunction]
fn set_rpc_timeout(seconds: f64) -> Result<(), Error> {
    let timeout = call::timeout_of(seconds)?.unwrap_or(Duration::ZERO);
    ferry::set_rpc_timeout(timeout)?;
    Ok(())
}

/// Adds the submodule `rpc` to `parent`.
pub fn register(parent: &Bound<'_, PyModule>) -> PyResult<()> {
    let m = PyModule::new(parent.py(), "rpc")?;
    m.add_function(wrap_pyfunction!(init, &m)?)?;
    m.add_function(wrap_pyfunction!(retain_freed_memory, &m)?)?;
    m.add_function(wrap_pyfunction!(shutdown, &m)?)?;
    m.add_function(wrap_pyfunction!(get_worker_info, &m)?)?;
    m.add_function(wrap_pyfunction!(workers, &m)?)?;
    m.add_function(wrap_pyfunction!(link_info, &m)?)?;
    m.add_function(wrap_pyfunction!(get_rpc_timeout, &m)?)?;
    m.add_function(wrap_pyfunction!(set_rpc_timeout, &m)?)?;
    m.add_function(wrap_pyfunction!(call::rpc_sync, &m)?)?;
    m.add_function(wrap_pyfunction!(call::rpc_async, &m)?)?;
    m.add_function(wrap_pyfunction!(call::remote, &m)?)?;
    m.add_function(wrap_pyfunction!(crate::future::set_future_error, &m)?)?;
    m.add_class::<PyRRef>()?;
    parent.add_submodule(&m)
}
