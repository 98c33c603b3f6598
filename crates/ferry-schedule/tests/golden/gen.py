"""Regenerates the golden compute-only schedules from PyTorch.

Run from the repository root:

    .venv/bin/python crates/ferry-schedule/tests/golden/gen.py

For every schedule PyTorch ships and every shape of ranks {2, 4} x stages
per rank {1, 2} x microbatches {2, 4, 8} that PyTorch accepts, it builds the
schedule with stand-in stage objects (only the attributes the constructors
read: no process group, no model) and writes rank by rank the compute-only
action list with PyTorch's own `_dump_csv` to `<schedule>_r<ranks>_s<stages
per rank>_m<microbatches>.csv`. Shapes PyTorch rejects are listed with its
error text in `rejected.txt`.

GPipe and 1F1B are the exception: their golden files hold the order
PyTorch's runtime executes, not their `_get_pipeline_order` table (1F1B's
table starts the last rank at F1 and fails PyTorch's own lowering). The
order is recorded by running PyTorch's own `_step_microbatches` for each
rank on a stand-in stage that logs every `forward_one_chunk`,
`backward_one_chunk` and `perform_reduce_grad` call (no tensors, no
communication). Their tables are kept in `pytorch_table/<shape>.csv`. The same tables lowered by PyTorch's
`_add_send_recv` (SEND/RECV inserted) go to `comms/<shape>.csv`, and the
step count PyTorch's `_simulate_comms_compute` gives each to
`comms/steps.txt`.

FSDP lowering: for a few shapes listed in `UNSHARD_SHAPES` (several stages
per rank, V placements, OVERLAP_F_B), PyTorch's compute-only table (for
GPipe and 1F1B, the runtime order) goes to `unshard/<shape>.csv`, and that
table run through PyTorch's `_add_unshard_reshard(actions,
max_active_stages=k)` rank by rank to `unshard/<shape>_a<k>.csv` for k in
{1, 2, 3}. Every stage index stays below 8, so PyTorch's iteration over its
set of active stages is in increasing stage order (Ferry's order).
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


class _Recorder:
    """A stand-in stage for one rank that records, in order, what the
    schedule's runtime asks of it (no tensors, no communication: every
    send/recv op list is empty, so `_batch_p2p` has nothing to post)."""

    def __init__(self, index, num_stages, ranks):
        self.__dict__.update(vars(stage(index, num_stages, index, ranks)))
        self.actions = []

    def get_fwd_recv_ops(self, mb):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.actions.append(S._Action(self.stage_index, S._ComputationType.FORWARD, mb))

    def backward_one_chunk(self, mb, **kwargs):
        self.actions.append(
            S._Action(self.stage_index, S._ComputationType.FULL_BACKWARD, mb)
        )

    def perform_reduce_grad(self, scale):
        self.actions.append(
            S._Action(self.stage_index, S._ComputationType.REDUCE_GRAD, None)
        )


def runtime_order(name, ranks, micro):
    """The order PyTorch's runtime executes GPipe or 1F1B, rank by rank:
    PyTorch's own `_step_microbatches` run on a `_Recorder` stage per rank,
    with the schedule's input, loss and initialisation helpers stubbed out
    (they touch tensors only, never the order)."""
    order = {}
    for rank in range(ranks):
        recorder = _Recorder(rank, ranks, ranks)
        schedule = SINGLE[name](recorder, micro, loss_fn=lambda *a: None)
        schedule._check_inputs = lambda *a: ([None] * micro, [None] * micro)
        schedule._initialize_stage = lambda *a: None
        schedule._maybe_compute_loss = lambda *a: None
        schedule._maybe_get_loss = lambda *a: None
        schedule._update_losses = lambda *a: None
        schedule._step_microbatches()
        order[rank] = recorder.actions
    return order


def dump_comms(schedule, shape, order=None):
    """The compute-only table (or, for GPipe and 1F1B, the runtime `order`)
    lowered by PyTorch's `_add_send_recv` alone (into `comms/<shape>.csv`)."""
    mapping = getattr(schedule, "stage_index_to_group_rank", None)
    if order is None:
        order = {r: list(a) for r, a in schedule.pipeline_order.items()}
    if mapping is None:  # single-stage: stage s on rank s
        mapping = {s: s for s in order}
    os.makedirs(os.path.join(HERE, "comms"), exist_ok=True)
    try:
        lowered = S._add_send_recv(
            order, stage_to_rank=lambda s: mapping[s], num_stages=len(mapping)
        )
    except AssertionError as exc:  # never expected: the runtime orders lower
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


# (schedule, ranks, stages per rank, microbatches) for the UNSHARD/RESHARD
# fixtures; stage counts at most 8 (see the module doc).
UNSHARD_SHAPES = [
    ("gpipe", 2, 1, 4),
    ("1f1b", 4, 1, 8),
    ("interleaved1f1b", 2, 2, 4),
    ("interleaved1f1b", 2, 4, 4),
    ("loopedbfs", 2, 4, 4),
    ("interleavedzb", 2, 4, 8),
    ("interleavedzb", 4, 2, 8),
    ("zbv", 2, 2, 4),
    ("zbv", 4, 2, 8),
    ("dualpipev", 2, 2, 4),
    ("dualpipev", 4, 2, 8),
]


def dump_unshard(name, ranks, per_rank, micro):
    """PyTorch's compute-only order for one shape, and the same order with
    PyTorch's `_add_unshard_reshard` applied for max_active_stages 1..3."""
    shape = f"{name}_r{ranks}_s{per_rank}_m{micro}"
    if name in SINGLE:
        order = runtime_order(name, ranks, micro)
    else:
        schedule = build(name, ranks, per_rank, micro)
        order = {r: list(a) for r, a in schedule.pipeline_order.items()}
    if max(a.stage_index for row in order.values() for a in row if a) >= 8:
        raise ValueError(f"{shape}: stage indices must stay below 8")
    directory = os.path.join(HERE, "unshard")
    write_rows(os.path.join(directory, shape + ".csv"), order)
    for k in (1, 2, 3):
        lowered = {
            r: S._add_unshard_reshard(list(a), max_active_stages=k)
            for r, a in order.items()
        }
        write_rows(os.path.join(directory, f"{shape}_a{k}.csv"), lowered)


def write_rows(path, order):
    """One CSV row per rank, the way PipelineScheduleMulti's _dump_csv does."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for rank in sorted(order):
            writer.writerow(order[rank])


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
                        dump_comms(schedule, shape)
                        continue
                    # Single-stage schedules (GPipe, 1F1B) have no _dump_csv.
                    # Their `_get_pipeline_order` table is not what runs (1F1B's
                    # last rank starts at F1 and cannot be lowered): keep it in
                    # pytorch_table/ for the record, and take as the golden
                    # order the one `_step_microbatches` executes.
                    write_rows(
                        os.path.join(HERE, "pytorch_table", shape + ".csv"),
                        schedule.pipeline_order,
                    )
                    order = runtime_order(name, ranks, micro)
                    write_rows(path, order)
                    dump_comms(schedule, shape, order)
    for name, ranks, per_rank, micro in UNSHARD_SHAPES:
        dump_unshard(name, ranks, per_rank, micro)
    with open(os.path.join(HERE, "rejected.txt"), "w") as out:
        out.write(f"# torch {torch.__version__}\n")
        for line in rejected:
            out.write(line.replace("\n", " ") + "\n")


if __name__ == "__main__":
    main()
