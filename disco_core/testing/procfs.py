"""What live processes hold, read from ``/proc`` (Linux): for leak checks in tests."""

from __future__ import annotations

import os

from disco_core._procfs import children_of

__all__ = ["children_of", "shm_in_use"]


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
