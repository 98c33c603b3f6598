//! The `ucx` channel and the `ucx` transport (feature `ucx`) between two
//! endpoints in this process, with UCX's TCP and its shared-memory
//! transports. Where `libucp.so.0` does not load, each test says so and
//! returns (the multi-process runs are the RPC suite's).
#![cfg(feature = "ucx")]
#![allow(clippy::unwrap_used)]

mod common;

use std::ffi::{c_char, c_int, c_void};

use ferry_transport::{Endpoint, PeerConnection, TransportError, UcxUnusable};

use common::{
    assert_child_succeeded, assert_link, decode, endpoint, exchange_mixed, message, mixed, pair,
    run_test_in_child, Mixed,
};

/// Whether UCX loads here; prints why not when it does not.
fn ucx_here(test: &str) -> bool {
    match ferry_transport::ucx::viability() {
        Ok(_) => true,
        Err(reason) => {
            eprintln!("{test}: skipped, {reason}");
            false
        }
    }
}

/// An endpoint offering only `channels` and `transports`, every tensor
/// over its channel, with UCX's transports `tls`.
fn ucx_endpoint(name: &str, channels: &str, transports: &str, tls: &str) -> Endpoint {
    let mut e = endpoint(name, 0, channels, transports, 0);
    e.config.ucx_tls = Some(tls.into());
    e
}

