"""``python -m disco_mpi._donor SOCKET``: hand this process's PMI connection to a worker.

Started under ``mpiexec -n 1`` by a worker process that needs to become an MPI
process (see :mod:`disco_mpi._runtime`). It sends its ``PMI_*`` variables and the
``PMI_FD`` socket over the Unix socket ``SOCKET`` (``@name``: the abstract socket
``name``) and waits until the worker closes
it (the worker exited), then exits.
"""

from __future__ import annotations

import json
import os
import socket
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env = {k: v for k, v in os.environ.items() if k.startswith(("PMI_", "MPI_", "HYDRA_"))}
    if "PMI_FD" not in env:
        print("disco_mpi._donor: not started by a PMI launcher (no PMI_FD)", file=sys.stderr)
        return 2
    fd = int(env["PMI_FD"])
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = argv[0]
    s.connect("\0" + address[1:] if address.startswith("@") else address)
    socket.send_fds(s, [json.dumps(env).encode()], [fd])
    os.close(fd)
    try:
        while s.recv(4096):
            pass
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
