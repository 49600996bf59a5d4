"""The core's CCL conformance kit on disco-nccl, over the STAND-IN for CuPy and NCCL.

Not NCCL: ``_nccl_stand_in`` (see its docstring) stands in for CuPy and NCCL, so this
checks that disco-nccl's own logic keeps the CCL contract on 4 and 2 threaded
workers: every operation, group layout and dtype NCCL has, and the failure cases.
"""

from __future__ import annotations

import sys

import pytest
from _nccl_contract import NCCLContract, threaded_nccl
from _nccl_stand_in import make_modules


@pytest.fixture(scope="module", autouse=True)
def stand_in():
    """The stand-in is ``cupy`` for this module (its sessions are pooled across tests)."""
    saved = {name: sys.modules.get(name) for name in ("cupy", "cupy.cuda", "cupy.cuda.nccl")}
    sys.modules.update(make_modules(gpus=4))
    yield
    for name, mod in saved.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod


class TestNCCLStandIn4(NCCLContract):
    num_workers = 4

    @pytest.fixture
    def make_session(self):
        return threaded_nccl


class TestNCCLStandIn2(NCCLContract):
    num_workers = 2

    @pytest.fixture
    def make_session(self):
        return threaded_nccl
