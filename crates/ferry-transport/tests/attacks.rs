//! Attacks on a worker from a client that does not play by the rules, each
//! across real processes on 127.0.0.1.
//!
//! The test process is the attacker. It starts the worker (an echo server:
//! this test binary re-run with `FERRY_ATTACK_ROLE=worker`, which prints
//! its port) and, where an attack needs one, an unrelated victim process
//! (`FERRY_ATTACK_ROLE=victim`, holding a secret in its environment). Every
//! child is killed when its guard drops; every wait is bounded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use ferry_transport::selection::Selection;
use ferry_transport::shm::{send_fds, ShmLink};
use ferry_transport::{
    channel, Allocator, Endpoint, FrameReader, FrameWriter, OutgoingMessage, PeerConnection,
    RawAllocator, RawTensor, RecvBuffer, TransportError,
};
use ferry_wire::{
    encode_descriptors, DType, Device, Flags, FrameHeader, Handshake, Limits, MessageKind,
    TensorDescriptor, HEADER_LEN, PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bound on every step an attack waits for.
const STEP: Duration = Duration::from_secs(20);

/// A child process, killed (by its own pid) when dropped.
struct Proc {
    child: Child,
    stdout: BufReader<ChildStdout>,
}

impl Proc {
    fn start(role: &str, envs: &[(&str, String)]) -> Proc {
        let mut c = Command::new(std::env::current_exe().unwrap());
        c.args([
            "role_entry_point",
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("FERRY_ATTACK_ROLE", role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        for (k, v) in envs {
            c.env(k, v);
        }
        let mut child = c.spawn().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Proc { child, stdout }
    }

    /// The next `KEY=value` line the child prints with this key.
    fn value(&mut self, key: &str) -> String {
        let prefix = format!("{key}=");
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "the child exited before printing {key}");
            if let Some((_, v)) = line.rsplit_once(&prefix) {
                return v.trim().to_string();
            }
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The entry point of the child roles; a no-op as an ordinary test.
#[test]
fn role_entry_point() {
    match std::env::var("FERRY_ATTACK_ROLE").as_deref() {
        Ok("worker") => worker(),
        Ok("victim") => {
            println!("READY=1");
            // Holds its secret until the attacker closes our stdin.
            let _ = std::io::stdin().read_line(&mut String::new());
        }
        _ => {}
    }
}

/// The worker: accepts connections and answers each request with the bytes
/// of the tensors it received (an echo), in the payload.
fn worker() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("PORT={}", listener.local_addr().unwrap().port());
        println!("PID={}", std::process::id());
        let mut endpoint = Endpoint::new("worker", 0);
        endpoint.allocator = Arc::new(Announcing);
        if let Ok(ms) = std::env::var("FERRY_ATTACK_STALL_MS") {
            endpoint.limits.frame_stall_timeout = Duration::from_millis(ms.parse().unwrap());
        }
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let endpoint = endpoint.clone();
            tokio::spawn(async move {
                let mut conn = match PeerConnection::accept(stream, &endpoint).await {
                    Ok(c) => c,
                    Err(e) => return println!("ACCEPT_FAILED={e}"),
                };
                loop {
                    let msg = match conn.reader.read().await {
                        Ok(Some(m)) => m,
                        Ok(None) => return,
                        Err(e) => return println!("READ_FAILED={e}"),
                    };
                    let mut echoed = Vec::new();
                    for t in msg.tensors {
                        let t = t.storage.downcast::<RawTensor>().unwrap();
                        echoed.extend_from_slice(&t.to_contiguous_bytes());
                    }
                    let reply = OutgoingMessage {
                        kind: MessageKind::RESPONSE,
                        flags: Flags::REPLY,
                        request_id: msg.header.request_id,
                        payload: echoed,
                        tensors: Vec::new(),
                    };
                    if conn.writer.write(&reply).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
}

/// The worker's allocator: the default one, announcing each destination it
/// hands out (`ALLOCATED=<bytes>`) so that the attacker knows when to look.
struct Announcing;

impl Allocator for Announcing {
    fn allocate(
        &self,
        descriptor: &TensorDescriptor,
    ) -> Result<Box<dyn RecvBuffer>, TransportError> {
        let dest = RawAllocator.allocate(descriptor)?;
        println!("ALLOCATED={}", descriptor.byte_len);
        Ok(dest)
    }
}

fn start_worker(envs: &[(&str, String)]) -> (Proc, SocketAddr) {
    let mut w = Proc::start("worker", envs);
    let port: u16 = w.value("PORT").parse().unwrap();
    (w, SocketAddr::from(([127, 0, 0, 1], port)))
}

/// A raw client: TCP halves wrapped in frame I/O with nothing negotiated.
struct Raw {
    reader: FrameReader<tokio::net::tcp::OwnedReadHalf>,
    writer: FrameWriter<tokio::net::tcp::OwnedWriteHalf>,
}

async fn raw(addr: SocketAddr) -> Raw {
    let (r, w) = TcpStream::connect(addr).await.unwrap().into_split();
    Raw {
        reader: FrameReader::new(
            r,
            Limits::default(),
            Arc::new(RawAllocator),
            Selection::default(),
            "worker",
        ),
        writer: FrameWriter::new(w, Selection::default(), "worker"),
    }
}

fn handshake(
    transports: &str,
    channels: &str,
    properties: Vec<(String, String)>,
) -> OutgoingMessage {
    let h = Handshake {
        protocol_version: PROTOCOL_VERSION,
        worker_name: "attacker".into(),
        rank: 1,
        transports: channel::parse_transports(transports).unwrap(),
        channels: channel::parse_channels(channels).unwrap(),
        selection: Vec::new(),
        properties,
        limits: Limits::default(),
        ucx_address: None,
    };
    OutgoingMessage {
        kind: MessageKind::HANDSHAKE,
        flags: Flags::NONE,
        request_id: 0,
        payload: h.encode().unwrap(),
        tensors: Vec::new(),
    }
}

/// The start of a request frame with no payload and one `len`-byte tensor:
/// its header and descriptor table, up to the tensor's mode byte.
fn one_tensor_request(request_id: u64, len: u64) -> Vec<u8> {
    let d = TensorDescriptor::contiguous(DType::U8, &[len as i64], Device::Cpu);
    let mut table = Vec::new();
    encode_descriptors(&[d], &mut table);
    let header = FrameHeader {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id,
        payload_len: 0,
        descriptors_len: table.len() as u32,
        tensor_count: 1,
    };
    let mut frame = header.encode().to_vec();
    frame.extend_from_slice(&table);
    frame
}

/// A request whose one `len`-byte tensor travels as a `cma` record naming
/// `addr`: the receiver is asked to pull the bytes from there.
fn cma_request(addr: u64, len: u64) -> Vec<u8> {
    let mut frame = one_tensor_request(7, len);
    frame.push(1); // mode: the channel's record follows
    frame.extend_from_slice(&addr.to_le_bytes());
    frame.extend_from_slice(&0u64.to_le_bytes()); // release token
    frame
}

/// Where process `pid` keeps its environment (`/proc/<pid>/stat` fields
/// 50 and 51) and the bytes there.
fn environment_of(pid: u32) -> (u64, Vec<u8>) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    // Field 3 (state) is the first after the command name.
    let start: u64 = fields[50 - 3].parse().unwrap();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    assert!(
        start != 0 && !environ.is_empty(),
        "cannot see {pid}'s environment"
    );
    (start, environ)
}

fn property<'a>(h: &'a Handshake, key: &str) -> Option<&'a str> {
    h.properties
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// Sends `frame` on `w` and reads the answer on `r`.
async fn ask<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    mut r: R,
    mut w: W,
    frame: &[u8],
) -> Option<Vec<u8>> {
    w.write_all(frame).await.ok()?;
    w.flush().await.ok()?;
    read_reply(&mut r).await
}

/// The payload of the next frame that is not channel bookkeeping: `None`
/// when the worker closed or failed the connection instead of answering.
async fn read_reply<R: AsyncRead + Unpin>(r: &mut R) -> Option<Vec<u8>> {
    let read = async {
        loop {
            let mut head = [0u8; HEADER_LEN];
            r.read_exact(&mut head).await.ok()?;
            let header = FrameHeader::decode(&head, &Limits::default()).ok()?;
            let mut body = vec![0u8; header.body_len()];
            r.read_exact(&mut body).await.ok()?;
            if header.kind != MessageKind::RELEASE {
                return Some(body.split_off(header.descriptors_len as usize));
            }
        }
    };
    tokio::time::timeout(STEP, read)
        .await
        .unwrap_or_else(|_| panic!("the worker neither answered nor closed within {STEP:?}"))
}

/// A client that claims another process's pid in its
/// handshake must not make the worker read that process's memory. Over TCP
/// it must not get `cma` at all; over the `shm` transport the worker reads
/// only from the process the kernel names as its peer (the attacker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_pid_never_makes_cma_read_another_process() {
    if channel::cma_viability().is_err() {
        panic!(
            "cma is not viable here: {:?}",
            channel::cma_viability().unwrap_err()
        );
    }
    let secret = format!(
        "{:032x}",
        std::process::id() as u128 * 0x9e37_79b9_7f4a_7c15
    );
    let mut victim = Proc::start("victim", &[("FERRY_VICTIM_SECRET", secret.clone())]);
    victim.value("READY");
    let (start, environ) = environment_of(victim.pid());
    assert!(String::from_utf8_lossy(&environ).contains(&secret));
    let (_worker, addr) = start_worker(&[]);
    let claim = vec![("pid".to_string(), victim.pid().to_string())];
    let leaked = |bytes: &[u8]| String::from_utf8_lossy(bytes).contains(&secret);

    // Over TCP: the worker must not select cma for what we send.
    let mut c = raw(addr).await;
    c.writer
        .write(&handshake("tcp", "cma,inline", claim.clone()))
        .await
        .unwrap();
    let reply = tokio::time::timeout(STEP, c.reader.read())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let reply = Handshake::decode(&reply.payload).unwrap();
    let tcp_cma = reply.selection.iter().any(|s| s.channel == channel::CMA);
    if tcp_cma {
        // Today's hole: go on with the attack and see what comes back.
        c.writer
            .write_raw_for_tests(&cma_request(start, environ.len() as u64))
            .await;
        let answer = read_reply(c.reader.stream_mut()).await;
        assert!(
            !answer.as_deref().is_some_and(leaked),
            "over TCP, the worker read the victim's environment for us"
        );
    }
    assert!(
        !tcp_cma,
        "a peer whose frames come over TCP was offered cma: {:?}",
        reply.selection
    );

    // Over the shm transport: cma is allowed, but only from our own memory.
    let mut c = raw(addr).await;
    c.writer
        .write(&handshake("shm,tcp", "cma,inline", claim))
        .await
        .unwrap();
    let reply = tokio::time::timeout(STEP, c.reader.read())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let reply = Handshake::decode(&reply.payload).unwrap();
    assert!(
        reply.selection.iter().any(|s| s.channel == channel::CMA),
        "with the shm transport cma is selected: {:?}",
        reply.selection
    );
    let socket = property(&reply, "shm.socket").expect("the worker names its socket");
    let unix = {
        use std::os::linux::net::SocketAddrExt;
        let a = std::os::unix::net::SocketAddr::from_abstract_name(socket.as_bytes()).unwrap();
        let s = std::os::unix::net::UnixStream::connect_addr(&a).unwrap();
        s.set_nonblocking(true).unwrap();
        tokio::net::UnixStream::from_std(s).unwrap()
    };
    let (link, fds) = ShmLink::create(1 << 20).unwrap();
    let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    send_fds(&unix, &[1, 0], &borrowed).await.unwrap();
    let (sr, sw) = link.split(None);
    let answer = ask(sr, sw, &cma_request(start, environ.len() as u64)).await;
    assert!(
        !answer.as_deref().is_some_and(leaked),
        "the worker read the victim's environment for a peer that claimed its pid"
    );
    drop(c);
    let _ = victim.child.stdin.take();
}

/// Waits (bounded) until the worker closes `s`; fails if it sends anything.
async fn closed_without_a_word(s: &mut TcpStream) {
    let mut got = Vec::new();
    match tokio::time::timeout(STEP, s.read_to_end(&mut got)).await {
        Ok(_) => assert!(got.is_empty(), "the worker sent {} bytes", got.len()),
        Err(_) => panic!("the worker kept the connection open for {STEP:?}"),
    }
}

/// The header of the first frame is checked against the
/// handshake's 64 KiB cap before anything else is read: a header announcing
/// 256 MiB closes the connection at once, and the worker serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_frame_larger_than_a_handshake_is_refused_unread() {
    let (mut worker, addr) = start_worker(&[]);
    let mut s = TcpStream::connect(addr).await.unwrap();
    let header = FrameHeader {
        kind: MessageKind::HANDSHAKE,
        flags: Flags::NONE,
        request_id: 0,
        payload_len: 256 << 20,
        descriptors_len: 0,
        tensor_count: 0,
    };
    s.write_all(&header.encode()).await.unwrap();
    closed_without_a_word(&mut s).await;
    let err = worker.value("ACCEPT_FAILED");
    assert!(
        err.contains("payload length") && err.contains(&(64 << 10).to_string()),
        "{err}"
    );
    PeerConnection::connect(addr, &Endpoint::new("client", 1))
        .await
        .expect("the worker still serves");
}

/// Handshake disclosure: a client that sends garbage or
/// an invalid handshake gets nothing back; one whose handshake is valid
/// but shares no same-host domain learns neither the worker's pid nor its
/// boot id, namespaces or user ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_reveals_nothing_a_stranger_does_not_need() {
    let (worker, addr) = start_worker(&[]);
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n")
        .await
        .unwrap();
    closed_without_a_word(&mut s).await;

    let mut wrong = Handshake::decode(&handshake("tcp", "inline", Vec::new()).payload).unwrap();
    wrong.protocol_version = PROTOCOL_VERSION + 1;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let payload = wrong.encode().unwrap();
    let header = FrameHeader {
        kind: MessageKind::HANDSHAKE,
        flags: Flags::NONE,
        request_id: 0,
        payload_len: payload.len() as u32,
        descriptors_len: 0,
        tensor_count: 0,
    };
    s.write_all(&[&header.encode()[..], &payload].concat())
        .await
        .unwrap();
    closed_without_a_word(&mut s).await;

    let mut c = raw(addr).await;
    c.writer
        .write(&handshake("tcp", "inline", Vec::new()))
        .await
        .unwrap();
    let reply = tokio::time::timeout(STEP, c.reader.read())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let reply = Handshake::decode(&reply.payload).unwrap();
    let text = format!("{reply:?}");
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    for secret in [
        boot.trim(),
        "pid:[",
        "user:[",
        "net:[",
        "uid=",
        &worker.pid().to_string(),
    ] {
        assert!(
            !text.contains(secret),
            "the reply reveals {secret:?}: {text}"
        );
    }
    assert_eq!(reply.worker_name, "worker");
    assert_eq!(reply.selection.len(), 1, "{:?}", reply.selection);
}

/// A process's resident memory (`VmRSS` of `/proc/<pid>/status`), in bytes.
fn rss_of(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("VmRSS in /proc/<pid>/status");
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

/// An attacker's connection: a valid handshake, then the start of a request
/// whose one inline tensor is announced as `len` bytes, of which only
/// `sent` follow. The stream is returned open and silent.
async fn announce_and_fall_silent(addr: SocketAddr, len: u64, sent: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let h = handshake("tcp", "inline", Vec::new());
    let header = FrameHeader {
        kind: MessageKind::HANDSHAKE,
        flags: Flags::NONE,
        request_id: 0,
        payload_len: h.payload.len() as u32,
        descriptors_len: 0,
        tensor_count: 0,
    };
    s.write_all(&[&header.encode()[..], &h.payload].concat())
        .await
        .unwrap();
    let mut frame = one_tensor_request(9, len);
    frame.extend(std::iter::repeat_n(0x5a, sent));
    s.write_all(&frame).await.unwrap();
    s.flush().await.unwrap();
    s
}

/// An honest client's echo of an 8 MiB tensor: the worker still serves.
async fn honest_echo(addr: SocketAddr) {
    let mut c = PeerConnection::connect(addr, &Endpoint::new("honest", 1))
        .await
        .expect("the worker accepts an honest client");
    let bytes: Vec<u8> = (0..8u32 << 20).map(|i| (i % 251) as u8).collect();
    let t = RawTensor::from_bytes(DType::U8, &[bytes.len() as i64], &bytes).unwrap();
    let request = OutgoingMessage {
        kind: MessageKind::REQUEST,
        flags: Flags::NONE,
        request_id: 1,
        payload: Vec::new(),
        tensors: vec![Arc::new(t)],
    };
    c.writer.write(&request).await.unwrap();
    let reply = tokio::time::timeout(STEP, c.reader.read())
        .await
        .expect("the worker answers the honest client in time")
        .unwrap()
        .expect("a reply");
    assert!(reply.payload == bytes, "the echo differs");
}

/// Two small frames announcing 2 GiB tensors each, then
/// silence, must not make the worker commit the memory they announce. The
/// worker commits receive memory in step with the bytes that arrive, so its
/// resident memory grows by a few MiB (one receive step per connection),
/// not 4 GiB; and it serves an honest client meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_tensors_that_never_arrive_cost_no_memory() {
    let (mut worker, addr) = start_worker(&[]);
    honest_echo(addr).await; // warm up: runtime, pool, first connection
    assert_eq!(worker.value("ALLOCATED"), (8u64 << 20).to_string());
    let before = rss_of(worker.pid());
    let _a = announce_and_fall_silent(addr, 2 << 30, 1000).await;
    assert_eq!(worker.value("ALLOCATED"), (2u64 << 30).to_string());
    let _b = announce_and_fall_silent(addr, 2 << 30, 1000).await;
    assert_eq!(worker.value("ALLOCATED"), (2u64 << 30).to_string());
    let grown = rss_of(worker.pid()).saturating_sub(before);
    eprintln!("worker RSS grew by {} KiB", grown >> 10);
    assert!(
        grown < 64 << 20,
        "two silent 2 GiB announcements cost the worker {} MiB",
        grown >> 20
    );
    honest_echo(addr).await;
}

/// A frame that stops arriving closes its connection
/// once the stall timeout runs out, with an error naming the peer and the
/// piece that stalled; the worker serves other peers on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_that_stops_arriving_closes_its_connection() {
    let (mut worker, addr) = start_worker(&[("FERRY_ATTACK_STALL_MS", "300".into())]);
    let mut s = announce_and_fall_silent(addr, 2 << 30, 1000).await;
    assert_eq!(worker.value("ALLOCATED"), (2u64 << 30).to_string());
    let err = worker.value("READ_FAILED");
    assert!(
        err.contains("attacker")
            && err.contains("stalled mid-frame")
            && err.contains(&format!("1000 of {} bytes", 2u64 << 30))
            && err.contains("tensor 0 of 1")
            && err.contains("channel inline")
            && err.contains("request frame"),
        "{err}"
    );
    // The worker closed the connection: what is left to read is its
    // handshake reply, then the end of the stream.
    let mut got = Vec::new();
    tokio::time::timeout(STEP, s.read_to_end(&mut got))
        .await
        .expect("the worker closed the stalled connection")
        .ok();
    honest_echo(addr).await;

    // A frame that stalls inside its header is cut off the same way.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let h = handshake("tcp", "inline", Vec::new());
    let header = FrameHeader {
        kind: MessageKind::HANDSHAKE,
        flags: Flags::NONE,
        request_id: 0,
        payload_len: h.payload.len() as u32,
        descriptors_len: 0,
        tensor_count: 0,
    };
    s.write_all(&[&header.encode()[..], &h.payload, &b"FRY"[..]].concat())
        .await
        .unwrap();
    let err = worker.value("READ_FAILED");
    assert!(
        err.contains("stalled mid-frame") && err.contains("3 of 32 bytes of the frame header"),
        "{err}"
    );
}
