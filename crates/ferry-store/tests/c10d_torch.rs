//! Ferry's c10d `TCPStore` protocol against the real one: PyTorch's
//! `torch.distributed.TCPStore` from the repository's `.venv`, in each
//! direction.
//!
//! - `ferry_client_against_torchs_server`: PyTorch hosts the store (its
//!   default libuv server, which ignores clients until they validate);
//!   Ferry's [`C10dStore`] sets, gets, adds, compare-sets, waits with a
//!   timeout, checks, deletes and counts keys, and the Python side reads
//!   and writes the same keys. `ferry_client_against_torchs_legacy_server`
//!   does the same against PyTorch's older server (`use_libuv=False`).
//! - `torch_client_against_ferrys_server`: Ferry's [`TcpStoreServer`]
//!   hosts; PyTorch's client does the same, and Ferry's own client on the
//!   same port sees its keys.
//!
//! Without `.venv/bin/python` or without torch in it, the tests print
//! `SKIPPED: …` and pass.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use ferry_store::c10d::wire::{self, Query, Reply, ReplyKind, VALIDATION_MAGIC};
use ferry_store::{C10dStore, Store, StoreError, TcpStore, TcpStoreServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bound on every test: a hang fails instead of stalling CI.
const BOUND: Duration = Duration::from_secs(120);
const TIMEOUT: Duration = Duration::from_secs(30);

/// `.venv/bin/python` at the repository root if it has torch; otherwise
/// `None`, printed as skipped.
fn torch_python() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent()?.parent()?;
    let python = root.join(".venv").join("bin").join("python");
    if !python.is_file() {
        println!("SKIPPED: no .venv/bin/python at the repository root");
        return None;
    }
    // Finding the package is enough (importing torch takes seconds).
    let ok = Command::new(&python)
        .args([
            "-c",
            "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        println!("SKIPPED: {} has no torch", python.display());
        return None;
    }
    Some(python)
}

/// A Python child whose stdout is read line by line; killed when dropped.
struct Py {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Py {
    fn start(python: &Path, program: &str, args: &[String]) -> Py {
        let mut child = Command::new(python)
            .arg("-c")
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the .venv's python");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Py {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The value of the first line `KEY=value` the program prints.
    fn value(&mut self, key: &str) -> String {
        let prefix = format!("{key}=");
        loop {
            let line = self
                .lines
                .recv_timeout(BOUND)
                .unwrap_or_else(|_| panic!("python printed no {key}= (so far: {:?})", self.seen));
            self.seen.push(line.clone());
            if let Some(v) = line.strip_prefix(&prefix) {
                return v.to_owned();
            }
        }
    }

    /// Waits for the program to exit with success.
    fn finish(mut self) -> Vec<String> {
        while let Ok(line) = self.lines.recv_timeout(BOUND) {
            self.seen.push(line);
        }
        let status = self.child.wait().expect("wait for python");
        assert!(
            status.success(),
            "python failed: {status}; printed {:?}",
            self.seen
        );
        std::mem::take(&mut self.seen)
    }
}

impl Drop for Py {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("the test finished within its bound")
}

/// PyTorch hosts; it writes `from_torch`, waits for `ferry_done`, checks
/// what Ferry wrote, writes `torch_done`, and serves until `ferry_bye`.
const TORCH_SERVER: &str = r#"
import datetime, sys, torch.distributed as dist
T = datetime.timedelta(seconds=60)
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T,
                  use_libuv=sys.argv[1] == "libuv")
print(f"LIBUV={s.libuvBackend}", flush=True)
s.set("from_torch", b"hello ferry")
s.set("to_delete", b"x")
print(f"PORT={s.port}", flush=True)
s.wait(["ferry_done"], T)
assert s.get("from_ferry") == b"hello torch", s.get("from_ferry")
assert s.get("counter") == b"7", s.get("counter")
assert s.add("counter", 1) == 8
assert s.get("claim") == b"ferry", s.get("claim")
assert not s.check(["to_delete"])
s.set("torch_done", b"1")
s.wait(["ferry_bye"], T)
print("TORCH=ok", flush=True)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ferry_client_against_torchs_server() {
    ferry_client_against(true).await;
}

/// The same against PyTorch's older, non-libuv server (`use_libuv=False`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ferry_client_against_torchs_legacy_server() {
    ferry_client_against(false).await;
}

async fn ferry_client_against(libuv: bool) {
    let Some(python) = torch_python() else {
        return;
    };
    let backend = if libuv { "libuv" } else { "legacy" };
    let mut py = Py::start(&python, TORCH_SERVER, &[backend.to_string()]);
    let expected = if libuv { "True" } else { "False" };
    assert_eq!(py.value("LIBUV"), expected, "the {backend} server");
    let port: u16 = py.value("PORT").parse().unwrap();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    within(async {
        let store = C10dStore::connect(addr, TIMEOUT).await.unwrap();
        // Keys torch wrote, with torch's `/` prefix taken care of.
        assert_eq!(store.get("from_torch").await.unwrap(), b"hello ferry");
        assert!(store.check(&["from_torch".into()]).await.unwrap());
        assert!(!store.check(&["nobody".into()]).await.unwrap());
        store
            .set("from_ferry", b"hello torch".to_vec())
            .await
            .unwrap();
        assert_eq!(store.add("counter", 5).await.unwrap(), 5);
        assert_eq!(store.add("counter", 2).await.unwrap(), 7);
        // compare-set: absent + empty expected stores; a mismatch returns
        // the current value; a match swaps.
        assert_eq!(
            store
                .compare_set("claim", None, b"x".to_vec())
                .await
                .unwrap(),
            b"x"
        );
        assert_eq!(
            store
                .compare_set("claim", Some(b"y".to_vec()), b"z".to_vec())
                .await
                .unwrap(),
            b"x"
        );
        assert_eq!(
            store
                .compare_set("claim", Some(b"x".to_vec()), b"ferry".to_vec())
                .await
                .unwrap(),
            b"ferry"
        );
        assert!(store.delete("to_delete").await.unwrap());
        assert!(!store.delete("to_delete").await.unwrap());
        // A wait that times out names the missing key; the canceled wait
        // leaves the connection usable.
        match store
            .wait(
                &["from_torch".into(), "never".into()],
                Duration::from_millis(200),
            )
            .await
        {
            Err(StoreError::Timeout { keys, .. }) => assert_eq!(keys, vec!["never".to_string()]),
            other => panic!("expected a timeout, got {other:?}"),
        }
        // from_torch, from_ferry, counter, claim (to_delete is gone).
        assert_eq!(store.num_keys().await.unwrap(), 4);
        store.set("ferry_done", Vec::new()).await.unwrap();
        // A wait answered once torch sets the key.
        store.wait(&["torch_done".into()], TIMEOUT).await.unwrap();
        assert_eq!(store.get("counter").await.unwrap(), b"8");
        store.append("log", b"a".to_vec()).await.unwrap();
        store.append("log", b"b".to_vec()).await.unwrap();
        assert_eq!(store.get("log").await.unwrap(), b"ab");
        store.set("ferry_bye", Vec::new()).await.unwrap();
    })
    .await;
    let printed = py.finish();
    assert!(printed.iter().any(|l| l == "TORCH=ok"), "{printed:?}");
}

/// PyTorch's client on Ferry's server: every operation, checked in Python,
/// then `py_done`; it reads `ferry_said` which Ferry's own client wrote.
const TORCH_CLIENT: &str = r#"
import datetime, sys, torch.distributed as dist
T = datetime.timedelta(seconds=60)
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, wait_for_workers=False, timeout=T)
s.set("a", b"1")
assert s.get("a") == b"1"
assert s.add("n", 3) == 3 and s.add("n", -1) == 2
assert s.get("n") == b"2"
assert s.compare_set("c", "", "first") == b"first"
assert s.compare_set("c", "wrong", "second") == b"first"
assert s.compare_set("c", "first", "second") == b"second"
assert s.compare_set("absent", "expected", "v") == b"expected"
assert not s.check(["absent"])
assert s.check(["a", "n"]) and not s.check(["a", "zz"])
try:
    s.wait(["zz"], datetime.timedelta(milliseconds=200))
    raise SystemExit("wait did not time out")
