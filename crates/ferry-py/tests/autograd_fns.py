"""Functions, modules and the local references the distributed autograd
and optimizer tests share: what runs on other workers (they travel by
reference, so every worker imports this module) and the same computations
done locally with plain torch, to compare with."""

import torch
from torch import nn

import ferry.autograd as dist_autograd
import ferry.rpc as rpc


# --- the computations, run remotely and locally --------------------------------


def mul_add(a, b):
    """``a * b + a``: both inputs in the graph."""
    return a * b + a


def identity(x):
    return x


def tanh_mm(a, b):
    """A nonlinear step: ``tanh(a @ b)``."""
    return torch.tanh(a @ b)


def chain(to, a, b):
    """Runs on the middle worker: a local step, a nested call to ``to``,
    and a local step on its result (gradients cross two hops)."""
    h = mul_add(a, b)
    r = rpc.rpc_sync(to, tanh_mm, args=(h, b))
    return r * a + h.sum()


def chain_local(a, b):
    """What ``chain`` computes, in one process."""
    h = mul_add(a, b)
    return tanh_mm(h, b) * a + h.sum()


def nested_add(to, a, b):
    """Runs on the middle worker: ``torch.add`` on ``to``, scaled here
    (sparse tensors too: both steps keep them sparse)."""
    return rpc.rpc_sync(to, torch.add, args=(a, b)) * 2


def fetch_and_square(rref):
    """Fetches an RRef's value from its owner and squares it."""
    return rref.to_here() ** 2


def async_then_add(to, a, b):
    """An ``rpc_async`` made inside the caller's context."""
    fut = rpc.rpc_async(to, mul_add, args=(a, b))
    return fut.wait() + b


def current_context_id():
    """The context this call runs in, or None outside any."""
    try:
        return dist_autograd._current_context()._context_id()
    except RuntimeError:
        return None


def call_current_context_id_on(to):
    """The context a call made from here to ``to`` runs in there."""
    return rpc.rpc_sync(to, current_context_id)


def recorded_here(context_id):
    """``(number of send functions, number of recv functions, known
    worker ids)`` that ``context_id`` recorded on this worker."""
    ctx = dist_autograd._retrieve_context(context_id)
    return len(ctx._send_functions()), len(ctx._recv_functions()), ctx._known_worker_ids()


def gradients_here(context_id):
    """The gradients of ``context_id`` on this worker, as a list of
    ``(shape, gradient)`` (tensors are not hashable across processes)."""
    return [(tuple(t.shape), g) for t, g in dist_autograd.get_gradients(context_id).items()]


def no_contexts_left(timeout):
    """Whether every context this worker took part in was released here
    (waiting at most ``timeout`` seconds)."""
    return dist_autograd._wait_until_no_contexts(timeout)


class FailingBackward(torch.autograd.Function):
    """Passes its input through; raises in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("Simulate error on backward pass")


def fail_in_backward(x):
    return FailingBackward.apply(x) * 2


# --- modules owned by workers ---------------------------------------------------


def make_linear(in_features, out_features, seed):
    """An ``nn.Linear`` with parameters from ``seed`` (the same on every
    worker and locally)."""
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features)


def module_forward(module_rref, x):
    """Runs the module an RRef refers to, on its owner."""
    return module_rref.local_value()(x)


def param_rrefs(module_rref):
    """RRefs, owned here, to the module's parameters."""
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


def module_state(module_rref):
    """The module's parameters, copied."""
    return [p.detach().clone() for p in module_rref.local_value().parameters()]


def module_grads(module_rref, context_id):
    """The gradients of the module's parameters in ``context_id``, looked
    up by the parameter objects themselves (``None`` where absent), and
    the parameters' ``.grad`` (which distributed autograd leaves alone)."""
    grads = dist_autograd.get_gradients(context_id)
    params = list(module_rref.local_value().parameters())
    return [grads.get(p) for p in params], [p.grad for p in params]


class ScaledSGD(torch.optim.Optimizer):
    """A user's own optimizer class: ``p -= lr * scale * grad``."""

    def __init__(self, params, lr, scale=1.0):
        super().__init__(params, dict(lr=lr, scale=scale))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * group["scale"])
