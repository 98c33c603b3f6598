"""The group the RPC tests run in: this process is worker0 (the caller),
worker1 and worker2 are processes running ``worker.py``."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import group  # noqa: E402

#: The group's default timeout of calls (seconds): a test that goes wrong
#: fails within it instead of hanging.
RPC_TIMEOUT_S = 30.0
WORLD_SIZE = 3


@pytest.fixture(scope="session")
def workers():
    """worker0 (this process), worker1, worker2, for the whole session."""
    import ferry.rpc as rpc

    port = group.free_port()
    procs = group.start(
        ["worker.py", str(RPC_TIMEOUT_S)], ranks=[1, 2], world_size=WORLD_SIZE, port=port
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=RPC_TIMEOUT_S)
    try:
        rpc.init_rpc("worker0", rank=0, world_size=WORLD_SIZE, rpc_backend_options=options)
    except BaseException:
        group.join(procs, bound=1)
        raise
    yield ["worker0", "worker1", "worker2"]
    rpc.shutdown()
    codes = group.join(procs)
    assert codes == [0, 0], f"workers exited with {codes}"
