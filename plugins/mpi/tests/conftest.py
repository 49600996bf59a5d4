"""Shared set-up of disco-mpi's tests."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from disco_core.testing.leftovers import pytest_sessionfinish, pytest_sessionstart  # noqa: F401  (hooks: a run that leaves temporary files fails)
