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


def test_param_server_in_rust_trains_python_trainers_to_the_true_model():
    """examples/python/param_server_trainer.py: two Python trainers and the
    Rust parameter server (crates/ferry/examples/param_server.rs) in one
    group; the server checks the trained model and exits with 0."""
    import rust_worker

    port = group.free_port()
    world = 3
    server = subprocess.Popen(
        [rust_worker.binary("param_server")],
        env=group.worker_env(0, world, port),
        cwd=group.HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    trainers = group.start(
        [os.path.join(EXAMPLES, "param_server_trainer.py"), "--steps", "60"],
        ranks=[1, 2],
        world_size=world,
        port=port,
    )
    try:
        out, _ = server.communicate(timeout=group.EXIT_BOUND_S * 2)
    except subprocess.TimeoutExpired:
        server.kill()
        out, _ = server.communicate()
    codes = group.join(trainers)
    assert server.returncode == 0, out
    assert codes == [0, 0], f"trainers exited with {codes}\n{out}"
    assert "parameter server: trained" in out, out
    assert out.count("loss under the trained model") == 2, out
