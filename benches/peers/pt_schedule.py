#!/usr/bin/env python3
"""PyTorch's side of `cargo xtask bench --only schedule`: generating, lowering
and simulating pipeline schedules with torch.distributed.pipelining (the
same work as Ferry's `schedule_bench` example in crates/ferry-schedule).

Schedules: ScheduleInterleaved1F1B (loop placement) and ScheduleZBVZeroBubble
(V placement), both with 2 stages per rank, built for rank 0 with stand-in
stage objects that carry only the attributes the constructors read (no
process group, no model: as PyTorch's own tests and
crates/ferry-schedule/tests/golden/gen.py build them). The constructor still
runs PyTorch's real generation code for every rank (`pipeline_order`).

One repetition of a row (ranks x microbatches), each phase timed on its own:
  generate  the constructor with its own lowering switched off
            (`_prepare_schedule_with_comms` skipped): `pipeline_order` for
            every rank, nothing else;
  lower     `_add_send_recv(pipeline_order)`;
  simulate  `_simulate_comms_compute(lowered)`;
  total     generate + lower + simulate: exactly the work Ferry's side does.
and, once per row and run (unless --no-constructor), the full constructor
as users call it (`construct`: generation plus its own lowering: UNSHARD /
RESHARD, REDUCE_GRAD and SEND/RECV for rank 0's runtime). `construct_total` =
construct + lower + simulate: PyTorch's side as its users run it.

Repetitions: at least --min-reps and until --min-seconds of work, at most
--max-reps (the 64x256 rows take seconds each, so they get --min-reps).
Each row also reports the simulated step count and the number of lowered
actions, which the xtask checks against Ferry's.

Prints one final JSON object and writes it to --out when given.

Examples:
  .venv/bin/python benches/peers/pt_schedule.py --shapes 8x32 --min-reps 3
  .venv/bin/python benches/peers/pt_schedule.py --quick --out /tmp/pt.json
"""
import argparse
import json
import statistics
import sys
import time
import types

import torch
from torch.distributed.pipelining import schedules as S

STAGES_PER_RANK = 2
SCHEDULES = {
    "Interleaved1F1B": (S.ScheduleInterleaved1F1B, False),
    "ZBVZeroBubble": (S.ScheduleZBVZeroBubble, True),
}
SHAPES = ("8x32", "32x128", "64x256")


def stage(index, num_stages, ranks):
    """A stand-in for rank 0's PipelineStage: what the constructors read."""
    return types.SimpleNamespace(
        stage_index=index,
        num_stages=num_stages,
        group_rank=0,
        group_size=ranks,
        is_first=index == 0,
        is_last=index == num_stages - 1,
        submod=torch.nn.Identity(),
        stage_index_to_group_rank={},
    )


def construct(name, ranks, micro, lower):
    """The schedule object for rank 0; without `lower`, the constructor
    skips its own lowering (the generation of `pipeline_order` still runs)."""
    cls, v = SCHEDULES[name]
    num_stages = ranks * STAGES_PER_RANK
    # Rank 0 holds stage 0 and, in the V, the last stage; in the loop, stage `ranks`.
    stages = [stage(0, num_stages, ranks), stage(num_stages - 1 if v else ranks, num_stages, ranks)]
    if lower:
        return cls(stages, micro, loss_fn=lambda *a: None)
    saved = S._PipelineScheduleRuntime._prepare_schedule_with_comms
    S._PipelineScheduleRuntime._prepare_schedule_with_comms = lambda self, *a, **k: None
    try:
        return cls(stages, micro, loss_fn=lambda *a: None)
    finally:
        S._PipelineScheduleRuntime._prepare_schedule_with_comms = saved


def one_rep(name, ranks, micro):
    t0 = time.perf_counter()
    schedule = construct(name, ranks, micro, lower=False)
    t1 = time.perf_counter()
    mapping = schedule.stage_index_to_group_rank
    num_stages = ranks * STAGES_PER_RANK
    order = {rank: list(actions) for rank, actions in schedule.pipeline_order.items()}
    t1b = time.perf_counter()  # the copy above is not PyTorch's work: not timed
    lowered = S._add_send_recv(order, stage_to_rank=lambda s: mapping[s], num_stages=num_stages)
    t2 = time.perf_counter()
    simulated = S._simulate_comms_compute(
        lowered, stage_to_rank=lambda s: mapping[s], num_stages=num_stages
    )
    t3 = time.perf_counter()
    steps = max(len(row) for row in simulated.values())
    actions = sum(len(row) for row in lowered.values())
    return {
        "generate": t1 - t0,
        "lower": t2 - t1b,
        "simulate": t3 - t2,
        "steps": steps,
        "actions": actions,
    }


