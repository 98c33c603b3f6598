#!/usr/bin/env python3
"""PyTorch's side of `cargo xtask bench --only rpc`: torch.distributed.rpc
(TensorPipe) latency and throughput on one host, CPU tensors, the same
measurements as Ferry's `rpc_latency` (benches/src/bin/rpc_latency.rs).

Two processes over 127.0.0.1: worker0 calls, worker1 serves `identity(t)`,
which returns its float32 argument. Per tensor size:
  rpc_sync  round-trip latency after a warm-up; as many calls as fit in
            --cell-seconds (within --min-reps and --max-reps); median, p10,
            p90, mean;
  async10   the PyTorch RPC paper's protocol: 10 rpc_async calls back to back,
            then wait for all; the time per call, median over repetitions.
Then empty-call throughput: identity on an empty tensor with --inflight
calls in flight for --tput-seconds, --tput-runs times (calls per second).

Sizes are in binary units (1KB = 1024 B). Prints one JSON object and writes
it to --out. Run with the project's .venv (torch 2.13.0, which `cargo xtask
bench` installs):
  .venv/bin/python benches/peers/pt_rpc_latency.py --quick --sizes 0 1KB 4MB
"""
import argparse
import time
from collections import deque

import torch
import torch.distributed.rpc as rpc

from peer_common import log, parse_size, percentile, run_rpc_pair, size_label, stats_ms, sync_latencies, versions, write_result


def identity(t):
    return t


def async10_totals(t, a, one_call_s):
    """Totals of 10 rpc_async calls in flight, or None when one repetition
    would take longer than --async-max-seconds."""
    rep_s = 10 * one_call_s
    if rep_s > a.async_max_seconds:
        return None
    reps = max(1, min(a.async_max_reps, int(a.cell_seconds // max(rep_s, 1e-9))))
    reps = max(reps, min(a.async_min_reps, int(a.async_max_seconds // max(rep_s, 1e-9))))
    if rep_s < 1.0:
        torch.futures.wait_all([rpc.rpc_async("worker1", identity, args=(t,)) for _ in range(10)])
    totals = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.futures.wait_all([rpc.rpc_async("worker1", identity, args=(t,)) for _ in range(10)])
        totals.append(time.perf_counter() - t0)
    return totals


def throughput(a):
    empty = torch.empty(0, dtype=torch.float32)
    torch.futures.wait_all([rpc.rpc_async("worker1", identity, args=(empty,)) for _ in range(a.inflight)])
    rates = []
    for _ in range(a.tput_runs):
        pending, done = deque(), 0
        start = time.perf_counter()
        while time.perf_counter() - start < a.tput_seconds:
            while len(pending) < a.inflight:
                pending.append(rpc.rpc_async("worker1", identity, args=(empty,)))
            pending.popleft().wait()
            done += 1
        while pending:
            pending.popleft().wait()
            done += 1
        rates.append(done / (time.perf_counter() - start))
    return {
        "inflight": a.inflight,
        "seconds_per_run": a.tput_seconds,
        "runs_calls_per_s": rates,
        "median_calls_per_s": percentile(rates, 0.5),
    }


def measure(a):
    cells = []
    for nbytes in a.sizes_bytes:
        t = torch.rand(nbytes // 4, dtype=torch.float32)
        label = size_label(nbytes)
        log(f"[pt_rpc_latency] identity {label}")
        lat = sync_latencies(rpc, identity, t, a)
        cell = {"func": "identity", "size": label, "bytes": nbytes, "numel": t.numel(), "rpc_sync": stats_ms(lat)}
        totals = async10_totals(t, a, cell["rpc_sync"]["median_ms"] / 1e3)
        if totals:
            cell["async10_total"] = stats_ms(totals)
            cell["async10_per_call_ms_median"] = cell["async10_total"]["median_ms"] / 10
        log(f"    rpc_sync median {cell['rpc_sync']['median_ms']:.3f} ms over {len(lat)} calls")
        cells.append(cell)
    return {"cells": cells, "throughput_empty": throughput(a)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["0", "1KB", "1MB", "4MB", "40MB", "400MB"])
    ap.add_argument("--cell-seconds", type=float, default=10.0)
    ap.add_argument("--min-reps", type=int, default=5)
    ap.add_argument("--max-reps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--async-min-reps", type=int, default=3)
    ap.add_argument("--async-max-reps", type=int, default=200)
    ap.add_argument("--async-max-seconds", type=float, default=60.0)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--tput-seconds", type=float, default=5.0)
    ap.add_argument("--tput-runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads per process")
    ap.add_argument("--rpc-timeout", type=float, default=900.0)
    ap.add_argument("--quick", action="store_true", help="short cells and one short throughput run")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.quick:
        a.cell_seconds, a.min_reps, a.warmup = 1.0, 3, 5
        a.tput_seconds, a.tput_runs, a.async_max_seconds = 1.0, 1, 10.0
    a.sizes_bytes = [parse_size(s) for s in a.sizes]
    if any(b % 4 for b in a.sizes_bytes):
        ap.error("sizes must be multiples of 4 bytes (float32)")
    start = time.time()
    result = run_rpc_pair(measure, a)
    write_result(a.out, {
        "bench": "pt_rpc_latency",
        "versions": versions(),
        "config": {k: v for k, v in vars(a).items() if k != "out"},
        **result,
        "elapsed_s": time.time() - start,
    })


if __name__ == "__main__":
    main()
