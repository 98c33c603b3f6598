"""Ferry's counterpart of PyTorch's ``TensorPipeRpcAgentTestFixture``, and
the test classes it makes from PyTorch's suites.

PyTorch runs each suite class mixed with an agent fixture and a helper
that starts one process per rank (``generate_tests`` in
``torch.testing._internal.distributed.rpc_utils``). This module does the
same with Ferry's fixture, :class:`FerryRpcAgentTestFixture`, and
:class:`ForkHelper`, which forks the rank processes from this one (where
``torch``, ``ferry`` and the suites are already imported, and no RPC agent
ever starts) instead of spawning fresh interpreters: each test still gets
fresh processes, in milliseconds instead of seconds.

Import :mod:`substitute` and call ``install()`` first.
"""

import os
import socket

import torch
import torch.distributed.rpc as rpc
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import (
    RpcAgentTestFixture,
)

#: Host every test's group meets on.
HOST = "127.0.0.1"


#: The port the current test's group meets on: set by the parent before it
#: forks the ranks, which see it here (each rank's test case is a new
#: instance, made in the child).
_master_port = None


def free_port():
    """A TCP port free on ``HOST`` right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class FerryRpcAgentTestFixture(RpcAgentTestFixture):
    """The agent fixture for ``ferry.rpc``: the group meets at
    ``tcp://127.0.0.1:<port>``, a port picked per test by
    :class:`ForkHelper` (Ferry has no ``file://`` rendezvous; PyTorch's
    own suites use this form under ``RPC_INIT_WITH_TCP=1``)."""

    @property
    def init_method(self):
        return f"tcp://{HOST}:{_master_port}"

    @property
    def rpc_backend(self):
        return rpc.BackendType.TENSORPIPE

    @property
    def rpc_backend_options(self):
        return rpc.TensorPipeRpcBackendOptions(init_method=self.init_method)

    def get_shutdown_error_regex(self):
        # As PyTorch's TensorPipe fixture: any error a peer's shutdown causes.
        return "(.*)"

    def get_timeout_error_regex(self):
        return "RPC ran for more than"


class ForkHelper(MultiProcessTestCase):
    """Starts the test's ranks by forking this process, after picking the
    port its group meets on (the children inherit it)."""

    def setUp(self):
        global _master_port
        super().setUp()
        _master_port = free_port()
        # Tests that read MASTER_ADDR/MASTER_PORT (init_method "env://").
        os.environ["MASTER_ADDR"] = HOST
        os.environ["MASTER_PORT"] = str(_master_port)
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


def generate(prefix, suites, module_name):
    """One class per suite in ``suites``, mixed with Ferry's fixture and
    :class:`ForkHelper`, named ``prefix + suite name`` and placed in module
    ``module_name`` (as ``rpc_utils.generate_tests`` does)."""
    classes = {}
    for suite in suites:
        name = f"{prefix}{suite.__name__}"
        cls = type(name, (suite, FerryRpcAgentTestFixture, ForkHelper), {})
        cls.__module__ = module_name
        classes[name] = cls
    return classes
