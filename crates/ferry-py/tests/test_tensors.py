"""Tensors through ferry.rpc: every dtype, non-contiguous views, zero-size
and large tensors, in both directions, each arriving in a fresh tensor."""

import pytest
import torch

import ferry.rpc as rpc
import remote_fns as fns

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def sample(dtype, shape=(3, 5)):
    g = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 10).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def assert_same(a, b):
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_goes_and_comes_back(workers, dtype):
    t = sample(dtype)
    back = rpc.rpc_sync("worker1", fns.identity, args=(t,))
    assert_same(back, t)
    # As the callee saw it.
    dtype_name, shape, strides, values = rpc.rpc_sync("worker2", fns.describe, args=(t,))
    assert (dtype_name, shape, strides) == (str(dtype), tuple(t.shape), t.stride())
    assert values == t.tolist()


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.t(),
        lambda t: t[:, 1::2],
        lambda t: t[1:],
        lambda t: t[2],
        lambda t: t.unsqueeze(1).expand(4, 3, 6),
    ],
    ids=["transpose", "step", "offset", "row", "expand"],
)
def test_a_non_contiguous_view_arrives_as_the_same_view(workers, view):
    t = view(torch.arange(24, dtype=torch.float32).reshape(4, 6))
    dtype_name, shape, strides, values = rpc.rpc_sync("worker1", fns.describe, args=(t,))
    assert (shape, strides) == (tuple(t.shape), t.stride())
    assert values == t.tolist()
    back = rpc.rpc_sync("worker1", fns.identity, args=(t,))
    assert back.stride() == t.stride()
    assert_same(back, t)


@pytest.mark.parametrize(
    "t",
    [torch.empty(0), torch.empty(3, 0), torch.zeros(0, 4, dtype=torch.int64), torch.tensor(2.5)],
    ids=["empty", "3x0", "0x4-int64", "scalar"],
)
def test_zero_size_and_zero_dim_tensors(workers, t):
    back = rpc.rpc_sync("worker1", fns.identity, args=(t,))
    assert_same(back, t)


def test_a_large_tensor_travels_over_the_channel(workers):
    # 4 MiB: far over the size that goes inline with the message.
    t = torch.arange(1 << 20, dtype=torch.float32)
    back = rpc.rpc_sync("worker1", fns.identity, args=(t,))
    assert_same(back, t)


def test_tensors_nested_in_containers(workers):
    t = torch.arange(6)
    arg = {"list": [t, t * 2], "tuple": (t.float(),), "nested": {"x": [t[::2]]}}
    back = rpc.rpc_sync("worker2", fns.identity, args=(arg,))
    assert torch.equal(back["list"][0], t) and torch.equal(back["list"][1], t * 2)
    assert torch.equal(back["tuple"][0], t.float())
    assert torch.equal(back["nested"]["x"][0], t[::2])


def test_a_parameter_travels_as_a_parameter(workers):
    p = torch.nn.Parameter(torch.ones(3))
    back = rpc.rpc_sync("worker1", fns.identity, args=(p,))
    assert isinstance(back, torch.nn.Parameter)
    assert back.requires_grad
    assert torch.equal(back.detach(), p.detach())


def test_a_received_tensor_is_fresh_memory(workers):
    t = torch.zeros(1 << 16)
    # Even a call to this worker itself goes through a channel: the
    # callee fills what it received, and the caller's tensor is untouched.
    filled = rpc.rpc_sync("worker0", fns.fill_, args=(t, 3.0))
    assert torch.equal(filled, torch.full_like(t, 3.0))
    assert torch.equal(t, torch.zeros(1 << 16))
    assert filled.data_ptr() != t.data_ptr()


def test_tensors_made_on_the_callee(workers):
    got = rpc.rpc_sync("worker1", fns.make_tensors, args=(3,))
    assert got == got  # a dict came back
    g = torch.Generator().manual_seed(3)
    base = torch.rand(4, 6, generator=g)
    assert torch.equal(got["f32"], base)
    assert got["t"].stride() == base.t().stride() and torch.equal(got["t"], base.t())
    assert torch.equal(got["i64"], torch.arange(10))
    assert got["empty"].shape == (0, 3)
    assert torch.equal(got["b"], base > 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.bool], ids=str)
