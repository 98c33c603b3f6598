"""PyTorch's RPC test suites, run against ``ferry.rpc``.

The test classes of ``rpc_test.py``, ``dist_autograd_test.py`` and
``dist_optimizer_test.py`` (from the installed torch, unchanged), each
mixed with Ferry's fixture (:mod:`fixture`) under its own name, with
``ferry.rpc`` (and ``ferry.autograd``/``ferry.optim`` where they exist)
installed in place of ``torch.distributed.rpc`` (:mod:`substitute`).

Run it with ``run.py`` (``cargo xtask test`` does), which selects the
tests and compares the outcome with ``expected.txt`` and ``skips.txt``;
the plain ``pytest`` run of ``tests/`` does not collect this file.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import substitute  # noqa: E402

substitute.install()

import fixture  # noqa: E402

#: (module of torch.testing._internal.distributed.rpc, its suite classes).
SUITES = [
    ("rpc_test", ["RpcTest", "TensorPipeAgentRpcTest", "CudaRpcTest", "TensorPipeAgentCudaRpcTest"]),
    (
        "dist_autograd_test",
        [
            "DistAutogradTest",
            "TensorPipeAgentDistAutogradTest",
            "CudaDistAutogradTest",
            "TensorPipeCudaDistAutogradTest",
            "FaultyAgentDistAutogradTest",
        ],
    ),
    ("dist_optimizer_test", ["DistOptimizerTest"]),
]


def _suite_classes():
    import importlib

    for module, names in SUITES:
        m = importlib.import_module(f"torch.testing._internal.distributed.rpc.{module}")
        for name in names:
            yield getattr(m, name)


# Only the generated classes are globals here: pytest collects every
# unittest.TestCase it finds in the module.
globals().update(fixture.generate("", list(_suite_classes()), __name__))
