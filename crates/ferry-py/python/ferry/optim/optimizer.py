"""The ``DistributedOptimizer``: one local ``torch.optim.Optimizer`` on
each worker that owns parameters, stepped with the gradients a
distributed autograd context accumulated there.

The optimizer's class travels by reference (module and qualified name, as
pickle sends classes), so any ``torch.optim.Optimizer`` subclass works,
built-in or the user's own, provided every owner can import it. Each owner
builds its optimizer over the local values of the parameter RRefs it owns
(the parameter objects themselves) and keeps it as an RRef the driver
holds; ``step(context_id)`` runs ``step`` on every owner at once and waits
for all of them.
"""

import threading
from collections import defaultdict

import ferry.autograd as dist_autograd
import ferry.rpc as rpc


class _LocalOptimizer:
    """An owner's optimizer over its own parameters."""

    # Steps on one worker run one at a time, as PyTorch's do: two contexts
    # stepping the same parameters must not interleave their updates (nor
    # their use of `.grad`).
    _lock = threading.Lock()

    def __init__(self, optimizer_class, local_params_rref, args, kwargs):
        self._params = [rref.local_value() for rref in local_params_rref]
        self.optim = optimizer_class(self._params, *args, **kwargs)

    def step(self, context_id):
        """One step of the optimizer with context ``context_id``'s
        gradients on this worker: each parameter's ``.grad`` is its
        gradient in the context (``None``, so that the optimizer skips
        it, where the context has none) while the optimizer steps, and
        what ``.grad`` held before afterwards."""
        grads = dist_autograd.get_gradients(context_id)
        with _LocalOptimizer._lock:
            saved = [p.grad for p in self._params]
            try:
                for p in self._params:
                    p.grad = grads.get(p)
                self.optim.step()
            finally:
                for p, g in zip(self._params, saved):
                    p.grad = g


def _new_local_optimizer(optimizer_class, local_params_rref, args, kwargs):
    """Runs on an owner: its local optimizer, as an RRef it owns."""
    return rpc.RRef(_LocalOptimizer(optimizer_class, local_params_rref, args, kwargs))


def _local_optimizer_step(local_optim_rref, context_id):
    """Runs on an owner: one step of its local optimizer."""
    local_optim_rref.local_value().step(context_id)


def _wait_for_all(futures):
    """The futures' values, once every one has completed; raises the first
    error among them after all are done (no owner is left mid-call)."""
    results, first_error = [], None
    for fut in futures:
        try:
            results.append(fut.wait())
        except Exception as e:  # noqa: BLE001 - re-raised below
            if first_error is None:
                first_error = e
    if first_error is not None:
        raise first_error
    return results


class DistributedOptimizer:
    """PyTorch's ``DistributedOptimizer`` over ``ferry.rpc``.

    ``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)``
    takes an optimizer class (any ``torch.optim.Optimizer``, built-in or
    the user's own), the RRefs of the parameters to optimize (owned by any
    workers) and the optimizer's arguments. Each owner builds
    ``optimizer_class(its_parameters, *args, **kwargs)`` once, here, and
    construction errors raise here.

    ``step(context_id)`` steps every owner's optimizer with the gradients
    that distributed autograd context ``context_id`` accumulated there
    (``ferry.autograd.get_gradients``), concurrently, and returns when all
    have stepped; a parameter the context has no gradient for is left
    as it is. Steps of several contexts on one worker run one at a time.
    """

    def __init__(self, optimizer_class, params_rref, *args, **kwargs):
        per_worker = defaultdict(list)
        for param in params_rref:
            per_worker[param.owner()].append(param)
        futures = [
            rpc.rpc_async(
                worker, _new_local_optimizer, args=(optimizer_class, rrefs, args, kwargs)
            )
            for worker, rrefs in per_worker.items()
        ]
        self.remote_optimizers = _wait_for_all(futures)

    def step(self, context_id):
        """Steps every owner's optimizer with context ``context_id``'s
        gradients; raises ``RuntimeError`` if the context does not live on
        this worker, or what an owner's step raised."""
        dist_autograd._is_valid_context(context_id)
        futures = [
            rpc.rpc_async(optim.owner(), _local_optimizer_step, args=(optim, context_id))
            for optim in self.remote_optimizers
        ]
        _wait_for_all(futures)