def pct(sorted_values, p):
    idx = p * (len(sorted_values) - 1)
    lo = int(idx)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] * (1 - (idx - lo)) + sorted_values[hi] * (idx - lo)


def stats(secs):
    ms = sorted(s * 1e3 for s in secs)
    return {
        "n": len(ms),
        "median_ms": pct(ms, 0.5),
        "p10_ms": pct(ms, 0.1),
        "p90_ms": pct(ms, 0.9),
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "mean_ms": statistics.fmean(ms),
        "samples_s": list(secs),
    }


def row(name, ranks, micro, args):
    phases = {"generate": [], "lower": [], "simulate": [], "total": []}
    counts = None
    start = time.perf_counter()
    while len(phases["total"]) < args.max_reps and (
        len(phases["total"]) < args.min_reps or time.perf_counter() - start < args.min_seconds
    ):
        rep = one_rep(name, ranks, micro)
        if counts is not None and counts != (rep["steps"], rep["actions"]):
            raise SystemExit(f"{name} {ranks}x{micro}: repetitions disagree")
        counts = (rep["steps"], rep["actions"])
        for phase in ("generate", "lower", "simulate"):
            phases[phase].append(rep[phase])
        phases["total"].append(rep["generate"] + rep["lower"] + rep["simulate"])
    result = {
        "schedule": name,
        "ranks": ranks,
        "microbatches": micro,
        "stages_per_rank": STAGES_PER_RANK,
        "shape": f"{ranks}x{micro}",
        "steps": counts[0],
        "actions": counts[1],
        "reps": len(phases["total"]),
    }
    result.update({phase: stats(secs) for phase, secs in phases.items()})
    line = (
        f"{name:>16} {ranks:>4}x{micro:<5} steps {counts[0]:>6} actions {counts[1]:>8} "
        f"reps {result['reps']:>3}  median {result['total']['median_ms']:>10.2f} ms "
        f"(generate {result['generate']['median_ms']:.2f}, lower {result['lower']['median_ms']:.2f}, "
        f"simulate {result['simulate']['median_ms']:.2f})"
    )
    if args.constructor:
        t0 = time.perf_counter()
        construct(name, ranks, micro, lower=True)
        took = time.perf_counter() - t0
        result["construct"] = stats([took])
        lower_sim = [l + s for l, s in zip(phases["lower"], phases["simulate"])]
        result["construct_total"] = stats([took + x for x in lower_sim])
        line += f", constructor {took * 1e3:.2f} ms"
    print(line, file=sys.stderr, flush=True)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=None, help="RANKSxMICROBATCHES (default: %s)" % " ".join(SHAPES))
    p.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULES), default=list(SCHEDULES))
    p.add_argument("--min-reps", type=int, default=None, help="default 3; 1 with --quick")
    p.add_argument("--max-reps", type=int, default=None, help="default 50; 10 with --quick")
    p.add_argument("--min-seconds", type=float, default=None, help="default 2; 0.5 with --quick")
    p.add_argument("--no-constructor", dest="constructor", action="store_false",
                   help="do not time the full constructor")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.min_reps = max(1, args.min_reps if args.min_reps is not None else (1 if args.quick else 3))
    args.max_reps = max(args.min_reps, args.max_reps if args.max_reps is not None else (10 if args.quick else 50))
    if args.min_seconds is None:
        args.min_seconds = 0.5 if args.quick else 2.0
    shapes = []
    for text in args.shapes or SHAPES:
        ranks, _, micro = text.partition("x")
        shapes.append((int(ranks), int(micro)))
    rows = [row(name, r, m, args) for name in args.schedules for r, m in shapes]
    result = {
        "bench": "pt_schedule",
        "torch": torch.__version__,
        "what": "generate (pipeline_order, all ranks) + _add_send_recv + _simulate_comms_compute",
        "config": {"min_reps": args.min_reps, "max_reps": args.max_reps, "min_seconds": args.min_seconds},
        "rows": rows,
    }
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
