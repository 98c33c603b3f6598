#!/usr/bin/env python3
"""The peer side of `cargo xtask bench --only collective`: allreduce time
and recovery of torchft 0.2.0's own process groups, `ProcessGroupGloo`
(in-process Gloo) and `ProcessGroupBabyGloo` (Gloo in a spawned child
process, tensors in shared memory), built standalone: a TCPStore master
in this process and `configure("127.0.0.1:PORT/tf_collective/Q",
replica_id, rank, 2)` on each group, a fresh store prefix per quorum, as
torchft's Manager does.

Two replica groups on this host: this script starts two worker processes
(itself with --worker RANK), one per replica group, world size 2. Ferry's
side (`crates/ferry-ft/examples/collective_bench.rs`) does the same with
its `ProcessGroup` and `BabyProcessGroup`.

Measured on rank 0, per float32 buffer size (--sizes):
  pg    one `allreduce([t], SUM).wait()` of ProcessGroupGloo;
  baby  the same through ProcessGroupBabyGloo (the tensor already in
        shared memory; the first call, which moves it there, is warm-up);
  --rounds timed calls after --warmup untimed ones, both groups configured
  once for all sizes; stats in ms (median, p10, p90, ...).
Recovery (--recoveries times, a --recovery-size buffer): both replica
groups configure a fresh ProcessGroupBabyGloo for quorum Q and run one
allreduce; after a 200 ms pause, both start an allreduce, rank 0 SIGKILLs its own child
right after submitting it, both wait for the failure (torchft's wait
raises, after the group's --timeout at the latest), configure quorum Q+1
and allreduce again. recovery.total: from the kill to that allreduce done;
recovery.detect: from the kill to the failure seen by rank 0.

Usage: .venv/bin/python benches/peers/tf_collective.py [--quick]
       [--sizes 1MB 16MB 64MB] [--rounds N] [--warmup N] [--recoveries N]
       [--timeout S] [--out PATH]
(--quick: 5 rounds, 2 recoveries.) Prints the result as one JSON line and
writes it to --out.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_common import free_port, log, parse_size, size_label, stats_ms, versions, write_result  # noqa: E402

WORLD = 2
# Pause between a recovery round's first allreduce and the one killed (not timed).
SETTLE_S = 0.2


def addr(port, quorum):
    return f"127.0.0.1:{port}/tf_collective/{quorum}"


def sum_opts():
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return opts


def timed_allreduces(pg, t, warmup, rounds):
    opts = sum_opts()
    for _ in range(warmup):
        pg.allreduce([t], opts).wait()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        pg.allreduce([t], opts).wait()
        times.append(time.perf_counter() - start)
    return times


def recovery_round(args, rank, port, quorum, n):
    """One kill-and-recover round; (detect_s, total_s, failed) on rank 0."""
    import torch
    from torchft.process_group import ProcessGroupBabyGloo

    pg = ProcessGroupBabyGloo(timeout=args.timeout)
    opts = sum_opts()
    t = torch.ones(n, dtype=torch.float32)
    t.share_memory_()
    try:
        pg.configure(addr(port, quorum), f"replica_{rank}", rank, WORLD)
        pg.allreduce([t], opts).wait()
        time.sleep(SETTLE_S)  # as Ferry's side: the peer done with this allreduce
        work = pg.allreduce([t], opts)
        start = time.perf_counter()
        if rank == 0:
            os.kill(pg._p.pid, signal.SIGKILL)
        failed = False
        try:
            work.wait()
        except Exception:  # noqa: BLE001 (any failure is the expected one)
            failed = True
        detect = time.perf_counter() - start
        pg.configure(addr(port, quorum + 1), f"replica_{rank}", rank, WORLD)
        pg.allreduce([t], opts).wait()
        total = time.perf_counter() - start
    finally:
        pg.shutdown()
    return detect, total, failed


def worker(args, rank, port):
    import torch
    from torchft.process_group import ProcessGroupBabyGloo, ProcessGroupGloo

    sizes = [parse_size(s) for s in args.sizes]
    rows = []
    groups = {}
    for kind, quorum in (("pg", 1), ("baby", 2)):
        cls = ProcessGroupGloo if kind == "pg" else ProcessGroupBabyGloo
        pg = cls(timeout=timedelta(seconds=args.timeout))
        pg.configure(addr(port, quorum), f"replica_{rank}", rank, WORLD)
        groups[kind] = pg
    for nbytes in sizes:
        row = {"size": size_label(nbytes), "bytes": nbytes}
        for kind, pg in groups.items():
            t = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float32)
            row[kind] = stats_ms(timed_allreduces(pg, t, args.warmup, args.rounds))
        row["baby_over_pg"] = row["baby"]["median_ms"] / row["pg"]["median_ms"]
        rows.append(row)
        if rank == 0:
            log(f"tf_collective: {row['size']}: gloo {row['pg']['median_ms']:.2f} ms, "
                f"baby gloo {row['baby']['median_ms']:.2f} ms")
    for pg in groups.values():
        pg.shutdown()

    detect, total, unfailed = [], [], 0
    n = parse_size(args.recovery_size) // 4
    for i in range(args.recoveries):
        d, s, failed = recovery_round(args, rank, port, 100 + 2 * i, n)
        detect.append(d)
        total.append(s)
        unfailed += 0 if failed else 1
    if rank == 0:
        result = {
            "bench": "tf_collective",
            "world_size": WORLD,
            "rows": rows,
            "recovery": stats_ms(total),
            "recovery_detect": stats_ms(detect),
            "recovery_bytes": n * 4,
            "recovery_unfailed": unfailed,
            "timeout_s": args.timeout,
            "settings": {"rounds": args.rounds, "warmup": args.warmup,
                         "recoveries": args.recoveries},
            "versions": versions(),
        }
        print(json.dumps(result), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["1MB", "16MB", "64MB"])
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recoveries", type=int)
    ap.add_argument("--recovery-size", default="16MB")
    ap.add_argument("--timeout", type=float, default=10.0, help="the groups' timeout, seconds")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 5 if args.quick else 20
    if args.recoveries is None:
        args.recoveries = 2 if args.quick else 5

    if args.worker is not None:
        worker(args, args.worker, args.port)
        return

    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=120))
    forwarded = ["--sizes", *args.sizes, "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                 "--recoveries", str(args.recoveries), "--recovery-size", args.recovery_size,
                 "--timeout", str(args.timeout), "--port", str(port)]
    procs = [
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(rank), *forwarded],
                         stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, text=True)
        for rank in range(WORLD)
    ]
    out, _ = procs[0].communicate()
    codes = [procs[0].returncode, procs[1].wait()]
    del store
    if any(codes):
        sys.exit(f"tf_collective: a worker failed (exit codes {codes})")
    result = json.loads(out.strip().splitlines()[-1])
    write_result(args.out, result)


if __name__ == "__main__":
    main()