except dist.DistStoreError:
    pass
s.set("tmp", b"x")
assert s.delete_key("tmp") and not s.delete_key("tmp")
s.multi_set(["m1", "m2"], [b"v1", b"v2"])
assert s.multi_get(["m1", "m2"]) == [b"v1", b"v2"]
s.append("log", b"x"); s.append("log", b"y")
assert s.get("log") == b"xy"
print(f"NUM_KEYS={s.num_keys()}", flush=True)
s.set("py_done", b"")
s.wait(["ferry_said"], T)
print(f"FERRY_SAID={s.get('ferry_said').decode()}", flush=True)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torch_client_against_ferrys_server() {
    let Some(python) = torch_python() else {
        return;
    };
    let server = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = server.local_addr();
    let mut py = Py::start(&python, TORCH_CLIENT, &[addr.port().to_string()]);
    // Ferry's own protocol on the same port, over the same keys (the
    // torch client put `/` before each).
    let ferry: Arc<dyn Store> = Arc::new(TcpStore::connect(addr, TIMEOUT).await.unwrap());
    within(async {
        ferry.wait(&["/py_done".into()], BOUND).await.unwrap();
        assert_eq!(ferry.get("/a").await.unwrap(), b"1");
        assert_eq!(ferry.get("/n").await.unwrap(), b"2");
        assert_eq!(ferry.get("/c").await.unwrap(), b"second");
        assert_eq!(ferry.get("/log").await.unwrap(), b"xy");
        assert!(!ferry.check(&["/tmp".into()]).await.unwrap());
        // a, n, c, m1, m2, log, py_done.
        assert_eq!(server.memory().len(), 7);
        ferry.set("/ferry_said", b"hi".to_vec()).await.unwrap();
    })
    .await;
    assert_eq!(py.value("NUM_KEYS"), "6");
    assert_eq!(py.value("FERRY_SAID"), "hi");
    py.finish();
    // Ferry's c10d client against Ferry's server sees the same keys.
    within(async {
        let c10d = C10dStore::connect(addr, TIMEOUT).await.unwrap();
        assert_eq!(c10d.get("ferry_said").await.unwrap(), b"hi");
        assert_eq!(c10d.num_keys().await.unwrap(), 8);
    })
    .await;
}

