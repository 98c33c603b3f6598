//! UCX (feature `ucx`): the `ucx` tensor channel and the `ucx` transport.
//!
//! - **Bindings.** [`sys`] is generated once by `cargo xtask ucx-bindings`
//!   (bindgen against Debian's UCX 1.13 headers, C enums as integer
//!   constants) and checked in. `libucp.so.0` is loaded at run time
//!   ([`api`]): a build needs neither UCX nor libclang, and a host without
//!   UCX gets [`TransportError::Unavailable`]
//!   (`UCX not available: <dlopen error>`).
//! - **One worker per connection.** Each side of a connection that selects
//!   `ucx` creates a UCP worker; the worker addresses travel in Ferry's
//!   handshake ([`ferry_wire::Handshake::ucx_address`]), which runs after
//!   the connection's authentication, so nothing of UCX is exchanged before
//!   the peer proved it holds the group's secret. Where both sides' UCX
//!   transports include TCP, the accepting side's worker listens instead
//!   (`ucp_listener` on the address the handshake arrived at, its port sent
//!   as the handshake property `ucx.listener`) and the connecting side
//!   connects through UCX's connection manager: UCX 1.13 then connects the
//!   TCP lanes endpoint to endpoint and keeps zero-copy rendezvous with
//!   peer-failure handling, which endpoints created from a worker address
//!   lose over TCP (module `worker`, `UcxWorker::listen`). The listener
//!   accepts one request, from the peer's TCP address, and closes.
//! - **Tags.** Bit 63 tells frames of the `ucx` transport (then the chunk's
//!   sequence number per direction) from tensors of the `ucx` channel (then
//!   the transfer's sequence number per direction: the tensors of all
//!   messages, numbered in order, which the channel record repeats). Each
//!   connection has its own worker, so the connection is part of every tag
//!   implicitly.
//! - **Buffers.** The channel receives straight into the destination the
//!   connection's [`Allocator`](crate::Allocator) returns, and sends from
//!   the tensor's own memory. A buffer stays owned by its request until UCX
//!   completes it: a request dropped early is cancelled and kept, with its
//!   buffer, until UCX reports it done.
//! - **Progress.** A waiting task spins on `ucp_worker_progress` for a
//!   short bounded time ([`ChannelConfig::spin`](crate::ChannelConfig),
//!   rounds of checks with the CPU yielded to the OS in between, like the
//!   `shm` rings; ten times as long on a link that posted a send or
//!   receive of 1 MiB or more in the last 2 ms, whose bytes are still on
//!   their way), then sleeps; a progress task per connection arms the
//!   worker (`ucp_worker_arm`) and sleeps on its event fd under tokio
//!   (`AsyncFd`), with a backstop timer, while a send is unfinished (after
//!   spinning while UCX keeps moving it), and wakes the tasks whose
//!   requests completed. Rendezvous goes by put (`RNDV_SCHEME=put_zcopy`, unless
//!   `UCX_RNDV_SCHEME` is set): its last step is a message to the
//!   receiver, which wakes a receiver asleep on its event fd.
//! - **Peer failure.** Endpoints ask for UCX's peer-failure handling where
//!   its transports may include a network one (UCX 1.13 aborts on a failed
//!   TCP peer without it), and go without where `UCX_TLS` names only
//!   shared-memory transports (which have none); the `ucx` transport's
//!   reader watches the connection's TCP socket for the peer's exit.
//! - **Process exit.** An exit handler (module `exit`) stops every thread from
//!   entering UCX before UCX's library destructors run: a process may exit
//!   with connections open and busy, or drop them on other threads while
//!   it exits.
//! - **UCX's own transports.** `UCX_*` environment variables pass through
//!   (UCX reads them); [`ChannelConfig::ucx_tls`](crate::ChannelConfig)
//!   (the RPC layer's `FERRY_UCX_TLS`) sets `UCX_TLS` for Ferry's context.

mod exit;
mod sockaddr;
mod stream;
pub mod sys;
mod worker;

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

pub use stream::{UcxReader, UcxWriter};
pub(crate) use worker::{UcxLink, UcxWorker};

use crate::TransportError;

/// The shared library loaded at run time.
pub const LIBRARY: &str = "libucp.so.0";

/// Tag bit of the `ucx` transport's frame chunks (clear: tensors of the
/// `ucx` channel).
pub(crate) const FRAME_TAG: u64 = 1 << 63;