def test_tensors_go_the_other_way_in_a_nested_call(workers, dtype):
    # worker1 calls worker0 (this process) with a tensor it received.
    t = sample(dtype, (2, 3)).t()
    got = rpc.rpc_sync("worker1", fns.call_back, args=("worker0", fns.describe, (t,)))
    assert got == (str(dtype), tuple(t.shape), t.stride(), t.tolist())
    total = rpc.rpc_sync("worker2", fns.sum_on, args=("worker0", torch.ones(5)))
    assert total.item() == 5.0


def test_a_tensor_without_strides_is_a_clean_error(workers):
    # A nested tensor has no strides of its own: refused with a typed
    # error (ferry-tch's NotStrided), never a panic, and the worker goes on.
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(RuntimeError, match="sends strided tensors with storage"):
        rpc.rpc_sync("worker1", fns.identity, args=(nested,))
    assert torch.equal(rpc.rpc_sync("worker1", fns.identity, args=(torch.ones(2),)), torch.ones(2))


def sparse_sample(dtype, size, sparse_dim, nnz, coalesced):
    """A sparse COO tensor of ``size`` with ``sparse_dim`` sparse
    dimensions and ``nnz`` specified elements (one index twice, and out of
    order, unless ``coalesced``)."""
    g = torch.Generator().manual_seed(11)
    indices = torch.zeros(sparse_dim, nnz, dtype=torch.int64)
    for d in range(sparse_dim):
        indices[d] = torch.randint(0, size[d], (nnz,), generator=g)
    if nnz > 1:
        indices[:, -1] = indices[:, 0]
    values = sample(dtype, (nnz, *size[sparse_dim:]))
    t = torch.sparse_coo_tensor(indices, values, size, check_invariants=True)
    return t.coalesce() if coalesced else t


def assert_same_sparse(a, b):
    assert a.layout == b.layout == torch.sparse_coo
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.sparse_dim() == b.sparse_dim() and a.dense_dim() == b.dense_dim()
    assert a.is_coalesced() == b.is_coalesced()
    # The same specified elements, in the same order: nothing was coalesced.
    assert torch.equal(a._indices(), b._indices())
    assert torch.equal(a._values(), b._values())


SPARSE_CASES = [
    (dtype, (6, 4), 2, 5, coalesced)
    for dtype in [torch.float32, torch.float64, torch.int64, torch.bool, torch.complex64]
    for coalesced in [False, True]
] + [
    (torch.float32, (6, 4, 3), 1, 3, False),  # hybrid: one dense dimension
    (torch.float32, (6, 4, 3), 3, 4, True),
    (torch.float16, (5, 5), 2, 0, False),  # no specified element
    (torch.float32, (5, 2), 0, 1, True),  # no sparse dimension
]


@pytest.mark.parametrize("case", SPARSE_CASES, ids=str)
def test_sparse_tensors_go_and_come_back(workers, case):
    t = sparse_sample(*case)
    back = rpc.rpc_sync("worker1", fns.identity, args=(t,))
    assert_same_sparse(back, t)
    # Beside dense ones, nested, and through a nested call back here.
    got = rpc.rpc_sync("worker1", fns.identity, args=({"s": [t], "d": torch.ones(2)},))
    assert_same_sparse(got["s"][0], t)
    assert torch.equal(got["d"], torch.ones(2))


def test_sparse_tensors_compute_on_the_callee(workers):
    a = sparse_sample(torch.float64, (6, 4), 2, 5, False)
    b = sparse_sample(torch.float64, (6, 4), 2, 3, True)
    total = rpc.rpc_sync("worker1", torch.add, args=(a, b))
    assert total.layout == torch.sparse_coo
    assert torch.equal(total.to_dense(), (a + b).to_dense())
    made = rpc.rpc_sync("worker2", torch.Tensor.to_sparse, args=(torch.eye(3),))
    assert torch.equal(made.to_dense(), torch.eye(3))
