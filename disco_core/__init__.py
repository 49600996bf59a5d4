"""Disco for Python: an SPMD distributed runtime with a pluggable core.

.. code-block:: python

    import numpy as np
    import disco_core as disco

    with disco.ProcessSession(num_workers=2) as sess:
        sess.init_ccl("shm")
        x = sess.broadcast(np.arange(4, dtype="float32"))
        y = sess.empty((4,), "float32")
        sess.allreduce(x, y, op="sum")
        print(y.debug_get_from_remote(1))   # [0. 2. 4. 6.]
"""

# First: elsewhere than Linux, one clear error instead of a failure deep inside.
from . import _platform  # noqa: F401  # isort: skip
from . import builtins as _builtins  # noqa: F401  (registers the disco.* functions)
from . import worker
from .ccl.base import CCL, REDUCE_OPS, Rendezvous
from .channels.base import Channel
from .device import Device
from .errors import (
    AuthenticationError,
    CCLError,
    CCLTimeoutError,
    DiscoError,
    DiscoFileNotFoundError,
    DiscoKeyError,
    DiscoModuleNotFoundError,
    DiscoPermissionError,
    DiscoTimeoutError,
    DiscoTypeError,
    DiscoValueError,
    FrameLimitError,
    InsecureBindError,
    IntegrityError,
    NetworkError,
    PluginConflictError,
    PluginLoadError,
    PluginNotFoundError,
    SessionClosedError,
    UnsupportedPlatformError,
    UntrustedValueError,
    WorkerDiedError,
    WorkerError,
    WorkerUnresponsiveError,
)
from .hookspecs import hookimpl, hookspec
from .host_array import HostArray
from .registry import get_global_func, list_global_func_names, register_func
from .session import (
    DModule,
    DPackedFunc,
    DRef,
    ProcessSession,
    Session,
    SocketSession,
    ThreadedSession,
)
from .tracing.session_trace import trace

__version__ = "0.1.0"

__all__ = [
    "Session",
    "ThreadedSession",
    "ProcessSession",
    "SocketSession",
    "DRef",
    "DPackedFunc",
    "DModule",
    "Device",
    "HostArray",
    "Channel",
    "CCL",
    "Rendezvous",
    "REDUCE_OPS",
    "register_func",
    "trace",
    "get_global_func",
    "list_global_func_names",
    "hookimpl",
    "hookspec",
    "worker",
    "DiscoError",
    "WorkerError",
    "WorkerDiedError",
    "WorkerUnresponsiveError",
    "PluginNotFoundError",
    "PluginConflictError",
    "PluginLoadError",
    "SessionClosedError",
    "CCLError",
    "CCLTimeoutError",
    "NetworkError",
    "AuthenticationError",
    "IntegrityError",
    "FrameLimitError",
    "InsecureBindError",
    "UntrustedValueError",
    "DiscoValueError",
    "DiscoTypeError",
    "DiscoKeyError",
    "DiscoFileNotFoundError",
    "DiscoModuleNotFoundError",
    "DiscoPermissionError",
    "DiscoTimeoutError",
    "UnsupportedPlatformError",
    "__version__",
]
