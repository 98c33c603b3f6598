"""``ferry.optim``: ``torch.distributed.optim``'s ``DistributedOptimizer``
over ``ferry.rpc`` and ``ferry.autograd``.

``from ferry.optim import DistributedOptimizer`` in place of ``from
torch.distributed.optim import DistributedOptimizer``.
"""

from ferry.optim.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
