"""Process and thread facts read from ``/proc`` (Linux): who is a child, who is running."""

from __future__ import annotations

import os
import threading
import time

__all__ = ["children_of", "running_threads", "thread_states", "wait_until_idle"]


def _stat_fields(path: str) -> list[str] | None:
    """The fields of a ``stat`` file after the command name, or None when it is gone."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):  # gone between the listing and the read
        return None


def children_of(pid: int) -> set[int]:
    """The live (not zombie) child processes of ``pid``."""
    out: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        rest = _stat_fields(f"/proc/{name}/stat")
        if rest is not None and int(rest[1]) == pid and rest[0] not in ("Z", "X"):
            out.add(int(name))
    return out


def thread_states(pid: int) -> dict[int, str]:
    """The state letter (``R``, ``S``, ``T``...) of each live thread of ``pid``."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    out = {}
    for tid in tids:
        rest = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if rest is not None:
            out[int(tid)] = rest[0]
    return out


def running_threads(pids: set[int]) -> int:
    """How many threads of the processes ``pids`` are running or runnable, the caller's own not counted."""
    me = threading.get_native_id()
    return sum(
        state == "R" and tid != me for pid in pids for tid, state in thread_states(pid).items()
    )


def wait_until_idle(limit: float = 0.5, poll: float = 0.005) -> float:
    """Wait until no other thread of this process or of its children is running.

    Spinning threads a step leaves behind (OpenBLAS keeps its idle threads polling for
    about 2**28 cycles; the shm CCL polls before it sleeps) would otherwise take CPU
    from whatever is measured next. Gives up after ``limit`` seconds; returns the
    seconds waited.
    """
    start = time.monotonic()
    pids = {os.getpid()} | children_of(os.getpid())
    quiet = 0
    while time.monotonic() - start < limit:
        quiet = quiet + 1 if running_threads(pids) == 0 else 0
        if quiet >= 2:  # two looks in a row: not a thread caught between two sleeps
            break
        time.sleep(poll)
    return time.monotonic() - start
