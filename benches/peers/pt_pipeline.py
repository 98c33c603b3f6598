#!/usr/bin/env python3
"""PyTorch's side of `cargo xtask bench --only pipeline`: pipeline-parallel
training with torch.distributed.pipelining over gloo, 2 processes on
127.0.0.1, the same model, data, schedules and timing as ferry-pipeline's
example `pipeline_bench` (crates/ferry-pipeline/examples/pipeline_bench.rs).

Model: --layers (8) blocks of nn.Linear(W, W) + ReLU, W = --width (1024),
initialised under seed 0 with Kaiming-normal weights and zero biases.
Batch --batch (64) split into equal microbatches, nn.MSELoss() (mean) per
microbatch with the schedule's scale_grads, torch.optim.SGD (--lr 0.05)
over each rank's own stages, stepped after schedule.step(). Step k trains
on x ~ N(0, 1) from seed 1000 + k and target relu(x @ W_t / sqrt(W)) with
a fixed teacher W_t (seed 7).

Cells, each a fresh 2-process gloo group (a failing schedule cannot spoil
the next), at every --microbatches value:
  GPipe, 1F1B                   1 stage per rank (stages 0 | 1)
  Interleaved1F1B, LoopedBFS,   2 stages per rank, loop placement
  InterleavedZeroBubble         (rank 0: 0, 2; rank 1: 1, 3)
  ZBVZeroBubble, DualPipeV      2 stages per rank, V placement
                                (rank 0: 0, 3; rank 1: 1, 2)
A step, timed on every rank after an untimed dist.barrier: zero_grad +
schedule.step + optimizer.step; the first --warmup steps are left out.
Per cell: each rank's step times, the per-step maximum over the ranks
(`step_ms_max_of_ranks`, the step the xtask compares), the losses, and the
largest parameter difference from the baseline after the same steps.
Baseline: the same model and data in one process, full batch, --threads
intra-op threads (as each pipeline process has).

Prints one JSON object and writes it to --out. Run with the project's
.venv (torch 2.13.0):
  .venv/bin/python benches/peers/pt_pipeline.py --quick --schedules GPipe --microbatches 4
"""
import argparse
import datetime
import json
import os
import shutil
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from peer_common import free_port, log, stats_ms, versions, write_result

ONE_STAGE = ("GPipe", "1F1B")
V_PLACED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV")
QUICK_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")
RANKS = 2


def build_model(a):
    torch.manual_seed(0)
    blocks = []
    for _ in range(a.layers):
        linear = nn.Linear(a.width, a.width)
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        blocks.append(nn.Sequential(linear, nn.ReLU()))
    return nn.Sequential(*blocks)


def teacher(a):
    return torch.randn(a.width, a.width, generator=torch.Generator().manual_seed(7))


def batch(a, k, w_t):
    x = torch.randn(a.batch, a.width, generator=torch.Generator().manual_seed(1000 + k))
    return x, torch.relu(x @ w_t / (a.width ** 0.5))


def loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def placement(schedule):
    """(stages per rank, number of stages, stages of each rank)."""
    per_rank = 1 if schedule in ONE_STAGE else 2
    stages = RANKS * per_rank
    if schedule in V_PLACED:
        of_rank = {r: sorted([r, stages - 1 - r]) for r in range(RANKS)}
    else:
        of_rank = {r: [r + i * RANKS for i in range(per_rank)] for r in range(RANKS)}
    return per_rank, stages, of_rank


def baseline(a):
    torch.set_num_threads(a.threads)
    model, w_t = build_model(a), teacher(a)
    optimizer = torch.optim.SGD(model.parameters(), lr=a.lr)
    loss_fn = nn.MSELoss()
    times, losses = [], []
    for k in range(a.warmup + a.steps):
        x, y = batch(a, k, w_t)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        elapsed = time.perf_counter() - t0
        losses.append(loss.item())
        if k >= a.warmup:
            times.append(elapsed)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"threads": a.threads, "step_ms": stats_ms(times), "losses": losses, "final_loss": losses[-1]}, params