/// Messages both ways, every byte checked, over the expected link.
async fn exchange(channels: &str, transports: &str, tls: &str, transport: &str, chosen: &str) {
    let (mut server, mut client) = pair(
        ucx_endpoint("server", channels, transports, tls),
        ucx_endpoint("client", channels, transports, tls),
    )
    .await;
    assert_link([&server, &client], transport, chosen);
    exchange_mixed(
        &mut server,
        &mut client,
        &format!("{chosen}/{transport}/{tls}"),
    )
    .await;
    // A clean end: the reader sees the end of the stream, not an error.
    client.writer.shutdown().await.unwrap();
    assert!(server.reader.read().await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_channel_over_tcp_with_ucx_tcp_and_shm() {
    if !ucx_here("ucx_channel_over_tcp_with_ucx_tcp_and_shm") {
        return;
    }
    exchange("ucx", "tcp", "tcp", "tcp", "ucx").await;
    exchange("ucx", "tcp", "shm,self", "tcp", "ucx").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_transport_with_inline_and_ucx_channels() {
    if !ucx_here("ucx_transport_with_inline_and_ucx_channels") {
        return;
    }
    for tls in ["tcp", "shm,self"] {
        exchange("inline", "ucx", tls, "ucx", "inline").await;
        exchange("ucx", "ucx", tls, "ucx", "ucx").await;
        exchange("mpt", "ucx", tls, "ucx", "mpt").await;
    }
}

#[tokio::test]
async fn ucx_on_a_current_thread_runtime() {
    if !ucx_here("ucx_on_a_current_thread_runtime") {
        return;
    }
    exchange("ucx", "ucx", "shm,self", "ucx", "ucx").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_is_above_mpt_and_below_the_same_host_channels() {
    if !ucx_here("ucx_is_above_mpt_and_below_the_same_host_channels") {
        return;
    }
    // Defaults: every viable channel with its default priority.
    let mut a = Endpoint::new("a", 0);
    let mut b = Endpoint::new("b", 1);
    for e in [&mut a, &mut b] {
        e.channels.retain(|o| o.name == "ucx" || o.name == "mpt");
        e.transports.retain(|o| o.name == "tcp");
    }
    let (_s, c) = pair(a, b).await;
    assert_eq!(c.outgoing_channels()[0].channel, "ucx");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_ucx_falls_back() {
    if !ucx_here("a_peer_without_ucx_falls_back") {
        return;
    }
    let (s, c) = pair(
        ucx_endpoint("s", "mpt,inline", "tcp", "tcp"),
        ucx_endpoint("c", "ucx,mpt,inline", "ucx,tcp", "tcp"),
    )
    .await;
    assert_eq!((s.transport, c.transport), ("tcp", "tcp"));
    assert_eq!(c.outgoing_channels()[0].channel, "mpt");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_ucx_transport_list_withdraws_the_offer() {
    if !ucx_here("an_unknown_ucx_transport_list_withdraws_the_offer") {
        return;
    }
    // UCX refuses the list on the connecting side: it offers no UCX, and
    // the connection falls back to what both offer besides.
    let (s, c) = pair(
        ucx_endpoint("s", "ucx,inline", "ucx,tcp", "tcp"),
        ucx_endpoint("c", "ucx,inline", "ucx,tcp", "no-such-transport"),
    )
    .await;
    assert_eq!((s.transport, c.transport), ("tcp", "tcp"));
    assert_eq!(c.outgoing_channels()[0].channel, "inline");
}

#[test]
fn a_missing_library_names_the_loader_error() {
    let Err(err) = ferry_transport::ucx::load("libucp-that-is-not-there.so.0") else {
        panic!("loading a missing library succeeded");
    };
    assert!(matches!(
        err,
        TransportError::Unavailable { what: "UCX", .. }
    ));
    let text = err.to_string();
    assert!(text.starts_with("UCX not available: "), "{text}");
    assert!(text.contains("libucp-that-is-not-there.so.0"), "{text}");
}

/// Messages both ways over `server` and `client`, every byte checked.
async fn round_trip(
    server: &mut ferry_transport::PeerConnection,
    client: &mut ferry_transport::PeerConnection,
) {
    let want = mixed(7);
    client.writer.write(&message(1, &want)).await.unwrap();
    let got: Mixed = decode(server.reader.read().await.unwrap().unwrap());
    assert!(got == want, "the request differs");
    server.writer.write(&message(2, &got)).await.unwrap();
    let back: Mixed = decode(client.reader.read().await.unwrap().unwrap());
    assert!(back == want, "the reply differs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_that_cannot_reach_the_peer_falls_back_to_the_next_viable_link() {
    if !ucx_here("ucx_that_cannot_reach_the_peer_falls_back_to_the_next_viable_link") {
        return;
    }
    // Both sides load UCX and offer it, so the selection picks the `ucx`
    // transport and channel; but one side's UCX has only TCP and the
    // other's only shared memory: no endpoint can be created. Both fall
    // back to what ranks next (`mpt` over `tcp`) and say why.
    let (mut s, mut c) = pair(
        ucx_endpoint("s", "ucx,mpt,inline", "ucx,tcp", "tcp"),
        ucx_endpoint("c", "ucx,mpt,inline", "ucx,tcp", "shm,self"),
    )
    .await;
    for conn in [&s, &c] {
        assert_eq!(conn.transport, "tcp");
        assert_eq!(conn.outgoing_channels()[0].channel, "mpt");
        assert_eq!(conn.incoming_channels()[0].channel, "mpt");
        let why = conn.ucx_fallback.clone().expect("a recorded reason");
        assert!(
            matches!(why.local, Some(UcxUnusable::Endpoint(_))),
            "{why:?}"
        );
        assert!(
            matches!(why.peer, Some(UcxUnusable::Endpoint(_))),
            "{why:?}"
        );
        assert!(why.to_string().contains("no UCX endpoint"), "{why}");
    }
    round_trip(&mut s, &mut c).await;
}

/// The value of handshake property `key`.
fn property<'a>(h: &'a ferry_wire::Handshake, key: &str) -> Option<&'a str> {
    h.properties
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_ucx_tcp_the_endpoints_connect_through_the_accepting_sides_listener() {
    if !ucx_here("over_ucx_tcp_the_endpoints_connect_through_the_accepting_sides_listener") {
        return;
    }
    // Both sides' UCX transports include TCP: the connecting side says it
    // can connect to a listener, the accepting side names its listener on
    // the address the handshake arrived at, and the link carries messages.
    let (mut s, mut c) = pair(
        ucx_endpoint("s", "ucx,mpt,inline", "ucx,tcp", "tcp"),
        ucx_endpoint("c", "ucx,mpt,inline", "ucx,tcp", "tcp"),
    )
    .await;
    assert_eq!(property(&s.peer, "ucx.client_server"), Some("1"));
    let listener: std::net::SocketAddr = property(&c.peer, "ucx.listener")
        .expect("the accepting side named no UCX listener")
        .parse()
        .unwrap();
    assert_eq!(listener.ip(), std::net::Ipv4Addr::LOCALHOST);
    assert_ne!(listener.port(), 0);
    for conn in [&s, &c] {
        assert_eq!(conn.transport, "ucx");
        assert_eq!(conn.ucx_fallback, None);
    }
    round_trip(&mut s, &mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_ucx_shared_memory_only_the_endpoints_connect_by_worker_address() {
    if !ucx_here("with_ucx_shared_memory_only_the_endpoints_connect_by_worker_address") {
        return;
    }
    // No network transport on either side: no listener is asked for or
    // opened, and the worker addresses connect the endpoints.
    let (mut s, mut c) = pair(
        ucx_endpoint("s", "ucx,mpt,inline", "ucx,tcp", "shm,self"),
        ucx_endpoint("c", "ucx,mpt,inline", "ucx,tcp", "shm,self"),
    )
    .await;
    assert_eq!(property(&s.peer, "ucx.client_server"), None);
    assert_eq!(property(&c.peer, "ucx.listener"), None);
    for conn in [&s, &c] {
        assert_eq!(conn.transport, "ucx");
        assert_eq!(conn.ucx_fallback, None);
    }
    round_trip(&mut s, &mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_usable_ucx_records_no_fallback() {
    if !ucx_here("a_usable_ucx_records_no_fallback") {
        return;
    }
    let (mut s, mut c) = pair(
        ucx_endpoint("s", "ucx,mpt,inline", "ucx,tcp", "tcp"),
        ucx_endpoint("c", "ucx,mpt,inline", "ucx,tcp", "tcp"),
    )
    .await;
    for conn in [&s, &c] {
        assert_eq!(conn.transport, "ucx");
        assert_eq!(conn.outgoing_channels()[0].channel, "ucx");
        assert_eq!(conn.ucx_fallback, None);
    }
    round_trip(&mut s, &mut c).await;
}

/// Set in the child processes of
/// [`a_process_exiting_with_busy_ucx_links_exits_cleanly`].
const EXIT_CHILD: &str = "FERRY_UCX_EXIT_CHILD";

/// A process may exit with UCX links open and busy, and may drop a
/// connection late in its exit (the RPC layer's immediate shutdown lets
/// its runtime drop connections on its own threads while the main thread
/// exits). Each child keeps messages flowing both ways over the `ucx`
/// channel on the `ucx` transport, exits from the main thread in the middle
/// of that, and drops one more connection at the very end of `exit`, after
/// UCX's library destructors, on the exiting thread: it must exit with
/// status 0, and the late drop must neither crash nor wait for the locks
/// the exit handler (`ucx::exit`) keeps.
///
/// The race the handler closes (a worker destroyed or progressed on another
/// thread *while* UCX's destructors run: SIGSEGV in
/// `ucs_async_context_cleanup`, or heap corruption and a failed assertion
/// in UCX's `vfs_obj.c`) cannot be timed from a test; the RPC suite over
/// the `ucx` channel, which `cargo xtask test` runs, exercises it.
#[test]
fn a_process_exiting_with_busy_ucx_links_exits_cleanly() {
    const TEST: &str = "a_process_exiting_with_busy_ucx_links_exits_cleanly";
    if let Ok(tls) = std::env::var(EXIT_CHILD) {
        exit_mid_traffic(&tls);
    }
    if !ucx_here(TEST) {
        return;
    }
    for tls in ["tcp", "shm,self"] {
        for round in 0..4 {
            let out = run_test_in_child(TEST, (EXIT_CHILD, tls));
            assert_child_succeeded(&out, &format!("child {round} (UCX_TLS={tls})"));
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                stdout.contains("EXCHANGED=") && stdout.contains("LATE_DROP=done"),
                "child {round} (UCX_TLS={tls}) did not do its part:\n{stdout}"
            );
        }
    }
}

/// A connected pair, each side a connection of its own.
type Pair = (PeerConnection, PeerConnection);

/// The connection the child drops in [`drop_late`].
static LATE: std::sync::Mutex<Option<Pair>> = std::sync::Mutex::new(None);

/// glibc's `cookie_io_functions_t` (not in the `libc` crate).
#[repr(C)]
struct CookieIo {
    read: Option<unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> isize>,
    write: Option<unsafe extern "C" fn(*mut c_void, *const c_char, usize) -> isize>,
    seek: Option<unsafe extern "C" fn(*mut c_void, *mut i64, c_int) -> c_int>,
    close: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
}

extern "C" {
    fn fopencookie(cookie: *mut c_void, mode: *const c_char, io: CookieIo) -> *mut libc::FILE;
}

/// Arranges for [`drop_late`] to run at the very end of `exit`: a stdio
/// stream of its own holds one unflushed byte, and glibc flushes every
/// stream (`_IO_cleanup`) after the exit handlers, `_dl_fini` and so UCX's
/// library destructors included.
fn drop_at_the_end_of_exit() {
    let io = CookieIo {
        read: None,
        write: Some(drop_late),
        seek: None,
        close: None,
    };
    // SAFETY: a valid mode string and callbacks with glibc's signatures;
    // the stream is never closed.
    let stream = unsafe { fopencookie(std::ptr::null_mut(), c"w".as_ptr(), io) };
    assert!(!stream.is_null(), "fopencookie failed");
    // SAFETY: a live stream; the byte stays in its buffer until exit.
    assert_eq!(unsafe { libc::fputc(b'.' as c_int, stream) }, b'.' as c_int);
}

unsafe extern "C" fn drop_late(_cookie: *mut c_void, _buf: *const c_char, len: usize) -> isize {
    let late = LATE.lock().map(|mut l| l.take()).unwrap_or(None);
    if let Some(pair) = late {
        drop(pair);
        // Raw write: Rust's stdout may be gone this late.
        let line = b"LATE_DROP=done\n";
        // SAFETY: writes a static buffer to fd 1.
        unsafe { libc::write(1, line.as_ptr().cast(), line.len()) };
    }
    len as isize
}

/// The child's body: a connection with traffic both ways and one kept for
/// [`drop_late`], on a runtime that is never shut down; then `exit(0)`
/// while the traffic flows.
fn exit_mid_traffic(tls: &str) -> ! {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let connect = || {
        runtime.block_on(pair(
            ucx_endpoint("server", "ucx", "ucx", tls),
            ucx_endpoint("client", "ucx", "ucx", tls),
        ))
    };
    let (server, client) = connect();
    assert_link([&server, &client], "ucx", "ucx");
    *LATE.lock().unwrap() = Some(connect());
    drop_at_the_end_of_exit();
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    // Both directions: each connection's writer sends forever and the
    // other's reader takes what arrives.
    for (mut writer, mut reader) in [
        (client.writer, server.reader),
        (server.writer, client.reader),
    ] {
        let started = started_tx.clone();
        runtime.spawn(async move {
            let payload = mixed(7);
            for id in 0.. {
                if writer.write(&message(id, &payload)).await.is_err() {
                    return;
                }
            }
        });
        runtime.spawn(async move {
            let mut read = 0;
            while let Ok(Some(_)) = reader.read().await {
                read += 1;
                if read == 2 {
                    let _ = started.send(());
                }
            }
        });
    }
    for _ in 0..2 {
        started_rx.recv().unwrap();
    }
    println!("EXCHANGED=2 each way");
    // The runtime and its threads stay: they are in the middle of it.
    std::mem::forget(runtime);
    std::process::exit(0)
}
