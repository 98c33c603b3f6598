//! torchft 0.2.0 from PyPI against Ferry, over real sockets on 127.0.0.1:
//! torchft's own Rust code compiled into the wheel (`torchft._torchft`), run
//! by the project's `.venv` Python, talking to Ferry's servers, and Ferry's
//! lighthouse serving torchft's own manager.
//!
//! - `LighthouseClient` → Ferry's [`Lighthouse`]: two replicas (two
//!   threads) form quorums. The lighthouse ticks once an hour here, so a
//!   quorum can only be formed by the tick a quorum request runs: the Python
//!   client's requests form it. The test checks what the Python side
//!   received (quorum id, `created`, each participant's replica id,
//!   addresses, step, world size and `data`, which torchft's client sends as
//!   JSON text and parses back) against what it sent, and against the quorum
//!   Ferry's lighthouse reports it delivered.
//! - `ManagerClient` → Ferry's [`Manager`]: the two ranks of a replica group
//!   ask for quorums, read checkpoint metadata and vote, with a second group
//!   on Ferry's own client; every `QuorumResult` field torchft decodes
//!   (`replica_ids` included) is checked against Ferry's rules.
//! - `ManagerServer` → Ferry's [`Lighthouse`]: two torchft managers, asked
//!   by torchft's `ManagerClient`, form quorums through Ferry's lighthouse,
//!   which reports them as members with their addresses.
//! - Access control: torchft's `LighthouseClient` is served by a lighthouse
//!   whose allow-list holds its network and refused by one whose does
//!   not; it cannot reach a lighthouse serving TLS by `https://` or
//!   `http://` (its extension's tonic is built without TLS).
//!
//! Set-up: `cargo xtask bench` installs torchft into `.venv`
//! (`xtask/src/setup.rs`, `ensure_torchft`). Without `.venv/bin/python` or
//! an importable `torchft._torchft`, each test prints `SKIPPED: …` and
//! passes.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ferry_ft::access::Access;
use ferry_ft::lighthouse::{HeartbeatStatus, Lighthouse};
use ferry_ft::manager::{
    compute_quorum_results, Manager, ManagerClient, QuorumRequest, QuorumResult,
};
use ferry_ft::proto::{Quorum, QuorumMember};
use serde_json::{json, Value};

use common::{
    connect, lighthouse_options, start_lighthouse, start_manager, stop_lighthouse, stop_manager,
    store, Pki,
};

/// Bound on the Python program (importing torch alone takes seconds).
const BOUND: Duration = Duration::from_secs(120);
/// The timeout (gRPC deadline) Ferry's ranks ask with.
const DEADLINE: Duration = Duration::from_secs(30);

/// The start of every Python program here: imports `names` from torchft's
/// compiled module (`torchft._torchft`) and torchft's version, or prints
/// `{"skip": why}` and exits when they cannot be imported.
fn torchft_import(names: &str) -> String {
    format!(
        r#"
import json, sys, threading
from datetime import timedelta
try:
    from torchft._torchft import {names}
    import importlib.metadata
    version = importlib.metadata.version("torchft")
except ImportError as e:
    print(json.dumps({{"skip": f"cannot import {names} from torchft._torchft: {{e}}"}}))
    sys.exit(0)
"#
    )
}

/// Two replica groups, two rounds each: round `r` at step `10 + r + i` for
/// replica `i`. Prints one JSON object: `{"torchft": version, "rounds":
/// [[quorum seen by replica 0, by replica 1], …]}`.
const LIGHTHOUSE_CLIENT_MAIN: &str = r#"
addr = sys.argv[1]
ROUNDS, N = 2, 2
seen = [[None] * N for _ in range(ROUNDS)]
errors = []

def member(m):
    return {"replica_id": m.replica_id, "address": m.address, "store_address": m.store_address,
            "step": m.step, "world_size": m.world_size, "shrink_only": m.shrink_only, "data": m.data}

def replica(i):
    try:
        client = LighthouseClient(addr, connect_timeout=timedelta(seconds=10))
        client.heartbeat(f"replica_{i}")
        for r in range(ROUNDS):
            q = client.quorum(replica_id=f"replica_{i}", timeout=timedelta(seconds=20),
                              address=f"http://replica{i}.invalid:29512",
                              store_address=f"replica{i}.invalid:29500",
                              step=10 + r + i, world_size=2 + i, shrink_only=False,
                              data={"rank": i, "round": r, "tag": "ferry-interop"})
            seen[r][i] = {"quorum_id": q.quorum_id,
                          "created": [q.created.seconds, q.created.nanos],
                          "participants": [member(m) for m in q.participants]}
    except Exception as e:
        errors.append(f"replica_{i}: {e!r}")

threads = [threading.Thread(target=replica, args=(i,)) for i in range(N)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps({"torchft": version, "rounds": seen, "errors": errors}))
"#;

