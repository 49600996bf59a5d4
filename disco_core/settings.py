"""Durations read from the environment (``DISCO_*_TIMEOUT`` and the like): one parser.

A bad value is a :class:`~disco_core.errors.DiscoValueError` that names the variable,
raised where the setting is used (a session's start, for instance). Where refusing
would do harm (``shutdown()`` must still stop the workers; ``import disco_core`` must
still work) :func:`env_seconds_or_default` warns and uses the default instead.
"""

from __future__ import annotations

import math
import os
import warnings

from .errors import DiscoValueError

__all__ = ["env_seconds", "env_seconds_or_default", "shutdown_timeout"]


def env_seconds(name: str, default: float) -> float:
    """The number of seconds in ``$name`` (``default`` when unset or empty).

    Raises
    ------
    DiscoValueError
        The value is not a number, or is negative or NaN.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return float(default)
    try:
        value = float(raw)
    except ValueError:
        raise DiscoValueError(f"{name}={raw!r} is not a number of seconds") from None
    if math.isnan(value) or value < 0:
        raise DiscoValueError(f"{name}={raw!r}: a number of seconds >= 0 is needed")
    return value


def env_seconds_or_default(name: str, default: float) -> float:
    """Like :func:`env_seconds`, but a bad value warns and gives ``default``."""
    try:
        return env_seconds(name, default)
    except DiscoValueError as exc:
        warnings.warn(f"{exc}; using {default:g}", RuntimeWarning, stacklevel=2)
        return float(default)


def shutdown_timeout() -> float:
    """``$DISCO_SHUTDOWN_TIMEOUT`` (5 s): how long a shutdown, and the trace it stops,
    waits for each step before it leaves a worker out."""
    return env_seconds_or_default("DISCO_SHUTDOWN_TIMEOUT", 5.0)
