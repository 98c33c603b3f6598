"""A worker of a test group: joins it, serves, and leaves with it.

``python worker.py [rpc_timeout]``: RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT come from the environment.
"""

import os
import sys

import ferry.rpc as rpc


def main():
    rank = int(os.environ["RANK"])
    options = None
    if len(sys.argv) > 1:
        options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=float(sys.argv[1]))
    rpc.init_rpc(f"worker{rank}", rank=rank, rpc_backend_options=options)
    # Serves until every worker has called shutdown (graceful).
    rpc.shutdown()


if __name__ == "__main__":
    main()
