"""A worker that checks one way of starting ferry.rpc, then leaves.

``python init_worker.py MODE``:

- ``tcp``: ferry's options with ``init_method="tcp://127.0.0.1:PORT"``
  (``TEST_PORT``) and ``rpc_timeout=7``, no ``MASTER_*`` variables;
- ``torch-options``: the same through PyTorch's own
  ``TensorPipeRpcBackendOptions``;
- ``env``: no argument but the name: rank, world size and the rendezvous
  from the environment (as torchrun sets it);
- ``uninitialized``: a call before ``init_rpc`` raises PyTorch's error.

Exits 0 when every check held.
"""

import os
import sys

import ferry.rpc as rpc
import remote_fns as fns


def check_group(expected_timeout=None):
    rank = rpc.get_worker_info().id
    world = len(rpc.api._all_worker_infos())
    if expected_timeout is not None:
        assert rpc._get_rpc_timeout() == expected_timeout, rpc._get_rpc_timeout()
    peer = (rank + 1) % world
    assert rpc.rpc_sync(peer, fns.worker_name) == f"worker{peer}"
    rpc.shutdown()


def main(mode):
    if mode == "uninitialized":
        try:
            rpc.rpc_sync("worker1", fns.add, args=(1, 2))
        except RuntimeError as e:
            assert "RPC has not been initialized" in str(e), str(e)
        else:
            raise AssertionError("rpc_sync before init_rpc did not raise")
        return
    rank = int(os.environ["RANK"])
    if mode == "env":
        rpc.init_rpc(f"worker{rank}")
        check_group()
        return
    world = int(os.environ["WORLD_SIZE"])
    init_method = f"tcp://127.0.0.1:{os.environ['TEST_PORT']}"
    if mode == "tcp":
        options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=7)
    elif mode == "torch-options":
        import torch.distributed.rpc as torch_rpc

        options = torch_rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=7)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    check_group(expected_timeout=7.0)


if __name__ == "__main__":
    main(sys.argv[1])
