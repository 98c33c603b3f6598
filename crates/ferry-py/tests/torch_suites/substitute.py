"""Putting ``ferry.rpc`` where PyTorch's RPC test suites import
``torch.distributed.rpc``.

:func:`install` replaces, in ``sys.modules`` and as attributes of their
parent packages, ``torch.distributed.rpc`` and its submodules (and
``torch.distributed.autograd`` and ``torch.distributed.optim`` once
``ferry.autograd`` and ``ferry.optim`` exist) with *facades*: modules that
answer every attribute from Ferry's module. A name that PyTorch's module
has and Ferry's lacks (agent internals such as ``_get_debug_info``, the
TorchScript helpers, the faulty agent's options) resolves to a
placeholder, so that the test modules import unchanged; using the
placeholder (calling it, reading its attributes) raises
:class:`NotPartOfFerry`, which names what the test reached for. The
runner counts such a test as skipped only where ``skips.txt`` says why.

Install before the test modules are imported: they bind names from
``torch.distributed.rpc`` at import time.
"""

import importlib
import sys
import types

#: The prefix of every message :class:`NotPartOfFerry` carries.
NOT_PART = "is not part of ferry"


class NotPartOfFerry(NotImplementedError):
    """A test used a name of ``torch.distributed.*`` that Ferry's module
    does not provide."""

    def __init__(self, name):
        super().__init__(f"{name} {NOT_PART}")
        self.name = name


class _MissingMeta(type):
    """Placeholders are classes (a test module may subclass one at import,
    as ``rpc_test.py`` does ``rpc.RpcBackendOptions``); making one or
    reading an attribute of it raises."""

    def __call__(cls, *args, **kwargs):
        raise NotPartOfFerry(cls._torch_name)

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise NotPartOfFerry(f"{cls._torch_name}.{name}")


def _placeholder(torch_name):
    """A placeholder for ``torch_name`` (``module.attribute``)."""
    short = torch_name.rsplit(".", 1)[-1]
    return _MissingMeta(short, (), {"_torch_name": torch_name, "__module__": __name__})


#: PyTorch's own objects that a facade hands out as they are: plain data
#: the suites use to pick a mode, touching no agent.
PASS_THROUGH = {
    # An enum (SYNC, ASYNC, REMOTE, ...) of how a test helper makes a call.
    "torch.distributed.rpc.internal": {"RPCExecMode"},
}


class Facade(types.ModuleType):
    """A module standing for PyTorch's ``torch_module``, answering from
    ``ferry_module`` (``None``: nothing of Ferry's yet). Submodules of the
    facade (``rpc.api``, ``rpc.functions``) are themselves facades, set as
    attributes by :func:`install`. Attributes a test sets are kept on the
    facade and read back first."""

    def __init__(self, name, torch_module, ferry_module):
        super().__init__(name, f"ferry's stand-in for {name}")
        self.__dict__["_torch_module"] = torch_module
        self.__dict__["_ferry_module"] = ferry_module
        # `from torch.distributed.rpc import *` takes what both offer.
        self.__dict__["__all__"] = [
            n for n in getattr(torch_module, "__all__", []) if self._ferry_has(n)
        ]

    def _ferry_has(self, name):
        ferry = self.__dict__["_ferry_module"]
        return ferry is not None and hasattr(ferry, name)

    def __getattr__(self, name):
        ferry = self.__dict__["_ferry_module"]
        if ferry is not None and hasattr(ferry, name):
            return getattr(ferry, name)
        torch_module = self.__dict__["_torch_module"]
        if name in PASS_THROUGH.get(self.__name__, ()):
            return getattr(torch_module, name)
        if hasattr(torch_module, name) and not (
            name.startswith("__") and name.endswith("__")
        ):
            missing = _placeholder(f"{self.__name__}.{name}")
            self.__dict__[name] = missing
            return missing
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")


def _optional(name):
    """``import name``, or ``None`` where it does not exist yet."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            return None
        raise


#: PyTorch's module -> Ferry's module standing for it (``None``: none).
def _mapping():
    import ferry.rpc

    autograd = _optional("ferry.autograd")
    optim = _optional("ferry.optim")
    return {
        "torch.distributed.rpc": ferry.rpc,
        "torch.distributed.rpc.api": ferry.rpc.api,
        "torch.distributed.rpc.functions": _optional("ferry.rpc.functions"),
        "torch.distributed.rpc.constants": _optional("ferry.rpc.constants"),
        "torch.distributed.rpc.options": ferry.rpc.options,
        "torch.distributed.rpc.internal": _optional("ferry.rpc.internal"),
        "torch.distributed.rpc.backend_registry": _optional("ferry.rpc.backend_registry"),
        "torch.distributed.rpc.server_process_global_profiler": None,
        "torch.distributed.rpc.rref_proxy": None,
        "torch.distributed.autograd": autograd,
        "torch.distributed.optim": optim,
    }


#: What :func:`install` put in place, by PyTorch's name.
installed = {}


def install():
    """Puts the facades in place (once); returns them by PyTorch's name."""
    if installed:
        return installed
    import torch.distributed.autograd  # noqa: F401  (imports rpc and its submodules)
    import torch.distributed.optim  # noqa: F401
    import torch.distributed.rpc  # noqa: F401

    mapping = _mapping()
    for name, ferry_module in mapping.items():
        torch_module = importlib.import_module(name)
        installed[name] = Facade(name, torch_module, ferry_module)
    for name, facade in installed.items():
        parent, _, attr = name.rpartition(".")
        sys.modules[name] = facade
        holder = installed.get(parent) or sys.modules[parent]
        if isinstance(holder, Facade):
            holder.__dict__[attr] = facade
        else:
            setattr(holder, attr, facade)
    return installed


def ferry_provides(torch_name):
    """Whether Ferry stands for module ``torch_name`` at all (``ferry.autograd``
    and ``ferry.optim`` may not exist yet)."""
    facade = installed.get(torch_name)
    return facade is not None and facade.__dict__["_ferry_module"] is not None
