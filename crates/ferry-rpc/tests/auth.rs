//! A group holding a shared secret lets no outsider in: a process with
//! another secret, with none, or replaying a captured handshake cannot
//! call a function, send any other message (an RRef's `remote` travels the
//! same way), or read or write a rendezvous store key — each refused
//! before a frame of it is read, with a warning naming its address — and
//! the group serves on meanwhile. Real processes on 127.0.0.1; the
//! outsider learns the victim's RPC address through a side store the test
//! hosts (state, not time).
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;

use ferry_rpc::store::{Store, TcpStore};
use ferry_rpc::{Function, Functions, RpcOptions};
use ferry_testkit::outsider::{
    captured_handshake, group_secret, host_side_store, replay, side_store, wrong_secret, WAIT as T,
};
use ferry_testkit::{worker_rank, world_wrapped_ok};
use ferry_transport::{Endpoint, PeerConnection};

const ADD: Function<(i64, i64), i64> = Function::new("add");
/// Plants a key in the group's store: if an outsider ever ran it, the
/// key would be there.
const PLANT: Function<String, ()> = Function::new("plant");

fn log_warnings() {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .try_init();
}

/// Member `rank` of the group of 2 (the third process is the outsider).
fn member(rank: u32) {
    log_warnings();
    let mut functions = Functions::new();
    functions.add(ADD, |(a, b)| a + b);
    functions.add(PLANT, |key: String| {
        let agent = ferry_rpc::Agent::current().unwrap();
        agent
            .block_on(agent.store().set(&key, b"planted".to_vec()))
            .unwrap();
    });
    let mut options = RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(functions)
        .init_timeout(T)
        .auth_secret(group_secret());
    options.world_size = 2;
    init_rpc(options).unwrap();
    let agent = ferry_rpc::agent().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let side = side_store(&rt);
    if rank == 0 {
        let me = agent.worker_addr(0u32).unwrap();
        rt.block_on(side.set("rpc0", me.to_string().into_bytes()))
            .unwrap();
    } else {
        // What a member sends in a handshake, as an eavesdropper on the
        // wire would capture it.
        rt.block_on(side.set("captured", captured_handshake()))
            .unwrap();
        // The group works before the outsider starts...
        let r: i64 = ADD.rpc_sync(0u32, (1, 2)).unwrap();
        assert_eq!(r, 3);
    }
    rt.block_on(side.wait(&["outsider/done".into()], T))
        .unwrap();
    if rank == 1 {
        // ...and after it finished.
        let r: i64 = ADD.rpc_sync(0u32, (3, 4)).unwrap();
        println!("RESULT={r}");
    }
    let planted = agent
        .block_on(agent.store().check(&["planted".into()]))
        .unwrap();
    println!("PLANTED={planted}");
    ferry_rpc::shutdown().unwrap();
}

fn outsider() {
    log_warnings();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let side = side_store(&rt);
    let master: SocketAddr = format!("127.0.0.1:{}", std::env::var("MASTER_PORT").unwrap())
        .parse()
        .unwrap();
    rt.block_on(async {
        side.wait(&["rpc0".into(), "captured".into()], T)
            .await
            .unwrap();
        let rpc0: SocketAddr = String::from_utf8(side.get("rpc0").await.unwrap())
            .unwrap()
            .parse()
            .unwrap();
        let captured = side.get("captured").await.unwrap();
        let wrong = wrong_secret();

        // The RPC port: another secret, none, a replayed handshake.
        let mut with_wrong = Endpoint::new("worker1", 1);
        with_wrong.auth = Some(wrong.clone());
        let e = PeerConnection::connect(rpc0, &with_wrong)
            .await
            .err()
            .unwrap();
        assert!(e.to_string().contains("authentication failed"), "{e}");
        let refused = PeerConnection::connect(rpc0, &Endpoint::new("worker1", 1)).await;
        assert!(refused.is_err());
        replay(rpc0, &captured).await;

        // The store: another secret, none, a replayed handshake.
        let e = TcpStore::connect_authenticated(master, T, Some(wrong))
            .await
            .err()
            .unwrap();
        assert!(e.to_string().contains("authentication"), "{e}");
        let plain = TcpStore::connect(master, T).await.unwrap();
        assert!(plain.set("planted", b"x".to_vec()).await.is_err());
        let plain = TcpStore::connect(master, T).await.unwrap();
        assert!(plain.get("ferry/rpc/worker/0").await.is_err());
        replay(master, &captured).await;

        println!("OUTSIDER=refused");
        side.set("outsider/done", Vec::new()).await.unwrap();
    });
}

#[test]
fn an_outsider_cannot_call_or_touch_the_store_and_the_group_serves_on() {
    const TEST: &str = "an_outsider_cannot_call_or_touch_the_store_and_the_group_serves_on";
    // The parent hosts the side store (plain: it is the test's, not the group's).
    let rt = tokio::runtime::Runtime::new().unwrap();
    let side = host_side_store(&rt, worker_rank(TEST).is_none());
    let env = side.as_ref().map_or("", |(_, env)| *env);
    let Some(outputs) = world_wrapped_ok(
        TEST,
        3,
        |_| vec!["env", env],
        |rank| if rank < 2 { member(rank) } else { outsider() },
    ) else {
        return;
    };
    assert_eq!(outputs[2].values("OUTSIDER"), ["refused"]);
    assert_eq!(outputs[1].values("RESULT"), ["7"]);
    for o in &outputs[..2] {
        assert_eq!(o.values("PLANTED"), ["false"]);
    }
    // Worker 0 warned about the refused connections, naming the address
    // and reason of each line's latest: the first at once, the others
    // counted into a summary (written within 10 s, or as the worker shut
    // down), every refusal counted.
    let log = &outputs[0].stderr;
    let rpc = log
        .lines()
        .filter(|l| l.contains("rejected a connection"))
        .collect::<Vec<_>>();
    assert!(rpc[0].contains("authentication failed"), "{log}");
    assert_eq!(refusals(&rpc), 3, "{log}");
    assert!(rpc.iter().all(|l| l.contains("peer=127.0.0.1:")), "{log}");
    let store = log
        .lines()
        .filter(|l| l.contains("refused a store client that failed authentication"))
        .collect::<Vec<_>>();
    assert_eq!(refusals(&store), 4, "{log}");
    assert!(store.iter().all(|l| l.contains("peer=127.0.0.1:")), "{log}");
}

/// The refusals the warning `lines` count (their `refusals=N` fields).
fn refusals(lines: &[&str]) -> u64 {
    lines
        .iter()
        .map(|l| {
            let at = l.find("refusals=").expect("a count") + "refusals=".len();
            let n: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
            n.parse::<u64>().unwrap()
        })
        .sum()
}

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
