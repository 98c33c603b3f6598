//! A Ferry worker for torchrun: every worker calls every worker (itself
//! included) and reports who answered.
//!
//! ```sh
//! cargo build -p ferry-rpc --example torchrun_worker
//! # on each of two hosts (or twice on one, with --local-addr 127.0.0.1):
//! torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
//!     --rdzv-endpoint HOST0:29400 --rdzv-id job1 --max-restarts 1 \
//!     --no-python target/debug/examples/torchrun_worker
//! ```
//!
//! torchrun sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `GROUP_RANK`, `MASTER_ADDR`, `MASTER_PORT` and the `TORCHELASTIC_*`
//! variables; [`RpcOptions::from_env`] reads them all, and the group meets
//! through the store torchrun's agent hosts.
//!
//! For tests: `FERRY_TORCHRUN_OUT=DIR` makes each worker write what it
//! saw to `DIR/restart{count}_rank{rank}`; `FERRY_TORCHRUN_FAIL=COUNT`
//! makes every worker of restart `COUNT` exit with an error (code 1) as
//! soon as the group has formed, leaving its rendezvous keys in the store,
//! so that torchrun restarts the group. Every worker fails on its own
//! rather than through a peer's death: then each node's agent sees its own
//! workers fail and counts the restart (torchrun does not count one on a
//! node it restarts only because another node rejoined, and the workers
//! of the next attempt would disagree on its number).

use std::time::Duration;

use anyhow::Context;
use ferry_rpc::{Agent, Function, Functions, RpcOptions};

/// Who answers: name, node (`GROUP_RANK`), `LOCAL_RANK` and the restart
/// count of its attempt.
const WHOAMI: Function<(), (String, u32, u32, u32)> = Function::new("whoami");

fn main() -> anyhow::Result<()> {
    let rank: u32 = std::env::var("RANK")
        .context("RANK is not set: start this under torchrun")?
        .parse()
        .context("RANK is not a number")?;
    let name = format!("worker{rank}");
    let options = RpcOptions::from_env(name.clone())?
        .init_timeout(Duration::from_secs(60))
        .rpc_timeout(Duration::from_secs(60));
    let restart = options.torchelastic.as_ref().map_or(0, |t| t.restart_count);
    let (node, local) = (options.local.group_rank, options.local.local_rank);
    let fails = std::env::var("FERRY_TORCHRUN_FAIL").ok().as_deref() == Some(&restart.to_string());

    let mut functions = Functions::new();
    let me = (name.clone(), node, local, restart);
    functions.add(WHOAMI, move |()| me.clone());
    let world_size = options.world_size;
    let agent = Agent::start(options.functions(functions))?;
    if fails {
        anyhow::bail!("{name} (restart {restart}) fails on purpose");
    }

    let mut seen = Vec::new();
    for peer in 0..world_size {
        let (who, node, local, their_restart) = WHOAMI
            .agent(&agent)
            .rpc_sync(peer, ())
            .with_context(|| format!("{name} calling rank {peer}"))?;
        seen.push(format!(
            "{who}@node{node}/local{local}/restart{their_restart}"
        ));
    }
    let report = format!(
        "{name} node{node} local{local} restart{restart}: {}",
        seen.join(" ")
    );
    println!("{report}");
    if let Ok(dir) = std::env::var("FERRY_TORCHRUN_OUT") {
        let path = std::path::Path::new(&dir).join(format!("restart{restart}_rank{rank}"));
        std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
    }
    agent.shutdown()?;
    Ok(())
}
