#!/usr/bin/env python3
"""PyTorch's side of `cargo xtask bench --only autograd`: the PyTorch RPC
paper's Table 2, the overhead of distributed autograd, with
torch.distributed.rpc (TensorPipe) on one host; the same measurement as
ferry-autograd's example `autograd_overhead`.

Model: two nn.Linear(H, H) (H = --hidden, 1024), input --batch x H (32),
loss = output.sum(). worker0 holds layer 1; worker1 holds layer 2 behind an
RRef for the RPC cases, and worker0 a local copy for the local ones.
Columns, each timed per iteration in ms:
  norpc-fwd        both layers local, autograd on;
  nograd-fwd       under no_grad, layer 2 through rpc_sync (no context);
  grad-fwd         inside dist_autograd.context(), layer 2 through rpc_sync;
  norpc-bwd        loss.backward() of the local model;
  grad-bwd         dist_autograd.backward(ctx, [loss]) after grad-fwd;
  dist-optim-step  DistributedOptimizer(SGD).step(ctx) after a forward and
                   backward (its own loop).
The three forward cases alternate in blocks of --block iterations. The
overheads the xtask infers: RPC forward (nograd-fwd - norpc-fwd),
distributed autograd forward (grad-fwd - nograd-fwd) and backward
(grad-bwd - norpc-bwd).

Prints one JSON object and writes it to --out. Run with the project's
.venv (torch 2.13.0):
  .venv/bin/python benches/peers/pt_dist_autograd_overhead.py --quick
"""
import argparse
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.optim import DistributedOptimizer

from peer_common import run_rpc_pair, stats_ms, versions, write_result


def make_layer(hidden, seed):
    torch.manual_seed(seed)
    return nn.Linear(hidden, hidden)


def forward(layer_rref, h):
    return layer_rref.local_value()(h)


def forward_no_grad(layer_rref, h):
    with torch.no_grad():
        return layer_rref.local_value()(h)


def parameter_rrefs(layer_rref):
    return [rpc.RRef(p) for p in layer_rref.local_value().parameters()]


def measure(a):
    layer1 = make_layer(a.hidden, 1)
    layer2_local = make_layer(a.hidden, 2)
    layer2 = rpc.remote("worker1", make_layer, args=(a.hidden, 2))
    x = torch.randn(a.batch, a.hidden)
    times = {k: [] for k in ("norpc-fwd", "nograd-fwd", "grad-fwd", "norpc-bwd", "grad-bwd")}

    def local(record):
        for p in [*layer1.parameters(), *layer2_local.parameters()]:
            p.grad = None
        t0 = time.perf_counter()
        loss = layer2_local(layer1(x)).sum()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if record:
            times["norpc-fwd"].append(t1 - t0)
            times["norpc-bwd"].append(t2 - t1)

    def no_grad(record):
        t0 = time.perf_counter()
        with torch.no_grad():
            rpc.rpc_sync("worker1", forward_no_grad, args=(layer2, layer1(x))).sum()
        if record:
            times["nograd-fwd"].append(time.perf_counter() - t0)

    def distributed(record):
        with dist_autograd.context() as ctx:
            t0 = time.perf_counter()
            loss = rpc.rpc_sync("worker1", forward, args=(layer2, layer1(x))).sum()
            t1 = time.perf_counter()
            dist_autograd.backward(ctx, [loss])
            t2 = time.perf_counter()
        if record:
            times["grad-fwd"].append(t1 - t0)
            times["grad-bwd"].append(t2 - t1)

    for _ in range(a.warmup):
        local(False)
        no_grad(False)
        distributed(False)
    done = 0
    while done < a.reps:
        k = min(a.block, a.reps - done)
        for case in (local, no_grad, distributed):
            for _ in range(k):
                case(True)
        done += k
    columns = {k: stats_ms(v) for k, v in times.items()}

    params = [rpc.RRef(p) for p in layer1.parameters()]
    params += rpc.rpc_sync("worker1", parameter_rrefs, args=(layer2,))
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=1e-3)
    steps = []
    for i in range(a.warmup + a.optim_reps):
        with dist_autograd.context() as ctx:
            loss = rpc.rpc_sync("worker1", forward, args=(layer2, layer1(x))).sum()
            dist_autograd.backward(ctx, [loss])
            t0 = time.perf_counter()
            optimizer.step(ctx)
            if i >= a.warmup:
                steps.append(time.perf_counter() - t0)
    columns["dist-optim-step"] = stats_ms(steps)
    return {"columns": columns}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--optim-reps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads per process")
    ap.add_argument("--rpc-timeout", type=float, default=120.0)
    ap.add_argument("--quick", action="store_true", help="40 iterations, 20 optimizer steps")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.quick:
        a.reps, a.optim_reps, a.warmup, a.block = 40, 20, 5, 10
    start = time.time()
    result = run_rpc_pair(measure, a)
    write_result(a.out, {
        "bench": "pt_dist_autograd_overhead",
        "versions": versions(),
        "config": {k: v for k, v in vars(a).items() if k != "out"},
        **result,
        "elapsed_s": time.time() - start,
    })


if __name__ == "__main__":
    main()
