"""A pytest plugin: a test run that leaves the runtime's temporary files behind fails.

Sessions, servers, agents and MPI workers make private folders and files in the
temporary directory (and MPICH a segment in ``/dev/shm``); each removes its own, and
the next one sweeps what a killed one left. A test that kills at the wrong moment can
still leave one for good: a leak watch over the suites found a folder left by every
run of one test. This plugin compares the names at the start and at the end of the
run, and fails the run (exit status 1) for each new one still there a few seconds
after the last test, naming it.

Only the runtime's own names are watched (:data:`TEMP_PREFIXES`,
:data:`SHM_PREFIXES`): an example that writes ``/tmp/disco-trace.json`` where its
user asked is not a leftover. A suite takes part by importing the two hooks into its
``conftest.py``::

    from disco_core.testing.leftovers import pytest_sessionfinish, pytest_sessionstart
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

__all__ = [
    "SHM_PREFIXES",
    "TEMP_PREFIXES",
    "pytest_sessionfinish",
    "pytest_sessionstart",
    "snapshot",
]

#: The names the runtime's temporary folders and files start with.
TEMP_PREFIXES = (
    "disco-mpi-",
    "disco-minrpc-",
    "disco-rpc-",
    "disco-socket-",
    ".disco-trace-",
)
#: The names of shared-memory segments of the runtime's MPI (MPICH) in ``/dev/shm``.
SHM_PREFIXES = ("mpich_shm_",)
#: Seconds the last test's own clean-up may still take (a server's sweep, a reaped child).
SETTLE_SECONDS = 5.0

_BEFORE = "disco_leftovers_before"


def _names(folder: str, prefixes: tuple[str, ...]) -> set[str]:
    try:
        return {os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(prefixes)}
    except OSError:
        return set()


def snapshot() -> set[str]:
    """The paths of the runtime's temporary files and segments that exist now."""
    return _names(tempfile.gettempdir(), TEMP_PREFIXES) | _names("/dev/shm", SHM_PREFIXES)


def pytest_sessionstart(session: Any) -> None:
    setattr(session.config, _BEFORE, snapshot())


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    before = getattr(session.config, _BEFORE, None)
    if before is None:
        return
    deadline = time.monotonic() + SETTLE_SECONDS
    left = snapshot() - before
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = snapshot() - before
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [
        f"temporary files of the runtime left behind by this run ({len(left)}):",
        *(f"  {path}" for path in sorted(left)),
    ]
    if reporter is not None:
        reporter.write_line("\n".join(lines), red=True)
    else:  # pragma: no cover - pytest always has one unless disabled
        print("\n".join(lines))
    if session.exitstatus == 0:
        session.exitstatus = 1
