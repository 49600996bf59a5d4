"""disco-rpc: the ``tvm.rpc`` equivalent for Disco, safe by default.

.. code-block:: python

    import numpy as np
    import disco_rpc as rpc

    server = rpc.Server(port=9091)                 # 127.0.0.1 unless told otherwise
    sess = rpc.connect("127.0.0.1", server.port)
    dev = sess.cpu(0)
    x = rpc.tensor(np.arange(4, dtype="float32"), device=dev)
    print(x.numpy())
    server.terminate()
"""

from . import base
from .client import (
    BenchmarkResult,
    LocalSession,
    PopenSession,
    RemoteDevice,
    RemoteFunction,
    RemoteModule,
    RemoteObject,
    RemoteTensor,
    RPCSession,
    connect,
    empty,
    tensor,
)
from .errors import RPCAuthError, RPCError, RPCSessionTimeoutError
from .minrpc import with_minrpc
from .proxy import Proxy
from .server import Server, serve_stdio
from .tracker import Tracker, TrackerSession, connect_tracker

__version__ = "0.1.0"

__all__ = [
    "Server",
    "BenchmarkResult",
    "connect",
    "RPCSession",
    "LocalSession",
    "PopenSession",
    "RemoteFunction",
    "RemoteModule",
    "RemoteTensor",
    "RemoteDevice",
    "RemoteObject",
    "tensor",
    "empty",
    "serve_stdio",
    "Tracker",
    "Proxy",
    "with_minrpc",
    "TrackerSession",
    "connect_tracker",
    "RPCError",
    "RPCSessionTimeoutError",
    "RPCAuthError",
    "base",
    "__version__",
]
