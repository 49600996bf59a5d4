"""A process's name (``/proc/self/comm``): what ``ps`` shows, and what the ``"rpc"``
channel checks before it kills a frozen worker (see :mod:`disco_rpc.worker_host`)."""

from __future__ import annotations

import os
import threading

__all__ = ["name_process"]


def name_process(name: str) -> bool:
    """Name this process ``name`` (``/proc/self/comm``, 15 characters at most), when the
    calling thread leads it; returns whether it was named.

    A process inherits its parent's name across ``fork``: every process disco-rpc
    forks (a server, tracker or proxy process, a session process) names itself first,
    so none started from inside a Disco worker passes for one (an outside check: a
    ``no_fork`` server started by a worker was killed as its clients' worker).
    """
    if threading.current_thread() is not threading.main_thread() or threading.get_native_id() != os.getpid():  # fmt: skip
        return False
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
        return True
    except OSError:  # (no /proc: nothing is killed from the controller's side then)
        return False
