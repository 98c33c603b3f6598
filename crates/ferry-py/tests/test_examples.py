"""The Python examples (``examples/python``) run to the end."""

import os
import subprocess
import sys

import group

EXAMPLES = os.path.join(group.HERE, "..", "..", "..", "examples", "python")


def test_listing1_runs_and_matches_the_local_layers():
    script = os.path.join(EXAMPLES, "listing1.py")
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, script, "--batches", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=group.EXIT_BOUND_S * 2,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("equal to the local layers'") == 2, proc.stdout
