"""Helpers shared by Ferry's peer benchmark scripts (benches/peers/*.py).

Not a benchmark itself: statistics in milliseconds, size labels in binary
units (1KB = 1024 B, 1MB = 2**20 B, as Ferry's side labels them), a free
local port, the result file every script writes, and a pair of PyTorch RPC
processes (TensorPipe over 127.0.0.1, or `ferry.rpc` where the arguments
name it) whose rank 0 runs a measurement.
"""
import json
import os
import platform
import socket
import statistics
import sys
import time

UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


def parse_size(text):
    """`0`, `1KB`, `4MB` ... in bytes."""
    text = text.strip().upper()
    for unit in ("KB", "MB", "GB", "B"):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * UNITS[unit])
    return int(text)


def size_label(nbytes):
    for unit in ("GB", "MB", "KB"):
        if nbytes and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]}{unit}"
    return f"{nbytes}B"


def percentile(values, p):
    """Linear interpolation between the two nearest ranks (numpy's default)."""
    v = sorted(values)
    at = p * (len(v) - 1)
    lo = int(at)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (at - lo)


def stats_ms(seconds):
    """Summary of durations given in seconds, in milliseconds; None if empty."""
    ms = [s * 1e3 for s in seconds]
    if not ms:
        return None
    return {
        "n": len(ms),
        "median_ms": percentile(ms, 0.5),
        "p10_ms": percentile(ms, 0.1),
        "p90_ms": percentile(ms, 0.9),
        "mean_ms": statistics.fmean(ms),
        "std_ms": statistics.stdev(ms) if len(ms) > 1 else 0.0,
        "min_ms": min(ms),
        "max_ms": max(ms),
    }


def sync_latencies(rpc, fn, t, a):
    """`rpc.rpc_sync("worker1", fn, args=(t,))` round trips, in seconds,
    after a warm-up (at least --warmup calls and 0.3 s, cut short for a
    call slower than 0.5 s): as many as fit in --cell-seconds, between
    --min-reps and --max-reps. `rpc` is the module measured
    (torch.distributed.rpc or ferry.rpc)."""
    start, n = time.perf_counter(), 0
    while n < a.warmup or time.perf_counter() - start < 0.3:
        t0 = time.perf_counter()
        rpc.rpc_sync("worker1", fn, args=(t,))
        n += 1
        if time.perf_counter() - t0 > 0.5 and n >= 2:
            break
    latencies, start = [], time.perf_counter()
    while len(latencies) < a.max_reps and (
        len(latencies) < a.min_reps or time.perf_counter() - start < a.cell_seconds
    ):
        t0 = time.perf_counter()
        rpc.rpc_sync("worker1", fn, args=(t,))
        latencies.append(time.perf_counter() - t0)
    return latencies


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def versions():
    import torch

    return {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def write_result(out, result):
    """Writes `result` to `out` (when given) and prints it as one JSON line."""
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


def _rpc_worker(rank, port, measure, args, result_path):
    import importlib

    import torch

    rpc = importlib.import_module(getattr(args, "module", "torch.distributed.rpc"))

    torch.set_num_threads(args.threads)
    # ferry.rpc's opt-in for large tensors (PyTorch has no such setting):
    # the table's header says it is on.
    if hasattr(rpc, "retain_freed_memory"):
        rpc.retain_freed_memory()
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=16,
        rpc_timeout=args.rpc_timeout,
        init_method=f"tcp://127.0.0.1:{port}",
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        result = measure(args)
        with open(result_path, "w") as f:
            json.dump(result, f)
    rpc.shutdown()


def run_rpc_pair(measure, args):
    """Runs `measure(args)` on rank 0 ("worker0") of a 2-process PyTorch RPC
    group (TensorPipe, 127.0.0.1; "worker1" only serves) and returns what it
    returned. `measure` must be a module-level function (it is pickled into
    the spawned processes); `args` needs `threads` and `rpc_timeout`, and
    may name in `module` the RPC module to use in place of
    `torch.distributed.rpc` (`ferry.rpc`, which takes the same calls)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ferry_peer_") as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(_rpc_worker, args=(free_port(), measure, args, path), nprocs=2, join=True)
        with open(path) as f:
            return json.load(f)
