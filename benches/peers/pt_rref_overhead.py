#!/usr/bin/env python3
"""PyTorch's side of `cargo xtask bench --only rref`: the PyTorch RPC paper's
Table 1, a tensor argument passed by value or as an RRef, with
torch.distributed.rpc (TensorPipe) on one host; the same measurement as
Ferry's `rref_overhead` (benches/src/bin/rref_overhead.rs).

Two processes over 127.0.0.1; worker0 owns a float32 tensor of each size.
  tensor  rpc_sync(worker1, identity, (t,)): worker1 returns t;
  rref    rpc_sync(worker1, identity_rref, (RRef(t),)): worker1 fetches the
          value from its owner with to_here() and returns it (the RRef is
          made before the timed call).
The two alternate in blocks of --block calls, --reps of each after --warmup
calls of each (--reps-large for sizes of --large-threshold and more).
Reports mean, std, median, p10 and p90 in ms per case, and the RRef's
difference from the tensor case.

Prints one JSON object and writes it to --out. Run with the project's
.venv (torch 2.13.0):
  .venv/bin/python benches/peers/pt_rref_overhead.py --quick --sizes 4MB
"""
import argparse
import time

import torch
import torch.distributed.rpc as rpc

from peer_common import log, parse_size, run_rpc_pair, stats_ms, versions, write_result


def identity(t):
    return t


def identity_rref(rref):
    return rref.to_here()


def by_value(t):
    t0 = time.perf_counter()
    r = rpc.rpc_sync("worker1", identity, args=(t,))
    elapsed = time.perf_counter() - t0
    assert r.numel() == t.numel()
    return elapsed


def by_rref(t):
    rref = rpc.RRef(t)
    t0 = time.perf_counter()
    r = rpc.rpc_sync("worker1", identity_rref, args=(rref,))
    elapsed = time.perf_counter() - t0
    assert r.numel() == t.numel()
    return elapsed


def measure(a):
    rows = []
    for label, nbytes in zip(a.sizes, a.sizes_bytes):
        reps = a.reps if nbytes < a.large_threshold else a.reps_large
        t = torch.rand(nbytes // 4)
        log(f"[pt_rref_overhead] {label}")
        for _ in range(a.warmup):
            by_value(t)
            by_rref(t)
        tensor, rref = [], []
        start = time.perf_counter()
        while len(rref) < reps:
            k = min(a.block, reps - len(rref))
            tensor += [by_value(t) for _ in range(k)]
            rref += [by_rref(t) for _ in range(k)]
        row = {"size": label, "bytes": nbytes, "reps": reps, "tensor": stats_ms(tensor), "rref": stats_ms(rref)}
        for stat in ("mean", "median"):
            row[f"rref_minus_tensor_{stat}_ms"] = row["rref"][f"{stat}_ms"] - row["tensor"][f"{stat}_ms"]
        row["rref_over_tensor_mean_ratio"] = row["rref"]["mean_ms"] / row["tensor"]["mean_ms"]
        row["wall_s"] = time.perf_counter() - start
        log(f"    tensor {row['tensor']['mean_ms']:.2f}±{row['tensor']['std_ms']:.2f} ms, "
            f"rref {row['rref']['mean_ms']:.2f}±{row['rref']['std_ms']:.2f} ms")
        rows.append(row)
    return {"rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["4MB", "40MB", "400MB"])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--reps-large", type=int, default=30)
    ap.add_argument("--large-threshold", type=parse_size, default="400MB")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads per process")
    ap.add_argument("--rpc-timeout", type=float, default=600.0)
    ap.add_argument("--quick", action="store_true", help="20 repetitions (5 for large sizes)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.quick:
        a.reps, a.reps_large, a.warmup = 20, 5, 2
    a.sizes_bytes = [parse_size(s) for s in a.sizes]
    start = time.time()
    result = run_rpc_pair(measure, a)
    write_result(a.out, {
        "bench": "pt_rref_overhead",
        "versions": versions(),
        "config": {k: v for k, v in vars(a).items() if k != "out"},
        **result,
        "elapsed_s": time.time() - start,
    })


if __name__ == "__main__":
    main()
