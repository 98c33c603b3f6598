#!/usr/bin/env python3
"""The driver of `cargo xtask bench --only lighthouse`: quorum latency and
heartbeat rate of any lighthouse speaking torchft's gRPC protocol, measured
with torchft 0.2.0's own client (`torchft._torchft.LighthouseClient`). The
xtask runs it against `ferry-lighthouse` and against torchft's
`torchft_lighthouse`, each started as its own process with the same
options (min_replicas 1, a short join timeout), and passes --addr.

For each replica count N (--replicas): N clients heartbeat, then all N ask
for a quorum at once, --rounds times after one round that forms the
membership. Reported per N, medians over the rounds:
  after_last_request_ms_median  from the last request sent until every
                                replica has its answer;
  first_to_all_done_ms_median   from the first request sent until then.
Then heartbeats per second: --hb-clients clients (threads) heartbeat back
to back for --hb-seconds. torchft's Python client spends more CPU per
heartbeat than either server, so on a small host this rate is the
client's; the xtask measures the servers' capacity with its own load
generator (`lighthouse_load`).

Prints one JSON object on one line. Run with the project's .venv
(torch 2.13.0 and torchft 0.2.0, which `cargo xtask bench` installs):
  .venv/bin/python benches/peers/lighthouse_bench.py --addr http://127.0.0.1:29510
"""
import argparse
import json
import statistics
import threading
import time
from datetime import timedelta

from torchft._torchft import LighthouseClient


def quorum_round(clients, names, step):
    """All clients ask for a quorum at once; (ms after the last request,
    ms after the first) until every answer is in."""
    barrier = threading.Barrier(len(clients) + 1)
    sent, done = [0.0] * len(clients), [0.0] * len(clients)

    def ask(i):
        barrier.wait()
        sent[i] = time.perf_counter()
        clients[i].quorum(replica_id=names[i], timeout=timedelta(seconds=30), address="a",
                          store_address="s", step=step, world_size=1, shrink_only=False)
        done[i] = time.perf_counter()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    return (max(done) - max(sent)) * 1e3, (max(done) - min(sent)) * 1e3


def heartbeats_per_s(addr, n_clients, seconds):
    clients = [LighthouseClient(addr, connect_timeout=timedelta(seconds=10)) for _ in range(n_clients)]
    counts = [0] * n_clients
    stop = time.perf_counter() + seconds

    def beat(i):
        while time.perf_counter() < stop:
            clients[i].heartbeat(f"hb{i}")
            counts[i] += 1

    threads = [threading.Thread(target=beat, args=(i,)) for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--addr", required=True, help="the lighthouse, http://HOST:PORT or HOST:PORT")
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 16, 128])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hb-clients", type=int, default=8)
    ap.add_argument("--hb-seconds", type=float, default=3.0)
    a = ap.parse_args()
    addr = a.addr if a.addr.startswith("http") else "http://" + a.addr

    result = {"addr": addr, "quorum": {}}
    for k, n in enumerate(a.replicas):
        names = [f"bench{k}_{i:04d}" for i in range(n)]
        clients = [LighthouseClient(addr, connect_timeout=timedelta(seconds=10)) for _ in range(n)]
        for client, name in zip(clients, names):
            client.heartbeat(name)
        quorum_round(clients, names, 0)  # forms the membership; not counted
        after_last, span = zip(*(quorum_round(clients, names, r) for r in range(1, a.rounds + 1)))
        result["quorum"][str(n)] = {
            "after_last_request_ms_median": round(statistics.median(after_last), 3),
            "first_to_all_done_ms_median": round(statistics.median(span), 3),
            "rounds": a.rounds,
        }
    result["heartbeats_per_s"] = round(heartbeats_per_s(addr, a.hb_clients, a.hb_seconds), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