/// Sends `bytes` on a raw connection to `addr` and returns what comes
/// back until the server closes the connection.
async fn raw_until_closed(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut back = Vec::new();
    within(s.read_to_end(&mut back)).await.unwrap();
    back
}

/// The validation handshake on Ferry's server: a wrong magic number, or
/// any query before `VALIDATE`, closes the connection without an answer;
/// a validated client is answered; the server serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ferrys_server_requires_the_validation_handshake() {
    let server = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = server.local_addr();
    let enc = |q: &Query| wire::encode_query(q).unwrap();
    let ping = enc(&Query::Ping { nonce: 77 });

    // The preamble (type and the magic's low three bytes) matches, the
    // magic's last byte does not.
    let mut bad_magic = enc(&Query::Validate { magic: 0x3D85_F7CE });
    bad_magic.extend_from_slice(&ping);
    assert_eq!(raw_until_closed(addr, &bad_magic).await, b"");

    // A query before VALIDATE is a Ferry frame as far as the first bytes
    // go, and not a valid one: closed, unanswered.
    assert_eq!(raw_until_closed(addr, &ping).await, b"");

    let mut good = enc(&Query::Validate {
        magic: VALIDATION_MAGIC,
    });
    good.extend_from_slice(&ping);
    good.extend_from_slice(&enc(&Query::QueueLen { key: "/q".into() }));
    let back = raw_until_closed(addr, &good).await;
    // The ping is answered; the queue query (not served) closes.
    assert_eq!(
        wire::decode_reply(ReplyKind::Nonce, &back).unwrap(),
        Some((Reply::Nonce(77), 4))
    );
    assert_eq!(back.len(), 4);

    let store = C10dStore::connect(addr, TIMEOUT).await.unwrap();
    store.set("still", b"serving".to_vec()).await.unwrap();
    assert_eq!(store.get("still").await.unwrap(), b"serving");
}
