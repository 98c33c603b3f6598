//! A relay between two members of a group that has a secret runs
//! nothing: the attack of an outsider who can write the rendezvous store
//! (as anyone can write torchrun's agent store, a c10d TCPStore).
//!
//! The members meet at a store that has no secret, spoken to in c10d's
//! TCPStore protocol as torchrun's agent store is (and, in a second test,
//! in Ferry's own store protocol). The outsider rewrites worker1's
//! rendezvous record to point at its own relay, so worker0 connects to the relay, which connects to worker1 and
//! passes the four authentication messages through unchanged: both
//! members accept the handshake. What the relay does next, one connection
//! each:
//! 1. it speaks for worker0 (the handshake frame a worker0 without a
//!    secret would send, which before session-bound records opened a
//!    connection on which the relay could call anything): worker1 closes
//!    the connection, naming the record that failed, and runs nothing;
//! 2. it passes everything through but flips one byte of a tensor on its
//!    way to worker1: worker1 closes the connection, the call fails;
//! 3. it passes everything through: the call works (a relay that changes
//!    nothing is only a longer cable).
//!
//! Real processes on 127.0.0.1, every tensor inline on the TCP stream.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;

use ferry_rpc::store::Store;
use ferry_rpc::{Function, Functions, RpcOptions};
use ferry_testkit::outsider::{group_secret, host_side_store, side_store, WAIT as T};
use ferry_testkit::{worker_rank, world_wrapped_ok};
use ferry_transport::auth::records::Protection;
use ferry_transport::{Endpoint, PeerConnection, RawTensor};
use ferry_wire::{FrameHeader, Limits, HEADER_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const SUM: Function<RawTensor, f64> = Function::new("sum");
/// Plants a key in the store: if anyone but worker0 ever ran it through
/// the relay, the key would be there.
const PLANT: Function<String, ()> = Function::new("plant");

/// The rendezvous record of a worker, as `ferry-rpc` stores it.
#[derive(serde::Serialize, serde::Deserialize)]
struct WorkerRecord {
    name: String,
    addr: SocketAddr,
}

/// Bytes of the authentication messages each way: the connecting side's
/// hello and proof, the accepting side's challenge and verdict.
const FROM_CONNECTOR: [usize; 2] = [38, 38];
const FROM_ACCEPTOR: [usize; 2] = [70, 6];

fn log_warnings() {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .try_init();
}

/// How the processes speak to the store they meet at.
#[derive(Clone, Copy)]
enum Protocol {
    /// c10d's TCPStore protocol, as to torchrun's agent store.
    C10d,
    /// Ferry's own store protocol (a store hosted without a secret).
    Ferry,
}

/// A client of the side store in `protocol`.
fn store_client(rt: &tokio::runtime::Runtime, protocol: Protocol) -> Arc<dyn Store> {
    match protocol {
        Protocol::Ferry => Arc::new(side_store(rt)),
        Protocol::C10d => {
            let addr = std::env::var(ferry_testkit::outsider::SIDE_STORE_ENV)
                .unwrap()
                .parse()
                .unwrap();
            Arc::new(
                rt.block_on(ferry_rpc::store::c10d::C10dStore::connect(addr, T))
                    .unwrap(),
            )
        }
    }
}

fn member(rank: u32, protocol: Protocol) {
    log_warnings();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The store every member meets at: like torchrun's agent store, it
    // has no secret, and anyone who reaches it may write it.
    let store = store_client(&rt, protocol);
    if rank == 0 {
        // Worker0 reads the table once the record has been rewritten.
        rt.block_on(store.wait(&["relay/ready".into()], T)).unwrap();
    }
    let mut functions = Functions::new();
    functions.add(SUM, |t: RawTensor| {
        t.as_slice::<f32>()
            .unwrap()
            .iter()
            .map(|&x| f64::from(x))
            .sum::<f64>()
    });
    let planting = store.clone();
    functions.add(PLANT, move |key: String| {
        let agent = ferry_rpc::Agent::current().unwrap();
        agent
            .block_on(planting.set(&key, b"planted".to_vec()))
            .unwrap();
    });
    let mut options = RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(functions)
        .init_timeout(T)
        .auth_secret(group_secret())
        .store(store.clone());
    options.world_size = 2;
    init_rpc(options).unwrap();
    if rank == 0 {
        let tensor = RawTensor::from_slice(&vec![1.0f32; 64 << 10], &[64 << 10]).unwrap();
        // 1: the relay speaks for worker0.
        let first = PLANT.rpc_sync(1u32, "planted".to_string());
        println!("FIRST={}", first.is_ok());
        // 2: the relay flips a byte of the tensor.
        let second = SUM.rpc_sync(1u32, tensor.clone());
        println!("SECOND={}", second.is_ok());
        // 3: the relay passes everything through.
        let third = SUM.rpc_sync(1u32, tensor).unwrap();
        println!("THIRD={third}");
        rt.block_on(store.set("calls/done", Vec::new())).unwrap();
    }
    rt.block_on(store.wait(&["calls/done".into()], T)).unwrap();
    let planted = rt.block_on(store.check(&["planted".into()])).unwrap();
    println!("PLANTED={planted}");
    // The relay still carries worker0's connection to worker1: a graceful
    // shutdown through it ends cleanly (without it, worker0 could not
    // reach worker1 again and would rightly name it absent).
    ferry_rpc::shutdown().unwrap();
    // The agent closed the client it was given; a new one says so.
    let after = store_client(&rt, protocol);
    rt.block_on(after.set(&format!("shutdown/{rank}"), Vec::new()))
        .unwrap();
}

/// Copies exactly `n` bytes from `from` to `to`.
async fn pass(from: &mut TcpStream, to: &mut TcpStream, n: usize) -> std::io::Result<()> {
    let mut buf = vec![0u8; n];
    from.read_exact(&mut buf).await?;
    to.write_all(&buf).await
}

/// Passes the authentication messages through, in their order.
async fn pass_authentication(c: &mut TcpStream, s: &mut TcpStream) -> std::io::Result<()> {
    pass(c, s, FROM_CONNECTOR[0]).await?;
    pass(s, c, FROM_ACCEPTOR[0]).await?;
    pass(c, s, FROM_CONNECTOR[1]).await?;
    pass(s, c, FROM_ACCEPTOR[1]).await
}

/// The bytes of the handshake frame a worker without a secret sends when
/// it connects as `name` (rank `rank`): what the relay would say for it.
async fn plain_handshake(name: &str, rank: u32) -> Vec<u8> {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let endpoint = Endpoint::new(name, rank);
    let connecting = tokio::spawn(async move { PeerConnection::connect(addr, &endpoint).await });
    let (mut stream, _) = listener.accept().await.unwrap();
    let mut frame = vec![0u8; HEADER_LEN];
    stream.read_exact(&mut frame).await.unwrap();
    let header: [u8; HEADER_LEN] = frame[..].try_into().unwrap();
    let header = FrameHeader::decode(&header, &Limits::default()).unwrap();
    let mut body = vec![0u8; header.body_len()];
    stream.read_exact(&mut body).await.unwrap();
    frame.extend_from_slice(&body);
    connecting.abort();
    frame
}

/// Passes records from `from` to `to`, flipping one byte of the first
/// record large enough to hold a tensor's bytes.
async fn pass_flipping(mut from: impl AsyncReadExt + Unpin, mut to: impl AsyncWriteExt + Unpin) {
    let mut flipped = false;
    loop {
        let mut len = [0u8; 4];
        if from.read_exact(&mut len).await.is_err() {
            return;
        }
        let n = u32::from_be_bytes(len) as usize + Protection::Mac.tag_len();
        let mut record = vec![0u8; n];
        if from.read_exact(&mut record).await.is_err() {
            return;
        }
        if !flipped && n > 100_000 {
            record[n / 2] ^= 0x40;
            flipped = true;
            println!("FLIPPED=1");
        }
        if to.write_all(&len).await.is_err() || to.write_all(&record).await.is_err() {
            return;
        }
    }
}

fn outsider(protocol: Protocol) {
    log_warnings();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = store_client(&rt, protocol);
    rt.block_on(async {
        let key = "ferry/rpc/worker/1";
        store.wait(&[key.into()], T).await.unwrap();
        let record: WorkerRecord = postcard::from_bytes(&store.get(key).await.unwrap()).unwrap();
        let worker1 = record.addr;
        let relay = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let forged = WorkerRecord {
            name: record.name,
            addr: relay.local_addr().unwrap(),
        };
        store
            .set(key, postcard::to_stdvec(&forged).unwrap())
            .await
            .unwrap();
        store.set("relay/ready", Vec::new()).await.unwrap();

        // 1: speak for worker0 after the handshake.
        let (mut c, _) = relay.accept().await.unwrap();
        let mut s = TcpStream::connect(worker1).await.unwrap();
        pass_authentication(&mut c, &mut s).await.unwrap();
        s.write_all(&plain_handshake("worker0", 0).await)
            .await
            .unwrap();
        let mut rest = Vec::new();
        // Worker1 closes the connection without a word (it used to answer
        // with its own handshake, and then serve the relay's calls).
        let n = s.read_to_end(&mut rest).await.unwrap_or(0);
        println!("INJECTED_REPLY_BYTES={n}");
        drop((c, s));

        // 2: pass everything, flipping one byte of a tensor.
        let (c, _) = relay.accept().await.unwrap();
        let s = TcpStream::connect(worker1).await.unwrap();
        let (mut c, mut s) = (c, s);
        pass_authentication(&mut c, &mut s).await.unwrap();
        let (cr, mut cw) = c.into_split();
        let (mut sr, sw) = s.into_split();
        tokio::join!(pass_flipping(cr, sw), async {
            let _ = tokio::io::copy(&mut sr, &mut cw).await;
            let _ = cw.shutdown().await;
        });

        // 3: pass everything.
        let (mut c, _) = relay.accept().await.unwrap();
        let mut s = TcpStream::connect(worker1).await.unwrap();
        let relaying = tokio::spawn(async move {
            let _ = tokio::io::copy_bidirectional(&mut c, &mut s).await;
        });
        store
            .wait(&["shutdown/0".into(), "shutdown/1".into()], T)
            .await
            .unwrap();
        relaying.abort();
    });
}

/// Runs the three processes of `test` with the members meeting over
/// `protocol`, and checks what each saw.
fn relayed(test: &str, protocol: Protocol) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let side = host_side_store(&rt, worker_rank(test).is_none());
    let env = side.as_ref().map_or("", |(_, env)| *env);
    let Some(outputs) = world_wrapped_ok(
        test,
        3,
        |_| vec!["env", env, "FERRY_TRANSPORTS=tcp", "FERRY_CHANNELS=inline"],
        |rank| {
            if rank < 2 {
                member(rank, protocol)
            } else {
                outsider(protocol)
            }
        },
    ) else {
        return;
    };
    assert_eq!(outputs[0].values("FIRST"), ["false"]);
    assert_eq!(outputs[0].values("SECOND"), ["false"]);
    assert_eq!(outputs[0].values("THIRD"), [format!("{}", 64 << 10)]);
    assert_eq!(outputs[2].values("INJECTED_REPLY_BYTES"), ["0"]);
    assert_eq!(outputs[2].values("FLIPPED"), ["1"]);
    for o in &outputs[..2] {
        assert_eq!(o.values("PLANTED"), ["false"]);
    }
    // Worker1 closed both tampered connections, naming the record.
    let log = &outputs[1].stderr;
    let tampered: Vec<_> = log
        .lines()
        .filter(|l| l.contains("tampered with: record"))
        .collect();
    assert_eq!(tampered.len(), 2, "{log}");
    // The relay's handshake frame is no record: its first bytes, read as
    // one's length, announce far more than a record may carry.
    assert!(tampered[0].contains("record 0 announces"), "{log}");
    assert!(tampered[1].contains("failed its integrity check"), "{log}");
}

#[test]
fn under_an_agent_store_a_relay_can_neither_speak_nor_alter() {
    relayed(
        "under_an_agent_store_a_relay_can_neither_speak_nor_alter",
        Protocol::C10d,
    );
}

#[test]
fn under_a_ferry_store_without_a_secret_a_relay_can_neither_speak_nor_alter() {
    relayed(
        "under_a_ferry_store_without_a_secret_a_relay_can_neither_speak_nor_alter",
        Protocol::Ferry,
    );
}

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