/// The function table of `libucp.so.0`, loaded once per process.
pub fn api() -> Result<&'static sys::Ucp, TransportError> {
    static API: OnceLock<Result<sys::Ucp, String>> = OnceLock::new();
    API.get_or_init(|| {
        // UCX's virtual file system (its objects exported over FUSE) is
        // torn down by libucs's destructor at exit, where UCX 1.13 fails an
        // assertion and aborts when workers are still alive (a process
        // exiting with connections open). Ferry does not use it: off,
        // unless the environment says otherwise. Set before the library
        // loads, since libucs reads its configuration then.
        if std::env::var_os("UCX_VFS_ENABLE").is_none() {
            std::env::set_var("UCX_VFS_ENABLE", "n");
        }
        let api = load(LIBRARY).map_err(|e| e.to_string())?;
        exit::register_handler();
        Ok(api)
    })
    .as_ref()
    .map_err(|reason| TransportError::Unavailable {
        what: "UCX",
        reason: reason.clone(),
    })
}

/// Loads UCX's function table from `path` (every function Ferry uses must
/// resolve). An error names what the dynamic loader said.
pub fn load(path: &str) -> Result<sys::Ucp, TransportError> {
    // SAFETY: loading libucp runs its initialisers, which have no
    // preconditions; every symbol is resolved with the C signature the
    // checked-in bindings (generated from the same library's headers) give.
    unsafe { sys::Ucp::new(path) }.map_err(|e| TransportError::Unavailable {
        what: "UCX",
        reason: e.to_string(),
    })
}

/// Whether UCX can be used in this process: `Ok` with the library's
/// version, or why not.
pub fn viability() -> Result<String, String> {
    let api = api().map_err(|e| e.to_string())?;
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: plain out-parameters.
    unsafe { api.ucp_get_version(&mut major, &mut minor, &mut release) };
    Ok(format!("{major}.{minor}.{release}"))
}

/// UCX's text for a status code.
pub(crate) fn status_text(api: &sys::Ucp, status: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a static C string for any value.
    let s = unsafe { api.ucs_status_string(status) };
    if s.is_null() {
        return format!("UCX status {status}");
    }
    // SAFETY: non-null, NUL-terminated, static.
    unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
}

/// The `UCX_TLS` list UCX will use: Ferry's own (`tls`), else the
/// environment's; `None`: UCX's default, every transport.
pub(crate) fn effective_tls(tls: Option<&str>) -> Option<String> {
    tls.map(str::to_owned)
        .or_else(|| std::env::var("UCX_TLS").ok())
}

/// Whether `name`, one entry of a `UCX_TLS` list, is one of UCX's
/// shared-memory transports (or their aliases).
pub(crate) fn is_shared_memory(name: &str) -> bool {
    matches!(
        name,
        "shm" | "sm" | "mm" | "posix" | "sysv" | "cma" | "knem" | "xpmem"
    )
}

/// Whether a `UCX_TLS` list (`None`: UCX's default, every transport) may
/// carry data over shared memory: no list, an exclusion list (`^...`),
/// `all`, or one that names a shared-memory transport.
fn may_use_shared_memory(tls: Option<&str>) -> bool {
    let Some(list) = tls.map(str::trim) else {
        return true;
    };
    list.starts_with('^')
        || list
            .split(',')
            .map(str::trim)
            .any(|t| t == "all" || is_shared_memory(t))
}

/// A UCP context (one per process and `UCX_TLS` choice; never cleaned up).
pub(crate) struct Context {
    pub(crate) handle: sys::ucp_context_h,
}

// SAFETY: a UCP context is only used to create workers, which happens
// under `CONTEXTS`' lock; UCX does not tie it to a thread.
unsafe impl Send for Context {}
// SAFETY: see `Send`.
unsafe impl Sync for Context {}

