"""Tracing: a per-worker timeline of a session.

:func:`disco_core.trace` (:mod:`~disco_core.tracing.session_trace`) records it,
:mod:`~disco_core.tracing.format` says what the file holds, and
:mod:`~disco_core.tracing.summary` and :mod:`~disco_core.tracing.plot` read it
(``disco trace summary|plot``). The modules are imported when used: reading a
trace needs no session, and plotting needs matplotlib.
"""

__all__ = [
    "ccl_hooks",
    "chrome",
    "format",
    "plot",
    "recorder",
    "session_trace",
    "summary",
    "worker_side",
]
