"""ferry.rpc across processes: calls, futures, RRefs, remote exceptions,
timeouts and tensors, with worker0 (this process) calling worker1 and
worker2 and them calling back."""

import pickle

import pytest
import torch

import ferry.autograd as dist_autograd
import ferry.rpc as rpc
import remote_fns as fns


# --- rpc_sync -------------------------------------------------------------


def test_rpc_sync_runs_a_python_function(workers):
    assert rpc.rpc_sync("worker1", fns.add, args=(2, 3)) == 5
    assert rpc.rpc_sync("worker1", fns.add_kw, args=(1,), kwargs={"b": 2, "c": 3}) == 6
    assert rpc.rpc_sync("worker2", fns.worker_name) == "worker2"


def test_rpc_sync_runs_a_torch_builtin(workers):
    a = torch.ones(3)
    assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(a, a)), a * 2)


def test_a_worker_is_named_by_name_rank_or_worker_info(workers):
    info = rpc.get_worker_info("worker2")
    assert info == rpc.WorkerInfo("worker2", 2)
    assert repr(info) == "WorkerInfo(id=2, name=worker2)"
    assert rpc.get_worker_info() == rpc.WorkerInfo("worker0", 0)
    for to in ("worker2", 2, info):
        assert rpc.rpc_sync(to, fns.worker_name) == "worker2"
    assert rpc.rpc_sync("worker0", fns.worker_name) == "worker0"


def test_an_unknown_worker_is_a_runtime_error(workers):
    with pytest.raises(RuntimeError, match="nobody"):
        rpc.rpc_sync("nobody", fns.add, args=(1, 2))


def test_link_info_names_the_transport_and_channels_of_a_link(workers):
    rpc.rpc_sync("worker1", fns.add, args=(1, 1))
    link = rpc.link_info("worker1")
    assert set(link) == {"transport", "outgoing", "incoming"}
    assert link["transport"] in {"shm", "tcp"}
    assert link["outgoing"] and link["incoming"]
    assert rpc.link_info(rpc.get_worker_info("worker1")) == link
    with pytest.raises(RuntimeError, match="nobody"):
        rpc.link_info("nobody")


def test_an_unpicklable_function_fails_on_the_caller(workers):
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        rpc.rpc_sync("worker1", lambda: 1)


# --- rpc_async --------------------------------------------------------------


def test_rpc_async_gives_a_torch_future(workers):
    fut = rpc.rpc_async("worker1", fns.add, args=(20, 22))
    assert isinstance(fut, torch.futures.Future)
    assert fut.wait() == 42
    assert fut.done()
    assert fut.value() == 42
    chained = fut.then(lambda f: f.value() + 1)
    assert chained.wait() == 43


def test_rpc_async_futures_work_with_torch_futures_helpers(workers):
    futs = [rpc.rpc_async(f"worker{r}", fns.add, args=(r, 10)) for r in (1, 2, 0)]
    assert torch.futures.wait_all(futs) == [11, 12, 10]
    both = torch.futures.collect_all(
        [rpc.rpc_async("worker1", fns.identity, args=(t,)) for t in ("a", "b")]
    )
    assert [f.value() for f in both.wait()] == ["a", "b"]


def test_calls_run_concurrently_on_the_callee(workers):
    rpc.rpc_sync("worker1", fns.close_gate)
    waiting = rpc.rpc_async("worker1", fns.wait_at_gate, args=(30.0,))
    # The callee still serves while one of its calls waits.
    assert rpc.rpc_sync("worker1", fns.add, args=(1, 1)) == 2
    assert not waiting.done()
    rpc.rpc_sync("worker1", fns.open_gate)
    assert waiting.wait() is True


# --- remote exceptions --------------------------------------------------------


def test_a_remote_exception_arrives_with_its_type_and_message(workers):
    with pytest.raises(ValueError, match="bad value: seven") as info:
        rpc.rpc_sync("worker1", fns.raise_value_error, args=("seven",))
    text = str(info.value)
    assert text.startswith("On WorkerInfo(id=1, name=worker1):"), text
    assert "raise_value_error" in text  # the callee's traceback


def test_a_remote_exception_of_a_custom_type(workers):
    with pytest.raises(fns.CustomError, match="custom text"):
        rpc.rpc_sync("worker2", fns.raise_custom, args=("custom text",))
    fut = rpc.rpc_async("worker2", fns.raise_custom, args=("async text",))
    with pytest.raises(fns.CustomError, match="async text"):
        fut.wait()


def test_a_remote_exception_reaches_to_here(workers):
    rref = rpc.remote("worker1", fns.raise_value_error, args=("in remote",))
    with pytest.raises(ValueError, match="in remote"):
        rref.to_here()
    counter = rpc.remote("worker1", fns.Counter)
    with pytest.raises(KeyError, match="no such key"):
        counter.rpc_sync().fail()


def test_wait_all_stops_at_the_first_remote_exception(workers):
    # The future fails as PyTorch's RPC futures do (its C++ future holds
    # the error), so wait_all raises while another call is still held.
    rpc.rpc_sync("worker1", fns.close_gate)
    try:
        held = rpc.rpc_async("worker1", fns.wait_at_gate, args=(30.0,))
        failing = rpc.rpc_async("worker2", fns.raise_custom, args=("first error",))
        with pytest.raises(fns.CustomError, match="first error"):
            torch.futures.wait_all([held, failing])
        assert not held.done()
        # Read again, the same exception of the same type.
        for _ in range(2):
            with pytest.raises(fns.CustomError, match="first error"):
                failing.value()
    finally:
        rpc.rpc_sync("worker1", fns.open_gate)
    assert held.wait() is True

# --- timeouts -----------------------------------------------------------------


