#!/usr/bin/env python3
"""Both sides of `cargo xtask bench --only python`: the very same Python
code run against `ferry.rpc` or against `torch.distributed.rpc`
(TensorPipe), the module named by --module; one host, CPU tensors.

Two processes over 127.0.0.1 (worker0 calls, worker1 serves), started by
`peer_common.run_rpc_pair` with the module's `init_rpc` and
`TensorPipeRpcBackendOptions`. Measured, as `pt_rpc_latency.py` and
`pt_rref_overhead.py` measure PyTorch alone:
  rpc_sync  per float32 tensor size (--sizes, those of `--only rpc`):
            `rpc_sync(worker1, identity, (t,))` round trips after a
            warm-up, as many as fit in --cell-seconds (within --min-reps
            and --max-reps); median, p10, p90, mean;
  async10   10 `rpc_async` calls back to back, then `torch.futures.wait_all`;
            the time per call, median over repetitions;
  table1    the PyTorch RPC paper's Table 1 (--table1-sizes): the tensor by
            value (`identity`) or as an `RRef` made before the timed call
            (`identity_rref`, which fetches it with `to_here()`), in
            alternating blocks of --block calls, --reps of each (--reps-large
            at --large-threshold and above).
Sizes are in binary units (1KB = 1024 B). Prints one JSON object and writes
it to --out. With `ferry.rpc`, `ferry` is whatever `import ferry` finds
first (the bench puts a release build first on PYTHONPATH); the result
names the compiled module's file.
  .venv/bin/python benches/peers/py_rpc.py --module ferry.rpc --quick
"""
import argparse
import importlib
import os
import time

import torch

from peer_common import log, parse_size, run_rpc_pair, size_label, stats_ms, sync_latencies, versions, write_result

MODULES = ("ferry.rpc", "torch.distributed.rpc")


def identity(t):
    return t


def identity_rref(rref):
    return rref.to_here()


def async10_totals(rpc, t, a, one_call_s):
    """Totals of 10 rpc_async calls in flight (as many repetitions as fit
    in --cell-seconds, 3 to --async-max-reps)."""
    reps = max(3, min(a.async_max_reps, int(a.cell_seconds // max(10 * one_call_s, 1e-9))))
    ten = lambda: torch.futures.wait_all(  # noqa: E731
        [rpc.rpc_async("worker1", identity, args=(t,)) for _ in range(10)]
    )
    ten()
    totals = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ten()
        totals.append(time.perf_counter() - t0)
    return totals


def by_value(rpc, t):
    t0 = time.perf_counter()
    r = rpc.rpc_sync("worker1", identity, args=(t,))
    elapsed = time.perf_counter() - t0
    assert r.numel() == t.numel()
    return elapsed


def by_rref(rpc, t):
    rref = rpc.RRef(t)
    t0 = time.perf_counter()
    r = rpc.rpc_sync("worker1", identity_rref, args=(rref,))
    elapsed = time.perf_counter() - t0
    assert r.numel() == t.numel()
    return elapsed


def table1_row(rpc, label, nbytes, a):
    reps = a.reps if nbytes < a.large_threshold else a.reps_large
    t = torch.rand(nbytes // 4)
    for _ in range(a.table1_warmup):
        by_value(rpc, t)
        by_rref(rpc, t)
    tensor, rref = [], []
    while len(rref) < reps:
        k = min(a.block, reps - len(rref))
        tensor += [by_value(rpc, t) for _ in range(k)]
        rref += [by_rref(rpc, t) for _ in range(k)]
    row = {"size": label, "bytes": nbytes, "reps": reps, "tensor": stats_ms(tensor), "rref": stats_ms(rref)}
    for stat in ("mean", "median"):
        row[f"rref_minus_tensor_{stat}_ms"] = row["rref"][f"{stat}_ms"] - row["tensor"][f"{stat}_ms"]
    log(f"    table1 {label}: tensor {row['tensor']['median_ms']:.3f} ms, rref {row['rref']['median_ms']:.3f} ms")
    return row


def compiled_module_file(module):
    """The file of the compiled part behind `module` (ferry's extension
    module, torch's `_C`), symlinks resolved."""
    name = "ferry._ferry" if module.startswith("ferry") else "torch._C"
    return os.path.realpath(importlib.import_module(name).__file__)


def measure(a):
    rpc = importlib.import_module(a.module)
    cells = []
    for nbytes in a.sizes_bytes:
        t = torch.rand(nbytes // 4, dtype=torch.float32)
        label = size_label(nbytes)
        lat = sync_latencies(rpc, identity, t, a)
        cell = {"func": "identity", "size": label, "bytes": nbytes, "rpc_sync": stats_ms(lat)}
        totals = async10_totals(rpc, t, a, cell["rpc_sync"]["median_ms"] / 1e3)
        cell["async10_per_call_ms_median"] = stats_ms(totals)["median_ms"] / 10
        log(f"[py_rpc {a.module}] identity {label}: rpc_sync median "
            f"{cell['rpc_sync']['median_ms']:.4f} ms over {len(lat)} calls")
        cells.append(cell)
    rows = [table1_row(rpc, label, nbytes, a) for label, nbytes in zip(a.table1_sizes, a.table1_bytes)]
    return {"cells": cells, "rows": rows, "compiled": compiled_module_file(a.module)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", required=True, choices=MODULES, help="the RPC module under test")
    ap.add_argument("--sizes", nargs="+", default=["0", "1KB", "1MB", "4MB", "40MB"])
    ap.add_argument("--table1-sizes", nargs="*", default=["4MB", "40MB", "400MB"])
    ap.add_argument("--cell-seconds", type=float, help="seconds of rpc_sync calls per size (3; 1 with --quick)")
    ap.add_argument("--min-reps", type=int, default=5)
    ap.add_argument("--max-reps", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--async-max-reps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--reps-large", type=int, default=6)
    ap.add_argument("--large-threshold", type=parse_size, default="400MB")
    ap.add_argument("--table1-warmup", type=int, default=2)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads per process")
    ap.add_argument("--rpc-timeout", type=float, default=600.0)
    ap.add_argument("--quick", action="store_true", help="1 s cells, Table 1 at 4MB and 40MB, 10 repetitions")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.quick:
        a.min_reps, a.warmup = 3, 5
        a.reps, a.table1_sizes = 10, [s for s in a.table1_sizes if parse_size(s) < a.large_threshold]
    if a.cell_seconds is None:
        a.cell_seconds = 1.0 if a.quick else 3.0
    a.sizes_bytes = [parse_size(s) for s in a.sizes]
    a.table1_bytes = [parse_size(s) for s in a.table1_sizes]
    if any(b % 4 for b in a.sizes_bytes + a.table1_bytes):
        ap.error("sizes must be multiples of 4 bytes (float32)")
    start = time.time()
    result = run_rpc_pair(measure, a)
    write_result(a.out, {
        "bench": "py_rpc",
        "module": a.module,
        "versions": versions(),
        "config": {k: v for k, v in vars(a).items() if k != "out"},
        **result,
        "load_average": list(os.getloadavg()),
        "elapsed_s": time.time() - start,
    })


if __name__ == "__main__":
    main()
