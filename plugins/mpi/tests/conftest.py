"""Shared set-up of disco-mpi's tests."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from disco_core.testing.leftovers import (  # noqa: F401  (hooks: a run's own TMPDIR; leftovers fail it)
    pytest_configure,
    pytest_sessionfinish,
    pytest_unconfigure,
)
