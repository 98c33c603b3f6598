"""Finding and starting the Rust worker binaries of the mixed-group tests
(``crates/ferry/examples/mixed_worker.rs``, ``param_server.rs``), which
``cargo xtask test`` builds before the Python tests."""

import os
import subprocess

import group

ROOT = os.path.normpath(os.path.join(group.HERE, "..", "..", ".."))

#: The examples these tests run, and the command that builds them.
BUILD = "cargo build -p ferry --features torch --example mixed_worker --example param_server"


def binary(name):
    """The path of the example binary ``name``: under ``FERRY_EXAMPLES_DIR``
    if set, else the cargo target directory's ``debug/examples``."""
    where = os.environ.get("FERRY_EXAMPLES_DIR")
    if not where:
        target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
        where = os.path.join(target, "debug", "examples")
    path = os.path.join(where, name)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} is missing: build it with `{BUILD}` (cargo xtask test does)"
        )
    return path


def start(name, args, rank, world_size, port):
    """Starts the Rust example ``name`` as rank ``rank`` of the group."""
    return subprocess.Popen(
        [binary(name), *args],
        env=group.worker_env(rank, world_size, port),
        cwd=group.HERE,
    )
