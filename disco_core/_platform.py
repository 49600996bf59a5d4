"""The platform check that runs first on ``import disco_core``.

Disco is built on Linux-only interfaces (``memfd_create`` for shared memory, the
``futex`` system call, ``splice``, ``PR_SET_PDEATHSIG``, ``/proc``). Elsewhere the
first failure would be an ``AttributeError`` deep inside a session; this module
turns that into one clear error at import time.
"""

from __future__ import annotations

import sys

from .errors import UnsupportedPlatformError

__all__ = ["check_platform"]


def check_platform(platform: str | None = None) -> None:
    """Raise :class:`UnsupportedPlatformError` unless this is Linux.

    Parameters
    ----------
    platform : str, optional
        The platform to judge (``sys.platform`` when left out).

    Raises
    ------
    UnsupportedPlatformError
        On any platform but Linux.
    """
    platform = sys.platform if platform is None else platform
    if not platform.startswith("linux"):
        raise UnsupportedPlatformError(
            f"Disco for Python needs Linux (memfd_create, futex, /proc); this is {platform}"
        )


check_platform()
