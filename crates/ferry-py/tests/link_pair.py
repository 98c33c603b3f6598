"""One side of a two-worker group over a link narrowed by the environment
(``FERRY_TRANSPORTS``, ``FERRY_CHANNELS``, ``FERRY_SMALL_TENSOR_BYTES``).

``python link_pair.py TRANSPORT CHANNEL``: rank 1 serves; rank 0 checks
that the link to worker1 is the one asked for, sends tensors of every
dtype, a non-contiguous view, a zero-size and a 4 MB tensor both ways and
checks each arrives equal, then both shut down. A failed check raises:
the process exits non-zero with the reason on stderr.
"""

import os
import sys

import torch

import ferry.rpc as rpc
import remote_fns as fns

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int64, torch.bool]


def sample(dtype, shape):
    g = torch.Generator().manual_seed(11)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def check_link(transport, channel):
    link = rpc.link_info("worker1")
    assert link is not None, "no link to worker1 after a call"
    assert link["transport"] == transport, f"link {link}, asked for transport {transport}"
    assert link["outgoing"] == [channel], f"link {link}, asked for channel {channel}"
    assert link["incoming"] == [channel], f"link {link}, asked for channel {channel}"


def round_trips():
    tensors = [sample(d, (5, 3)) for d in DTYPES]
    tensors.append(sample(torch.float32, (6, 8))[::2, 1::3])  # non-contiguous
    tensors.append(torch.empty(0, 4))  # zero-size
    tensors.append(sample(torch.float32, (1024, 1024)))  # 4 MB
    for t in tensors:
        back = rpc.rpc_sync("worker1", fns.identity, args=(t,))
        assert back.dtype == t.dtype and back.shape == t.shape, (t.dtype, t.shape, back.shape)
        assert torch.equal(back, t), f"{t.dtype} {tuple(t.shape)} changed on the way"
        assert back.data_ptr() != t.data_ptr() or t.numel() == 0
    # Several tensors in one call, and a value computed there.
    a, b = tensors[0], tensors[-1]
    assert torch.equal(rpc.rpc_sync("worker1", fns.add, args=(a, a)), a + a)
    assert torch.equal(rpc.rpc_sync("worker1", fns.sum_of, args=(b,)), b.sum())


def main():
    transport, channel = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=60)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    try:
        if rank == 0:
            rpc.rpc_sync("worker1", fns.identity, args=(1,))
            check_link(transport, channel)
            round_trips()
    finally:
        rpc.shutdown()


if __name__ == "__main__":
    main()
