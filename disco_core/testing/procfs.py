"""What live processes hold, read from ``/proc`` (Linux): for leak checks in tests."""

from __future__ import annotations

import os
import signal
import time

from disco_core._procfs import children_of, thread_states

__all__ = ["children_of", "freeze", "gone", "shm_in_use", "wait_gone"]

#: States of a thread that runs no more of its own code: stopped, traced, dead.
_STILL = frozenset("TtZX")


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped.

    ``kill`` returns before the process stops: the stop waits until the thread the
    kernel woke for it gets a CPU. On a loaded machine another thread of the process
    ran on meanwhile and answered a request sent after the ``kill`` (a tracker's
    reply, seen in CI). A test that expects silence must wait for the stop.

    Raises
    ------
    TimeoutError
        When some thread is still running after ``timeout`` seconds.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        running = [tid for tid, state in thread_states(pid).items() if state not in _STILL]
        if not running:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid}: threads {running} did not stop in {timeout:g} s")
        time.sleep(0.001)


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (no more, or a zombie not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or the read
        return True
    except OSError:  # no /proc: fall back to a signal 0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for ``pids`` to end; return those still alive."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if not gone(p)]
        if alive:
            time.sleep(0.05)
    return alive


def shm_in_use(names: set[str]) -> set[str]:
    """Those of ``/dev/shm/<name>`` that some live process maps or holds open.

    A segment that a live process still uses is not (yet) a leak, whoever made it:
    other programs, or another test suite running beside this one, make their own.
    """
    if not names:
        return set()
    paths = {f"/dev/shm/{n}": n for n in names}
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(None, 5)[-1].removesuffix(" (deleted)")
                    if path in paths:
                        used.add(paths[path])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target in paths:
                    used.add(paths[target])
        except OSError:
            continue  # gone, or not ours to read
    return used