def test_the_default_timeout_comes_from_the_backend_options(workers):
    assert rpc._get_rpc_timeout() == 30.0


def test_a_call_past_its_timeout_raises_pytorchs_error(workers):
    rpc.rpc_sync("worker1", fns.close_gate)
    try:
        with pytest.raises(RuntimeError, match=r"RPC ran for more than set timeout \(200 ms\)"):
            rpc.rpc_sync("worker1", fns.wait_at_gate, args=(30.0,), timeout=0.2)
        fut = rpc.rpc_async("worker1", fns.wait_at_gate, args=(30.0,), timeout=0.2)
        with pytest.raises(RuntimeError, match="RPC ran for more than set timeout"):
            fut.wait()
        # The default timeout, changed at run time.
        rpc._set_rpc_timeout(0.2)
        try:
            with pytest.raises(RuntimeError, match="RPC ran for more than set timeout"):
                rpc.rpc_sync("worker1", fns.wait_at_gate, args=(30.0,))
        finally:
            rpc._set_rpc_timeout(30.0)
        # A timeout of 0 is none.
        assert rpc.rpc_sync("worker1", fns.add, args=(1, 2), timeout=0) == 3
    finally:
        rpc.rpc_sync("worker1", fns.open_gate)


def test_to_here_past_its_timeout_raises(workers):
    rpc.rpc_sync("worker2", fns.close_gate)
    try:
        rref = rpc.remote("worker2", fns.wait_at_gate, args=(30.0,))
        with pytest.raises(RuntimeError, match="RPC ran for more than set timeout"):
            rref.to_here(timeout=0.2)
    finally:
        rpc.rpc_sync("worker2", fns.open_gate)
    assert rref.to_here() is True


# --- RRefs --------------------------------------------------------------------


def test_remote_returns_an_rref_owned_by_the_callee(workers):
    rref = rpc.remote("worker1", fns.add, args=(3, 4))
    assert isinstance(rref, rpc.RRef)
    assert rref.owner() == rpc.WorkerInfo("worker1", 1)
    assert rref.owner_name() == "worker1"
    assert not rref.is_owner()
    assert rref.to_here() == 7
    assert isinstance(rref.confirmed_by_owner(), bool)
    with pytest.raises(RuntimeError, match="Cannot call localValue\\(\\) on a non-local reference"):
        rref.local_value()


def test_an_rref_made_here_is_owned_here(workers):
    rref = rpc.RRef([1, 2, 3])
    assert rref.is_owner()
    assert rref.confirmed_by_owner()
    assert rref.owner() == rpc.WorkerInfo("worker0", 0)
    assert rref.local_value() == [1, 2, 3]
    assert rref.to_here() == [1, 2, 3]
    # Passed to another worker, which fetches it from here.
    assert rpc.rpc_sync("worker1", fns.fetch, args=(rref,)) == [1, 2, 3]


def test_an_rref_passed_on_is_fetched_from_its_owner(workers):
    rref = rpc.remote("worker1", fns.add, args=(torch.ones(2), 1))
    # worker2 gets a fork and fetches the value from worker1.
    assert torch.equal(rpc.rpc_sync("worker2", fns.fetch, args=(rref,)), torch.full((2,), 2.0))
    # Back on its owner it is the owner's.
    assert rpc.rpc_sync("worker1", fns.is_owner, args=(rref,)) is True
    assert torch.equal(rpc.rpc_sync("worker1", fns.owner_value, args=(rref,)), torch.full((2,), 2.0))


def test_rref_proxies_run_methods_on_the_owner(workers):
    counter = rpc.remote("worker2", fns.Counter, args=(10,))
    assert counter.rpc_sync().add(5) == 15
    fut = counter.rpc_async().add(1)
    assert isinstance(fut, torch.futures.Future)
    assert fut.wait() == 16
    total = counter.remote().get()
    assert isinstance(total, rpc.RRef)
    assert total.owner_name() == "worker2"
    assert total.to_here() == 16
    # The object stays where it lives: its state changed there.
    assert counter.to_here().value == 16


def test_an_rref_proxy_of_a_missing_method_is_an_attribute_error(workers):
    # Raised on the caller, as PyTorch's proxies look the value's type up.
    counter = rpc.remote("worker2", fns.Counter, args=(0,))
    with pytest.raises(AttributeError, match="has no attribute 'no_such'"):
        counter.rpc_sync().no_such()
    with pytest.raises(AttributeError, match="has no attribute 'no_such'"):
        counter.remote().no_such()
    fut = counter.rpc_async().no_such()
    with pytest.raises(AttributeError, match="has no attribute 'no_such'"):
        fut.wait()
    assert counter.rpc_sync().add(1) == 1


def test_rref_backward_runs_on_the_owner(workers):
    t = torch.ones(3, requires_grad=True)
    # An owner RRef without a context: local autograd, into .grad.
    rpc.RRef((t * 2).sum()).backward()
    assert torch.equal(t.grad, torch.full((3,), 2.0))
    with dist_autograd.context() as context_id:
        rref = rpc.remote("worker1", fns.sum_of, args=(t,))
        with pytest.raises(RuntimeError, match="require 'dist_autograd_ctx_id'"):
            rref.backward()
        rref.backward(context_id, retain_graph=True)
        rref.backward(context_id)
        grads = dist_autograd.get_gradients(context_id)
        assert torch.equal(grads[t], torch.full((3,), 2.0))
        with pytest.raises(RuntimeError, match="RRef should contain a tensor"):
            rpc.remote("worker1", fns.identity, args=("text",)).backward(context_id)


def test_an_rref_cannot_be_pickled_outside_a_call(workers):
    with pytest.raises(RuntimeError, match="only inside"):
        pickle.dumps(rpc.RRef(1))
