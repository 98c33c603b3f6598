"""ferry.optim.DistributedOptimizer across processes: a model split over
worker1, worker2 and this process (worker0), trained for several steps
with distributed autograd and compared, step by step, with the same model
trained locally by the same torch optimizer."""

import pytest
import torch
from torch import nn

import autograd_fns as fns
import ferry.autograd as dist_autograd
import ferry.rpc as rpc
from ferry.optim import DistributedOptimizer

STEPS = 4


class Split:
    """The model, split: Linear(4, 3) on worker1, ReLU and Linear(3, 2) on
    worker2, and a per-output scale on worker0; its parameter RRefs in
    the order of ``local_params``."""

    def __init__(self, seed):
        self.first = rpc.remote("worker1", fns.make_linear, args=(4, 3, seed))
        self.second = rpc.remote("worker2", fns.make_linear, args=(3, 2, seed + 1))
        self.scale = nn.Parameter(torch.tensor([0.5, -1.5]))
        self.param_rrefs = (
            rpc.rpc_sync("worker1", fns.param_rrefs, args=(self.first,))
            + rpc.rpc_sync("worker2", fns.param_rrefs, args=(self.second,))
            + [rpc.RRef(self.scale)]
        )

    def forward(self, x):
        h = rpc.rpc_sync("worker1", fns.module_forward, args=(self.first, x))
        out = rpc.rpc_sync("worker2", fns.module_forward, args=(self.second, torch.relu(h)))
        return out * self.scale

    def params(self):
        """The parameters as they are now, wherever they live."""
        return (
            rpc.rpc_sync("worker1", fns.module_state, args=(self.first,))
            + rpc.rpc_sync("worker2", fns.module_state, args=(self.second,))
            + [self.scale.detach().clone()]
        )


class Local:
    """The same model in this process, with plain torch."""

    def __init__(self, seed):
        self.first = fns.make_linear(4, 3, seed)
        self.second = fns.make_linear(3, 2, seed + 1)
        self.scale = nn.Parameter(torch.tensor([0.5, -1.5]))

    def forward(self, x):
        return self.second(torch.relu(self.first(x))) * self.scale

    def parameters(self):
        return list(self.first.parameters()) + list(self.second.parameters()) + [self.scale]


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def loss_of(out, target):
    return ((out - target) ** 2).mean()


@pytest.mark.parametrize(
    "optimizer_class, kwargs",
    [
        (torch.optim.SGD, dict(lr=0.05)),
        (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
        (torch.optim.Adam, dict(lr=0.01)),
        (torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.95), amsgrad=True)),
        (fns.ScaledSGD, dict(lr=0.1, scale=0.5)),
    ],
    ids=["sgd", "sgd-momentum", "adam", "adam-amsgrad", "user-class"],
)
def test_training_matches_the_local_optimizer_step_by_step(workers, optimizer_class, kwargs):
    model = Split(seed=3)
    local = Local(seed=3)
    for mine, theirs in zip(model.params(), local.parameters()):
        torch.testing.assert_close(mine, theirs.detach())
    dist_optim = DistributedOptimizer(optimizer_class, model.param_rrefs, **kwargs)
    local_optim = optimizer_class(local.parameters(), **kwargs)
    for step in range(STEPS):
        x, target = batch(step)
        with dist_autograd.context() as context_id:
            loss = loss_of(model.forward(x), target)
            dist_autograd.backward(context_id, [loss])
            dist_optim.step(context_id)
        local_optim.zero_grad()
        local_loss = loss_of(local.forward(x), target)
        local_loss.backward()
        local_optim.step()
        torch.testing.assert_close(loss.detach(), local_loss.detach(), rtol=1e-5, atol=1e-6)
        for mine, theirs in zip(model.params(), local.parameters()):
            torch.testing.assert_close(mine, theirs.detach(), rtol=1e-5, atol=1e-6)
    # The step used the context's gradients; `.grad` is as it was.
    assert model.scale.grad is None


def test_a_parameter_the_context_did_not_reach_is_left_alone(workers):
    model = Split(seed=5)
    before = model.params()
    dist_optim = DistributedOptimizer(torch.optim.SGD, model.param_rrefs, lr=0.1, momentum=0.5)
    x, _ = batch(0)
    with dist_autograd.context() as context_id:
        # Only the first layer takes part.
        h = rpc.rpc_sync("worker1", fns.module_forward, args=(model.first, x))
        dist_autograd.backward(context_id, [h.sum()])
        dist_optim.step(context_id)
    after = model.params()
    assert not torch.equal(after[0], before[0])  # the first layer's weight moved
    for b, a in zip(before[2:], after[2:]):
        assert torch.equal(a, b)


def test_step_with_an_unknown_context_raises(workers):
    model = Split(seed=6)
    dist_optim = DistributedOptimizer(torch.optim.SGD, model.param_rrefs, lr=0.1)
    with dist_autograd.context() as context_id:
        pass
    with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {context_id}"):
        dist_optim.step(context_id)


def test_an_owners_constructor_error_raises_at_construction(workers):
    model = Split(seed=7)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        DistributedOptimizer(torch.optim.SGD, model.param_rrefs, lr=-1.0)
