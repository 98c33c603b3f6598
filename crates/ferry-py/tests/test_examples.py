"""The Python examples (``examples/python``) run to the end, and what
they compute is what the same model computes locally with plain torch."""

import importlib.util
import os
import subprocess
import sys

import torch

import group

EXAMPLES = os.path.join(group.HERE, "..", "..", "..", "examples", "python")


def load_example(name):
    """The example ``name`` as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(name, *args):
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, f"{name}.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=group.EXIT_BOUND_S * 2,
    )


def test_listing1_forward_matches_and_training_matches_local_torch(tmp_path):
    batches = 3
    saved = tmp_path / "params.pt"
    proc = run_example("listing1", "--batches", str(batches), "--save", str(saved))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("equal to the local layers'") == batches, proc.stdout
    assert proc.stdout.count("training step") == batches, proc.stdout

    # The same two layers, from the same initial parameters, trained in
    # this process with plain torch autograd and torch.optim.SGD.
    listing1 = load_example("listing1")
    params = torch.load(saved)
    layers = []
    for state in params["initial"]:
        layer = listing1.Layer()
        layer.load_state_dict(state)
        layers.append(layer)
    l1, l2 = layers
    opt = torch.optim.SGD(list(l1.parameters()) + list(l2.parameters()), lr=params["lr"])
    for batch in listing1.batches(batches):
        opt.zero_grad()
        l2.net(l1.net(batch)).sum().backward()
        opt.step()
    for layer, initial, trained in zip(layers, params["initial"], params["trained"]):
        for name, value in layer.state_dict().items():
            assert not torch.equal(trained[name], initial[name]), f"{name} did not train"
            torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=4e-5)
