"""The PyTorch RPC paper's Listing 1 ("A Simple Model Parallel Example")
with ``ferry.rpc``, ``ferry.autograd`` and ``ferry.optim`` in place of
``torch.distributed.rpc``, ``torch.distributed.autograd`` and
``torch.distributed.optim``.

Three local processes: ``p0`` holds the ``Model`` and drives; ``p1`` and
``p2`` each own one ``Layer`` (``Linear(20, 20)`` + ``ReLU``), made there
by ``rpc.remote``. ``p0`` wraps each batch in an ``RRef`` it owns; ``p1``
fetches it, and its output ``rx`` stays on ``p1`` as an RRef that ``p2``
fetches straight from ``p1``: the activation never passes through ``p0``.
Only the final output comes back to ``p0`` (``to_here``).

The listing's line 23 passes ``ri`` to ``Layer.forward`` as if it were
the layer; here a small function runs the layer that the RRef refers to
on its owner, as the paper's text describes.

First the forward passes alone, each output checked against the same two
layers applied locally on ``p0``; then the listing's training loop: a
``DistributedOptimizer`` (SGD) over the layers' parameter RRefs, and for
each batch a distributed autograd context in which the forward pass runs,
``backward`` goes from ``p0`` through ``p2`` to ``p1`` (the send and recv
functions that the two ``to_here`` calls recorded), and the optimizer
steps both layers on their owners. ``--save PATH`` writes the layers'
parameters before and after training (``torch.save``), which the test
compares with the same model trained locally.

Run it from an environment where the ``ferry`` package is installed
(``cargo xtask test`` installs it into the project's ``.venv``)::

    .venv/bin/python examples/python/listing1.py [--batches N] [--save PATH]
"""

import argparse
import os
import socket

import torch
import torch.multiprocessing as mp
from torch import nn, optim

import ferry.autograd as dist_autograd
import ferry.rpc as rpc
from ferry.optim import DistributedOptimizer

FEATURES = 20
BATCH = 16
#: SGD's learning rate.
LR = 0.01


# Prepare model sub-layer
class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.ReLU())

    def forward(self, rx):
        return self.net(rx.to_here())


def layer_forward(layer_rref, x_rref):
    """Runs the layer ``layer_rref`` refers to, on its owner, on the input
    ``x_rref`` refers to (fetched from wherever it lives)."""
    return layer_rref.local_value()(x_rref)


def layer_state(layer_rref):
    """The layer's parameters, read on its owner."""
    return {k: v.clone() for k, v in layer_rref.local_value().state_dict().items()}


def layer_param_rrefs(layer_rref):
    """RRefs to the layer's parameters, owned by the layer's owner."""
    return [rpc.RRef(p) for p in layer_rref.local_value().parameters()]


# Assemble model
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.r11 = rpc.remote("p1", Layer)
        self.r12 = rpc.remote("p2", Layer)

    def forward(self, ri):
        rx = rpc.remote(self.r11.owner(), layer_forward, args=(self.r11, ri))
        ry = rpc.remote(self.r12.owner(), layer_forward, args=(self.r12, rx))
        return ry

    def parameter_rrefs(self):
        rrefs = []
        for r in (self.r11, self.r12):
            rrefs += rpc.rpc_sync(r.owner(), layer_param_rrefs, args=(r,))
        return rrefs

    def layer_states(self):
        return [rpc.rpc_sync(r.owner(), layer_state, args=(r,)) for r in (self.r11, self.r12)]


def batches(n):
    """The ``n`` input batches, the same on every run."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(BATCH, FEATURES, generator=g) for _ in range(n)]


def local_copy(state):
    """A layer on this worker with the parameters ``state``."""
    layer = Layer()
    layer.load_state_dict(state)
    return layer


def drive(n, save):
    """p0's part: the forward passes of Listing 1, checked locally, then
    its training loop."""
    m = Model()
    initial = m.layer_states()
    l1, l2 = (local_copy(s) for s in initial)
    for step, batch in enumerate(batches(n)):
        out = m(rpc.RRef(batch)).to_here()
        with torch.no_grad():
            expected = l2.net(l1.net(batch))
        torch.testing.assert_close(out.detach(), expected)
        print(f"step {step}: loss {out.sum().item():.4f} (equal to the local layers')")

    # Setup distributed optimizer
    opt = DistributedOptimizer(optim.SGD, m.parameter_rrefs(), lr=LR)
    for step, batch in enumerate(batches(n)):
        with dist_autograd.context() as ctx_id:
            ri = rpc.RRef(batch)
            loss = m(ri).to_here().sum()
            dist_autograd.backward(ctx_id, [loss])
            opt.step(ctx_id)
        print(f"training step {step}: loss {loss.item():.4f}")
    if save:
        torch.save({"initial": initial, "trained": m.layer_states(), "lr": LR}, save)


def run(rank, world_size, port, n, save):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc(f"p{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        drive(n, save)
    # Every worker waits here until no worker has calls outstanding.
    rpc.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--save", help="write the parameters before and after training here")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(3, port, args.batches, args.save), nprocs=3, join=True)


if __name__ == "__main__":
    main()