/// `.venv/bin/python` at the repository root, if it is there (else the
/// test is skipped, and says so). Not canonicalized: that would follow the
/// venv's symlink to the base interpreter, which lacks the venv's packages.
fn venv_python() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent()?.parent()?;
    let python = root.join(".venv").join("bin").join("python");
    if !python.is_file() {
        skipped("no .venv/bin/python at the repository root");
        return None;
    }
    Some(python)
}

fn skipped(why: &str) {
    println!("SKIPPED: {why} (cargo xtask bench installs torchft)");
}

fn unix_ms(t: SystemTime) -> i64 {
    let since = t.duration_since(UNIX_EPOCH).expect("after the epoch");
    i64::try_from(since.as_millis()).expect("fits")
}

/// A lighthouse on 127.0.0.1 for two replica groups that ticks once an
/// hour: only the tick a quorum request runs can form a quorum.
async fn request_driven_lighthouse() -> Lighthouse {
    start_lighthouse(lighthouse_options(2).with_quorum_tick(Duration::from_secs(3600))).await
}

/// The replica ids of `heartbeats` (a lighthouse status's), sorted.
fn heartbeat_ids(heartbeats: &[HeartbeatStatus]) -> Vec<&str> {
    let mut ids: Vec<&str> = heartbeats.iter().map(|h| h.replica_id.as_str()).collect();
    ids.sort_unstable();
    ids
}

/// Runs the program made of [`torchft_import`]`(imports)` and `program`
/// with the `.venv`'s `python` and `args`, within [`BOUND`], and returns
/// the last JSON line it printed, once checked (it succeeded, with torchft
/// 0.2.0 and no `errors`), and its stderr (torchft's logs). `None` (printed
/// as skipped) when the program could not import torchft.
async fn run_python(
    python: &Path,
    imports: &str,
    program: &[&str],
    args: &[String],
) -> Option<(Value, String)> {
    let program = torchft_import(imports) + &program.concat();
    let child = tokio::process::Command::new(python)
        .arg("-c")
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the .venv's python");
    // On timeout the future (and with it the child) is dropped: killed.
    let output = tokio::time::timeout(BOUND, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("the torchft program did not finish within {BOUND:?}"))
        .expect("run the .venv's python");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the torchft program failed ({}):\nstdout: {stdout}\nstderr: {stderr}",
        output.status
    );
    let result: Value = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .unwrap_or_else(|| panic!("no JSON from the torchft program:\n{stdout}\n{stderr}"));
    if let Some(why) = result.get("skip").and_then(Value::as_str) {
        skipped(&format!("{why} ({})", python.display()));
        return None;
    }
    assert_eq!(result["torchft"], "0.2.0", "{result}");
    assert_eq!(result["errors"], json!([]), "{result}\nstderr: {stderr}");
    Some((result, stderr.into_owned()))
}

