"""A pytest plugin: a test run that leaves the runtime's temporary files behind fails.

Sessions, servers, agents and MPI workers make private folders and files in the
temporary directory (and MPICH a segment in ``/dev/shm``); each removes its own, and
the next one sweeps what a killed one left. A test that kills at the wrong moment can
still leave one for good: a leak watch over the suites found a folder left by every
run of one test.

At the start of the run this plugin points ``$TMPDIR`` (and ``tempfile``) at a
folder of the run's own, which every process the tests start inherits, so suites
that run side by side (as CI's streams do) never see each other's files. At the end
it fails the run (exit status 1) for each of the runtime's names
(:data:`TEMP_PREFIXES`) still in that folder a few seconds after the last test, and
for each new MPICH segment in ``/dev/shm`` (:data:`SHM_PREFIXES`), naming them;
then it removes the folder. An example that writes ``/tmp/disco-trace.json`` where
its user asked is not watched. A suite takes part by importing the hooks into its
``conftest.py``::

    from disco_core.testing.leftovers import (
        pytest_configure, pytest_sessionfinish, pytest_unconfigure,
    )
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from typing import Any

import pytest

__all__ = [
    "SHM_PREFIXES",
    "TEMP_PREFIXES",
    "pytest_configure",
    "pytest_sessionfinish",
    "pytest_unconfigure",
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

_KEY = "_disco_leftovers"


def _names(folder: str, prefixes: tuple[str, ...]) -> set[str]:
    try:
        return {os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(prefixes)}
    except OSError:
        return set()


def snapshot(folder: str | None = None) -> set[str]:
    """The runtime's temporary files in ``folder`` (default: the temporary directory)
    and its MPICH segments, as paths."""
    return _names(folder or tempfile.gettempdir(), TEMP_PREFIXES) | _names("/dev/shm", SHM_PREFIXES)  # fmt: skip


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: Any) -> None:
    own = tempfile.mkdtemp(prefix="disco-tests-")
    state = {"own": own, "TMPDIR": os.environ.get("TMPDIR"), "shm": _names("/dev/shm", SHM_PREFIXES)}  # fmt: skip
    setattr(config, _KEY, state)
    os.environ["TMPDIR"] = own
    tempfile.tempdir = None  # (gettempdir() caches its answer)


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    state = getattr(session.config, _KEY, None)
    if state is None:
        return
    own = state["own"]
    deadline = time.monotonic() + SETTLE_SECONDS
    left = snapshot(own) - state["shm"]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = snapshot(own) - state["shm"]
    if not left:
        return
    lines = [
        f"temporary files of the runtime left behind by this run ({len(left)}):",
        *(f"  {path}{_who_holds(path)}" for path in sorted(left)),
    ]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("\n".join(lines), red=True)
    else:  # pragma: no cover - pytest always has one unless disabled
        print("\n".join(lines))
    if session.exitstatus == 0:
        session.exitstatus = 1


#: The owner lock a scratch folder of disco-rpc holds (``disco_rpc.scratch.LOCK_NAME``).
_LOCK_NAME = ".disco-owner.lock"


def _who_holds(path: str) -> str:
    """For a folder with an owner lock: whether it is held, and by which processes (a
    flaky leftover of the rpc suite, seen 2 in 5 loaded runs, left no clue of its own)."""
    lock = os.path.join(path, _LOCK_NAME)
    if not os.path.isfile(lock):
        return ""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return ""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held = False
    except OSError:
        held = True
    finally:
        os.close(fd)
    if not held:
        return (
            f" (its lock is free: its owners are gone; made {time.ctime(os.path.getmtime(lock))})"
        )
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == lock for fd in fds):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read(200).replace(b"\0", b" ").decode(errors="replace").strip()
                holders.append(f"pid {pid} {cmd}")
        except OSError:
            continue
    return f" (its lock is held by: {'; '.join(holders) or 'a process not seen'})"


def pytest_unconfigure(config: Any) -> None:
    state = getattr(config, _KEY, None)
    if state is None:
        return
    if state["TMPDIR"] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = state["TMPDIR"]
    tempfile.tempdir = None
    shutil.rmtree(state["own"], ignore_errors=True)
