"""Starting and stopping ferry.rpc: the ways PyTorch's users start it
(backend options, an init method, the environment, torchrun), and the
error of a call made before it starts. Each runs in worker processes of
its own."""

import os
import shutil
import subprocess
import sys

import pytest

import group


def run_group(mode, world_size=2, env=None):
    port = group.free_port()
    extra = {"TEST_PORT": str(port)}
    extra.update(env or {})
    procs = group.start(["init_worker.py", mode], range(world_size), world_size, port, extra)
    return group.join(procs)


@pytest.mark.parametrize("mode", ["tcp", "torch-options"])
def test_init_rpc_with_backend_options(mode):
    # No MASTER_* variables: the init method names the rendezvous.
    env = {"MASTER_ADDR": "", "MASTER_PORT": ""}
    assert run_group(mode, env=env) == [0, 0]


def test_init_rpc_from_the_environment():
    assert run_group("env", world_size=3) == [0, 0, 0]


def test_a_call_before_init_rpc_raises_pytorchs_error():
    assert run_group("uninitialized", world_size=1) == [0]


def test_init_rpc_under_torchrun():
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        print("SKIPPED: torchrun is not installed beside this Python")
        return
    env = group.worker_env(0, 2, group.free_port())
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k)
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "init_worker.py", "env"],
        cwd=group.HERE,
        env=env,
        timeout=group.EXIT_BOUND_S * 2,
    )
    assert proc.returncode == 0
