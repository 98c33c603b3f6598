//! A group holding a shared secret: an outsider process with another
//! secret, with none, or replaying a member's captured handshake cannot
//! join it (so cannot call `remote`) and cannot open a connection to a
//! worker to send an RRef message (create or fork); the owner holds no
//! RRef of its making, and a member creates and fetches an RRef on the
//! same owner meanwhile. Three processes on 127.0.0.1; the outsider learns
//! the owner's address and the captured handshake through a side store
//! the test hosts.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

use ferry_rpc::store::Store;
use ferry_rpc::{Function, Functions, RpcOptions};
use ferry_rref::{RRef, RRefContext, RemoteExt};
use ferry_testkit::outsider::{
    captured_handshake, group_secret, host_side_store, replay, side_store, wrong_secret, WAIT as T,
};
use ferry_testkit::{worker_rank, world_wrapped_ok};
use ferry_transport::auth::Secret;
use ferry_transport::{Endpoint, PeerConnection};

const ADD: Function<(i64, i64), i64> = Function::new("add");
const OWNED: Function<(), usize> = Function::new("owned");
const TEST: &str = "an_outsider_cannot_create_an_rref_and_a_member_can";

fn options(rank: u32, secret: Option<Secret>) -> RpcOptions {
    let mut f = Functions::new();
    f.add(ADD, |(a, b)| a + b);
    f.add(OWNED, |()| {
        RRefContext::current().unwrap().debug_info().num_owner_rrefs
    });
    let mut o = RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(f)
        .init_timeout(Duration::from_secs(5));
    o.world_size = 2;
    o.auth = secret;
    o
}

fn member(rank: u32) {
    let mut o = options(rank, Some(group_secret())).init_timeout(T);
    let ctx = ferry_rref::install(&mut o);
    init_rpc(o).unwrap();
    let agent = ferry_rpc::agent().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let side = side_store(&rt);
    if rank == 0 {
        let me = agent.worker_addr(0u32).unwrap().to_string();
        rt.block_on(side.set("owner", me.into_bytes())).unwrap();
    } else {
        // What a member writes in a handshake, as a sniffer would see it.
        rt.block_on(side.set("captured", captured_handshake()))
            .unwrap();
    }
    rt.block_on(side.wait(&["outsider/done".into()], T))
        .unwrap();
    if rank == 1 {
        // The owner holds nothing the outsider made...
        assert_eq!(OWNED.rpc_sync(0u32, ()).unwrap(), 0);
        // ...and a member's RRef works.
        let r: RRef<i64> = ADD.remote("worker0", (2i64, 3i64)).unwrap();
        assert_eq!(r.to_here().unwrap(), 5);
        println!("OWNED_WHILE_HELD={}", OWNED.rpc_sync(0u32, ()).unwrap());
        drop(r);
    }
    ferry_rpc::shutdown().unwrap();
    assert!(ctx.leaked().is_empty());
}

fn outsider() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let side = side_store(&rt);
    let wrong = wrong_secret();
    // Joining the group, as rank 1, fails at the store: no agent, no `remote`.
    for secret in [Some(wrong.clone()), None] {
        let mut o = options(1, secret);
        let _ctx = ferry_rref::install(&mut o);
        assert!(init_rpc(o).is_err());
    }
    rt.block_on(async {
        side.wait(&["owner".into(), "captured".into()], T)
            .await
            .unwrap();
        let captured = side.get("captured").await.unwrap();
        let owner: SocketAddr = String::from_utf8(side.get("owner").await.unwrap())
            .unwrap()
            .parse()
            .unwrap();
        // No connection to the owner to carry an RRef message on.
        let mut e = Endpoint::new("worker1", 1);
        e.auth = Some(wrong);
        assert!(PeerConnection::connect(owner, &e).await.is_err());
        assert!(PeerConnection::connect(owner, &Endpoint::new("worker1", 1))
            .await
            .is_err());
        // A replayed handshake opens neither the owner's port (where an
        // RRef's create and fork messages arrive) nor the store (to join).
        replay(owner, &captured).await;
        let master: SocketAddr = format!("127.0.0.1:{}", std::env::var("MASTER_PORT").unwrap())
            .parse()
            .unwrap();
        replay(master, &captured).await;
        side.set("outsider/done", Vec::new()).await.unwrap();
    });
    println!("OUTSIDER=refused");
}

#[test]
fn an_outsider_cannot_create_an_rref_and_a_member_can() {
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
    assert_eq!(outputs[1].values("OWNED_WHILE_HELD"), ["1"]);
}

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
