"""ferry.autograd across processes: contexts, backward across two and
three workers (rpc_sync, rpc_async, remote and to_here, nested calls)
compared with local torch autograd on the same inputs, get_gradients,
retain_graph, and PyTorch's errors. worker0 is this process."""

import subprocess
import sys
import threading

import pytest
import torch

import autograd_fns as fns
import ferry.autograd as dist_autograd
import ferry.rpc as rpc
import group


def leaves(*shapes, seed=0):
    """Leaf tensors that require grad, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def local_grads(fn, *inputs):
    """Gradients of ``fn(*copies).sum()`` with respect to copies of
    ``inputs``, by local torch autograd."""
    copies = [t.detach().clone().requires_grad_() for t in inputs]
    fn(*copies).sum().backward()
    return [c.grad for c in copies]


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --- contexts ------------------------------------------------------------------


def test_a_context_yields_an_id_and_the_callee_runs_inside_it(workers):
    with dist_autograd.context() as context_id:
        assert isinstance(context_id, int)
        assert dist_autograd._current_context()._context_id() == context_id
        assert rpc.rpc_sync("worker1", fns.current_context_id) == context_id
        # A nested call, from worker1 to worker2, still runs inside it.
        assert (
            rpc.rpc_sync("worker1", fns.call_current_context_id_on, args=("worker2",))
            == context_id
        )
    assert rpc.rpc_sync("worker1", fns.current_context_id) is None
    with dist_autograd.context() as other:
        assert other != context_id


def test_a_context_lists_its_send_and_recv_functions_and_workers(workers):
    a, b = leaves((2,), (2,))
    c = torch.ones(2)  # does not require grad: no send function
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", fns.mul_add, args=(a, b))
        rpc.rpc_sync("worker2", fns.identity, args=(c,))
        ctx = dist_autograd._current_context()
        sends = ctx._send_functions()
        # One per tensor that left requiring grad, by message id.
        assert len(sends) == 2 and list(sends) == sorted(sends)
        for send, leaf in zip(sends.values(), (a, b)):
            ((node, nr),) = send.next_functions
            assert node.name() == "torch::autograd::AccumulateGrad"
            assert node.variable is leaf and nr == 0
        (recv,) = ctx._recv_functions().values()
        assert recv is torch.autograd.graph.get_gradient_edge(out).node
        assert ctx._known_worker_ids() == {1, 2}
        # The callee recorded the receives and the send of the result.
        assert rpc.rpc_sync("worker1", fns.recorded_here, args=(context_id,)) == (1, 2, {0})
        assert dist_autograd._get_max_id() == (1 << 48) - 1  # rank 0
    with pytest.raises(RuntimeError, match="Could not find autograd context"):
        dist_autograd._retrieve_context(context_id)._send_functions()


def test_contexts_do_not_nest(workers):
    with dist_autograd.context():
        with pytest.raises(RuntimeError, match="Already have an autograd context id for this thread"):
            with dist_autograd.context():
                pass


# --- backward across workers ------------------------------------------------------


def test_backward_across_two_workers_matches_local_autograd(workers):
    a, b = leaves((3, 3), (3, 3))
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", fns.mul_add, args=(a, b))
        assert out.requires_grad and out.is_leaf  # the recv function's leaf
        loss = (out * out).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    expected = local_grads(lambda x, y: fns.mul_add(x, y) ** 2, a, b)
    close(grads[a], expected[0])
    close(grads[b], expected[1])
    # Accumulated in the context, never in `.grad`.
    assert a.grad is None and b.grad is None


def test_backward_across_three_workers_with_a_nested_call(workers):
    a, b = leaves((4, 4), (4, 4), seed=1)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", fns.chain, args=("worker2", a, b))
        loss = (out * 3).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    expected = local_grads(lambda x, y: fns.chain_local(x, y) * 3, a, b)
    close(grads[a], expected[0])
    close(grads[b], expected[1])


def test_backward_through_remote_and_to_here_across_three_workers(workers):
    # worker1 computes and keeps the value; worker2 fetches it from
    # worker1 (to_here) and squares it; worker0 gets the square back.
    a, b = leaves((2, 5), (2, 5), seed=2)
    with dist_autograd.context() as context_id:
        rref = rpc.remote("worker1", fns.mul_add, args=(a, b))
        out = rpc.rpc_sync("worker2", fns.fetch_and_square, args=(rref,))
        mine = rref.to_here()  # fetched here too: a second path
        loss = out.sum() + (mine * b).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    expected = local_grads(
        lambda x, y: (fns.mul_add(x, y) ** 2).sum() + (fns.mul_add(x, y) * y).sum(), a, b
    )
    close(grads[a], expected[0])
    close(grads[b], expected[1])


def test_backward_through_rpc_async_and_its_nested_async_call(workers):
    a, b = leaves((3,), (3,), seed=3)
    with dist_autograd.context() as context_id:
        fut = rpc.rpc_async("worker2", fns.async_then_add, args=("worker1", a, b))
        loss = (fut.wait() * a).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    expected = local_grads(lambda x, y: (fns.mul_add(x, y) + y) * x, a, b)
    close(grads[a], expected[0])
    close(grads[b], expected[1])


def test_several_roots_and_tensors_that_do_not_require_grad(workers):
    a, b = leaves((3,), (3,), seed=4)
    c = torch.ones(3)  # no grad: travels as plain data
    with dist_autograd.context() as context_id:
        x = rpc.rpc_sync("worker1", fns.mul_add, args=(a, c))
        y = rpc.rpc_sync("worker2", fns.mul_add, args=(b, b))
        dist_autograd.backward(context_id, [x.sum(), (y * 2).sum()])
        grads = dist_autograd.get_gradients(context_id)
    assert len(grads) == 2
    close(grads[a], local_grads(lambda x: fns.mul_add(x, c), a)[0])
    close(grads[b], local_grads(lambda x: fns.mul_add(x, x) * 2, b)[0])


def test_a_tensor_sent_back_as_it_came_is_still_in_the_graph(workers):
    # worker1 returns the recv leaf itself: its send function's tensor is
    # that leaf, whose gradient goes on back here.
    (a,) = leaves((4,), seed=13)
    with dist_autograd.context() as context_id:
        back = rpc.rpc_sync("worker1", fns.identity, args=(a,))
        dist_autograd.backward(context_id, [(back * back).sum()])
        grads = dist_autograd.get_gradients(context_id)
    close(grads[a], 2 * a.detach())


def test_contexts_of_several_threads_stay_apart(workers):
    # Each thread is inside its own context; their forward and backward
    # passes overlap (a barrier holds both between the two).
    inputs = [leaves((3, 3), (3, 3), seed=20 + i) for i in range(2)]
    barrier = threading.Barrier(2, timeout=30)
    results, errors = [None, None], []

    def train(i):
        try:
            a, b = inputs[i]
            with dist_autograd.context() as context_id:
                out = rpc.rpc_sync(f"worker{i + 1}", fns.chain, args=(f"worker{2 - i}", a, b))
                barrier.wait()
                dist_autograd.backward(context_id, [out.sum()])
                results[i] = (context_id, dist_autograd.get_gradients(context_id))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    assert not errors, errors
    assert results[0][0] != results[1][0]
    for (a, b), (_, grads) in zip(inputs, results):
        assert set(map(id, grads)) == {id(a), id(b)}
        expected = local_grads(fns.chain_local, a, b)
        close(grads[a], expected[0])
        close(grads[b], expected[1])


# --- get_gradients ---------------------------------------------------------------


def test_get_gradients_is_keyed_by_the_tensors_python_holds(workers):
    a, b = leaves((2, 2), (2, 2), seed=5)
    unused = torch.zeros(2, requires_grad=True)
    with dist_autograd.context() as context_id:
        assert dist_autograd.get_gradients(context_id) == {}
        out = rpc.rpc_sync("worker1", fns.mul_add, args=(a, b))
        dist_autograd.backward(context_id, [out.sum()])
        grads = dist_autograd.get_gradients(context_id)
    assert {id(k) for k in grads} == {id(a), id(b)}
    assert unused not in grads
    for k in grads:
        assert k is a or k is b


def test_get_gradients_on_the_owner_of_remote_parameters(workers):
    # The module lives on worker1; its parameters' gradients are read
    # there, by the parameter objects themselves.
    module = rpc.remote("worker1", fns.make_linear, args=(4, 3, 7))
    local = fns.make_linear(4, 3, 7)
    (x,) = leaves((5, 4), seed=6)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", fns.module_forward, args=(module, x))
        dist_autograd.backward(context_id, [torch.tanh(out).sum()])
        remote_grads, dot_grads = rpc.rpc_sync(
            "worker1", fns.module_grads, args=(module, context_id)
        )
        here = dist_autograd.get_gradients(context_id)
    xl = x.detach().clone().requires_grad_()
    torch.tanh(local(xl)).sum().backward()
    close(remote_grads[0], local.weight.grad)
    close(remote_grads[1], local.bias.grad)
    assert dot_grads == [None, None]
    close(here[x], xl.grad)


def test_gradients_stay_on_each_worker_that_holds_the_leaf(workers):
    # A leaf made on worker1 gets its gradient there, not here.
    a, b = leaves((3,), (3,), seed=8)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", fns.mul_add, args=(a, b))
        dist_autograd.backward(context_id, [out.sum()])
        there = rpc.rpc_sync("worker1", fns.gradients_here, args=(context_id,))
    # worker1 received a and b: their gradients went back to worker0.
    assert there == []


# --- retain_graph --------------------------------------------------------------------


def test_retain_graph_keeps_the_graph_and_gradients_accumulate(workers):
    a, b = leaves((3,), (3,), seed=9)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", fns.tanh_mm, args=(a.unsqueeze(0), b.unsqueeze(1)))
        loss = out.sum()
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        once = {k: v.clone() for k, v in dist_autograd.get_gradients(context_id).items()}
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        dist_autograd.backward(context_id, [loss])
        thrice = dist_autograd.get_gradients(context_id)
        with pytest.raises(RuntimeError, match="second time"):
            dist_autograd.backward(context_id, [loss])
    expected = local_grads(lambda x, y: fns.tanh_mm(x.unsqueeze(0), y.unsqueeze(1)), a, b)
    close(once[a], expected[0])
    close(once[b], expected[1])
    close(thrice[a], 3 * expected[0])
    close(thrice[b], 3 * expected[1])


# --- clean-up ---------------------------------------------------------------------


def test_leaving_a_context_releases_it_on_every_worker(workers):
    a, b = leaves((3,), (3,), seed=14)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", fns.chain, args=("worker2", a, b))
        dist_autograd.backward(context_id, [out.sum()])
        assert dist_autograd._get_debug_info()["num_autograd_contexts"] == "1"
    assert dist_autograd._wait_until_no_contexts(0)
    # worker1 learns of the release on this call, worker2 from worker1.
    for worker in ("worker1", "worker2"):
        assert rpc.rpc_sync(worker, fns.no_contexts_left, args=(30.0,)), worker


# --- errors ----------------------------------------------------------------------------


def test_an_unknown_context_is_pytorchs_error(workers):
    with dist_autograd.context() as context_id:
        pass
    # Released on leaving the block.
    for call in (
        lambda: dist_autograd.get_gradients(context_id),
        lambda: dist_autograd.backward(context_id, [torch.ones(1, requires_grad=True).sum()]),
        lambda: dist_autograd._retrieve_context(context_id),
    ):
        with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {context_id}"):
            call()
    for never in (123456789, -1, 1 << 70):
        with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {never}"):
            dist_autograd.get_gradients(never)
        with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {never}"):
            dist_autograd._is_valid_context(never)
    with pytest.raises(TypeError, match="incompatible function arguments"):
        dist_autograd.get_gradients("1")
    with pytest.raises(TypeError, match="incompatible function arguments"):
        dist_autograd.backward(1.5, [])


def test_autograd_before_init_rpc_raises_pytorchs_error():
    code = (
        "import ferry.autograd as a\n"
        "for f in (lambda: a.context().__enter__(), lambda: a.get_gradients(1)):\n"
        "    try:\n"
        "        f()\n"
        "    except RuntimeError as e:\n"
        "        assert 'Current RPC agent is not set' in str(e), str(e)\n"
        "    else:\n"
        "        raise AssertionError('no error')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=group.EXIT_BOUND_S
    )
    assert proc.returncode == 0, proc.stderr


def test_bad_roots_are_pytorchs_errors(workers):
    (a,) = leaves((3,), seed=10)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", fns.mul_add, args=(a, a))
        with pytest.raises(RuntimeError, match="is not a scalar, all roots need to be scalar"):
            dist_autograd.backward(context_id, [out])
        with pytest.raises(RuntimeError, match="requires_grad not set on"):
            dist_autograd.backward(context_id, [torch.ones(())])
        with pytest.raises(RuntimeError, match="does not have a valid gradient function"):
            dist_autograd.backward(context_id, [torch.ones((), requires_grad=True)])
        with pytest.raises(RuntimeError, match="No tensors provided for gradient computation"):
            dist_autograd.backward(context_id, [])
        with pytest.raises(TypeError, match="incompatible function arguments"):
            dist_autograd.backward(context_id, None)
        with pytest.raises(TypeError, match="incompatible function arguments"):
            dist_autograd.backward(context_id, [out.sum(), "loss"])
        # Nothing was spent: a good backward still runs.
        dist_autograd.backward(context_id, [out.sum()])
        close(dist_autograd.get_gradients(context_id)[a], local_grads(lambda x: fns.mul_add(x, x), a)[0])


def test_an_error_in_a_remote_backward_names_its_node(workers):
    (a,) = leaves((3,), seed=11)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker2", fns.fail_in_backward, args=(a,))
        with pytest.raises(RuntimeError, match="Error on Node 2: .*Simulate error on backward pass"):
            dist_autograd.backward(context_id, [out.sum()])


def test_under_no_grad_a_context_records_nothing(workers):
    (a,) = leaves((3,), seed=15)
    with dist_autograd.context():
        with torch.no_grad():
            out = rpc.rpc_sync("worker1", fns.mul_add, args=(a, a))
        assert not out.requires_grad
        # Grad mode back on: recorded again.
        assert rpc.rpc_sync("worker1", fns.mul_add, args=(a, a)).requires_grad


def test_outside_a_context_tensors_travel_as_plain_data(workers):
    (a,) = leaves((3,), seed=12)
    out = rpc.rpc_sync("worker1", fns.mul_add, args=(a, a))
    assert not out.requires_grad
    with pytest.raises(RuntimeError, match="doesn't have a valid autograd context"):
        dist_autograd._current_context()


# --- sparse tensors ---------------------------------------------------------------


def sparse_leaves(seed=0):
    """Two sparse COO leaves of shape (5, 3) that require grad, one not
    coalesced (a row twice), one coalesced."""
    g = torch.Generator().manual_seed(seed)
    a = torch.sparse_coo_tensor(torch.tensor([[0, 3, 3, 1]]), torch.randn(4, 3, generator=g), (5, 3), check_invariants=True)
    b = torch.sparse_coo_tensor(torch.tensor([[4, 1]]), torch.randn(2, 3, generator=g), (5, 3), check_invariants=True)
    return a.requires_grad_(), b.coalesce().requires_grad_()


def local_sparse_grads(fn, *inputs):
    copies = [t.detach().clone().requires_grad_() for t in inputs]
    fn(*copies).backward()
    return [c.grad for c in copies]


@pytest.mark.parametrize("how", ["rpc_sync", "remote"])
def test_sparse_tensors_backward_like_local_autograd(workers, how):
    a, b = sparse_leaves()
    with dist_autograd.context() as context_id:
        if how == "remote":
            out = rpc.remote("worker1", torch.add, args=(a, b)).to_here()
        else:
            out = rpc.rpc_sync("worker1", torch.add, args=(a, b))
        assert out.layout == torch.sparse_coo and out.requires_grad
        dist_autograd.backward(context_id, [torch.sparse.sum(out)])
        grads = dist_autograd.get_gradients(context_id)
    expected = local_sparse_grads(lambda x, y: torch.sparse.sum(x + y), a, b)
    for got, want in zip((grads[a], grads[b]), expected):
        assert got.layout == torch.sparse_coo
        close(got.to_dense(), want.to_dense())


def test_sparse_gradients_accumulate_over_a_nested_call(workers):
    a, b = sparse_leaves(seed=1)
    with dist_autograd.context() as context_id:
        # a twice in one call, then again with b through worker1 to
        # worker2: three sends of a, whose gradients accumulate.
        twice = rpc.rpc_sync("worker1", torch.add, args=(a, a))
        nested = rpc.rpc_sync("worker1", fns.nested_add, args=("worker2", b, a))
        loss = torch.sparse.sum(twice) + torch.sparse.sum(nested)
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    expected = local_sparse_grads(
        lambda x, y: torch.sparse.sum(x + x) + torch.sparse.sum((y + x) * 2), a, b
    )
    close(grads[a].to_dense(), expected[0].to_dense())
    close(grads[b].to_dense(), expected[1].to_dense())


# --- where gradients land ----------------------------------------------------------


class _PassThrough(torch.autograd.Function):
    """Hands its gradient on as it is, noting where its bytes live."""

    grad_ptr = None

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _PassThrough.grad_ptr = grad.data_ptr()
        return grad


def test_a_gradient_nothing_else_holds_is_kept_without_a_copy(workers):
    a, b = leaves((4,), (4,), seed=5)
    with dist_autograd.context() as context_id:
        # The only reference to the gradient reaching a: kept as it is.
        dist_autograd.backward(context_id, [(_PassThrough.apply(a) * 2).sum()])
        assert dist_autograd.get_gradients(context_id)[a].data_ptr() == _PassThrough.grad_ptr
    with dist_autograd.context() as context_id:
        # One expanded gradient for both a and b: each gets its own copy.
        dist_autograd.backward(context_id, [(a + b).sum()])
        grads = dist_autograd.get_gradients(context_id)
        assert grads[a].data_ptr() != grads[b].data_ptr()
        assert grads[a].is_contiguous() and torch.equal(grads[a], torch.ones(4))


def test_a_leafs_accumulate_grad_hooks_run_once_per_backward(workers):
    calls = []
    t = torch.rand(3, requires_grad=True)
    doubled = t + t  # both edges reach t's one AccumulateGrad node
    node = doubled.grad_fn.next_functions[0][0]
    node.register_prehook(lambda grad_outputs: (grad_outputs[0] * 10,))
    node.register_hook(lambda outputs, inputs: calls.append(inputs[0].clone()))
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", fns.identity, args=(doubled,))
        dist_autograd.backward(context_id, [out.sum()])
        grads = dist_autograd.get_gradients(context_id)
    # The pre hook scaled what accumulated; the post hook saw it, once.
    assert torch.equal(grads[t], torch.full((3,), 20.0))
    assert len(calls) == 1 and torch.equal(calls[0], grads[t])
    assert t.grad is None
