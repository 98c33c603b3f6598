//! torchft 0.2.0 from PyPI as a real client of Ferry's lighthouse: its own
//! `torchft._torchft.LighthouseClient` (torchft's Rust client, compiled
//! into the wheel), run by the project's `.venv` Python, forms quorums of two
//! replicas (two threads) against [`Lighthouse`] on 127.0.0.1.
//!
//! The lighthouse ticks once an hour here, so a quorum can only be formed by
//! the tick a quorum request runs: the Python client's requests form it.
//! The test checks what the Python side received (quorum id, `created`, each
//! participant's replica id, addresses, step, world size and `data`, which
//! torchft's client sends as JSON text and parses back) against what it
//! sent, and against the quorum Ferry's lighthouse reports it delivered.
//!
//! Set-up: `cargo xtask bench` installs torchft into `.venv`
//! (`xtask/src/setup.rs`, `ensure_torchft`). Without `.venv/bin/python` or
//! an importable `torchft._torchft`, the test prints `SKIPPED: …` and passes.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ferry_ft::lighthouse::{Lighthouse, LighthouseOptions};
use serde_json::{json, Value};

/// Bound on the Python program (importing torch alone takes seconds).
const BOUND: Duration = Duration::from_secs(120);

/// Two replica groups, two rounds each: round `r` at step `10 + r + i` for
/// replica `i`. Prints one JSON object: `{"torchft": version, "rounds":
/// [[quorum seen by replica 0, by replica 1], …]}`, or `{"skip": why}`
/// when torchft cannot be imported.
const PROGRAM: &str = r#"
import json, sys, threading
from datetime import timedelta
try:
    from torchft._torchft import LighthouseClient
    import importlib.metadata
    version = importlib.metadata.version("torchft")
except ImportError as e:
    print(json.dumps({"skip": f"cannot import torchft._torchft.LighthouseClient: {e}"}))
    sys.exit(0)

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

/// `.venv/bin/python` at the repository root, if it is there. Not
/// canonicalized: that would follow the venv's symlink to the base
/// interpreter, which lacks the venv's packages.
fn venv_python() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent()?.parent()?;
    let python = root.join(".venv").join("bin").join("python");
    python.is_file().then_some(python)
}

fn skipped(why: &str) {
    println!("SKIPPED: {why} (cargo xtask bench installs torchft)");
}

fn unix_ms(t: SystemTime) -> i64 {
    let since = t.duration_since(UNIX_EPOCH).expect("after the epoch");
    i64::try_from(since.as_millis()).expect("fits")
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
        skipped("no .venv/bin/python at the repository root");
        return;
    };

    // min_replicas 2: neither request alone makes a quorum. A one-hour tick:
    // only the tick run by a quorum request can form one.
    let options = LighthouseOptions::new(2)
        .with_quorum_tick(Duration::from_secs(3600))
        .with_heartbeat_timeout(Duration::from_secs(60));
    let lighthouse = Lighthouse::bind("127.0.0.1:0", options)
        .await
        .expect("bind 127.0.0.1:0");
    let url = lighthouse.url();

    let started = SystemTime::now();
    let child = tokio::process::Command::new(&python)
        .arg("-c")
        .arg(PROGRAM)
        .arg(&url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the .venv's python");
    // On timeout the future (and with it the child) is dropped: killed.
    let output = tokio::time::timeout(BOUND, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("the torchft client did not finish within {BOUND:?}"))
        .expect("run the .venv's python");
    let finished = SystemTime::now();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the torchft client failed ({}):\nstdout: {stdout}\nstderr: {stderr}",
        output.status
    );
    let result: Value = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .unwrap_or_else(|| panic!("no JSON from the torchft client:\n{stdout}\n{stderr}"));
    if let Some(why) = result.get("skip").and_then(Value::as_str) {
        skipped(&format!("{why} ({})", python.display()));
        return;
    }

    assert_eq!(result["torchft"], "0.2.0", "{result}");
    assert_eq!(result["errors"], json!([]), "{result}\nstderr: {stderr}");

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
    let mut heard: Vec<&str> = status
        .heartbeats
        .iter()
        .map(|h| h.replica_id.as_str())
        .collect();
    heard.sort_unstable();
    assert_eq!(heard, ["replica_0", "replica_1"]);

    lighthouse.shutdown().await.expect("shutdown");
}
