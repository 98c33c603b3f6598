"""Ferry from Python.

``ferry.rpc`` is a drop-in for ``torch.distributed.rpc``
(``import ferry.rpc as rpc``): the same functions and semantics, over
Ferry's agent, RRef protocol and tensor channels. ``ferry.autograd`` is
``torch.distributed.autograd`` over Ferry's distributed autograd, and
``ferry.optim`` holds the ``DistributedOptimizer``. The compiled half is
the private module ``ferry._ferry`` (the Rust crate ``ferry-py``).
"""

# torch first: the extension module links libtorch and libtorch_python,
# which torch's import has loaded.
import torch  # noqa: F401

from . import _ferry  # noqa: F401

__all__ = ["rpc", "autograd", "optim"]


def __getattr__(name):
    # Submodules on first use, as `torch.distributed.rpc` is a submodule.
    if name in __all__:
        import importlib

        return importlib.import_module(f"ferry.{name}")
    raise AttributeError(f"module 'ferry' has no attribute {name!r}")
