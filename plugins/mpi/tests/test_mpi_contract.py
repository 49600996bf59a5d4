"""The core's CCL conformance kit (:class:`disco_core.testing.CCLContract`) on the ``mpi`` CCL.

ProcessSession workers with the MPI from PyPI (mpich + mpi4py), 4 and 2 workers:
every operation, dtype and group mode bit-identical to the NumPy reference, and the
failure cases (mismatches, bad peers, a dead worker, a timeout).
"""

from __future__ import annotations

import pytest

import disco_core as disco
from disco_core.testing import CCLContract, session_maker

# ordered=True: floating sum/prod/avg folded in rank order, bit-identical to the
# kit's NumPy reference (MPI's own order is checked with a tolerance in test_mpi_ccl).
_maker = session_maker(disco.ProcessSession, "mpi", ordered=True)


class MPIContract(CCLContract):
    workers_are_processes = True
    timeout_options = {"timeout": 1}


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