def cell_worker(rank, a, cell, port, tmp):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    torch.set_num_threads(a.threads)
    out = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=RANKS, timeout=datetime.timedelta(seconds=a.pg_timeout))
        name, microbatches = cell["schedule"], cell["microbatches"]
        _, n_stages, of_rank = placement(name)
        mine = of_rank[rank]
        full = build_model(a)
        per_stage = a.layers // n_stages
        modules = {s: full[s * per_stage:(s + 1) * per_stage] for s in mine}
        stages = [PipelineStage(modules[s], s, n_stages, torch.device("cpu")) for s in mine]
        schedule = get_schedule_class(name)(stages[0] if name in ONE_STAGE else stages, microbatches,
                                            loss_fn=nn.MSELoss())
        optimizer = torch.optim.SGD([p for s in mine for p in modules[s].parameters()], lr=a.lr)
        first, last = 0 in mine, n_stages - 1 in mine
        w_t = teacher(a)
        times, step_losses = [], []
        for k in range(a.warmup + a.steps):
            x, y = batch(a, k, w_t)
            dist.barrier()
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            losses = [] if last else None
            kwargs = {"target": y, "losses": losses} if last else {}
            schedule.step(*((x,) if first else ()), return_outputs=False, **kwargs)
            optimizer.step()
            times.append(time.perf_counter() - t0)
            if last:
                step_losses.append(torch.stack([l.detach() for l in losses]).mean().item())
        dist.barrier()
        params = {f"{s * per_stage + i}.{n}": p.detach().clone()
                  for s in mine for i, block in enumerate(modules[s]) for n, p in block.named_parameters()}
        torch.save(params, os.path.join(tmp, f"params_rank{rank}.pt"))
        out.update({"ok": True, "times_s": times, "losses": step_losses if last else None})
    except Exception as e:  # noqa: BLE001 (reported in the cell, not raised)
        out.update({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
    finally:
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_cell(a, cell, base_params):
    """One cell in a fresh pair of processes, bounded by --cell-timeout."""
    tmp = tempfile.mkdtemp(prefix="ferry_pt_pipeline_")
    start = time.time()
    result = dict(cell)
    per_rank, n_stages, of_rank = placement(cell["schedule"])
    result.update({"stages_per_rank": per_rank, "num_stages": n_stages,
                   "rank_stages": {str(r): s for r, s in of_rank.items()}})
    ctx = mp.start_processes(cell_worker, args=(a, cell, free_port(), tmp), nprocs=RANKS, join=False,
                             start_method="spawn")
    killed = None
    try:
        while not ctx.join(timeout=0.5):
            if time.time() - start > a.cell_timeout:
                killed = f"cell exceeded --cell-timeout {a.cell_timeout}s"
                break
    except Exception as e:  # noqa: BLE001 (a worker died; spawn re-raises)
        killed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
        p.join(10)
    ranks = {}
    for r in range(RANKS):
        path = os.path.join(tmp, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks[r] = json.load(f)
    result["wall_s"] = time.time() - start
    errors = [f"rank{r}: {v['error']}" for r, v in ranks.items() if not v.get("ok")]
    if killed or errors or len(ranks) != RANKS:
        missing = [] if len(ranks) == RANKS else ["a rank wrote no result"]
        result.update({"status": "failed", "error": "; ".join(errors + ([killed] if killed else []) + missing)})
        shutil.rmtree(tmp, ignore_errors=True)
        return result
    w = a.warmup
    t0, t1 = ranks[0]["times_s"], ranks[1]["times_s"]
    last = next(r for r in ranks if ranks[r]["losses"] is not None)
    params = {}
    for r in range(RANKS):
        params.update(torch.load(os.path.join(tmp, f"params_rank{r}.pt")))
    shutil.rmtree(tmp, ignore_errors=True)
    result.update({
        "status": "ok",
        "step_ms_rank0": stats_ms(t0[w:]),
        "step_ms_max_of_ranks": stats_ms([max(x, y) for x, y in zip(t0[w:], t1[w:])]),
        "losses": ranks[last]["losses"],
        "final_loss": ranks[last]["losses"][-1],
        "max_abs_param_diff_vs_baseline": max((params[n] - base_params[n]).abs().max().item() for n in base_params),
    })
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="+", choices=SCHEDULES,
                    help="default: all seven; with --quick: " + " ".join(QUICK_SCHEDULES))
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per cell, after --warmup")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    ap.add_argument("--pg-timeout", type=float, default=120.0, help="gloo's timeout, s")
    ap.add_argument("--cell-timeout", type=float, default=240.0, help="wall-clock limit of a cell, s")
    ap.add_argument("--quick", action="store_true", help="10 timed steps after 2 warm-up steps")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.warmup = 10, 2
    a.schedules = a.schedules or list(QUICK_SCHEDULES if a.quick else SCHEDULES)
    if any(a.batch % m for m in a.microbatches):
        ap.error("--batch must be divisible by every --microbatches value")
    if a.layers % (2 * RANKS):
        ap.error("--layers must be divisible by 4 (2 ranks x 2 stages)")
    start, load_start = time.time(), loadavg()

    log(f"[pt_pipeline] baseline, {a.threads} thread(s)")
    base, base_params = baseline(a)
    cells = []
    for name in a.schedules:
        for m in a.microbatches:
            log(f"[pt_pipeline] {name} mb={m}")
            cell = run_cell(a, {"schedule": name, "microbatches": m}, base_params)
            if cell["status"] == "ok":
                log(f"    step {cell['step_ms_max_of_ranks']['median_ms']:.1f} ms (max of ranks, median), "
                    f"max |param - baseline| {cell['max_abs_param_diff_vs_baseline']:.2e}")
            else:
                log(f"    FAILED: {cell['error'][:300]}")
            cells.append(cell)
    write_result(a.out, {
        "bench": "pt_pipeline",
        "versions": versions(),
        "config": {k: v for k, v in vars(a).items() if k != "out"},
        "host": {"cpu_count": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": loadavg()},
        "baseline": [base],
        "cells": cells,
        "elapsed_s": time.time() - start,
    })


if __name__ == "__main__":
    main()
