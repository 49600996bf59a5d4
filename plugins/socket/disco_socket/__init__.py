"""disco-socket: Disco sessions across machines (the ``socket`` channel) and the node agent.

.. code-block:: python

    import disco_core as disco

    # controller (node 0); on every other node: disco-socket join HOST 9091 --workers 2
    with disco.SocketSession(3, 2, host="0.0.0.0", port=9091, token="secret") as sess:
        ...

See ``README.md`` for the protocol, security and failure behaviour.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from disco_core import SocketSession

from .controller import DEFAULT_TIMEOUT, NodeLink, SocketChannel
from .wire import PROTOCOL_VERSION

__all__ = [
    "SocketSession",
    "SocketChannel",
    "NodeLink",
    "PROTOCOL_VERSION",
    "DEFAULT_TIMEOUT",
    "run_agent",
    "start_local_agents",
]


def run_agent(*args: Any, **kwargs: Any) -> int:
    """Run a node agent in this process (see :func:`disco_socket.agent.run_agent`)."""
    from .agent import run_agent as _run

    return _run(*args, **kwargs)


def start_local_agents(
    host: str,
    port: int,
    count: int,
    workers: int,
    token: str | None = None,
    extra_args: Sequence[str] = (),
    env: dict | None = None,
    **popen_kwargs: Any,
) -> list[subprocess.Popen]:
    """Start ``count`` node agents on this machine (tests, benchmarks, one-box trials).

    Meant as the ``on_listen`` of a session::

        agents = []
        sess = disco.SocketSession(
            3, 2, port=0,
            on_listen=lambda h, p: agents.extend(start_local_agents(h, p, 2, 2)),
        )

    The token travels in the agents' environment (``DISCO_TOKEN``), never on their
    command line. The agents and their workers log warnings and errors only (a
    program's output is its own), unless ``extra_args`` or ``$DISCO_LOG_LEVEL`` set
    a level (``extra_args=["-v"]`` for the INFO lines ``disco-socket join`` prints).
    """
    env = dict(os.environ if env is None else env)
    if token is not None:
        env["DISCO_TOKEN"] = token
    levels = ("-q", "--quiet", "-v", "--verbose", "-vv", "--log-level")
    if not env.get("DISCO_LOG_LEVEL") and not any(
        a in levels or a.startswith("--log-level=") for a in extra_args
    ):
        extra_args = [*extra_args, "--log-level", "WARNING"]
    argv = [
        sys.executable,
        "-m",
        "disco_socket",
        "join",
        host,
        str(port),
        "--workers",
        str(workers),
    ]
    return [
        subprocess.Popen([*argv, *extra_args], env=env, stdin=subprocess.DEVNULL, **popen_kwargs)
        for _ in range(count)
    ]
