"""The PyTorch RPC paper's Listing 1 ("A Simple Model Parallel Example")
with ``ferry.rpc`` in place of ``torch.distributed.rpc``.

Three local processes: ``p0`` holds the ``Model`` and drives; ``p1`` and
``p2`` each own one ``Layer`` (``Linear(20, 20)`` + ``ReLU``), made there
by ``rpc.remote``. ``p0`` wraps each batch in an ``RRef`` it owns; ``p1``
fetches it, and its output ``rx`` stays on ``p1`` as an RRef that ``p2``
fetches straight from ``p1``: the activation never passes through ``p0``.
Only the final output comes back to ``p0`` (``to_here``).

The listing's line 23 passes ``ri`` to ``Layer.forward`` as if it were
the layer; here a small function runs the layer that the RRef refers to
on its owner, as the paper's text describes.

The listing trains with distributed autograd and a
``DistributedOptimizer`` (its lines 31-41); those come with
``ferry.autograd`` and ``ferry.optim``. This script runs the forward
passes and checks each output against the same two layers applied
locally on ``p0``.

Run it from an environment where the ``ferry`` package is installed
(``cargo xtask test`` installs it into the project's ``.venv``)::

    .venv/bin/python examples/python/listing1.py [--batches N]
"""

import argparse
import os
import socket

import torch
import torch.multiprocessing as mp
from torch import nn

import ferry.rpc as rpc

FEATURES = 20
BATCH = 16


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
    with torch.no_grad():
        return layer_rref.local_value()(x_rref)


def layer_state(layer_rref):
    """The layer's parameters, read on its owner."""
    return layer_rref.local_value().state_dict()


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


def local_copy(rref):
    """The remote layer's twin on this worker, from its parameters."""
    layer = Layer()
    layer.load_state_dict(rpc.rpc_sync(rref.owner(), layer_state, args=(rref,)))
    return layer


def drive(batches):
    """p0's part: the forward passes of Listing 1, checked locally."""
    m = Model()
    l1, l2 = local_copy(m.r11), local_copy(m.r12)
    g = torch.Generator().manual_seed(0)
    for step in range(batches):
        batch = torch.randn(BATCH, FEATURES, generator=g)
        ri = rpc.RRef(batch)
        out = m(ri).to_here()
        loss = out.sum()
        with torch.no_grad():
            expected = l2.net(l1.net(batch))
        torch.testing.assert_close(out, expected)
        print(f"step {step}: loss {loss.item():.4f} (equal to the local layers')")


def run(rank, world_size, port, batches):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc(f"p{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        drive(batches)
    # Every worker waits here until no worker has calls outstanding.
    rpc.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(3, port, args.batches), nprocs=3, join=True)


if __name__ == "__main__":
    main()
