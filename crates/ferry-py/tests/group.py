"""Starting a group of worker processes for the tests, bounded in time.

The test process itself is worker 0 (it makes the calls); the others run
``worker.py``, which serves until the group shuts down. Every wait is
bounded: a worker that has not exited after its bound is killed and the
test fails, saying so.
"""

import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

#: How long a worker may take to exit once the group shut down.
EXIT_BOUND_S = 60


def free_port():
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(rank, world_size, port, extra=None):
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [HERE, env.get("PYTHONPATH", "")] if p
    )
    env.update(extra or {})
    return env


def start(script_args, ranks, world_size, port, extra_env=None, prefix=None):
    """Starts ``python <script_args...>`` once per rank in ``ranks``; with
    ``prefix(rank)``, a command prefix for each (``nsenter`` onto a host)."""
    procs = []
    for rank in ranks:
        procs.append(
            subprocess.Popen(
                [*(prefix(rank) if prefix else []), sys.executable, *script_args],
                env=worker_env(rank, world_size, port, extra_env),
                cwd=HERE,
            )
        )
    return procs


def join(procs, bound=EXIT_BOUND_S):
    """Waits for every process, at most ``bound`` seconds each; returns
    their exit codes (a killed one: ``"killed"``)."""
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=bound))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append("killed")
    return codes
