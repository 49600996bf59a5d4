"""The core's CCL conformance kit (:class:`disco_core.testing.CCLContract`) on the ``mpi`` CCL.

ProcessSession workers with the MPI from PyPI (mpich + mpi4py), 4 and 2 workers:
every operation, dtype and group mode bit-identical to the NumPy reference, and the
failure cases (mismatches, bad peers, a dead worker, a timeout).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import disco_core as disco
from disco_core.testing import CCLContract, session_maker

# ordered=True: floating sum/prod/avg folded in rank order, bit-identical to the
# kit's NumPy reference (MPI's own order is checked with a tolerance in test_mpi_ccl).
_maker = session_maker(disco.ProcessSession, "mpi", ordered=True)


class MPIContract(CCLContract):
    workers_are_processes = True
    timeout_options = {"timeout": 1}
    buffered_sends = 8  # small messages go out eagerly (MPICH)
    # A worker waiting in MPI_Comm_connect cannot be released by an abort (the abort
    # reaches the controller's process only, and MPI cannot cancel a connect): when a
    # peer fails in its constructor the others give up by the connect timeout, and
    # MPI in their processes stays stuck, so init_ccl cannot be retried there.
    construction_options = {"connect_timeout": 5}
    reinit_after_failed_init = False

    # A join thread left blocked in MPI_Comm_accept makes every later init_ccl("mpi")
    # of the process refuse (disco_mpi.ccl._JOINS): the construction cases
    # therefore run the kit's own case in a fresh interpreter each.
    @pytest.mark.timeout(120)
    @pytest.mark.parametrize("where", ["first", "last"])
    def test_constructor_fails_on_one_worker(self, request, make_bare_session, where):
        if os.environ.get(_ISOLATED):
            super().test_constructor_fails_on_one_worker(make_bare_session, where)
        else:
            _in_fresh_process(request)

    @pytest.mark.timeout(120)
    def test_ccl_missing_on_a_worker(self, request, make_bare_session):
        if os.environ.get(_ISOLATED):
            super().test_ccl_missing_on_a_worker(make_bare_session)
        else:
            _in_fresh_process(request)


_ISOLATED = "DISCO_MPI_KIT_ISOLATED"


def _in_fresh_process(request) -> None:
    """Run this very test (the kit's case) in a new pytest process; fail with its output."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
        cwd=here,
        env={**os.environ, _ISOLATED: "1"},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]


class TestMPIProcess4(MPIContract):
    num_workers = 4

    @pytest.fixture
    def make_session(self):
        return _maker


class TestMPIProcess2(MPIContract):
    num_workers = 2

    @pytest.fixture
    def make_session(self):
        return _maker
