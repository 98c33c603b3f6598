"""A Python trainer of a parameter server in Rust, in one group.

The server (``crates/ferry/examples/param_server.rs``, worker ``ps``)
holds a linear model's parameters ``w`` and ``b`` and applies the
gradients its trainers push. Each trainer (``trainer<rank>``) makes its
own data from the same true model (``y = x·w + b`` plus a little noise),
and for each step pulls the parameters, computes the mean squared error's
gradients with torch's autograd, and pushes them: it calls the Rust
functions by name, its values converted by their Rust types (``Params``
arrives as a ``dict`` with a ``torch.Tensor``; ``Grads`` leaves as one).
When it has run its steps it tells the server it is done; the server then
calls back each trainer's ``evaluate``, a Python function registered for
Rust callers with the shapes of the Rust types, and checks the model.

Start the server as rank 0 and the trainers as ranks 1.. of the same
group::

    export MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=3
    RANK=0 target/debug/examples/param_server &
    RANK=1 .venv/bin/python examples/python/param_server_trainer.py &
    RANK=2 .venv/bin/python examples/python/param_server_trainer.py
"""

import argparse
import os

import torch

import ferry.rpc as rpc

#: The model the data comes from (the server checks against the same).
TRUE_W = torch.tensor([2.0, -3.0, 0.5, 1.0])
TRUE_B = 0.7
SAMPLES = 256
#: The shape of the server's ``Params`` (``w: Tensor, b: f32, version: u64``).
PARAMS = "Params { w: Tensor, b: f32, version: u64 }"


def make_data(rank):
    """This trainer's samples: its own inputs, the true model's outputs."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(SAMPLES, TRUE_W.numel(), generator=g)
    y = x @ TRUE_W + TRUE_B + 0.01 * torch.randn(SAMPLES, generator=g)
    return x, y


def loss_of(params, x, y):
    return torch.nn.functional.mse_loss(x @ params["w"] + params["b"], y)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ps", default="ps", help="the server's worker name")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    x, y = make_data(rank)

    def evaluate(params):
        """This trainer's loss under ``params`` (the server calls it)."""
        with torch.no_grad():
            return float(loss_of(params, x, y))

    # Registered before init_rpc, so that the server finds it on its first
    # call (a registration after init_rpc is found from then on).
    rpc.register("evaluate", evaluate, args=PARAMS, returns="f64")
    rpc.init_rpc(f"trainer{rank}", rank=rank)
    print(f"trainer{rank}: the server's push is {rpc.describe(args.ps, 'push')}")
    for step in range(args.steps):
        params = rpc.rpc_sync(args.ps, "pull")
        w = params["w"].requires_grad_()
        b = torch.tensor(params["b"], requires_grad=True)
        loss = loss_of({"w": w, "b": b}, x, y)
        loss.backward()
        rpc.rpc_sync(args.ps, "push", args=({"w": w.grad, "b": float(b.grad)},))
        if step % 20 == 0 or step == args.steps - 1:
            print(f"trainer{rank}: step {step}, version {params['version']}, loss {loss.item():.5f}")
    rpc.rpc_sync(args.ps, "done", args=(f"trainer{rank}",))
    # Serves (the server's evaluate calls) until the whole group shuts down.
    rpc.shutdown()


if __name__ == "__main__":
    main()