/// What replica `i` sent in round `r`, as torchft's client gives it back.
fn expected_member(i: u64, r: i64) -> Value {
    json!({
        "replica_id": format!("replica_{i}"),
        "address": format!("http://replica{i}.invalid:29512"),
        "store_address": format!("replica{i}.invalid:29500"),
        "step": 10 + r + i64::try_from(i).expect("small"),
        "world_size": 2 + i,
        "shrink_only": false,
        "data": {"rank": i, "round": r, "tag": "ferry-interop"},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torchft_client_forms_quorums_with_ferrys_lighthouse() {
    let Some(python) = venv_python() else {
        return;
    };

    // min_replicas 2: neither request alone makes a quorum. A one-hour tick:
    // only the tick run by a quorum request can form one.
    let lighthouse = request_driven_lighthouse().await;
    let url = lighthouse.url();

    let started = SystemTime::now();
    let Some((result, _)) = run_python(
        &python,
        "LighthouseClient",
        &[LIGHTHOUSE_CLIENT_MAIN],
        &[url],
    )
    .await
    else {
        return;
    };
    let finished = SystemTime::now();

    let window = unix_ms(started)..=unix_ms(finished);
    for (r, round) in (0_i64..).zip(result["rounds"].as_array().expect("rounds")) {
        let seen = round.as_array().expect("one quorum per replica");
        assert_eq!(seen.len(), 2, "{result}");
        // Both replicas got the same quorum…
        assert_eq!(seen[0], seen[1], "round {r}: {result}");
        let quorum = &seen[0];
        // …the first ever (the second round keeps the id: same members)…
        assert_eq!(quorum["quorum_id"], 1, "round {r}: {result}");
        // …formed during this test (the wall clock `created` stamp)…
        let secs = quorum["created"][0].as_i64().expect("seconds");
        let nanos = quorum["created"][1].as_i64().expect("nanos");
        let created_ms = secs * 1000 + nanos / 1_000_000;
        assert!(
            window.contains(&created_ms),
            "round {r}: created {created_ms} outside {window:?}"
        );
        // …with both replicas as they asked, sorted by replica id.
        assert_eq!(
            quorum["participants"],
            json!([expected_member(0, r), expected_member(1, r)]),
            "round {r}"
        );
    }

    // Ferry's side: the quorum it delivered last is the one Python received.
    let status = lighthouse.status();
    assert_eq!(status.quorum_id, 1);
    let prev = status.prev_quorum.expect("a delivered quorum");
    let last = &result["rounds"][1][0];
    let secs = last["created"][0].as_i64().expect("seconds");
    let nanos = last["created"][1].as_i64().expect("nanos");
    assert_eq!(prev.created_unix_ms, Some(secs * 1000 + nanos / 1_000_000));
    assert_eq!(prev.max_step, 12);
    let members: Vec<Value> = prev
        .members
        .iter()
        .map(|m| {
            // torchft's client sent `data` as JSON text; Ferry keeps it opaque.
            let data: Value = serde_json::from_str(&m.data).expect("data is JSON text");
            json!({
                "replica_id": m.replica_id,
                "address": m.address,
                "store_address": m.store_address,
                "step": m.step,
                "world_size": m.world_size,
                "shrink_only": m.shrink_only,
                "data": data,
            })
        })
        .collect();
    assert_eq!(members, [expected_member(0, 1), expected_member(1, 1)]);
    // Nobody is waiting: both requests of the last round were answered.
    assert!(status.participants.is_empty(), "{:?}", status.participants);
    assert_eq!(
        heartbeat_ids(&status.heartbeats),
        ["replica_0", "replica_1"]
    );

    stop_lighthouse(lighthouse).await;
}

// ---------------------------------------------------------------------------
// torchft's `ManagerClient` against Ferry's `Manager`.

/// Every attribute of torchft's `QuorumResult`, printed, and their names.
const QUORUM_RESULT_FIELDS: &str = r#"
def attributes(q):
    return sorted(a for a in dir(q) if not a.startswith("_"))

def result(q):
    return {a: getattr(q, a) for a in attributes(q)}
"#;

/// The attributes of torchft 0.2.0's Python `QuorumResult`. Not
/// `commit_failures`: `_torchft.pyi` lists it, but the wheel's class does
/// not have it (the field is on the wire, `ManagerQuorumResponse` field 12,
/// and torchft's Python `Manager` does not read it).
const TORCHFT_QUORUM_RESULT: [&str; 12] = [
    "heal",
    "max_replica_rank",
    "max_step",
    "max_world_size",
    "quorum_id",
    "recover_dst_replica_ranks",
    "recover_src_manager_address",
    "recover_src_replica_rank",
    "replica_ids",
    "replica_rank",
    "replica_world_size",
    "store_address",
];

/// With [`QUORUM_RESULT_FIELDS`] and [`MANAGER_CLIENT_MAIN`]: the two ranks
/// of replica group `replica_b` (threads), through torchft's
/// `ManagerClient`, against the Ferry manager at `argv[1]`, round after
/// round (`argv[2]`, JSON: step, init_sync, commit_failures, the ranks'
/// votes): each rank asks for the quorum (checkpoint metadata
/// `b/{rank}/r{round}`), reads back its own checkpoint metadata, reads its
/// source's when it heals, and votes. Prints `{"torchft": version,
/// "rounds": [[what rank 0 saw, what rank 1 saw], …], "errors": […]}`, or
/// `{"skip": why}`.
const MANAGER_CLIENT_MAIN: &str = r#"
addr, rounds = sys.argv[1], json.loads(sys.argv[2])
N = 2
TIMEOUT, CONNECT = timedelta(seconds=30), timedelta(seconds=10)
seen = [[None] * N for _ in rounds]
errors = []

def rank(i):
    try:
        client = ManagerClient(addr, connect_timeout=CONNECT)
        for r, rnd in enumerate(rounds):
            q = client._quorum(group_rank=i, step=rnd["step"], checkpoint_metadata=f"b/{i}/r{r}",
                               shrink_only=False, timeout=TIMEOUT,
                               commit_failures=rnd["commit_failures"], init_sync=rnd["init_sync"])
            got = {"result": result(q), "attributes": attributes(q),
                   "metadata": client._checkpoint_metadata(i, TIMEOUT), "source_metadata": None}
            if q.heal:
                source = ManagerClient(q.recover_src_manager_address, connect_timeout=CONNECT)
                got["source_metadata"] = source._checkpoint_metadata(i, TIMEOUT)
            got["decision"] = client.should_commit(group_rank=i, step=rnd["step"],
                                                   should_commit=rnd["votes"][i], timeout=TIMEOUT)
            seen[r][i] = got
    except Exception as e:
        errors.append(f"rank {i}: {e!r}")

threads = [threading.Thread(target=rank, args=(i,)) for i in range(N)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps({"torchft": version, "rounds": seen, "errors": errors}))
"#;

/// A round of the manager test: `replica_a`'s two ranks (Ferry's client)
/// ask at `a_step`, `replica_b`'s (torchft's client) at `b_step` with
/// `b_commit_failures`, then vote `b_votes`; both groups with `init_sync`.
struct Round {
    a_step: i64,
    b_step: i64,
    init_sync: bool,
    b_commit_failures: u64,
    b_votes: [bool; 2],
}

/// 0: both at step 0 with `init_sync`: each group rank has its own primary
/// (rank 0 `replica_a`, rank 1 `replica_b`), the other replica heals from
/// it; `replica_b` reports 2 commit failures.
/// 1: `replica_b` behind: it heals from `replica_a`; one rank votes false.
/// 2: `replica_b` ahead: `replica_a` heals from it; `replica_b`'s manager
/// carries the failed commit, which raises the quorum id.
const ROUNDS: [Round; 3] = [
    Round {
        a_step: 0,
        b_step: 0,
        init_sync: true,
        b_commit_failures: 2,
        b_votes: [true, true],
    },
    Round {
        a_step: 10,
        b_step: 5,
        init_sync: false,
        b_commit_failures: 0,
        b_votes: [true, false],
    },
    Round {
        a_step: 10,
        b_step: 11,
        init_sync: false,
        b_commit_failures: 0,
        b_votes: [true, true],
    },
];

/// A quorum result as torchft's Python `QuorumResult` shows it: no
/// recovery source is an empty address, absent ranks are `None`, no
/// `commit_failures` (see [`TORCHFT_QUORUM_RESULT`]).
fn torchft_view(q: &QuorumResult) -> Value {
    json!({
        "quorum_id": q.quorum_id,
        "replica_rank": q.replica_rank,
        "replica_world_size": q.replica_world_size,
        "recover_src_manager_address": q.recover_src_manager_address.clone().unwrap_or_default(),
        "recover_src_replica_rank": q.recover_src_replica_rank,
        "recover_dst_replica_ranks": q.recover_dst_replica_ranks,
        "store_address": q.store_address,
        "max_step": q.max_step,
        "max_replica_rank": q.max_replica_rank,
        "max_world_size": q.max_world_size,
        "heal": q.heal,
        "replica_ids": q.replica_ids,
    })
}

/// The quorum Ferry's lighthouse delivered last, as it sent it.
fn delivered_quorum(lighthouse: &Lighthouse) -> Quorum {
    let prev = lighthouse.status().prev_quorum.expect("a delivered quorum");
    Quorum {
        quorum_id: prev.quorum_id,
        participants: prev
            .members
            .into_iter()
            .map(|m| QuorumMember {
                replica_id: m.replica_id,
                address: m.address,
                store_address: m.store_address,
                step: m.step,
                world_size: m.world_size,
                shrink_only: m.shrink_only,
                data: m.data,
                commit_failures: m.commit_failures,
            })
            .collect(),
        created: None,
    }
}

/// What Ferry's manager answers rank `group_rank` of `replica_id` for
/// `quorum`, as Ferry's `ManagerClient` returns it.
fn ferry_result(
    replica_id: &str,
    group_rank: i64,
    quorum: &Quorum,
    init_sync: bool,
) -> QuorumResult {
    let response = compute_quorum_results(replica_id, group_rank, quorum, init_sync)
        .expect("the replica is in the quorum");
    QuorumResult::try_from(response).expect("no negative field")
}

/// `replica_a`'s side of [`ROUNDS`], through Ferry's client: both ranks ask
/// (checkpoint metadata `a/{rank}/r{round}`); then, before asking again
/// (which replaces that metadata), it waits for `replica_b`'s decision:
/// `replica_b`'s ranks have fetched what they heal from. Per round, the
/// ranks' results and the quorum the lighthouse delivered.
async fn drive_replica_a(
    client: &ManagerClient,
    b: &Manager,
    lighthouse: &Lighthouse,
) -> Result<Vec<(Vec<QuorumResult>, Quorum)>, String> {
    let mut rounds = Vec::new();
    for (r, round) in ROUNDS.iter().enumerate() {
        let asks: Vec<_> = (0..2_u64)
            .map(|rank| {
                let client = client.clone();
                let (step, init_sync) = (round.a_step, round.init_sync);
                tokio::spawn(async move {
                    let request = QuorumRequest {
                        checkpoint_metadata: format!("a/{rank}/r{r}"),
                        init_sync,
                        ..QuorumRequest::new(rank, step)
                    };
                    client.quorum(request, DEADLINE).await
                })
            })
            .collect();
        let mut results = Vec::new();
        for (rank, ask) in asks.into_iter().enumerate() {
            let result = ask.await.expect("the request task");
            results.push(result.map_err(|e| format!("round {r}, replica_a/{rank}: {e}"))?);
        }
        // The next round cannot form before replica_a asks again.
        let quorum = delivered_quorum(lighthouse);
        rounds.push((results, quorum));
        tokio::time::timeout(
            DEADLINE,
            b.wait_for_status(|s| s.commit_decisions > r as u64),
        )
        .await
        .map_err(|_| format!("round {r}: replica_b did not decide within {DEADLINE:?}"))?;
    }
    Ok(rounds)
}

/// torchft's `ManagerClient` (the Python ranks' client, compiled into the
/// wheel) as the two ranks of replica group `replica_b`, against Ferry's
/// `Manager`, with Ferry's lighthouse and a second group, `replica_a`,
/// driven by Ferry's own client. Over three rounds (see [`ROUNDS`]) every
/// field of every `QuorumResult` torchft decodes is checked against what
/// Ferry's rules give for the quorum delivered (what Ferry's own client
/// would decode), and against the values written out here; each takes a
/// value other than its default in some round, so a field torchft numbers
/// differently would show. Also: checkpoint metadata, from the own manager
/// and from the healing source, and `should_commit` decisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torchft_manager_client_against_ferrys_manager() {
    let Some(python) = venv_python() else {
        return;
    };
    let lighthouse = request_driven_lighthouse().await;
    // Two ranks per group; the managers' stores are `{replica_id}.store:29500`.
    let a = start_manager("replica_a", &lighthouse.url(), 2).await;
    let b = start_manager("replica_b", &lighthouse.url(), 2).await;
    let client_a = connect(&a).await;

    let rounds: Vec<Value> = ROUNDS
        .iter()
        .map(|r| {
            json!({"step": r.b_step, "init_sync": r.init_sync,
                   "commit_failures": r.b_commit_failures, "votes": r.b_votes})
        })
        .collect();
    let program = [QUORUM_RESULT_FIELDS, MANAGER_CLIENT_MAIN];
    let args = [b.address().to_owned(), Value::from(rounds).to_string()];
    // Python first: when it skips, replica_a's side would wait in vain.
    let (result, ferry) = {
        let torchft = run_python(&python, "ManagerClient", &program, &args);
        let ferry = drive_replica_a(&client_a, &b, &lighthouse);
        tokio::pin!(torchft, ferry);
        tokio::select! {
            result = &mut torchft => match result {
                Some((result, _)) => (result, ferry.await),
                None => return,
            },
            ferry = &mut ferry => match torchft.await {
                Some((result, _)) => (result, ferry),
                None => return,
            },
        }
    };
    let ferry = ferry.unwrap_or_else(|e| panic!("{e}\ntorchft: {result}"));

    let (a_addr, b_addr) = (a.address(), b.address());
    let ids = ["replica_a", "replica_b"];
    // What torchft's client must decode, by round and rank (the rules of
    // `compute_quorum_results`, written out).
    let expected = [
        [
            // Step 0 with init_sync: rank 0's primary is replica_a…
            json!({"quorum_id": 1, "replica_rank": 1, "replica_world_size": 2,
                   "recover_src_manager_address": a_addr, "recover_src_replica_rank": 0,
                   "recover_dst_replica_ranks": [], "store_address": store("replica_a"),
                   "max_step": 0, "max_replica_rank": 1, "max_world_size": 2,
                   "heal": true, "replica_ids": ids}),
            // …rank 1's is replica_b, from which replica_a heals.
            json!({"quorum_id": 1, "replica_rank": 1, "replica_world_size": 2,
                   "recover_src_manager_address": "", "recover_src_replica_rank": null,
                   "recover_dst_replica_ranks": [0], "store_address": store("replica_b"),
                   "max_step": 0, "max_replica_rank": 1, "max_world_size": 2,
                   "heal": false, "replica_ids": ids}),
        ],
        [0, 1].map(|_| {
            json!({"quorum_id": 1, "replica_rank": 1, "replica_world_size": 2,
                   "recover_src_manager_address": a_addr, "recover_src_replica_rank": 0,
                   "recover_dst_replica_ranks": [], "store_address": store("replica_a"),
                   "max_step": 10, "max_replica_rank": null, "max_world_size": 1,
                   "heal": true, "replica_ids": ids})
        }),
        [0, 1].map(|_| {
            json!({"quorum_id": 2, "replica_rank": 1, "replica_world_size": 2,
                   "recover_src_manager_address": "", "recover_src_replica_rank": null,
                   "recover_dst_replica_ranks": [0], "store_address": store("replica_b"),
                   "max_step": 11, "max_replica_rank": 0, "max_world_size": 1,
                   "heal": false, "replica_ids": ids})
        }),
    ];
    let seen_rounds = result["rounds"].as_array().expect("rounds");
    assert_eq!(seen_rounds.len(), ROUNDS.len(), "{result}");
    for (r, (round, seen)) in ROUNDS.iter().zip(seen_rounds).enumerate() {
        let (a_results, quorum) = &ferry[r];
        let seen = seen.as_array().expect("one entry per rank");
        assert_eq!(seen.len(), 2, "round {r}: {result}");
        for (rank, got) in (0_i64..).zip(seen) {
            let at = format!("round {r}, replica_b/{rank}");
            // torchft's QuorumResult has exactly the fields printed.
            assert_eq!(got["attributes"], json!(TORCHFT_QUORUM_RESULT), "{at}");
            let want = ferry_result("replica_b", rank, quorum, round.init_sync);
            assert_eq!(got["result"], torchft_view(&want), "{at}: Ferry's rules");
            assert_eq!(got["result"], expected[r][rank as usize], "{at}");

            // The rank's own metadata, and what it heals from.
            assert_eq!(got["metadata"], format!("b/{rank}/r{r}"), "{at}");
            let source = want
                .heal
                .then(|| format!("a/{rank}/r{r}"))
                .map_or(Value::Null, Value::from);
            assert_eq!(got["source_metadata"], source, "{at}");
            // All true commits; one false makes everyone false.
            assert_eq!(got["decision"], round.b_votes.iter().all(|&v| v), "{at}");
        }
        // replica_a, through Ferry's client, is in the same quorum; for
        // each rank what the rules say.
        for (rank, got) in (0_i64..).zip(a_results) {
            let want = ferry_result("replica_a", rank, quorum, round.init_sync);
            assert_eq!(got, &want, "round {r}, replica_a/{rank}");
            assert_eq!(got.replica_ids, ids);
        }
        // The quorum was the one both groups asked for.
        let steps: Vec<(&str, i64)> = quorum
            .participants
            .iter()
            .map(|p| (p.replica_id.as_str(), p.step))
            .collect();
        assert_eq!(
            steps,
            [("replica_a", round.a_step), ("replica_b", round.b_step)]
        );
    }
    // torchft's client sent its commit failures (round 0): they reached the
    // lighthouse, and replica_a's ranks, through replica_b's manager.
    let member_b = &ferry[0].1.participants[1];
    assert_eq!(
        (member_b.replica_id.as_str(), member_b.commit_failures),
        ("replica_b", 2)
    );
    assert!(ferry[0].0.iter().all(|q| q.commit_failures == 2));
    // The healing sources are the managers' own addresses.
    assert_eq!(
        ferry[0].0[1].recover_src_manager_address.as_deref(),
        Some(b_addr)
    );
    assert_eq!(
        ferry[2].0[0].recover_src_manager_address.as_deref(),
        Some(b_addr)
    );

    // Ferry's side: three decisions, the last committed.
    let status = b.status();
    assert_eq!((status.commit_decisions, status.commit_failures), (3, 0));
    assert_eq!(status.quorums, 3);
    assert!(status.waiting_ranks.is_empty() && status.voted_ranks.is_empty());
    let members = lighthouse.status().prev_quorum.expect("a quorum").members;
    let failures: Vec<i64> = members.iter().map(|m| m.commit_failures).collect();
    assert_eq!(failures, [0, 1], "replica_b's manager carried the failure");

    stop_manager(a).await;
    stop_manager(b).await;
    stop_lighthouse(lighthouse).await;
}

// ---------------------------------------------------------------------------
// torchft's `ManagerServer` against Ferry's `Lighthouse`.

/// Two torchft `ManagerServer`s (replica groups `torchft_a`, `torchft_b`,
/// world size 1, the wheel's Rust manager) with Ferry's lighthouse at
/// `argv[1]`, each asked by its own torchft `ManagerClient` (one thread
/// per group), round after round (`argv[2]`, JSON: each group's step and
/// commit failures); a group that heals reads its source's checkpoint
/// metadata; both vote to commit; a barrier ends each round (a source's
/// metadata stays until its peer has read it). Prints `{"torchft": version,
/// "addresses": {replica id: manager address}, "rounds": [[what a saw,
/// what b saw], …], "errors": […]}`, or `{"skip": why}`.
const MANAGER_SERVER_MAIN: &str = r#"
lighthouse, rounds = sys.argv[1], json.loads(sys.argv[2])
REPLICAS = ["torchft_a", "torchft_b"]
TIMEOUT, CONNECT = timedelta(seconds=30), timedelta(seconds=10)
servers = {rid: ManagerServer(replica_id=rid, lighthouse_addr=lighthouse, hostname="127.0.0.1",
                              bind="127.0.0.1:0", store_addr=f"{rid}.store:29500", world_size=1,
                              heartbeat_interval=timedelta(milliseconds=100),
                              connect_timeout=CONNECT, quorum_retries=0)
           for rid in REPLICAS}
barrier = threading.Barrier(len(REPLICAS))
seen = [[None] * len(REPLICAS) for _ in rounds]
errors = []

def replica(i, rid):
    try:
        client = ManagerClient(servers[rid].address(), connect_timeout=CONNECT)
        for r, rnd in enumerate(rounds):
            step = rnd["steps"][i]
            q = client._quorum(group_rank=0, step=step, checkpoint_metadata=f"{rid}@{step}",
                               shrink_only=False, timeout=TIMEOUT,
                               commit_failures=rnd["commit_failures"][i], init_sync=False)
            got = {"result": result(q), "source_metadata": None}
            if q.heal:
                source = ManagerClient(q.recover_src_manager_address, connect_timeout=CONNECT)
                got["source_metadata"] = source._checkpoint_metadata(0, TIMEOUT)
            got["decision"] = client.should_commit(group_rank=0, step=step, should_commit=True,
                                                   timeout=TIMEOUT)
            seen[r][i] = got
            barrier.wait(timeout=60)
    except Exception as e:
        errors.append(f"{rid}: {e!r}")
        barrier.abort()

threads = [threading.Thread(target=replica, args=(i, rid)) for i, rid in enumerate(REPLICAS)]
[t.start() for t in threads]
[t.join() for t in threads]
addresses = {rid: server.address() for rid, server in servers.items()}
for server in servers.values():
    server.shutdown()
print(json.dumps({"torchft": version, "addresses": addresses, "rounds": seen, "errors": errors}))
"#;

/// torchft's own manager (`ManagerServer`, the Rust manager compiled into
/// the wheel) with Ferry's lighthouse: two replica groups of one rank each,
/// asked by torchft's `ManagerClient`. Round 0: `torchft_b` is behind and
/// heals from `torchft_a`, whose address it learns from the quorum Ferry
/// delivered; round 1: both at the same step, `torchft_b` reporting 2
/// commit failures, which raise the quorum id. Checks every field both
/// got (torchft's manager computes them from Ferry's quorum) and, in
/// Ferry's lighthouse status, the members as torchft's managers sent them
/// (their addresses included) and their heartbeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torchft_manager_servers_form_quorums_with_ferrys_lighthouse() {
    let Some(python) = venv_python() else {
        return;
    };
    let lighthouse = request_driven_lighthouse().await;
    let rounds = json!([
        {"steps": [3, 1], "commit_failures": [0, 0]},
        {"steps": [4, 4], "commit_failures": [0, 2]},
    ]);
    let program = [QUORUM_RESULT_FIELDS, MANAGER_SERVER_MAIN];
    let args = [lighthouse.url(), rounds.to_string()];
    let Some((result, logs)) =
        run_python(&python, "ManagerClient, ManagerServer", &program, &args).await
    else {
        return;
    };

    let address = |rid: &str| {
        result["addresses"][rid]
            .as_str()
            .unwrap_or_else(|| panic!("{rid}'s address: {result}"))
            .to_owned()
    };
    let (a_addr, b_addr) = (address("torchft_a"), address("torchft_b"));
    assert!(a_addr.starts_with("http://127.0.0.1:"), "{a_addr}");
    assert_ne!(a_addr, b_addr);
    let ids = ["torchft_a", "torchft_b"];
    let expected = json!([
        [
            {"quorum_id": 1, "replica_rank": 0, "replica_world_size": 2,
             "recover_src_manager_address": "", "recover_src_replica_rank": null,
             "recover_dst_replica_ranks": [1], "store_address": "torchft_a.store:29500",
             "max_step": 3, "max_replica_rank": 0, "max_world_size": 1,
             "heal": false, "replica_ids": ids},
            {"quorum_id": 1, "replica_rank": 1, "replica_world_size": 2,
             "recover_src_manager_address": a_addr, "recover_src_replica_rank": 0,
             "recover_dst_replica_ranks": [], "store_address": "torchft_a.store:29500",
             "max_step": 3, "max_replica_rank": null, "max_world_size": 1,
             "heal": true, "replica_ids": ids},
        ],
        [
            {"quorum_id": 2, "replica_rank": 0, "replica_world_size": 2,
             "recover_src_manager_address": "", "recover_src_replica_rank": null,
             "recover_dst_replica_ranks": [], "store_address": "torchft_a.store:29500",
             "max_step": 4, "max_replica_rank": 0, "max_world_size": 2,
             "heal": false, "replica_ids": ids},
            {"quorum_id": 2, "replica_rank": 1, "replica_world_size": 2,
             "recover_src_manager_address": "", "recover_src_replica_rank": null,
             "recover_dst_replica_ranks": [], "store_address": "torchft_a.store:29500",
             "max_step": 4, "max_replica_rank": 1, "max_world_size": 2,
             "heal": false, "replica_ids": ids},
        ],
    ]);
    let seen = &result["rounds"];
    for r in 0..2 {
        for i in 0..2 {
            let at = format!("round {r}, {}", ids[i]);
            let got = &seen[r][i];
            assert_eq!(got["result"], expected[r][i], "{at}");
            assert_eq!(got["decision"], true, "{at}");
        }
    }
    // torchft_b healed from torchft_a's manager, at the address Ferry relayed.
    assert_eq!(seen[0][1]["source_metadata"], "torchft_a@3");
    assert_eq!(seen[0][0]["source_metadata"], Value::Null);

    // Ferry's side: the last quorum, as torchft's managers asked for it.
    let status = lighthouse.status();
    assert_eq!(status.quorum_id, 2);
    let prev = status.prev_quorum.expect("a delivered quorum");
    assert_eq!(prev.quorum_id, 2);
    let members: Vec<Value> = prev
        .members
        .iter()
        .map(|m| {
            json!({"replica_id": m.replica_id, "address": m.address,
                   "store_address": m.store_address, "step": m.step,
                   "world_size": m.world_size, "shrink_only": m.shrink_only,
                   "commit_failures": m.commit_failures, "data": m.data})
        })
        .collect();
    assert_eq!(
        members,
        [
            json!({"replica_id": "torchft_a", "address": a_addr,
                   "store_address": "torchft_a.store:29500", "step": 4, "world_size": 1,
                   "shrink_only": false, "commit_failures": 0, "data": ""}),
            json!({"replica_id": "torchft_b", "address": b_addr,
                   "store_address": "torchft_b.store:29500", "step": 4, "world_size": 1,
                   "shrink_only": false, "commit_failures": 2, "data": ""}),
        ]
    );
    // Ferry's rules on that quorum give what torchft's managers gave.
    let quorum = delivered_quorum(&lighthouse);
    for (i, rid) in ids.iter().enumerate() {
        let want = ferry_result(rid, 0, &quorum, false);
        assert_eq!(seen[1][i]["result"], torchft_view(&want), "{rid}");
    }
    // torchft's managers decoded torchft_b's commit failures in the quorum
    // Ferry sent (their only trace: torchft's Python `QuorumResult` has no
    // `commit_failures`; each manager logs the lighthouse response).
    let decoded = logs
        .lines()
        .filter(|line| line.contains("got lighthouse quorum") && line.contains("quorum_id: 2"))
        .filter(|line| {
            line.contains(r#"replica_id: "torchft_b""#) && line.contains("commit_failures: 2")
        })
        .count();
    assert_eq!(decoded, 2, "both managers' logs:\n{logs}");
    assert!(status.participants.is_empty(), "{:?}", status.participants);
    assert_eq!(
        heartbeat_ids(&status.heartbeats),
        ids,
        "torchft's managers heartbeat"
    );

    stop_lighthouse(lighthouse).await;
}

/// For each `label=address` argument: a `LighthouseClient` with a 2 s
/// connect timeout heartbeats as `replica_{label}`; prints each outcome
/// (`"ok"` or the exception's text) under `"results"`.
const ACCESS_MAIN: &str = r#"
results = {}
for arg in sys.argv[1:]:
    label, addr = arg.split("=", 1)
    try:
        client = LighthouseClient(addr, connect_timeout=timedelta(seconds=2))
        client.heartbeat(f"replica_{label}", timeout=timedelta(seconds=5))
        results[label] = "ok"
    except Exception as e:
        results[label] = repr(e)
print(json.dumps({"torchft": version, "results": results, "errors": []}))
"#;

/// What torchft's clients can use against Ferry's access control: a
/// lighthouse allowing 127.0.0.0/8 serves torchft's `LighthouseClient`;
/// one allowing only 10.0.0.0/8 closes its connections unread (the call
/// fails, the lighthouse saw no heartbeat); one serving TLS is out of its
/// reach with an `https://` address (torchft's tonic has no TLS and speaks
/// plain HTTP/2 to it) and with `http://`. Ferry's side: each lighthouse's
/// heartbeats are exactly the ones that got through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torchft_client_gets_through_the_allow_list_but_not_tls() {
    let Some(python) = venv_python() else {
        return;
    };
    let with = |access: Access| start_lighthouse(lighthouse_options(1).with_access(access));
    let allowed = with(Access::default().with_allow("127.0.0.0/8".parse().expect("net"))).await;
    let outside = with(Access::default().with_allow("10.0.0.0/8".parse().expect("net"))).await;
    let pki = Pki::new();
    let tls = with(Access::default().with_tls(pki.server)).await;
    let port = tls.local_addr().port();
    let args = vec![
        format!("allowed={}", allowed.url()),
        format!("outside={}", outside.url()),
        format!("https=https://127.0.0.1:{port}"),
        format!("http=http://127.0.0.1:{port}"),
    ];
    let Some((result, _)) = run_python(&python, "LighthouseClient", &[ACCESS_MAIN], &args).await
    else {
        return;
    };
    let results = &result["results"];
    assert_eq!(results["allowed"], "ok", "{result}");
    for refused in ["outside", "https", "http"] {
        let outcome = results[refused].as_str().expect("an outcome");
        assert_ne!(outcome, "ok", "{refused}: {result}");
    }
    assert_eq!(
        heartbeat_ids(&allowed.status().heartbeats),
        ["replica_allowed"]
    );
    assert!(outside.status().heartbeats.is_empty());
    assert!(tls.status().heartbeats.is_empty());
    for lighthouse in [allowed, outside, tls] {
        stop_lighthouse(lighthouse).await;
    }
}
