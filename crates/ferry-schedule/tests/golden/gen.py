"""Regenerates the golden compute-only schedules from PyTorch.

Run from the repository root:

    .venv/bin/python crates/ferry-schedule/tests/golden/gen.py

For every schedule PyTorch ships and every shape of ranks {2, 4} x stages
per rank {1, 2} x microbatches {2, 4, 8} that PyTorch accepts, it builds the
schedule with stand-in stage objects (only the attributes the constructors
read: no process group, no model) and writes rank by rank the compute-only
action list with PyTorch's own `_dump_csv` to `<schedule>_r<ranks>_s<stages
per rank>_m<microbatches>.csv`. Shapes PyTorch rejects are listed with its
error text in `rejected.txt`. The same tables lowered by PyTorch's
`_add_send_recv` (SEND/RECV inserted) go to `comms/<shape>.csv`, and the
step count PyTorch's `_simulate_comms_compute` gives each to
`comms/steps.txt`.
"""

import csv
import os
import types

import torch
from torch.distributed.pipelining import schedules as S

HERE = os.path.dirname(os.path.abspath(__file__))

SINGLE = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B}
MULTI = {
    "interleaved1f1b": S.ScheduleInterleaved1F1B,
    "loopedbfs": S.ScheduleLoopedBFS,
    "interleavedzb": S.ScheduleInterleavedZeroBubble,
    "zbv": S.ScheduleZBVZeroBubble,
    "dualpipev": S.ScheduleDualPipeV,
}


def stage(index, num_stages, rank, ranks):
    return types.SimpleNamespace(
        stage_index=index,
        num_stages=num_stages,
        group_rank=rank,
        group_size=ranks,
        is_first=index == 0,
        is_last=index == num_stages - 1,
        submod=torch.nn.Identity(),
        stage_index_to_group_rank={},
    )


def build(name, ranks, per_rank, micro):
    num_stages = ranks * per_rank
    loss = lambda *a: None  # noqa: E731 - a loss makes the schedules train
    if name in SINGLE:
        if per_rank != 1:
            raise ValueError("single-stage schedules have one stage per rank")
        return SINGLE[name](stage(0, num_stages, 0, ranks), micro, loss_fn=loss)
    v = name in ("zbv", "dualpipev")
    stages = []
    for local in range(per_rank):
        if v:
            index = ranks * local + (0 if local % 2 == 0 else ranks - 1)
        else:
            index = ranks * local
        stages.append(stage(index, num_stages, 0, ranks))
    return MULTI[name](stages, micro, loss_fn=loss)


def dump_comms(schedule, shape):
    """The compute-only table lowered by PyTorch's `_add_send_recv` alone
    (into `comms/<shape>.csv`)."""
    mapping = getattr(schedule, "stage_index_to_group_rank", None)
    order = {r: list(a) for r, a in schedule.pipeline_order.items()}
    if mapping is None:  # single-stage: stage s on rank s
        mapping = {s: s for s in order}
    os.makedirs(os.path.join(HERE, "comms"), exist_ok=True)
    try:
        lowered = S._add_send_recv(
            order, stage_to_rank=lambda s: mapping[s], num_stages=len(mapping)
        )
    except AssertionError as exc:  # PyTorch's 1F1B table, see the issue
        with open(os.path.join(HERE, "comms", "failed.txt"), "a") as out:
            out.write(f"{shape}: {exc}\n")
        return
    try:
        simulated = S._simulate_comms_compute(
            {r: list(a) for r, a in lowered.items()},
            stage_to_rank=lambda s: mapping[s],
            num_stages=len(mapping),
        )
        steps = max(len(row) for row in simulated.values())
        with open(os.path.join(HERE, "comms", "steps.txt"), "a") as out:
            out.write(f"{shape} {steps}\n")
    except (ValueError, KeyError):  # REDUCE_GRAD, OVERLAP_F_B: refused
        pass
    with open(os.path.join(HERE, "comms", shape + ".csv"), "w", newline="") as f:
        writer = csv.writer(f)
        for rank in sorted(lowered):
            writer.writerow(lowered[rank])


def main():
    rejected = []
    for stale in ("failed.txt", "steps.txt"):
        if os.path.exists(os.path.join(HERE, "comms", stale)):
            os.remove(os.path.join(HERE, "comms", stale))
    for name in list(SINGLE) + list(MULTI):
        for ranks in (2, 4):
            for per_rank in (1, 2):
                for micro in (2, 4, 8):
                    shape = f"{name}_r{ranks}_s{per_rank}_m{micro}"
                    try:
                        schedule = build(name, ranks, per_rank, micro)
                    except Exception as exc:  # PyTorch's own rejection
                        rejected.append(f"{shape}: {type(exc).__name__}: {exc}")
                        continue
                    path = os.path.join(HERE, shape + ".csv")
                    if isinstance(schedule, S._PipelineScheduleRuntime):
                        schedule._dump_csv(path, format="compute_only")
                    else:
                        # Single-stage schedules have no _dump_csv; write
                        # their table the way PipelineScheduleMulti's does.
                        with open(path, "w", newline="") as f:
                            writer = csv.writer(f)
                            for rank in schedule.pipeline_order:
                                writer.writerow(schedule.pipeline_order[rank])
                    dump_comms(schedule, shape)
    with open(os.path.join(HERE, "rejected.txt"), "w") as out:
        out.write(f"# torch {torch.__version__}\n")
        for line in rejected:
            out.write(line.replace("\n", " ") + "\n")


if __name__ == "__main__":
    main()
