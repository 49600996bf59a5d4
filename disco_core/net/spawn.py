"""Starting worker processes: one command line and one way to spawn, for every channel.

The process channel and the socket channel's node agent both start
``python -m <entrypoint>`` workers that talk over two inherited file
descriptors; the arguments are built here and nowhere else.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence

__all__ = ["worker_argv", "spawn_worker"]


def worker_argv(
    entrypoint: str,
    worker_id: int,
    num_workers: int,
    num_groups: int,
    cmd_fd: int,
    reply_fd: int,
    *,
    untrusted: bool = False,
    reply_key_fd: int | None = None,
) -> list[str]:
    """The command line of a worker process (see ``python -m disco_core.worker --help``).

    Parameters
    ----------
    entrypoint : str
        The module run with ``python -m`` (``disco_core.worker`` or a user's own).
    worker_id, num_workers, num_groups : int
        The worker's place in the session.
    cmd_fd, reply_fd : int
        The inherited descriptors it reads commands from and writes replies to.
    untrusted : bool
        Its commands cross a socket: they and its replies are in the tagged network
        format (:mod:`disco_core.wire_values`), never pickles.
    reply_key_fd : int, optional
        An inherited descriptor holding the 64-byte key the worker seals its
        replies with (a socket channel's reply connection with a token); the
        key never appears on the command line.
    """
    argv = [
        sys.executable, "-m", entrypoint,
        "--worker-id", str(worker_id), "--num-workers", str(num_workers),
        "--num-groups", str(num_groups), "--cmd-fd", str(cmd_fd), "--reply-fd", str(reply_fd),
    ]  # fmt: skip
    if untrusted:
        argv.append("--untrusted")
    if reply_key_fd is not None:
        argv += ["--reply-key-fd", str(reply_key_fd)]
    return argv


def spawn_worker(
    argv: Sequence[str], pass_fds: Sequence[int], env: Mapping[str, str], stderr_fd: int
) -> subprocess.Popen:
    """Start a worker with only ``pass_fds`` inherited, no stdin and its stderr on ``stderr_fd``."""
    return subprocess.Popen(
        list(argv),
        pass_fds=tuple(pass_fds),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stderr=stderr_fd,
    )