/// The context for `tls` (`None`: UCX's default, or `UCX_TLS` from the
/// environment).
pub(crate) fn context(tls: Option<&str>) -> Result<Arc<Context>, TransportError> {
    static CONTEXTS: OnceLock<Mutex<HashMap<Option<String>, Arc<Context>>>> = OnceLock::new();
    let api = api()?;
    let mut contexts = CONTEXTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let key = tls.map(str::to_owned);
    if let Some(c) = contexts.get(&key) {
        return Ok(c.clone());
    }
    let fail = |what: &str, status| TransportError::Unavailable {
        what: "UCX",
        reason: format!("{what}: {}", status_text(api, status)),
    };
    let mut config: *mut sys::ucp_config_t = std::ptr::null_mut();
    // SAFETY: null prefix and file name mean the defaults and the
    // environment; `config` is an out-parameter.
    let status = unsafe { api.ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config) };
    if status != sys::UCS_OK {
        return Err(fail("reading UCX's configuration failed", status));
    }
    // Rendezvous by put where shared memory may carry it: the sender
    // writes the bytes when the receiver's ready-to-receive arrives, then
    // a message tells the receiver it is done, which wakes a receiver
    // asleep on its event fd. With get (UCX's choice on shared memory) the
    // receiver's own copy completes only on a later progress call that no
    // event announces: a sleeping receiver would wait for the backstop
    // timer on every rendezvous. Over network transports the data itself
    // arrives as an event, so UCX keeps its own choice there.
    // `UCX_RNDV_SCHEME` in the environment still wins.
    if std::env::var_os("UCX_RNDV_SCHEME").is_none()
        && may_use_shared_memory(effective_tls(tls).as_deref())
    {
        // SAFETY: `config` is live; both strings are NUL-terminated.
        let status = unsafe {
            api.ucp_config_modify(config, c"RNDV_SCHEME".as_ptr(), c"put_zcopy".as_ptr())
        };
        if status != sys::UCS_OK {
            tracing::debug!(status = %status_text(api, status), "UCX refuses RNDV_SCHEME=put_zcopy");
        }
    }
    if let Some(tls) = tls {
        let value = CString::new(tls).map_err(|_| TransportError::Unavailable {
            what: "UCX",
            reason: format!("the UCX transport list {tls:?} holds a NUL byte"),
        })?;
        // SAFETY: `config` is live; both strings are NUL-terminated.
        let status = unsafe { api.ucp_config_modify(config, c"TLS".as_ptr(), value.as_ptr()) };
        if status != sys::UCS_OK {
            // SAFETY: `config` came from ucp_config_read.
            unsafe { api.ucp_config_release(config) };
            return Err(TransportError::Unavailable {
                what: "UCX",
                reason: format!(
                    "UCX refuses the transport list {tls:?}: {}",
                    status_text(api, status)
                ),
            });
        }
    }
    // SAFETY: zeroed is a valid ucp_params_t (a plain C struct).
    let mut params: sys::ucp_params_t = unsafe { std::mem::zeroed() };
    params.field_mask =
        (sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED) as u64;
    params.features = (sys::UCP_FEATURE_TAG | sys::UCP_FEATURE_WAKEUP) as u64;
    params.mt_workers_shared = 1;
    let mut handle: sys::ucp_context_h = std::ptr::null_mut();
    // SAFETY: params and config are valid; handle is an out-parameter.
    let status = unsafe {
        api.ucp_init_version(
            sys::UCP_API_MAJOR,
            sys::UCP_API_MINOR,
            &params,
            config,
            &mut handle,
        )
    };
    // SAFETY: `config` came from ucp_config_read and is used no more.
    unsafe { api.ucp_config_release(config) };
    if status != sys::UCS_OK {
        return Err(fail("creating a UCX context failed", status));
    }
    let c = Arc::new(Context { handle });
    contexts.insert(key, c.clone());
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendezvous_by_put_is_asked_for_only_where_shared_memory_may_carry_data() {
        for tls in [
            None,
            Some("shm"),
            Some("sm,tcp"),
            Some("^ib"),
            Some(" all"),
            Some("posix"),
        ] {
            assert!(may_use_shared_memory(tls), "{tls:?}");
        }
        for tls in [
            Some("tcp"),
            Some("rc,ud"),
            Some("tcp, rc_x"),
            Some("self,tcp"),
        ] {
            assert!(!may_use_shared_memory(tls), "{tls:?}");
        }
    }

    #[test]
    fn a_missing_library_is_a_typed_error_naming_the_loader() {
        let Err(err) = load("/nonexistent/libucp.so.0") else {
            panic!("a missing library loaded");
        };
        let text = err.to_string();
        assert!(
            text.starts_with("UCX not available: "),
            "unexpected error: {text}"
        );
        assert!(text.contains("/nonexistent/libucp.so.0"), "{text}");
    }
}
